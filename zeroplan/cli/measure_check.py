"""Checks ``zeroplan measure`` makes before it launches a single rank, so that a request the
machine cannot run is refused in one line instead of failing inside every rank. It runs in the
launcher only; the ranks never import it (their measurement stays independent of the planner)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zeroplan.errors import ZeroplanError
from zeroplan.specs import ModelSpec, StrategyKind
from zeroplan.units import GB

# fp32 parameters (4 bytes) + fp32 gradients (4 bytes): every measurable precision keeps at least
# these per parameter, summed over the ranks whatever the sharding (ZeRO paper, section 3.1: 2Ψ+2Ψ
# in fp16 is the least any of its stages keeps in total; the harness trains fp32 or fp32 masters).
MIN_STATE_BYTES_PER_PARAMETER = 8


def cuda_available() -> bool:
    """Whether torch sees a CUDA device, asked in a child process (this process never imports torch)."""
    program = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def available_host_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else physical pages; None where neither exists."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def least_host_bytes(model: ModelSpec, strategy: StrategyKind, nproc: int) -> int:
    """A lower bound of the host RAM a CPU run needs: fp32 parameters and gradients, replicated on
    every rank under DDP and split over the ranks otherwise (activations and optimizer states come on top)."""
    from zeroplan.core.params import total_parameters

    copies = nproc if strategy is StrategyKind.ddp else 1
    return total_parameters(model) * MIN_STATE_BYTES_PER_PARAMETER * copies


def check_machine(model: ModelSpec, strategy: StrategyKind, nproc: int, backend: str | None) -> None:
    """Refuse nccl without CUDA, and a CPU run whose states alone exceed this machine's RAM."""
    if backend == "gloo":
        on_cpu = True
    else:
        has_cuda = cuda_available()
        if backend == "nccl" and not has_cuda:
            raise ZeroplanError("backend", "nccl needs a CUDA GPU and torch does not see one here (allowed: gloo)")
        on_cpu = not has_cuda
    if not on_cpu:
        return
    needed = least_host_bytes(model, strategy, nproc)
    available = available_host_memory_bytes()
    if available is not None and needed > available:
        raise ZeroplanError(
            "model",
            f"{model.name} on {nproc} CPU ranks ({strategy.value}) needs at least {needed / GB:,.1f} GB of RAM "
            f"({MIN_STATE_BYTES_PER_PARAMETER} bytes/parameter before activations) and {available / GB:,.1f} GB "
            f"is available (use a harness preset such as tiny-llama, or fewer ranks)",
        )
