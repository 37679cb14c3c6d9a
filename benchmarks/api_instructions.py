"""Instructions one `plan()` and one `fit()` execute at the defaults, over the 60 requests of
benchmarks/api_throughput.py, counted under valgrind's callgrind: the configurations per second
that script prints swing by half between runs of the same code on a shared machine (2,100-3,700
plan() a second), the instruction count is the same on every run of the same code whatever else
the machine runs, so a change's before and after differ by what the change does.

Each function is counted by difference, as api_throughput.per_second times it: one child process
imports and warms up on the first three requests (the import, the warm-up and the interpreter's
start), another does the same and then answers all 60; the second's count less the first's, over
60, is the instructions a request. Python's hash seed is fixed (PYTHONHASHSEED=0: the order of a
set of strings, and so the work done, would otherwise change between runs) and the bytecode cache
is on, warmed by one uncounted run (as benchmarks/cli_latency.py runs its commands); each child is
counted twice and the fewer kept (counted). Two checkouts of the same code count within about 1 %
of each other (their paths differ in length).

The count weighs the caching-allocator model's replays less than the CPU seconds do: they walk
long lists of blocks, fewer instructions a second than the planner's arithmetic (the plan
question's 35 replays are about 4 % of its instructions and 15 % of its CPU time), so read it
beside api_throughput.py's seconds, not instead of them.

    python benchmarks/api_instructions.py [--against DIR] [--only plan|fit] [--rest]

``--against DIR`` counts DIR (another checkout's source root, e.g. `git worktree add DIR COMMIT`)
as well, on the row below: a change's before and after in one run. ``--rest`` counts what
api_throughput.py --breakdown calls the rest (the planner's terms, step times, collectives,
specs): the instructions executed inside zeroplan.allocator.planner's replay_ops, record_step
and step_inputs are left out, each call run through itertools.starmap's C iterator and
counted alone (--toggle-collect=starmap_next; nothing zeroplan runs uses starmap otherwise, and
the three are never nested, as the breakdown's timings add) and taken from the whole count.
callgrind's --toggle-collect collects inside the function only, whatever --collect-atstart says
(valgrind 3: a script that sums 1e6 numbers outside starmap and 3e6 inside counts 801 M
instructions whole, 534 M with the toggle, with or without --collect-atstart=yes), so the toggled
count alone is the three calls' share, not the rest.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile

REQUESTS = 60
"""benchmarks/api_throughput.py's requests (3 sequence lengths x micro-batches 1-20)."""


ALLOCATOR_CALLS = ("replay_ops", "record_step", "step_inputs")
"""zeroplan.allocator.planner's calls that --rest leaves out (api_throughput.py --breakdown's split)."""


def _uncounted(call):
    """``call`` run inside itertools.starmap's iterator, where --rest's callgrind collects nothing."""
    def wrapper(*args):
        return next(itertools.starmap(call, (args,)))
    return wrapper


def child(function_name: str, answer_all: bool, rest: bool = False) -> None:
    """Import, warm up as api_throughput.per_second does, and answer every request when asked;
    with ``rest`` the allocator's calls run where --rest's callgrind does not count them."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from api_throughput import requests

    from zeroplan.core.plan import fit, plan

    if rest:
        from zeroplan.allocator import planner

        for name in ALLOCATOR_CALLS:
            setattr(planner, name, _uncounted(getattr(planner, name)))

    function = {"plan": plan, "fit": fit}[function_name]
    batch = requests()
    assert len(batch) == REQUESTS
    for request in batch[:3]:
        function(request)
    if answer_all:
        for request in batch:
            function(request)


def counted(root: str, function_name: str, answer_all: bool, env: dict[str, str], rest: bool = False) -> int:
    """Instructions of a child run under callgrind, with ``root`` first on PYTHONPATH: the fewer
    of two runs (a first run after the bytecode cache is warmed has counted a few million more,
    and once tens of millions, than every run after it); with ``rest``, the whole count of the
    child that runs the allocator's calls through starmap less the count inside them."""
    command = [sys.executable, os.path.abspath(__file__), "--child", function_name, str(int(answer_all)), str(int(rest))]
    child_env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=child_env, cwd=root)  # warms the bytecode cache

    def fewest(toggle: list[str]) -> int:
        counts = []
        for _ in range(2):
            result = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *toggle, *command],
                                    check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    env=child_env, cwd=root)
            counts.append(int(re.search(r"Collected : (\d+)", result.stderr).group(1)))
        return min(counts)

    if rest:
        return fewest([]) - fewest(["--toggle-collect=starmap_next"])
    return fewest([])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="DIR", help="another checkout's source root, counted beside this one")
    parser.add_argument("--only", choices=["plan", "fit"], help="count one function only")
    parser.add_argument("--rest", action="store_true",
                        help="leave out the allocator's replays, trace builds and trace keys (api_throughput.py --breakdown's rest)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1] == "1", args.child[2] == "1")
        return
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [here] + ([os.path.abspath(args.against)] if args.against else [])
    functions = [args.only] if args.only else ["plan", "fit"]
    heading = "instructions a request" + (" (rest)" if args.rest else "")
    print(f"{'source root':40s} {'function':8s} {heading:>31s}")
    for function_name in functions:
        for root in roots:
            # Each root its own cache: the same module paths in two checkouts are two sources.
            with tempfile.TemporaryDirectory(prefix="zeroplan-pycache-") as cache_dir:
                env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
                env.update(PYTHONPYCACHEPREFIX=cache_dir, PYTHONHASHSEED="0")
                before = counted(root, function_name, False, env, args.rest)
                after = counted(root, function_name, True, env, args.rest)
            print(f"{os.path.basename(root):40s} {function_name + '()':8s} {(after - before) / REQUESTS:31,.0f}")


if __name__ == "__main__":
    main()
