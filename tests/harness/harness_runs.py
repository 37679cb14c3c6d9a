"""The measured runs the harness tests check, and how they are launched: every run of one world
size in a single torchrun launch (tests/harness/ranks_worker.py), the tensor and pipeline
parallel runs of test_model_parallel.py (PARALLEL_RUNS) included."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from zeroplan.harness.launch import run_torchrun

WORKER = Path(__file__).with_name("ranks_worker.py")
STEPS, MICRO_BATCH, SEQ_LEN = 3, 2, 16


@dataclass(frozen=True)
class Run:
    strategy: str
    engine: str
    nproc: int = 2
    grad_accum: int = 1
    optimizer: str = "adamw"
    keep_unsharded: bool = False
    model: str = "micro-llama"  # odd sizes: every unit needs padding at N = 2 and 4

    @property
    def name(self) -> str:
        keep = "-keep" if self.keep_unsharded else ""
        return f"{self.strategy}-{self.engine}-n{self.nproc}-k{self.grad_accum}-{self.optimizer}{keep}-{self.model}"

    def argv(self) -> list[str]:
        argv = [self.model, "--strategy", self.strategy, "--engine", self.engine, "--steps", str(STEPS),
                "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN), "--precision", "fp32",
                "--grad-accum", str(self.grad_accum), "--optimizer", self.optimizer, "--run-id", self.name]
        return argv + (["--keep-unsharded-grads-on-accum"] if self.keep_unsharded else [])


@dataclass(frozen=True)
class ParallelRun:
    """A tensor or pipeline parallel run (test_model_parallel.py), given by its own flags; its
    full parameters are not saved."""

    name: str
    flags: tuple[str, ...]
    nproc: int = 4

    def argv(self) -> list[str]:
        return [PARALLEL_MODEL, *self.flags, "--steps", str(PARALLEL_STEPS), "--micro-batch", str(MICRO_BATCH),
                "--seq-len", str(SEQ_LEN), "--run-id", self.name]


PARALLEL_MODEL, PARALLEL_STEPS, PARALLEL_MICRO_BATCHES = "micro-llama-mp", 2, 2
PARALLEL_RUNS = [
    ParallelRun("tp", ("--strategy", "fsdp-full-shard", "--tp", "2")),
    ParallelRun("tp-sp", ("--strategy", "fsdp-full-shard", "--tp", "2", "--sequence-parallel")),
    ParallelRun("pp-1f1b-fsdp", ("--strategy", "fsdp-full-shard", "--pp", "2", "--pp-schedule", "1f1b",
                                 "--grad-accum", str(PARALLEL_MICRO_BATCHES))),
    ParallelRun("pp-gpipe-ddp", ("--strategy", "ddp", "--pp", "2", "--pp-schedule", "gpipe",
                                 "--grad-accum", str(PARALLEL_MICRO_BATCHES))),
]


def launch_batch(nproc: int, runs: list[Run | ParallelRun], root: Path, timeout_s: float = 600) -> dict[Run | ParallelRun, Path]:
    """Run ``runs`` (all of world size ``nproc``) in one torchrun launch; each run's records and,
    for a Run, rank 0's full parameters (parameters.pt) go to root/<name>/."""
    assert all(run.nproc == nproc for run in runs)
    outs = {run: root / run.name for run in runs}
    spec = [{"name": run.name, "argv": run.argv(), "out": str(out),
             "save_parameters": str(out / "parameters.pt") if isinstance(run, Run) else None}
            for run, out in outs.items()]
    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / "runs.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), str(spec_path)]
    returncode, output = run_torchrun(command, timeout_s)
    errors = [line for line in output.splitlines() if "zeroplan measure:" in line]
    assert returncode == 0, errors or output[-3000:]
    return outs


_REFERENCE_ONE_MICRO_BATCH = [
    Run("zero1", "zeroplan"), Run("zero2", "zeroplan"), Run("zero3", "zeroplan"),
    Run("zero1", "zeroplan", 4), Run("zero3", "zeroplan", 4),
]
_TORCH_ONE_MICRO_BATCH = [
    Run("ddp", "torch"), Run("zero1", "torch"),
    Run("fsdp-full-shard", "torch"), Run("fsdp-shard-grad-op", "torch"), Run("fsdp-full-shard", "torch", 4),
    Run("fsdp-full-shard", "torch-fsdp1"), Run("fsdp-shard-grad-op", "torch-fsdp1"),
]
# Two micro-batches per step on every engine, in both accumulation modes where an engine has two.
_ACCUMULATING = [
    Run("zero1", "zeroplan", grad_accum=2), Run("zero2", "zeroplan", grad_accum=2),
    Run("zero3", "zeroplan", grad_accum=2), Run("zero3", "zeroplan", grad_accum=2, keep_unsharded=True),
    # Tied embeddings. SGD, not AdamW: the key bias of GPT-2 attention has a zero gradient in
    # exact arithmetic (softmax ignores a per-query constant), so its gradient is rounding
    # noise, which AdamW scales up to updates of lr * g / eps that no two summation orders share.
    Run("zero3", "zeroplan", grad_accum=2, optimizer="sgd-momentum", model="micro-gpt2"),
    Run("zero2", "zeroplan", 4, grad_accum=2),
    Run("ddp", "torch", grad_accum=2), Run("zero1", "torch", grad_accum=2),
    Run("fsdp-full-shard", "torch", grad_accum=2),
    Run("fsdp-shard-grad-op", "torch", grad_accum=2, keep_unsharded=True),
    Run("fsdp-full-shard", "torch-fsdp1", grad_accum=2, keep_unsharded=True),
    Run("fsdp-shard-grad-op", "torch-fsdp1", grad_accum=2),
]
# Each optimizer besides AdamW on the reference ZeRO (stage 2 or 3) and on FSDP2; Adafactor,
# which neither runs (engines_table.py), on the engines that step whole tensors.
_OPTIMIZERS = [
    Run("zero2", "zeroplan", grad_accum=2, optimizer="adam"),
    Run("zero3", "zeroplan", grad_accum=2, optimizer="sgd"),
    Run("zero1", "zeroplan", grad_accum=2, optimizer="sgd-momentum"),
    Run("zero2", "zeroplan", grad_accum=2, optimizer="sgd-momentum", keep_unsharded=True),
    Run("zero3", "zeroplan", grad_accum=2, optimizer="sgd-momentum"),
    Run("fsdp-full-shard", "torch", grad_accum=2, optimizer="adam"),
    Run("fsdp-full-shard", "torch", grad_accum=2, optimizer="sgd"),
    Run("fsdp-full-shard", "torch", grad_accum=2, optimizer="sgd-momentum"),
    Run("ddp", "torch", grad_accum=2, optimizer="adafactor"),
    Run("zero1", "torch", grad_accum=2, optimizer="adafactor"),
]
RUNS = _REFERENCE_ONE_MICRO_BATCH + _TORCH_ONE_MICRO_BATCH + _ACCUMULATING + _OPTIMIZERS


def find_run(**fields) -> Run:
    """The one run in RUNS with these fields (the others at their defaults)."""
    wanted = Run(**fields)
    assert wanted in RUNS, wanted
    return wanted
