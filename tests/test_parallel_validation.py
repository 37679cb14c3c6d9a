"""The planner under model parallelism against what torchtitan 0.3.0's own parallelism code holds
and issues on a fake process group (benchmarks/parallel-records) and what torch 2.13's own
pipeline schedules and torchtitan's own stage split produce (benchmarks/pipeline-records).
Targets (docs/validation.md, "Model parallelism"): parameters per rank to the byte, saved
activations per block within 2 %, collective bytes per block equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.parallel.pipeline import in_flight_chunks, pipeline_stages, rank_stage_indices
from zeroplan.core.parallel.units import rank_parameter_elements
from zeroplan.frameworks.parallel_record import load_parallel_records
from zeroplan.frameworks.pipeline_record import load_schedule_records, load_split_records
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategySpec, TrainingSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.hardware import cluster_from_gpus
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.validate.parallel import (
    ACTIVATION_TARGET, PRESET, measured_collectives, predicted_block_bytes, predicted_collectives,
    predicted_parameter_bytes,
)

ROOT = Path(__file__).resolve().parents[1] / "benchmarks"
PARALLEL = load_parallel_records(ROOT / "parallel-records")
SPLITS = [r for r in load_split_records(ROOT / "pipeline-records") if r.error is None]
SCHEDULES = [r for r in load_schedule_records(ROOT / "pipeline-records") if r.error is None]


def test_the_records_are_there():
    assert len(PARALLEL) >= 60 and len(SPLITS) >= 35 and len(SCHEDULES) >= 90


def test_the_presets_are_the_flavours_that_ran():
    for record in PARALLEL:
        model = get_model(PRESET[record.flavor])
        assert (model.hidden_size, model.num_heads, model.kv_heads, model.ffn_hidden_size, model.vocab_size,
                model.num_layers) == (record.dim, record.n_heads, record.n_kv_heads, record.ffn_hidden,
                                      record.vocab_size, record.n_layers_full)


STATE_RECORDS = [r for r in PARALLEL if r.activations is None and r.cp == 1]


@pytest.mark.parametrize("record", STATE_RECORDS, ids=lambda r: r.name)
def test_parameters_per_tensor_parallel_rank_to_the_byte(record):
    # The records hold fp32 parameters (torchtitan's TrainingConfig.dtype); FSDP2 on top shards
    # the tensor-parallel local tensor over dp_shard (the dp2 records).
    assert record.param_dtype.endswith("float32")
    assert predicted_parameter_bytes(record) == record.full_depth_param_bytes()


ACTIVATION_RECORDS = [r for r in PARALLEL if r.activations is not None and r.dp_shard == 1]


@pytest.mark.parametrize("record", ACTIVATION_RECORDS, ids=lambda r: r.name)
def test_saved_activations_per_block_within_target(record):
    predicted, measured = predicted_block_bytes(record), record.activations.block_kept_bytes
    assert abs(predicted / measured - 1) <= ACTIVATION_TARGET, (predicted, measured)


# torchtitan's default backend (ParallelismConfig.spmd_backend); under partial_dtensor DTensor
# reduces the tensor-parallel gradients later, as reduce-scatters (docs/parallelism-measured.md).
COLLECTIVE_RECORDS = [r for r in ACTIVATION_RECORDS if r.spmd_backend == "spmd_types"]


@pytest.mark.parametrize("record", COLLECTIVE_RECORDS, ids=lambda r: r.name)
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_collective_bytes_per_block_equal(record, phase):
    assert predicted_collectives(record, phase) == measured_collectives(record, phase)


# --- pipeline --------------------------------------------------------------------------------

SCHEDULE_OF = {s.torch_name: s for s in PipelineSchedule}


@pytest.mark.parametrize("record", SPLITS, ids=lambda r: r.name)
def test_stage_split_and_parameters_per_pipeline_rank_equal_torchtitans(record):
    schedule = SCHEDULE_OF[record.schedule]
    stages = record.pp * record.stages_per_rank
    planned = pipeline_stages(record.num_layers, stages, Framework.torchtitan)
    assert [s.num_blocks for s in planned] == [s.layers for s in record.stages]
    parallel = ParallelSpec(pp=record.pp, pp_schedule=schedule, virtual_stages=record.stages_per_rank)
    request = PlanRequest(
        model=get_model(PRESET[record.flavour]), training=TrainingSpec(framework=Framework.torchtitan),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), record.pp), strategy=StrategySpec(kind="ddp"), parallel=parallel,
        batch=BatchSpec(grad_accum_steps=record.pp),
    )
    for rank in record.ranks:
        assert list(rank_stage_indices(parallel, rank.rank)) == rank.stage_indices
        assert rank_parameter_elements(request.at_pipeline_rank(rank.rank)) == rank.param_elements


@pytest.mark.parametrize("record", [r for r in SCHEDULES if r.schedule in SCHEDULE_OF], ids=lambda r: r.name)
def test_in_flight_chunks_equal_torchs_schedules(record):
    parallel = ParallelSpec(pp=record.pp, pp_schedule=SCHEDULE_OF[record.schedule], virtual_stages=record.stages_per_rank)
    measured = [r.peak_saved_chunks_measured for r in record.ranks]
    assert [in_flight_chunks(parallel, r, record.microbatches) for r in range(record.pp)] == measured


DOCS = (Path(__file__).resolve().parents[1] / "docs" / "validation.md").read_text()


def test_the_validation_docs_rows_are_the_records():
    # docs/validation.md "Model parallelism", selected rows: | model | tp | sp | predicted | measured | error |
    section = DOCS[DOCS.index("## Model parallelism"):DOCS.index("## What does not agree yet")]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| 8B |") or line.startswith("| 70B |")]
    assert len(rows) >= 5
    by_name = {r.name: r for r in PARALLEL}
    for model, tp, sp, predicted, measured, _ in rows:
        tp = int(tp)
        name = (f"torchtitan-llama3-{model.strip()}_spmd_tp{tp}_dp1_cp1_{'sp' if sp.strip() == 'on' else 'nosp'}"
                "_ac-none_s4096_b1")
        record = by_name[name]
        assert int(predicted.replace(",", "")) == predicted_block_bytes(record)
        assert int(measured.replace(",", "")) == record.activations.block_kept_bytes
