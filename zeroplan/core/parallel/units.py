"""The parameter units one rank of a model-parallel layout holds: the blocks of its pipeline
stages (with the embedding on the first, the head on the last), each tensor as its
tensor-parallel rank holds it. The data-parallel planner shards these as it shards the whole
model's units; with every degree 1 they are the model's units."""

from __future__ import annotations

from functools import lru_cache

from zeroplan.core.finetune.units import finetune_units, trainable_view
from zeroplan.core.params import ParamTensor, ParamUnit, parameter_units
from zeroplan.core.parallel.expert import expert_parallel_units
from zeroplan.core.parallel.pipeline import Stage, rank_stages, request_rank_stages
from zeroplan.core.parallel.tensor import tensor_parallel_units
from zeroplan.specs.finetune import FineTuneSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule
from zeroplan.specs.request import PlanRequest


@lru_cache(maxsize=256)
def _rank_units(model: ModelSpec, tp: int, pp: int, schedule: PipelineSchedule, virtual_stages: int, pipeline_rank: int,
                ep: int, framework: Framework, efsdp: int, finetune: FineTuneSpec,
                given_stages: tuple[Stage, ...] | None = None) -> tuple[ParamUnit, ...]:
    # Only what decides the units keys the cache (not sequence or context parallelism); the
    # spec is built on a miss only, since the planner asks for a rank's units many times a plan.
    parallel = ParallelSpec(tp=tp, pp=pp, pp_schedule=schedule, virtual_stages=virtual_stages,
                            pipeline_rank=pipeline_rank, ep=ep)
    units = parameter_units(model)
    if parallel.pp > 1:
        # A device map's stage is accelerate's split (given: it reads more than the layout).
        stages = given_stages or rank_stages(parallel, model.num_layers, framework, parallel.pipeline_rank)
        blocks = {i for stage in stages for i in range(stage.first_block, stage.first_block + stage.num_blocks)}
        keep = []
        for unit in units:
            if unit.name == "embedding":
                wanted = any(stage.has_embedding for stage in stages)
            elif unit.name == "head":
                wanted = any(stage.has_head for stage in stages)
            else:
                wanted = int(unit.name.split(".")[1]) in blocks
            if wanted:
                keep.append(unit)
        units = tuple(keep)
        # Megatron-DeepSpeed's GPTModelPipe (megatron/model/gpt_model.py, the fork at f4157be)
        # builds the tied embedding on the last stage too (TiedLayerSpec 'embed'), a module of
        # its own whose gradient the pipeline engine all-reduces with the first stage's.
        if framework.megatron_layout and model.tied_embeddings:
            units = _megatron_shared_embedding(units, model)
    units = expert_parallel_units(tensor_parallel_units(units, parallel.tp), model, parallel.ep, framework, efsdp)
    return finetune_units(units, finetune, framework, model)


MEGATRON_SHARED_EMBEDDING = "shared_embedding.weight"
"""The last pipeline stage's copy of a tied word embedding (megatron's output_layer.weight)."""


# megatron-core 0.16.1 models/common/language_module/language_module.py
# setup_embeddings_and_output_layer: with tied embeddings and a pipeline, the last stage builds
# its own output_layer.weight (V x h, marked shared_embedding), a trainable parameter with its own
# gradient and optimizer state whose gradient finalize_model_grads.py all-reduces with the first
# stage's word embedding; the stage holding both (pp 1) keeps one.
def _megatron_shared_embedding(units: tuple[ParamUnit, ...], model: ModelSpec) -> tuple[ParamUnit, ...]:
    copy = ParamTensor(name=MEGATRON_SHARED_EMBEDDING, shape=(model.vocab_size, model.hidden_size))
    return tuple(ParamUnit(name=u.name, tensors=(*u.tensors, copy)) if u.name == "head" else u for u in units)


@lru_cache(maxsize=64)
def _finetuned_units(model: ModelSpec, finetune: FineTuneSpec, framework: Framework) -> tuple[ParamUnit, ...]:
    return finetune_units(parameter_units(model), finetune, framework, model)


def rank_parameter_units(request: PlanRequest) -> tuple[ParamUnit, ...]:
    """The units the request's rank holds, each tensor as its tensor-parallel rank holds it:
    the model's units (zeroplan.core.params) when nothing is model-parallel."""
    # One plan asks for the same request's units from a dozen functions (model states, buffers,
    # collectives): the last request's are kept, by identity (the request is immutable and held).
    last = _LAST_REQUEST_UNITS
    if last[0] is request:
        return last[1]
    units = _request_units(request)
    last[0], last[1] = request, units
    return units


_LAST_REQUEST_UNITS: list = [None, ()]
"""[the last request rank_parameter_units answered, its units]."""


