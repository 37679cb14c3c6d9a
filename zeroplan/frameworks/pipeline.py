"""Pipeline parallelism as torchtitan 0.3.0 and torch 2.13 do it, recorded from their own code
(torch and torchtitan needed; the records it makes are read without either).

``split_record``: torchtitan's own stage count, module split and stage-to-rank mapping for a
Llama-3 flavour, applied to the full model built on the meta device; parameter elements
counted on each module it split off. ``schedule_record``: torch's own schedule object, built
by torchtitan's own schedule builder over tiny probe stages, on each rank of a fake process
group; its IR order is read, its step() is run, and the compute calls it makes and the
autograd-saved tensors alive at once are recorded.

Nothing here re-implements a split, a mapping or a schedule; what each call stands for is cited
on the line above it. This module does not import the planner (zeroplan.core).
"""

from __future__ import annotations

import inspect
import weakref
from importlib.metadata import version

import torch
from torch import nn

from zeroplan.frameworks.pipeline_record import (
    IDLE,
    SINGLE_STAGE,
    V_STYLE,
    PipelineScheduleRecord,
    PipelineSplitRecord,
    RankSchedule,
    RankSplit,
    StageSplit,
    compute_actions,
    peak_in_flight,
)
from zeroplan.simulate import _torch_private as private
from zeroplan.simulate.fake_world import fake_process_group

SPLIT_HOW = (
    "torchtitan.models.llama3.model_registry(flavour).model.build() on the meta device; "
    "distributed/pipeline_parallel.py _get_pipeline_metadata -> _generate_llm_fqn_per_model_part "
    "(config defaults: first/last_stage_less_layers 1; layers_per_stage as recorded) -> "
    "_pipeline_module_split on each rank of a fake process group (ParallelDims.get_mesh('pp')); "
    "numel of the parameters of each module it returns"
)
SCHEDULE_HOW = (
    "per rank of a fake process group: torchtitan distributed/pipeline_parallel.py "
    "_get_pp_rank_to_stage_indices_mapping for the stages, torch PipelineStage(Linear(8, 8, "
    "bias=False), input_args/output_args given) per stage, torchtitan _build_pipeline_schedule "
    "(microbatch size 1, local batch = micro-batches) for the schedule; its pipeline_order[rank] "
    "read, then step() run on real 8-wide CPU tensors with the stage's compute calls and the "
    "saved-tensor hooks recorded (the fake group moves no data; received buffers hold garbage); "
    "then the same with a Linear(4096, 4096, bias=False) probe under FakeTensorMode. Both with "
    "the P2P shape vote replaced by its STATIC outcome (_torch_private.pipeline_stages_static)"
)

PROBE_WIDTH = 8
FAKE_PROBE_WIDTH = 4096
"""The probe's width in the fake-tensor run: one saved [1, 4096] fp32 input per chunk, 16,384
bytes (Llama-3 8B's hidden width, in fp32)."""


def _refusal(error: Exception) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


# --------------------------------------------------------------------------- stage split


