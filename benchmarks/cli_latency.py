"""How long `zeroplan fit` takes, as a ratio against a bare `python -c pass`, measured side by
side in one run (this machine is noisy, so the ratio is what to read, not the seconds).

    python benchmarks/cli_latency.py [--repeats 10]

Every command runs with Python's bytecode cache on, in a temporary PYTHONPYCACHEPREFIX warmed by
one untimed run: an installed zeroplan has its modules compiled (pip compiles them at install),
so an environment with PYTHONDONTWRITEBYTECODE set would time compilation no user waits for
(about 60 ms of the fit). The two pydantic rows are the floor the specs' dependency sets: a
command that builds pydantic models cannot start faster than importing pydantic and building
one model (whose first build imports pydantic's validators and plugin loader). The
`--flat-reserve` row, beside the default one, is what the caching-allocator model's replays cost.
"""

from __future__ import annotations

import argparse
import os
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


def time_once(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def bytecode_cached_env(cache_dir: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache_dir
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory(prefix="zeroplan-pycache-") as cache_dir:
        env = bytecode_cached_env(cache_dir)
        for command in COMMANDS.values():  # compiles every module once, untimed
            time_once(command, env)
        for _ in range(args.repeats):
            # Interleave the commands so drift in machine load hits all of them alike.
            for name, command in COMMANDS.items():
                samples[name].append(time_once(command, env))
    baseline = statistics.median(samples["python -c pass"])
    print(f"{'command':50s} {'median s':>9s} {'ratio':>7s}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:50s} {median:9.3f} {median / baseline:7.1f}x")


if __name__ == "__main__":
    main()
