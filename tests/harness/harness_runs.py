"""The measured runs the harness tests check, and how they are launched: every run of one world
size in a single torchrun launch (tests/harness/ranks_worker.py), the tensor and pipeline
parallel runs of test_model_parallel.py (PARALLEL_RUNS) and the DeepSpeed runs and probes of
test_deepspeed.py (DEEPSPEED_RUNS, last) included. The launches run in the background
(BackgroundLaunches), while the tests that need none of them run."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from zeroplan.harness.launch import stop_torchrun

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


def batch_runs(nproc: int) -> list[AnyRun]:
    """Every run of world size ``nproc``, in launch order (DeepSpeed's last)."""
    return [run for run in (*RUNS, *PARALLEL_RUNS, *DEEPSPEED_RUNS) if run.nproc == nproc]


def _batch_command(nproc: int, runs: list[AnyRun], root: Path) -> tuple[list[str], dict[AnyRun, Path]]:
    """The torchrun command that runs ``runs`` (all of world size ``nproc``) in one launch, and
    each run's output directory: its records and, but for a ParallelRun, rank 0's full
    parameters (parameters.pt) go to root/<name>/ (a probe's files too)."""
    assert all(run.nproc == nproc for run in runs)
    outs = {run: root / run.name for run in runs}
    root.mkdir(parents=True, exist_ok=True)
    spec = [_entry(run, out) for run, out in outs.items()]
    spec_path = root / "runs.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), str(spec_path)]
    return command, outs


def _check_batch(runs: list[AnyRun], returncode: int, output: str) -> None:
    """A failed launch fails the test that reads it, with the lines naming the failed runs."""
    errors = [line for line in output.splitlines() if "zeroplan measure:" in line]
    if any(isinstance(run, DeepSpeedRun | ProbeRun) for run in runs):
        from zeroplan.harness.extension_locks import describe_extension_locks

        assert returncode == 0, (errors or output[-3000:], describe_extension_locks())
    assert returncode == 0, errors or output[-3000:]


BACKGROUND_NICENESS = 10
"""How much lower the background launches' CPU priority is than the test session's: they take
the cores the session leaves idle (it runs its in-process tests on one), not the session's."""
POLL_S = 0.5


@dataclass
class _Batch:
    nproc: int
    done: threading.Event
    waited_since: float | None = None
    """When a test first waited for it (time.monotonic); its time limit runs from then on."""
    outs: dict[AnyRun, Path] | None = None
    failure: BaseException | None = None


class BackgroundLaunches:
    """Each world size's batch in one torchrun launch, launched one after another on a thread
    of this session at a lower CPU priority, in the order asked, into a directory of its own
    removed at the session's end; a test that reads a run waits for its batch. Starting torch
    and gloo in every rank and measuring a few dozen runs costs minutes of CPU; started before
    the tests that read them, they run while the others do.
    A batch's time limit counts from when a test first waits for it (started earlier, it may
    be slowed by the tests beside it without being late)."""

    def __init__(self, timeout_s: float) -> None:
        self.root, self.timeout_s = Path(tempfile.mkdtemp(prefix="zeroplan-harness-runs-")), timeout_s
        self._batches: dict[int, _Batch] = {}
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._launch_all, name="harness-batches", daemon=True)
        self._thread.start()
        # Also where the session ends without tearing its fixtures down (Ctrl-C).
        atexit.register(self.stop)

    def ask(self, nproc: int) -> _Batch:
        """Queue the batch of world size ``nproc`` unless it is queued already."""
        with self._lock:
            if nproc not in self._batches:
                self._batches[nproc] = _Batch(nproc, threading.Event())
                self._queue.put(nproc)
            return self._batches[nproc]

    def out_dirs(self, nproc: int) -> dict[AnyRun, Path]:
        """Each run of world size ``nproc`` -> its output directory, once its launch has ended;
        a failed launch raises its failure in every test that reads one of its runs."""
        batch = self.ask(nproc)
        with self._lock:
            if batch.waited_since is None:
                batch.waited_since = time.monotonic()
        batch.done.wait()
        if batch.failure is not None:
            raise batch.failure
        assert batch.outs is not None
        return batch.outs

    def stop(self) -> None:
        """At the session's end: stop a launch still running (no test reads it) and start no other."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._queue.put(None)
        self._thread.join()
        shutil.rmtree(self.root, ignore_errors=True)

    def _launch_all(self) -> None:
        while (nproc := self._queue.get()) is not None and not self._stopping.is_set():
            batch = self._batches[nproc]
            try:
                batch.outs = self._launch(batch)
            except BaseException as failure:  # noqa: BLE001 - handed to the test that reads the batch
                batch.failure = failure
            finally:
                batch.done.set()

    def _launch(self, batch: _Batch) -> dict[AnyRun, Path]:
        runs = batch_runs(batch.nproc)
        if any(isinstance(run, DeepSpeedRun | ProbeRun) for run in runs):
            from zeroplan.harness.extension_locks import check_no_stale_extension_lock

            # A stale JIT build lock would make DeepSpeed's runs wait out the whole time limit.
            check_no_stale_extension_lock()
        command, outs = _batch_command(batch.nproc, runs, self.root / f"runs-n{batch.nproc}")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
        # Output to a file, not a pipe: torchrun starts each rank in a session of its own.
        with tempfile.TemporaryFile("w+") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
            # Before torchrun's agent has imported torch, so every rank it starts inherits it.
            os.setpriority(os.PRIO_PROCESS, process.pid,
                           min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICENESS))
            returncode = self._wait(process, batch)
            log.seek(0)
            output = log.read()
        _check_batch(runs, returncode, output)
        return outs

    def _wait(self, process: subprocess.Popen, batch: _Batch) -> int:
        """The launch's exit status; 124 once its time limit has passed, or at the session's end,
        after stopping it."""
        started = time.monotonic()
        while True:
            try:
                return process.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            waited_since = batch.waited_since
            late = waited_since is not None and time.monotonic() - max(started, waited_since) > self.timeout_s
            if late or self._stopping.is_set():
                # As zeroplan.harness.launch stops a launch: SIGTERM for torchrun's agent, then SIGKILL.
                stop_torchrun(process)
                return 124


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