def _elements(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def split_record(flavour: str, pp: int, schedule: str, layers_per_stage: int | None = None) -> PipelineSplitRecord:
    """torchtitan's split of Llama-3 ``flavour`` for ``pp`` ranks under ``schedule``, with its
    ``pipeline_parallel_layers_per_stage`` (None: its default, one or two stages per rank)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import pipeline_parallel as titan_pp
    from torchtitan.models.llama3 import model_registry

    config = model_registry(flavour).model
    with torch.device("meta"):
        whole = config.build()
    # config/configs.py ParallelismConfig defaults, but for the degree, the schedule and the
    # layers per stage.
    parallelism = ParallelismConfig(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule,
                                    pipeline_parallel_layers_per_stage=layers_per_stage)
    common = dict(
        torch_version=torch.__version__, framework_version=f"torchtitan {version('torchtitan')}",
        how_made=SPLIT_HOW, flavour=flavour, num_layers=len(config.layers),
        model_param_elements=_elements(whole), pp=pp, schedule=schedule, layers_per_stage=layers_per_stage,
        input_weight=parallelism.pipeline_parallel_first_stage_less_layers,
        output_weight=parallelism.pipeline_parallel_last_stage_less_layers,
        style="v" if schedule in V_STYLE else "loop",
    )
    stages: dict[int, StageSplit] = {}
    ranks: list[RankSplit] = []
    stages_per_rank = None
    try:
        for rank in range(pp):
            with fake_process_group(pp, rank):
                dims = ParallelDims.from_config(parallelism, world_size=pp)
                # pipeline_llm: (num_virtual_stages, num_layers, input_weight, output_weight).
                metadata = titan_pp._get_pipeline_metadata(dims, parallelism, config)
                stages_per_rank = metadata[0] // pp
                names = titan_pp._generate_llm_fqn_per_model_part(*metadata)
                # pipeline_llm: the split runs on the pp mesh, one module per local stage.
                built, parts = titan_pp._pipeline_module_split(
                    whole, dims.get_mesh("pp"), schedule, torch.device("cpu"), names)
                for stage, part in zip(built, parts):
                    stages[stage.stage_index] = _stage_split(stage.stage_index, names[stage.stage_index], part)
                ranks.append(RankSplit(rank=rank, stage_indices=[s.stage_index for s in built],
                                       param_elements=sum(_elements(p) for p in parts)))
    except (ValueError, AssertionError) as error:
        return PipelineSplitRecord(**common, stages_per_rank=stages_per_rank, error=_refusal(error))
    return PipelineSplitRecord(**common, stages_per_rank=stages_per_rank,
                               stages=[stages[i] for i in sorted(stages)], ranks=ranks)


def _stage_split(index: int, names: list[str], part: nn.Module) -> StageSplit:
    # pipeline_parallel.py _split_module: modules not kept are set to None; layers kept in its
    # ModuleDict under their original keys.
    layers = getattr(part, "layers", None)
    return StageSplit(
        stage_index=index, modules=list(names), layers=0 if layers is None else len(layers),
        embedding_elements=_elements(getattr(part, "tok_embeddings", None)),
        block_elements=_elements(layers),
        norm_elements=_elements(getattr(part, "norm", None)),
        output_elements=_elements(getattr(part, "lm_head", None)),
        total_elements=_elements(part),
    )


# --------------------------------------------------------------------------- schedules


class _SavedTensorCount:
    """Live autograd-saved tensors that are not parameters (torch.autograd.graph
    saved_tensors_hooks, public): each one is held by a small object whose finaliser counts it
    down when autograd drops the graph that saved it. Bytes are the saved tensor's own
    elements (a micro-batch is a view of the whole batch; its storage is the batch's)."""

    def __init__(self, parameters: list[torch.Tensor]):
        self._parameter_storages = {private.storage_key(p) for p in parameters}
        self.live = self.peak = 0
        self.live_bytes = self.peak_bytes = 0

    class _Held:
        def __init__(self, tensor: torch.Tensor):
            self.tensor = tensor

    def _pack(self, tensor: torch.Tensor):
        if private.storage_key(tensor) in self._parameter_storages:
            return tensor
        held = self._Held(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        self.live += 1
        self.live_bytes += nbytes
        self.peak = max(self.peak, self.live)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(held, self._release, nbytes)
        return held

    def _release(self, nbytes: int) -> None:
        self.live -= 1
        self.live_bytes -= nbytes

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _SavedTensorCount._Held) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def _record_calls(stage, log: list[str]) -> None:
    """Wrap the stage's public compute entry points so that each call is logged as 'sXm'."""
    for method_name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(stage, method_name)
        signature = inspect.signature(original)

        def logged(*args, _original=original, _name=method_name, _signature=signature, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if _name == "forward_one_chunk":
                kind, micro = "F", arguments["fwd_chunk_id"]
            elif _name == "backward_one_chunk":
                kind, micro = ("B" if arguments["full_backward"] else "I"), arguments["bwd_chunk_id"]
            else:
                kind, micro = "W", arguments["bwd_chunk_id"]
            log.append(f"{stage.stage_index}{kind}{micro}")
            return _original(*args, **kwargs)

        setattr(stage, method_name, logged)


def _ir_string(actions: list) -> str:
    action_type = private.pipeline_action_class()
    tokens = []
    for action in actions:
        if action is None:
            tokens.append(IDLE)
        elif isinstance(action, action_type) and action.computation_type.value == "REDUCE_GRAD":
            continue
        else:
            tokens.append(str(action))
    return " ".join(tokens)


def _probe_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    # torchtitan's loss functions return (loss, token count); _build_pipeline_schedule keeps
    # the first. sum() saves no tensor for its backward.
    return output.sum(), output.numel()


def _step_rank(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int,
               width: int, fake: bool) -> tuple[list[int], str, str, _SavedTensorCount]:
    """One rank's stages, IR and executed order, and its saved-tensor count, with a ``width``-wide
    probe on real CPU tensors or (``fake``) on fake tensors."""
    import contextlib

    from torch.distributed.pipelining import PipelineStage
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import pipeline_parallel as titan_pp

    num_stages = pp * stages_per_rank
    torch.manual_seed(0)
    tensors = private.fake_tensor_mode() if fake else contextlib.nullcontext()
    with fake_process_group(pp, rank), private.pipeline_stages_static(), tensors:
        # pipeline_parallel.py _pipeline_module_split: which stages this rank builds.
        indices = titan_pp._get_pp_rank_to_stage_indices_mapping(rank, pp, schedule, num_stages)
        stages = []
        for index in indices:
            probe = nn.Linear(width, width, bias=False)
            # Shapes given up front (what a STATIC stage needs); a stage after the first receives
            # an activation that needs its gradient.
            stages.append(PipelineStage(
                probe, index, num_stages, torch.device("cpu"),
                input_args=torch.empty(1, width, requires_grad=index != 0),
                output_args=torch.empty(1, width, requires_grad=True),
            ))
        # pipeline_parallel.py _build_pipeline_schedule: n_microbatches = local_batch_size //
        # pipeline_parallel_microbatch_size; scale_grads=False.
        parallelism = ParallelismConfig(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule,
                                        pipeline_parallel_microbatch_size=1)
        built = titan_pp._build_pipeline_schedule(parallelism=parallelism, local_batch_size=microbatches,
                                                  stages=stages, loss_fn=_probe_loss)
        ir = _ir_string(built.pipeline_order[rank])
        log: list[str] = []
        for stage in stages:
            _record_calls(stage, log)
        counter = _SavedTensorCount([p for s in stages for p in s.submod.parameters()])
        batch = torch.randn(microbatches, width)
        target = torch.randn(microbatches, width)
        args = (batch,) if any(s.is_first for s in stages) else ()
        with counter.hooks():
            built.step(*args, target=target if any(s.is_last for s in stages) else None, return_outputs=False)
    return list(indices), ir, " ".join(log), counter


def _run_rank(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int) -> RankSchedule:
    indices, ir, executed, counter = _step_rank(schedule, pp, stages_per_rank, microbatches, rank,
                                                PROBE_WIDTH, fake=False)
    _, _, fake_executed, fake_counter = _step_rank(schedule, pp, stages_per_rank, microbatches, rank,
                                                   FAKE_PROBE_WIDTH, fake=True)
    single = schedule in SINGLE_STAGE
    return RankSchedule(
        rank=rank, stage_indices=indices, ir_order=ir, executed_order=executed,
        ir_slots=None if single else len(ir.split()), ir_idle_slots=None if single else ir.split().count(IDLE),
        peak_in_flight_until_input_grad=peak_in_flight(executed, "BI"),
        peak_in_flight_until_weight_grad=peak_in_flight(executed, "BW"),
        peak_in_flight_ir=peak_in_flight(ir, "BW"),
        ir_matches_executed=compute_actions(ir) == compute_actions(executed),
        peak_saved_chunks_measured=counter.peak,
        fake_run_order_matches=fake_executed == executed,
        peak_saved_bytes_fake=fake_counter.peak_bytes,
    )


def schedule_record(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> PipelineScheduleRecord:
    """Every rank of torch's ``schedule`` for ``pp`` ranks, ``stages_per_rank`` stages each and
    ``microbatches`` micro-batches; the schedule's own refusal recorded as ``error``."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    common = dict(torch_version=torch.__version__, how_made=SCHEDULE_HOW, schedule=schedule,
                  fake_chunk_bytes=FAKE_PROBE_WIDTH * 4,
                  schedule_class=get_schedule_class(schedule).__name__, pp=pp,
                  stages_per_rank=stages_per_rank, microbatches=microbatches)
    notes = []
    if schedule in SINGLE_STAGE:
        notes.append("single-stage schedule: step() runs _step_microbatches, not the IR; its IR "
                     "(_get_pipeline_order) drops idle slots in _add_reduce_grad, so none are counted")
    ranks = []
    for rank in range(pp):
        try:
            ranks.append(_run_rank(schedule, pp, stages_per_rank, microbatches, rank))
        except (ValueError, AssertionError, RuntimeError) as error:
            return PipelineScheduleRecord(**common, error=f"rank {rank}: {_refusal(error)}", notes=notes)
    for rank in ranks:
        if not rank.ir_matches_executed:
            notes.append(f"rank {rank.rank}: the IR order differs from what step() executed")
    return PipelineScheduleRecord(**common, ranks=ranks, notes=notes)
