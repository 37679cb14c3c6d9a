"""A free TCP port on this machine for a rendezvous that every rank reaches on 127.0.0.1.

Scripts that spawn their own gloo ranks used fixed ports (or one derived from the process id),
which a port still held by another process on the machine turns into a failed run. Each spawn now
asks for a port no socket holds at that moment; afterwards the shared-memory buffers DeepSpeed's
CPU all-reduce named after that port are removed (remove_deepspeed_shm_buffers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default first ephemeral port, where the range cannot be read.
_DEFAULT_EPHEMERAL_LOW = 32768
_LOWEST = 20000


def free_local_port() -> int:
    """A port below the ephemeral range that binds on 127.0.0.1 now. Not bind(0): that hands out an
    ephemeral port, and a rank that starts first retries connecting to 127.0.0.1:PORT until rank 0
    listens; once one retry's own source port is PORT, Linux connects the socket to itself (TCP
    simultaneous open) and the rendezvous never happens."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = _DEFAULT_EPHEMERAL_LOW
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_LOWEST, max(_LOWEST + 1, low))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 between {_LOWEST} and {low}")


def remove_deepspeed_shm_buffers(port: int, shm_dir: Path = Path("/dev/shm")) -> int:
    """Unlink the shared-memory all-reduce buffers DeepSpeed's CPU accelerator made for a run whose
    ranks met on ``port``; how many were removed. Its shm.cpp names them
    deepspeed_allreduce_buffer_<id>_<MASTER_ADDR>_<MASTER_PORT>_<rank> and never unlinks them
    (shared_close has no caller), so each run would otherwise leave tens of MiB per rank behind."""
    removed = 0
    for buffer in shm_dir.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        buffer.unlink(missing_ok=True)
        removed += 1
    return removed
