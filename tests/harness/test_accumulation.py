"""Gradient accumulation and the optimizer choice: micro-batch data, collective counts per step
(derived from the unit structure, and the planner's), the accumulation mode of every engine, the
optimizer factory, and the one-line refusals. The measured runs are those of harness_runs.py."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

from harness_runs import MICRO_BATCH, RUNS, SEQ_LEN, STEPS, Run
from zeroplan.core.communication import collectives
from zeroplan.core.optimizer_states import adafactor_state_bytes, step_counter_bytes
from zeroplan.core.params import ParamTensor
from zeroplan.harness.data import global_batch, rank_batch
from zeroplan.harness.engine import make_optimizer
from zeroplan.harness.engines_table import MEASURABLE_OPTIMIZERS
from zeroplan.harness.model import build_model
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.record import read_record
from zeroplan.harness.zero import unit_modules
from zeroplan.specs import Optimizer
from zeroplan.validate.compare import compare_record, request_for

OPS = ("all_gather", "reduce_scatter", "all_reduce")


def _measured_counts(run_dir) -> list[Counter]:
    """Per rank: collective calls by op in the last step (the first may include one-offs)."""
    records = [read_record(p) for p in sorted(run_dir.glob("rank*.json"))]
    assert records and all(r.complete for r in records)
    return [Counter(c.op for c in r.steps[-1].collectives if c.op in OPS) for r in records]


def _planned_counts(record) -> Counter:
    counts: Counter = Counter()
    for collective in collectives(request_for(record.description)):
        counts[collective.op.value] += collective.calls * collective.occurrences_per_step
    return counts


def _counts_from_units(run: Run) -> Counter:
    """What the reference ZeRO must issue per step, from its U units and K micro-batches: every
    stage gathers each unit once after the step at stages 1-2; ZeRO-3 gathers each unit before
    its forward and again before its backward (a tied embedding once: it stays gathered for the
    head), per micro-batch; gradients are reduce-scattered once per step at stage 1 or when
    accumulated unsharded, else once per micro-batch."""
    spec = HARNESS_PRESETS[run.model]
    units, k = len(unit_modules(build_model(spec))), run.grad_accum
    stage = int(run.strategy[-1])
    reduces = units if stage == 1 or run.keep_unsharded else k * units
    gathers = k * (2 * units - (1 if spec.tied_embeddings else 0)) if stage == 3 else units
    return Counter(all_gather=gathers, reduce_scatter=reduces)


REFERENCE = [r for r in RUNS if r.engine == "zeroplan"]


@pytest.mark.parametrize("run", REFERENCE, ids=lambda run: run.name)
def test_reference_zero_collective_counts_follow_the_units_and_the_planner(measured, run: Run) -> None:
    expected = _counts_from_units(run)
    record = read_record(measured(run) / "rank00000.json")
    assert _planned_counts(record) == expected
    for counts in _measured_counts(measured(run)):
        assert counts == expected, (run.name, counts, expected)


def test_the_count_derivation_distinguishes_the_modes() -> None:
    """Accumulating unsharded gradients, ZeRO-3 and tied embeddings each change the count."""
    base = _counts_from_units(Run("zero3", "zeroplan", grad_accum=2))
    assert base == Counter(all_gather=16, reduce_scatter=8)  # micro-llama: 4 units
    assert _counts_from_units(Run("zero3", "zeroplan", grad_accum=2, keep_unsharded=True))["reduce_scatter"] == 4
    assert _counts_from_units(Run("zero3", "zeroplan", grad_accum=2, model="micro-gpt2"))["all_gather"] == 14
    assert _counts_from_units(Run("zero2", "zeroplan", grad_accum=2)) == Counter(all_gather=4, reduce_scatter=8)


# Engines with two accumulation modes: reduce every micro-batch (default) or once per step.
# K=2 against the same engine's K=1 run: gradient reductions double, or stay, as the mode
# says; the planner's bytes per step scale the same way.
TORCH_ACCUMULATING = [r for r in RUNS if r.engine != "zeroplan" and r.grad_accum == 2 and r.optimizer == "adamw"]


@pytest.mark.parametrize("run", TORCH_ACCUMULATING, ids=lambda run: run.name)
def test_torch_engines_reduce_per_micro_batch_or_once_as_their_mode_says(measured, run: Run) -> None:
    single = Run(run.strategy, run.engine, run.nproc)
    assert single in RUNS
    once_per_step = run.strategy in ("ddp", "zero1") or run.keep_unsharded
    reduction = "all_reduce" if run.strategy in ("ddp", "zero1") else "reduce_scatter"
    factor = 1 if once_per_step else run.grad_accum
    for one, two in zip(_measured_counts(measured(single)), _measured_counts(measured(run))):
        assert one[reduction] > 0
        assert two[reduction] == factor * one[reduction], (run.name, one, two)
        if run.strategy.startswith("fsdp"):  # every micro-batch's forward gathers again
            assert two["all_gather"] == run.grad_accum * one["all_gather"]
    record, single_record = (read_record(measured(r) / "rank00000.json") for r in (run, single))
    rows = {row.quantity: row for row in compare_record(record)}
    single_rows = {row.quantity: row for row in compare_record(single_record)}
    quantity = f"{reduction} bytes/step"
    assert rows[quantity].predicted_bytes == factor * single_rows[quantity].predicted_bytes
    assert rows[quantity].measured_bytes == factor * single_rows[quantity].measured_bytes


@pytest.mark.parametrize("run", [r for r in RUNS if r.strategy in ("ddp", "fsdp-full-shard", "fsdp-shard-grad-op")
                                 and r.engine == "torch"], ids=lambda run: run.name)
def test_ddp_and_fsdp2_bytes_equal_the_planner(measured, run: Run) -> None:
    """DDP and FSDP2 keep the layouts the planner names for them (whole tensors; dim-0 shards):
    model states and collective bytes per step match exactly, accumulating or not, whatever
    the optimizer (Adafactor's factored states and step counters included). FSDP2's optimizer
    states are zeros_like the unpadded local shard, so a rank that owns fewer rows than the
    padded shard (the last) holds less than the planner's padded figure (docs/simulate.md)."""
    for path in sorted(measured(run).glob("rank*.json")):
        record = read_record(path)
        rows = [row for row in compare_record(record) if row.category == "communication"
                or row.quantity in ("parameters", "gradients", "optimizer states")]
        assert len(rows) >= 4
        for row in rows:
            if record.rank > 0 and run.strategy != "ddp" and row.quantity == "optimizer states":
                assert 0 < row.measured_bytes <= row.predicted_bytes or row.predicted_bytes == 0
            else:
                assert row.measured_bytes == row.predicted_bytes, (run.name, path.name, row.quantity)


def test_micro_batches_are_distinct_and_make_up_the_global_batch() -> None:
    spec = HARNESS_PRESETS["micro-llama"]
    world, k, steps = 2, 3, 2
    seen = set()
    for step in range(steps):
        tokens, targets = global_batch(spec, step, world, MICRO_BATCH, SEQ_LEN, grad_accum_steps=k)
        parts = [rank_batch(spec, step, world, rank, MICRO_BATCH, SEQ_LEN, micro_batch=micro, grad_accum_steps=k)
                 for micro in range(k) for rank in range(world)]
        assert torch.equal(torch.cat([t for t, _ in parts]), tokens)
        assert torch.equal(torch.cat([t for _, t in parts]), targets)
        for part_tokens, _ in parts:
            key = tuple(part_tokens.flatten().tolist())
            assert key not in seen
            seen.add(key)
    assert len(seen) == steps * k * world
    # One micro-batch per step keeps the earlier layout: rank r's rows [r*b, (r+1)*b).
    one, _ = global_batch(spec, 0, world, MICRO_BATCH, SEQ_LEN)
    assert torch.equal(rank_batch(spec, 0, world, 1, MICRO_BATCH, SEQ_LEN)[0], one[MICRO_BATCH:])


@pytest.mark.parametrize("kind", MEASURABLE_OPTIMIZERS, ids=lambda o: o.value)
def test_the_factory_builds_each_optimizer_whose_states_the_planner_counts(kind: Optimizer) -> None:
    """torch's state tensors after one step, against the planner's optimizer_states.py."""
    expected_class = {Optimizer.adamw: torch.optim.AdamW, Optimizer.adam: torch.optim.Adam,
                      Optimizer.sgd: torch.optim.SGD, Optimizer.sgd_momentum: torch.optim.SGD,
                      Optimizer.adafactor: torch.optim.Adafactor}[kind]
    shapes = [(6,), (5, 7), (3, 4, 5)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    optimizer = make_optimizer(kind, params)
    assert type(optimizer) is expected_class
    sum(p.square().sum() for p in params).backward()
    optimizer.step()
    for shape, p in zip(shapes, params):
        state = optimizer.state[p]
        steps = [v for name, v in state.items() if name == "step" and isinstance(v, torch.Tensor)]
        states = [v for name, v in state.items() if name != "step" and isinstance(v, torch.Tensor)]
        assert sum(t.nbytes for t in steps) == step_counter_bytes(kind, 1)
        tensor = ParamTensor(name="p", shape=shape)
        if kind is Optimizer.adafactor:
            assert sum(t.nbytes for t in states) == adafactor_state_bytes(tensor, 4)
        else:
            per_element = {Optimizer.adamw: 8, Optimizer.adam: 8, Optimizer.sgd: 0, Optimizer.sgd_momentum: 4}[kind]
            assert sum(t.nbytes for t in states) == per_element * p.numel()


@pytest.mark.parametrize("strategy,engine", [("zero2", "zeroplan"), ("fsdp-full-shard", "torch"),
                                             ("fsdp-shard-grad-op", "torch-fsdp1")])
def test_adafactor_on_sharded_tensors_is_refused_in_one_line(zeroplan_cli, tmp_path, strategy, engine) -> None:
    code, _, err = zeroplan_cli("measure", "micro-llama", "--strategy", strategy, "--engine", engine,
                                "--optimizer", "adafactor", "--out", str(tmp_path))
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("zeroplan measure: error: --optimizer: 'adafactor' is not supported by ")
    assert "allowed: adamw, adam, sgd, sgd-momentum" in err
    assert not list(tmp_path.iterdir())  # refused before any rank started


def test_optimizers_torch_lacks_are_refused_by_the_parser(zeroplan_cli, tmp_path) -> None:
    code, _, err = zeroplan_cli("measure", "micro-llama", "--strategy", "zero2", "--optimizer", "lion", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "--optimizer" in err and "sgd-momentum" in err


@pytest.mark.slow  # runs a rank in a subprocess (python -m zeroplan.harness)
def test_a_rank_refuses_an_unsupported_optimizer_in_one_line(tmp_path) -> None:
    """The per-rank entry point checks too (a cluster launches it without zeroplan measure)."""
    done = subprocess.run([sys.executable, "-m", "zeroplan.harness", "micro-llama", "--strategy", "zero3",
                           "--optimizer", "adafactor", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "zeroplan measure: error: --optimizer: 'adafactor' is not supported by reference ZeRO stage 3 "
        "(--strategy zero3 --engine zeroplan; allowed: adamw, adam, sgd, sgd-momentum)"
    ]


@pytest.mark.slow  # launches torchrun
def test_measure_passes_the_accumulation_flags_to_every_rank(zeroplan_cli, tmp_path) -> None:
    """Through ``zeroplan measure`` itself (the other runs use the batched test launcher): the
    flags reach the ranks' records, and a rank that fails leaves every record with the steps
    done so far."""
    code, _, err = zeroplan_cli("measure", "micro-llama", "--strategy", "zero2", "--steps", str(STEPS),
                                "--seq-len", str(SEQ_LEN), "--grad-accum", "3", "--optimizer", "sgd-momentum",
                                "--keep-unsharded-grads-on-accum", "--fail-rank", "1", "--out", str(tmp_path))
    assert code == 1 and "rank 1 failed: InjectedFailure" in err
    assert "ranks without a complete record: [0, 1]; 2 record(s) kept" in err
    records = [read_record(p) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r.rank for r in records] == [0, 1] and not any(r.complete for r in records)
    for record in records:
        description = record.description
        assert description.batch.grad_accum_steps == 3 and description.keep_unsharded_grads_on_accum
        assert description.training.optimizer is Optimizer.sgd_momentum
        # One step of 3 micro-batches, reduce-scattered once (kept unsharded) over 4 units.
        assert Counter(c.op for c in record.steps[0].collectives)["reduce_scatter"] == 4


@pytest.mark.slow  # launches torchrun (one rank)
def test_one_rank_trains_unwrapped_as_the_planner_predicts(zeroplan_cli, tmp_path) -> None:
    """At world size 1 DDP is plain training: no gradient-sized bucket copy, on either side."""
    code, _, err = zeroplan_cli("measure", "micro-llama", "--strategy", "ddp", "--engine", "torch", "--nproc", "1",
                                "--steps", "2", "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN),
                                "--precision", "fp32", "--out", str(tmp_path))
    assert code == 0, err
    rows = {row.quantity: row for row in compare_record(read_record(next(tmp_path.glob("rank*.json"))))}
    assert all(rows[q].measured_bytes == rows[q].predicted_bytes for q in ("parameters", "gradients", "optimizer states"))
    peak = rows["peak (tracked tensors)"]
    # A bucket copy on one side only would put them a whole gradient size apart.
    assert abs(peak.measured_bytes - peak.predicted_bytes) < rows["gradients"].predicted_bytes / 2
