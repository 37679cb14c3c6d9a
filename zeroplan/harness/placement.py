"""Where a launch runs: how many nodes, which one this is, and where node 0's rendezvous store
listens, either from ``zeroplan measure``'s flags or from SLURM's environment. No torch here:
the launcher reads this before any rank starts."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from zeroplan.errors import ZeroplanError

DEFAULT_RDZV_PORT = 29500
"""torchrun's own default (--master-port); used under SLURM when neither --rdzv-endpoint nor
MASTER_PORT says otherwise."""


@dataclass(frozen=True)
class MultiNode:
    """One node's share of a multi-node launch (torchrun's static rendezvous)."""

    nnodes: int
    node_rank: int
    endpoint: str
    """HOST:PORT of node 0, where its agent's store listens; every node gives the same."""
    rdzv_id: str
    """torchrun's --rdzv-id, the same on every node (TORCHELASTIC_RUN_ID in each rank)."""


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets: [::1]:29500) -> (host, port)."""
    allowed = f"expected HOST:PORT with PORT in 1..65535, e.g. node01:{DEFAULT_RDZV_PORT}, got {text!r}"
    host, sep, port_text = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() for c in host) or not port_text.isdigit():
        raise ZeroplanError(flag, allowed)
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ZeroplanError(flag, allowed)
    return host, port


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_MAX_HOSTS = 1 << 20  # far above any allocation; stops a typo such as node[1-999999999] early


def parse_nodelist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand SLURM's compressed host list: ``node[01-03,07],gpu-a[1-2]b[1-2],login`` ->
    node01, node02, node03, node07, gpu-a1b1, gpu-a1b2, gpu-a2b1, gpu-a2b2, login.

    Within brackets, comma-separated numbers and LOW-HIGH ranges; a range keeps the width of
    its low bound (01-10 -> 01 ... 10), as Slurm's hostlist does. Several bracket groups in one
    name expand as a product, the first group outermost. Order is kept and so are repeats."""
    hosts: list[str] = []
    for item in _split_top_level(text, variable):
        hosts += _expand_item(item, text, variable)
        if len(hosts) > _MAX_HOSTS:
            raise ZeroplanError(variable, f"{text!r} names more than {_MAX_HOSTS:,} hosts")
    return hosts


