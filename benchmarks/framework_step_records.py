"""Run whole training steps of the frameworks' own models under their own FSDP2 wrapping and
write the records the planner's allocated peak is checked against.

    python benchmarks/framework_step_records.py [OUT_DIR [FRAMEWORK ...]]
        (default benchmarks/framework-step-records, every framework)
    python benchmarks/framework_step_records.py --optimizer-in-backward [OUT_DIR]
        (only torchtune's optimizer_in_bwd runs)

Each run (zeroplan.frameworks.step.run_step) builds the framework's model at full depth on fake
tensors, shards it over a fake process group of N ranks as the framework's recipe does, and
runs two steps (forward, the framework's loss, backward, fused AdamW), tracking the second with
FSDP2's FSDPMemTracker. Needs torch and the frameworks (scripts/install-frameworks); 6-80 s a
run on 2 cores (about 7 minutes for the 20), the wall time is printed and kept in each record.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.step import run_step, step_training
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, StrategyKind
from zeroplan.specs.framework import Framework

DEFAULT_OUT = Path(__file__).resolve().parent / "framework-step-records"

# issue 8's sizes: 8B at 8 and 128 ranks, 70B at 64, seq 4096 and 8192, micro-batch 1-2.
SHAPES = [
    ("llama-3.1-8b", 8, 4096, 1), ("llama-3.1-8b", 8, 8192, 2),
    ("llama-3.1-8b", 128, 4096, 1), ("llama-3.1-8b", 128, 8192, 2),
    ("llama-3.1-70b", 64, 4096, 1),
]
FRAMEWORKS = (Framework.torchtune, Framework.hf, Framework.torchtitan)
POLICIES = ("none", "full")
MORE_POLICIES = {Framework.torchtitan: ("selective-op",)}
"""Policies a framework offers beyond none and full (torchtitan's SelectiveAC)."""
OPTIMIZER_IN_BACKWARD = [("llama-3.1-8b", 8, 4096, 1, "none"), ("llama-3.1-8b", 8, 4096, 1, "full"),
                         ("llama-3.1-70b", 64, 4096, 1, "full")]
"""torchtune's optimizer_in_bwd: (model, ranks, seq, micro-batch, policy) of each extra run."""


def main(out: Path = DEFAULT_OUT, frameworks: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch in SHAPES:
        for framework in FRAMEWORKS:
            if frameworks and framework.value not in frameworks:
                continue
            for policy in POLICIES + MORE_POLICIES.get(framework, ()):
                _run(out, model_name, world_size, seq_len, micro_batch, step_training(framework, policy))
    if not frameworks or Framework.torchtune.value in frameworks:
        main_optimizer_in_backward(out)


def _run(out: Path, model_name: str, world_size: int, seq_len: int, micro_batch: int, training) -> None:
    record = run_step(get_model(model_name), StrategyKind.fsdp_full_shard, training,
                      BatchSpec(seq_len=seq_len, micro_batch_size=micro_batch), world_size)
    write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
    print(f"{record.name:72s} peak {record.peak_bytes / 2**30:8.2f} GiB at {record.peak_phase.value:9s} "
          f"({record.wall_time_s:.1f} s)", flush=True)


def main_optimizer_in_backward(out: Path = DEFAULT_OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model_name, world_size, seq_len, micro_batch, policy in OPTIMIZER_IN_BACKWARD:
        training = step_training(Framework.torchtune, policy).model_copy(update={"optimizer_in_backward": True})
        _run(out, model_name, world_size, seq_len, micro_batch, training)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--optimizer-in-backward"]:
        main_optimizer_in_backward(Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT)
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT, set(sys.argv[2:]) or None)
