"""zeroplan.core.deepspeed_coordinator's replay of DeepSpeed ZeRO-3's parameter coordinator
against DeepSpeed 0.13.3's own engine, on the PEFT docs' Llama-2-70B LoRA row: the engine's
events saved by benchmarks/deepspeed_zero3_allocator_replay.py --save-events (the row's shapes
over 1,024, its stage-3 defaults over 1,024; the gathered bytes scaled back as that script
scales them). Prints, per step after the first (the trace is recorded in the first), the order
in which parameters are gathered beside the replay's, and the gathered bytes alive (the
allocations made inside the coordinator's all-gathers and not yet freed) at their peak and at
the last block's recomputation. Usage:

    python benchmarks/deepspeed_coordinator_check.py --events EVENTS.json
"""

from __future__ import annotations

import argparse
import bisect
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from deepspeed_zero3_allocator_replay import (  # noqa: E402
    ROW, STAGE3, _collective_temporaries, persistent_elements, scaled,
)



def engine_persistent_elements(result: dict) -> int:
    """The scaled run's persistent elements (ds_numel <= its stage3_param_persistence_threshold):
    the norms and LoRA's narrow adapters, which shrink 32 times where max_live shrinks 1,024 times."""
    return persistent_elements(result.get("stage3", STAGE3)["stage3_param_persistence_threshold"])

# transformers' Llama and peft's LoRA names -> the planner's (zeroplan.core.parallel.units).
RENAMES = [(r"^base_model\.model\.", ""), (r"^model\.", ""), (r"^embed_tokens\.", "embedding.token."),
           (r"^lm_head\.", "head.lm_head."), (r"^norm\.", "head.final_norm."), (r"^layers\.", "block."),
           (r"self_attn\.(q|k|v|o)_proj", r"attention.\1"), (r"mlp\.(gate|up|down)_proj", r"mlp.\1"),
           (r"input_layernorm", "attention_norm"), (r"post_attention_layernorm", "mlp_norm"),
           (r"\.base_layer", ""), (r"\.lora_A\.default", ".lora_a"), (r"\.lora_B\.default", ".lora_b")]


def planner_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def engine_step(result: dict, step: int) -> tuple[list[list[str]], list[int], int, int]:
    """(each gather's parameters, the gathered bytes alive after each gather, their peak, alive at
    the first gather after the lm_head's: the last block's recomputation) in ``step``."""
    starts = result["step_starts"] + [2**63]
    windows = result["gathers"]
    window_starts = [w[0] for w in windows]
    skipped = _collective_temporaries(result["events"])
    live: dict[int, int] = {}
    alive_after: dict[int, int] = {}
    for index, (time_ns, size, ptr, _) in enumerate(result["events"]):
        if time_ns >= starts[step + 1]:
            break
        live.pop(ptr, None)
        k = bisect.bisect_right(window_starts, time_ns) - 1
        if size > 0 and index not in skipped and k >= 0 and time_ns <= windows[k][1] and time_ns >= starts[step]:
            live[ptr] = scaled(size)
            alive_after[k] = sum(live.values())
        elif k >= 0 and windows[k][0] >= starts[step]:
            alive_after.setdefault(k, sum(live.values()))
    own = [k for k, w in enumerate(windows) if starts[step] <= w[0] < starts[step + 1]]
    names = [sorted(planner_name(n) for n in windows[k][2].split(",") if n) for k in own]
    alive = [alive_after.get(k, 0) for k in own]
    head = next(i for i, n in enumerate(names) if "head.lm_head.weight" in n)
    return names, alive, max(alive), alive[head + 1]


def _planned(run) -> tuple[list, list, int, list]:
    """(each trace step's gathered parameters, what is held after it, the lm_head's index, all in order)."""
    by_step: dict[int, list[str]] = {}
    for step, name in run.gathers:
        by_step.setdefault(step, []).append(name)
    planned = [sorted(names) for _, names in sorted(by_step.items())]
    planned_alive = [run.held_bytes[step] for step in sorted(by_step)]
    head = next(i for i, n in enumerate(planned) if "head.lm_head.weight" in n)
    return planned, planned_alive, head, [n for names in planned for n in names]


def _after_head(run) -> list:
    head = next(i for i, (_, n) in enumerate(run.gathers) if n == "head.lm_head.weight")
    return list(run.gathers[head + 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=Path, required=True)
    options = parser.parse_args()
    result = json.loads(options.events.read_text())

    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.deepspeed_coordinator import replay
    from zeroplan.specs.strategy import StrategyKind

    gib = 2**30
    request = request_from_args(build_parser().parse_args(["fit", *ROW.split()]), StrategyKind.zero3)
    # Step 1 starts the counter at 0 (the step before ran in record mode, whose releases partition
    # the persistent parameters); from step 2 on it starts at minus the persistent elements
    # (zeroplan.core.deepspeed_coordinator.persistent_elements; the row's request, reentrant, also
    # has the embedding's: initial_counter; this run's embedding output takes no gradient, so its
    # weight is not held after the backward), which in the scaled run are
    # engine_persistent_elements() against a stage3_max_live_parameters of 1e9 / 1,024: the same
    # fraction of the row's 1e9 is replayed beside the row's own.
    engine_offset = engine_persistent_elements(result)
    as_run = -round(engine_offset / result.get("stage3", STAGE3)["stage3_max_live_parameters"] * 10**9)
    print(f"DeepSpeed {result['deepspeed']} engine (the 70B LoRA row's shapes over 1,024) against the replay of the row's request;"
          f" the scaled run's persistent elements {engine_offset:,}")
    for label, start in (("step 1 (counter from 0)", 0), ("steady state, the row's shapes", None),
                         (f"steady state, the scaled run's offset ({as_run:,})", as_run)):
        run = replay(request, start)
        print(f"  replay, {label}: gathered alive at its peak {run.peak_bytes / gib:.2f} GiB; after the lm_head gathers "
              f"{', '.join(sorted({n.rsplit('.', 2)[0] for _, n in _after_head(run)[:6]}))}")
    for step in range(1, len(result["step_starts"])):
        run = replay(request, 0 if step == 1 else as_run)
        planned, planned_alive, head, flat_planned = _planned(run)
        print(f"  replay as step {step} runs: {len(planned)} gathers, {len(flat_planned)} parameters; gathered alive at its peak "
              f"{run.peak_bytes / gib:.2f} GiB, at the last block's recomputation {planned_alive[head + 1] / gib:.2f} GiB")
        names, alive, peak, recompute = engine_step(result, step)
        flat = [n for group in names for n in group]
        matcher = difflib.SequenceMatcher(a=flat, b=flat_planned, autojunk=False)
        same_groups = sum(a == b for a, b in zip(names, planned))
        first = next((i for i, (a, b) in enumerate(zip(names, planned)) if a != b), None)
        print(f"  engine step {step}: {len(names)} gathers, {len(flat)} parameters; gathered alive at its peak "
              f"{peak / gib:.2f} GiB, at the last block's recomputation {recompute / gib:.2f} GiB; parameter order "
              f"matching the replay's {matcher.ratio():.3f}; gathers equal to the replay's, in place: {same_groups}"
              f" (first difference at gather {first})")
        if first is not None:
            print(f"    engine  {first}: {names[first][:4]}\n    replay  {first}: {planned[first][:4] if first < len(planned) else None}")


if __name__ == "__main__":
    main()
