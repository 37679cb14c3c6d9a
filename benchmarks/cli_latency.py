"""How long `zeroplan fit` and a `plan` question take, as a ratio against a bare `python -c pass`,
measured side by side in one run (this machine is noisy, so the ratio is what to read, not the
seconds).

    python benchmarks/cli_latency.py [--repeats 10] [--against DIR] [--instructions]

``--against DIR`` times each zeroplan command a second time, interleaved, with DIR (another
checkout's source root, e.g. `git worktree add DIR COMMIT`) as its working directory and first
on PYTHONPATH: a change's before and after in one run, under the same load.

Every command runs with Python's bytecode cache on, in a temporary PYTHONPYCACHEPREFIX warmed by
one untimed run: an installed zeroplan has its modules compiled (pip compiles them at install),
so an environment with PYTHONDONTWRITEBYTECODE set would time compilation no user waits for
(about 60 ms of the fit). The two pydantic rows are the floor the specs' dependency sets: a
command that builds pydantic models cannot start faster than importing pydantic and building
one model (whose first build imports pydantic's validators and plugin loader). The
`--flat-reserve` row, beside the default one, is what the caching-allocator model's replays cost.
Beside the wall-clock medians, the medians of each command's CPU seconds (user + system, from
the operating system's accounting of the finished child): on a loaded machine a command's wall
time includes the time it waited for a core, its CPU time does not, so the CPU ratio is the
steadier of the two when other work shares the cores. ``--instructions`` adds, from one more
run of each command under valgrind's callgrind, the instructions it executes: the same count on
every run of the same code whatever else the machine runs, so a change's before and after differ
by what the change does (the count weighs the interpreter's start, its shared libraries' loading
and page faults, less than the CPU seconds do: its ratios read higher than the CPU ratios).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The least a command whose inputs are pydantic specs does: define and build one frozen model
# with a constrained field (its first build imports pydantic's validators and plugin loader).
ONE_PYDANTIC_MODEL = """
from pydantic import BaseModel, ConfigDict, Field
class One(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    x: int = Field(default=1, ge=0)
One(x=2)
"""

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'from pydantic import BaseModel'": [sys.executable, "-c", "from pydantic import BaseModel"],
    "one frozen pydantic model, one constrained field": [sys.executable, "-c", ONE_PYDANTIC_MODEL],
    "zeroplan fit llama-2-70b (10 strategies)": [
        sys.executable, "-m", "zeroplan", "fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb",
    ],
    "zeroplan fit llama-2-70b --flat-reserve": [
        sys.executable, "-m", "zeroplan", "fit", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80gb", "--flat-reserve",
    ],
    "zeroplan fit llama-3.1-405b --gpus 512": [
        sys.executable, "-m", "zeroplan", "fit", "llama-3.1-405b", "--gpus", "512", "--gpu", "h100-80gb",
    ],
    "zeroplan fit llama-3.1-405b --gpus 65536": [
        sys.executable, "-m", "zeroplan", "fit", "llama-3.1-405b", "--gpus", "65536", "--gpu", "h100-80gb",
    ],
    "zeroplan fit llama-2-7b (every strategy fits)": [
        sys.executable, "-m", "zeroplan", "fit", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb",
    ],
    # Three strategies fit near the usable memory.
    "zeroplan fit llama-3.1-8b torchtitan 2 x 8192": [
        sys.executable, "-m", "zeroplan", "fit", "llama-3.1-8b", "--framework", "torchtitan", "--gpus", "8",
        "--gpu", "h100-80gb", "--micro-batch", "2", "--seq-len", "8192", "--activation-checkpointing", "selective-op",
    ],
    # The plan search, with the allocator model asked of every configuration it shows.
    "zeroplan plan llama-3.1-70b --gpus 64 --global-batch 512": [
        sys.executable, "-m", "zeroplan", "plan", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-80gb",
        "--global-batch", "512",
    ],
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_once(command: list[str], env: dict[str, str], cwd: str | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``command``."""
    cpu_before, start = _children_cpu_s(), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
    return time.perf_counter() - start, _children_cpu_s() - cpu_before


def instructions(command: list[str], env: dict[str, str], cwd: str | None = None) -> int:
    """Instructions one run of ``command`` executes (valgrind --tool=callgrind, every thread)."""
    result = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command], check=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    return int(re.search(r"Collected : (\d+)", result.stderr).group(1))


def bytecode_cached_env(cache_dir: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache_dir
    return env


def runs(against: str | None, env: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str], str | None]]:
    """Each row's command, environment and working directory; with ``against``, each zeroplan
    command once more on the row below its own, run in that source root with it first on
    PYTHONPATH (``python -m`` puts the working directory first on sys.path)."""
    rows = {}
    for name, command in COMMANDS.items():
        rows[name] = (command, env, None)
        if against is not None and name.startswith("zeroplan"):
            root = os.path.abspath(against)
            path = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            rows[f"{name} [{os.path.basename(root)}]"] = (command, {**env, "PYTHONPATH": path}, root)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--against", metavar="DIR", help="another checkout's source root, timed beside this one")
    parser.add_argument("--instructions", action="store_true",
                        help="also count each command's instructions once under valgrind's callgrind")
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions: valgrind is not on PATH")
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="zeroplan-pycache-") as cache_dir:
        rows = runs(args.against, bytecode_cached_env(cache_dir))
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
        for command, env, cwd in rows.values():  # compiles every module once, untimed
            time_once(command, env, cwd)
        for _ in range(args.repeats):
            # Interleave the commands so drift in machine load hits all of them alike.
            for name, (command, env, cwd) in rows.items():
                samples[name].append(time_once(command, env, cwd))
        if args.instructions:
            counts = {name: instructions(command, env, cwd) for name, (command, env, cwd) in rows.items()}

    def medians(name: str) -> tuple[float, float]:
        return statistics.median(w for w, _ in samples[name]), statistics.median(c for _, c in samples[name])

    wall_baseline, cpu_baseline = medians("python -c pass")
    header = f"{'command':66s} {'median s':>9s} {'ratio':>7s} {'CPU s':>7s} {'CPU ratio':>9s}"
    print(header + (f" {'M instr':>8s} {'ratio':>7s}" if counts else ""))
    for name in samples:
        wall, cpu = medians(name)
        line = f"{name:66s} {wall:9.3f} {wall / wall_baseline:6.1f}x {cpu:7.3f} {cpu / cpu_baseline:8.1f}x"
        if counts:
            line += f" {counts[name] / 1e6:8.0f} {counts[name] / counts['python -c pass']:6.1f}x"
        print(line)


if __name__ == "__main__":
    main()
