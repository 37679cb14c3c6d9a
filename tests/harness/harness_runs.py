"""The measured runs the harness tests check, and how they are launched: every run of one world
size in a single torchrun launch (tests/harness/ranks_worker.py), the tensor and pipeline
parallel runs of test_model_parallel.py (PARALLEL_RUNS) and the DeepSpeed runs and probes of
test_deepspeed.py (DEEPSPEED_RUNS, last) included."""

from __future__ import annotations

import importlib.util
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


@dataclass(frozen=True)
class DeepSpeedRun:
    """A run of DeepSpeed's own engine (test_deepspeed.py)."""

    strategy: str
    nproc: int
    grad_accum: int = 1

    @property
    def name(self) -> str:
        return f"deepspeed-{self.strategy}-n{self.nproc}-k{self.grad_accum}"

    def argv(self) -> list[str]:
        return ["micro-llama", "--strategy", self.strategy, "--engine", "deepspeed", "--steps", str(STEPS),
                "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN), "--precision", "fp32",
                "--grad-accum", str(self.grad_accum)]


@dataclass(frozen=True)
class ProbeRun:
    """One of ranks_worker.py's probes (test_deepspeed.py): ``args`` follow its output directory."""

    probe: str
    nproc: int
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"probe-{self.probe}-n{self.nproc}"


DEEPSPEED_STRATEGIES = [("zero1", 2), ("zero2", 2), ("zero3", 2), ("zero3", 4), ("zero2-offload", 2), ("zero3-offload", 2)]
DEEPSPEED_ACCUMULATION = 2
"""Micro-batches per step of the accumulation runs (DeepSpeed's gradient_accumulation_steps)."""
DEEPSPEED_ACCUMULATING = [("zero1", 2), ("zero2", 2), ("zero3", 2)]
OFFLOAD_COPIES = ((2, 1), (2, 3), (3, 3))
"""(stage, micro-batches per step) of the offload copy counts (tests/harness/offload_copies_worker.py)."""
HPZ = 2
"""zero_hpz_partition_size of the hpZ probe over four ranks (tests/harness/hpz_worker.py)."""
DEEPSPEED_KEYS: dict[tuple, DeepSpeedRun | ProbeRun] = {
    **{(strategy, nproc): DeepSpeedRun(strategy, nproc) for strategy, nproc in DEEPSPEED_STRATEGIES},
    **{(strategy, nproc, DEEPSPEED_ACCUMULATION): DeepSpeedRun(strategy, nproc, DEEPSPEED_ACCUMULATION)
       for strategy, nproc in DEEPSPEED_ACCUMULATING},
    ("offload-copies", 2): ProbeRun("offload_copies", 2, tuple(f"{stage}:{accum}" for stage, accum in OFFLOAD_COPIES)),
    ("hpz", 4): ProbeRun("hpz", 4, (str(HPZ),)),
    ("groups", 2): ProbeRun("groups", 2, ()),
}
"""test_deepspeed.py's runs by its keys."""
DEEPSPEED_RUNS = list(DEEPSPEED_KEYS.values()) if importlib.util.find_spec("deepspeed") is not None else []
"""Launched after every other run of their world size (DeepSpeed's import after them), where
DeepSpeed is installed."""

AnyRun = Run | ParallelRun | DeepSpeedRun | ProbeRun


def _entry(run: AnyRun, out: Path) -> dict:
    if isinstance(run, ProbeRun):
        out.mkdir(parents=True)
        return {"name": run.name, "probe": run.probe, "args": [str(out), *run.args]}
    return {"name": run.name, "argv": run.argv(), "out": str(out),
            "save_parameters": None if isinstance(run, ParallelRun) else str(out / "parameters.pt")}


def launch_batch(nproc: int, runs: list[AnyRun], root: Path, timeout_s: float = 600) -> dict[AnyRun, Path]:
    """Run ``runs`` (all of world size ``nproc``) in one torchrun launch; each run's records and,
    but for a ParallelRun, rank 0's full parameters (parameters.pt) go to root/<name>/ (a
    probe's files too)."""
    assert all(run.nproc == nproc for run in runs)
    outs = {run: root / run.name for run in runs}
    root.mkdir(parents=True, exist_ok=True)
    spec = [_entry(run, out) for run, out in outs.items()]
    spec_path = root / "runs.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), str(spec_path)]
    returncode, output = run_torchrun(command, timeout_s)
    errors = [line for line in output.splitlines() if "zeroplan measure:" in line]
    if any(isinstance(run, DeepSpeedRun | ProbeRun) for run in runs):
        from zeroplan.harness.extension_locks import describe_extension_locks

        assert returncode == 0, (errors or output[-3000:], describe_extension_locks())
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