def _request_units(request: PlanRequest) -> tuple[ParamUnit, ...]:
    parallel, finetune = request.parallel, request.training.finetune
    if parallel.is_trivial and parallel.ep == 1:
        if finetune.trains_everything:
            return parameter_units(request.model)
        return _finetuned_units(request.model, finetune, request.training.framework)
    # Under expert parallelism the experts' FSDP group (efsdp) decides their grouped shape too.
    return _rank_units(request.model, parallel.tp, parallel.pp, parallel.pp_schedule, parallel.virtual_stages,
                       parallel.pipeline_rank, parallel.ep, request.training.framework,
                       max(1, request.state_group_size // parallel.ep), finetune,
                       request_rank_stages(request, parallel.pipeline_rank) if parallel.device_map is not None else None)


def rank_trainable_units(request: PlanRequest) -> tuple[ParamUnit, ...]:
    """The rank's units reduced to what trains (all of them unless the fine-tune freezes some):
    what has gradients, optimizer states and master copies, and what gradient collectives reduce."""
    return trainable_view(rank_parameter_units(request))


def rank_trainable_elements(request: PlanRequest) -> int:
    """Trainable parameter elements the rank holds before data-parallel sharding."""
    return sum(unit.numel for unit in rank_trainable_units(request))


def rank_parameter_elements(request: PlanRequest) -> int:
    """Parameter elements the rank holds before data-parallel sharding."""
    return sum(unit.numel for unit in rank_parameter_units(request))


def rank_block_count(request: PlanRequest) -> int:
    """Blocks the rank holds (all of them without a pipeline)."""
    if request.parallel.pp == 1:
        return request.model.num_layers
    return len(block_positions(rank_parameter_units(request)))


def block_positions(units: tuple[ParamUnit, ...]) -> tuple[int, ...]:
    """The positions in ``units`` of the blocks ('block.<i>'), in order. The planner asks it of
    a rank's units for every buffer and collective of a plan, and the units tuples are cached,
    so it is kept by their identity (the entry holds them, so the identity cannot be reused)."""
    known = _BLOCK_POSITIONS.get(id(units))
    if known is not None and known[0] is units:
        return known[1]
    if len(_BLOCK_POSITIONS) >= _BLOCK_POSITIONS_LIMIT:
        _BLOCK_POSITIONS.clear()
    positions = tuple(i for i, unit in enumerate(units) if unit.name.startswith("block."))
    _BLOCK_POSITIONS[id(units)] = (units, positions)
    return positions


_BLOCK_POSITIONS: dict[int, tuple[tuple[ParamUnit, ...], tuple[int, ...]]] = {}
_BLOCK_POSITIONS_LIMIT = 4096


def holds_head(request: PlanRequest) -> bool:
    return request.parallel.pp == 1 or any(unit.name == "head" for unit in rank_parameter_units(request))


def holds_embedding(request: PlanRequest) -> bool:
    return request.parallel.pp == 1 or any(unit.name == "embedding" for unit in rank_parameter_units(request))


def _stage_of(unit: ParamUnit, stages) -> int:
    """Which of the rank's stages holds ``unit`` (embedding on the first, head on the last)."""
    for position, stage in enumerate(stages):
        if unit.name == "embedding" and stage.has_embedding or unit.name == "head" and stage.has_head:
            return position
        if unit.name.startswith("block.") and stage.first_block <= int(unit.name.split(".")[1]) < stage.first_block + stage.num_blocks:
            return position
    return 0


# torch 2.13 (and 2.6.0) distributed/pipelining/schedules.py ScheduleInterleaved1F1B
# backward_stage_index: the local stage changes every microbatches_per_round = m // max(1, m // p)
# backwards, and a stage's m-th backward (last_backward) runs FSDP's post-backward, which
# reduce-scatters and frees that stage's accumulated unsharded gradients (stage.py
# backward_maybe_with_nosync). With one round (m < 2p) a stage runs all its backwards before the
# next one starts: one stage's accumulators are alive at a time (counted on torch's own schedule:
# benchmarks/torchtitan_pipeline_outputs.py, 1 stage on every rank at pp 8 and m 8, 2 at m 16).
def accumulating_trainable_elements(request: PlanRequest) -> int:
    """Trainable elements of the rank's stages whose unsharded gradients accumulate at once under
    a pipeline's deferred FSDP reduction: the largest stage's where the schedule runs its stages'
    backwards one stage after another, else all the rank holds."""
    parallel = request.parallel
    microbatches = request.batch.grad_accum_steps
    if (parallel.virtual_stages == 1 or parallel.pp_schedule is not PipelineSchedule.interleaved_1f1b
            or microbatches // parallel.pp > 1):
        return rank_trainable_elements(request)
    stages = rank_stages(parallel, request.model.num_layers, request.training.framework, parallel.pipeline_rank)
    per_stage = [0] * len(stages)
    for unit in rank_trainable_units(request):
        per_stage[_stage_of(unit, stages)] += unit.numel
    return max(per_stage)