def _split_top_level(text: str, variable: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ZeroplanError(variable, f"{text!r}: nested '[' (allowed: name[1-4,7],other)")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ZeroplanError(variable, f"{text!r}: ']' without '[' (allowed: name[1-4,7],other)")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ZeroplanError(variable, f"{text!r}: '[' without ']' (allowed: name[1-4,7],other)")
    items.append(text[start:])
    items = [item.strip() for item in items]
    if not all(items):
        raise ZeroplanError(variable, f"{text!r}: an empty host name (allowed: comma-separated names such as node[1-4,7],other)")
    return items


def _expand_item(item: str, text: str, variable: str) -> list[str]:
    names = [""]
    for part in re.split(r"(\[[^\]]*\])", item):
        if part.startswith("["):
            numbers = _expand_brackets(part[1:-1], text, variable)
            names = [name + number for name in names for number in numbers]
            if len(names) > _MAX_HOSTS:
                raise ZeroplanError(variable, f"{text!r} names more than {_MAX_HOSTS:,} hosts")
        else:
            if any(c.isspace() for c in part):
                raise ZeroplanError(variable, f"{text!r}: a host name with a space in it")
            names = [name + part for name in names]
    return names


def _expand_brackets(inside: str, text: str, variable: str) -> list[str]:
    numbers: list[str] = []
    for piece in inside.split(","):
        match = _RANGE.match(piece.strip())
        if not match:
            raise ZeroplanError(variable, f"{text!r}: [{inside}] is not a list of numbers and LOW-HIGH ranges "
                                          "(allowed: e.g. [01-04,07])")
        low_text, high_text = match.group(1), match.group(2)
        low, high = int(low_text), int(high_text if high_text is not None else low_text)
        if high < low:
            raise ZeroplanError(variable, f"{text!r}: range {low_text}-{high_text} runs backwards (allowed: LOW-HIGH, LOW <= HIGH)")
        if high - low >= _MAX_HOSTS:
            raise ZeroplanError(variable, f"{text!r} names more than {_MAX_HOSTS:,} hosts")
        width = len(low_text)
        numbers += [f"{n:0{width}d}" for n in range(low, high + 1)]
    return numbers


def hostnames(nodelist: str, variable: str) -> list[str]:
    """The hosts of a SLURM node list: our own parser, and ``scontrol show hostnames`` for a form
    it does not know (when scontrol is there); the parser's one-line error otherwise."""
    try:
        return parse_nodelist(nodelist, variable)
    except ZeroplanError:
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            raise
        try:
            result = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            raise ZeroplanError(variable, f"cannot expand {nodelist!r} (scontrol show hostnames did not answer)") from None
        hosts = result.stdout.split()
        if result.returncode or not hosts:
            raise
        return hosts


def _slurm_int(env: Mapping[str, str], *names: str) -> tuple[str, int]:
    """The first of ``names`` that is set, as a non-negative integer."""
    for name in names:
        if name in env:
            value = env[name].strip()
            if not value.isdigit():
                raise ZeroplanError(name, f"expected a non-negative integer, got {value!r}")
            return name, int(value)
    raise ZeroplanError(names[0], "not set: --slurm reads SLURM's environment, so run it under srun inside an "
                                  "allocation (allowed: srun ... zeroplan measure --slurm, or --nnodes/--node-rank/--rdzv-endpoint)")


def slurm_multinode(env: Mapping[str, str], endpoint: str | None, rdzv_id: str | None) -> MultiNode:
    """The launch one ``srun`` task per node describes: node count and this node's index from
    SLURM_NNODES / SLURM_NODEID, node 0's host from the step's node list (SLURM numbers the nodes
    of a step in the order of that list), the rendezvous id from the job and step ids.
    ``endpoint`` (--rdzv-endpoint) and ``rdzv_id`` (--rdzv-id) override what SLURM implies."""
    nnodes_name, nnodes = _slurm_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    _, node_rank = _slurm_int(env, "SLURM_NODEID")
    tasks_name, ntasks = _slurm_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if nnodes < 1:
        raise ZeroplanError(nnodes_name, f"must be at least 1, got {nnodes}")
    if ntasks != nnodes:
        raise ZeroplanError(
            tasks_name,
            f"{ntasks} srun tasks on {nnodes} node(s); zeroplan measure --slurm is one task per node and starts "
            f"--nproc-per-node ranks on each (allowed: srun --ntasks-per-node=1)",
        )
    if node_rank >= nnodes:
        raise ZeroplanError("SLURM_NODEID", f"{node_rank} is not below {nnodes_name}={nnodes} (allowed: 0..{nnodes - 1})")
    list_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    if endpoint is None:
        if list_name is None:
            raise ZeroplanError("SLURM_JOB_NODELIST", "not set: node 0's host comes from it (or give --rdzv-endpoint HOST:PORT)")
        hosts = hostnames(env[list_name], list_name)
        if len(hosts) != nnodes:
            raise ZeroplanError(list_name, f"{env[list_name]!r} names {len(hosts)} host(s) and {nnodes_name} is {nnodes} "
                                           "(allowed: one host per node of the step)")
        port_text = env.get("MASTER_PORT", str(DEFAULT_RDZV_PORT))
        endpoint = f"{hosts[0]}:{port_text}"
        parse_endpoint(endpoint, "MASTER_PORT")
    if rdzv_id is None:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise ZeroplanError("SLURM_JOB_ID", "not set (give --rdzv-id, the same on every node)")
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        rdzv_id = f"slurm-{job_id}" + (f".{step}" if step else "")
    return MultiNode(nnodes=nnodes, node_rank=node_rank, endpoint=endpoint, rdzv_id=rdzv_id)


def srun_tasks(env: Mapping[str, str]) -> int:
    """How many tasks the srun step this process belongs to has (1 outside srun)."""
    value = env.get("SLURM_STEP_NUM_TASKS", "").strip()
    return int(value) if value.isdigit() else 1
