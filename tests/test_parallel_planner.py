"""The planner under tensor, sequence, context and pipeline parallelism, against the papers'
closed forms and the invariants any layout must keep."""

from __future__ import annotations

from fractions import Fraction

import pytest

from zeroplan.cli.main import main
from zeroplan.core.collective import CollectiveOp, Phase
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.core.parallel.activations import micro_batch_bytes
from zeroplan.core.parallel.collectives import (
    collective_recomputation, model_parallel_collectives, pipeline_collectives, tensor_parallel_collectives,
)
from zeroplan.core.profiles import profile
from zeroplan.core.parallel.pipeline import bubble_fraction, in_flight_chunks, pipeline_stages
from zeroplan.core.parallel.tensor import TensorSplit, tensor_split
from zeroplan.core.parallel.units import rank_parameter_elements, rank_parameter_units
from zeroplan.core.plan import reference_activations, fit, memory_breakdown, plan
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    ActivationCheckpointing, AttentionKernel, BatchSpec, PlanRequest, StateConvention, StrategyKind, StrategySpec,
    TrainingSpec,
)
from zeroplan.specs.framework import Framework
from zeroplan.specs.hardware import cluster_from_gpus
from zeroplan.specs.parallel import ParallelSpec, PipelineSchedule


def request(model="llama-3.1-8b", gpus=16, kind=StrategyKind.fsdp_full_shard, training=None, batch=None, **parallel):
    # A micro-batch per pipeline stage by default: torch's Schedule1F1B refuses fewer.
    return PlanRequest(
        model=get_model(model), training=training or TrainingSpec(),
        batch=batch or BatchSpec(grad_accum_steps=parallel.get("pp", 1)),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus), strategy=StrategySpec(kind=kind),
        parallel=ParallelSpec(**parallel),
    )


# --- tensor parallelism: parameters -------------------------------------------------------

def test_every_block_matrix_is_split_the_megatron_way():
    splits = {t.name: tensor_split(t.name) for t in parameter_units(get_model("llama-3.1-8b"))[1].tensors}
    assert splits["attention.q.weight"] is TensorSplit.column
    assert splits["attention.k.weight"] is TensorSplit.column
    assert splits["attention.o.weight"] is TensorSplit.row
    assert splits["mlp.gate.weight"] is TensorSplit.column
    assert splits["mlp.down.weight"] is TensorSplit.row
    assert splits["attention_norm.weight"] is TensorSplit.replicated
    assert tensor_split("token.weight") is TensorSplit.vocabulary
    assert tensor_split("mlp.fc2.bias") is TensorSplit.replicated


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_tensor_parallel_rank_holds_a_tth_of_every_matrix_and_all_of_the_norms(tp):
    model = get_model("llama-3.1-8b")
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    block = 2 * h + (h * model.q_size + 2 * h * model.kv_size + model.q_size * h + 3 * h * f) // tp
    expected = model.num_layers * block + 2 * (v // tp) * h + h
    assert v % tp == 0
    assert rank_parameter_elements(request(tp=tp)) == expected


def test_without_model_parallelism_the_rank_holds_the_model():
    r = request()
    assert rank_parameter_units(r) == parameter_units(r.model)


def test_fsdp_shards_the_tensor_parallel_shard_over_dp():
    # 16 GPUs, tp 4: FSDP over the other 4 ranks; fp32 parameters under FSDP2. Every local
    # tensor of Llama-3.1-8B at tp 4 has a multiple of 4 rows, so there is no padding.
    r = request(tp=4)
    local = rank_parameter_elements(r)
    assert r.shard_group_size == 4 and local % 4 == 0
    assert model_state_bytes(r).parameter_bytes == local // 4 * 4


# --- tensor and sequence parallelism: activations (Korthikanti et al. 2022, Table 2) ---------

# Korthikanti et al.'s blocks hold 16-bit weights: DeepSpeed's byte layout (no autocast, so no
# bf16 weight copies, zeroplan.core.frameworks.autocast_copies_bytes) under DDP's layout.
EAGER_GPT = TrainingSpec(attention_kernel=AttentionKernel.eager, state_convention=StateConvention.zero)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_block_is_korthikanti_table2(tp):
    model = get_model("gpt3-175b")
    s, b, h, a = 2048, 1, model.hidden_size, model.num_heads
    r = request("gpt3-175b", gpus=8, kind=StrategyKind.ddp, training=EAGER_GPT,
                batch=BatchSpec(seq_len=s, micro_batch_size=b), tp=tp)
    expected = s * b * h * (10 + Fraction(24, tp) + Fraction(5 * a * s, h * tp))
    assert micro_batch_bytes(r, reference_activations).per_block == expected


@pytest.mark.parametrize("tp", [2, 8])
def test_sequence_parallel_block_is_korthikanti_table2(tp):
    model = get_model("gpt3-175b")
    s, b, h, a = 2048, 1, model.hidden_size, model.num_heads
    r = request("gpt3-175b", gpus=8, kind=StrategyKind.ddp, training=EAGER_GPT,
                batch=BatchSpec(seq_len=s, micro_batch_size=b), tp=tp, sequence_parallel=True)
    expected = Fraction(s * b * h, tp) * (34 + Fraction(5 * a * s, h))
    assert micro_batch_bytes(r, reference_activations).per_block == expected


def test_context_parallelism_keeps_a_cpth_of_the_tokens():
    whole = micro_batch_bytes(request(cp=2, batch=BatchSpec(seq_len=8192)), reference_activations)
    half = micro_batch_bytes(request(batch=BatchSpec(seq_len=4096)).with_parallel(ParallelSpec()), reference_activations)
    assert whole == half


# --- pipeline parallelism -------------------------------------------------------------------

@pytest.mark.parametrize("layers,stages", [(32, 4), (80, 8), (126, 16), (5, 5)])
@pytest.mark.parametrize("framework", [Framework.zeroplan, Framework.torchtitan])
def test_stages_cover_every_block_once(layers, stages, framework):
    split = pipeline_stages(layers, stages, framework)
    assert sum(s.num_blocks for s in split) == layers
    assert [s.first_block for s in split] == [sum(x.num_blocks for x in split[:i]) for i in range(stages)]
    assert split[0].has_embedding and split[-1].has_head


def test_torchtitan_gives_the_first_and_last_stage_a_block_less():
    # 32 blocks + embedding + head = 34 weighted, 4 stages: 9, 9, 8, 8 less one each end.
    assert [s.num_blocks for s in pipeline_stages(32, 4, Framework.torchtitan)] == [8, 9, 8, 7]


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("virtual", [1, 2, 4])
def test_pipeline_ranks_hold_the_whole_model_once(pp, virtual):
    schedule = PipelineSchedule.interleaved_1f1b if virtual > 1 else PipelineSchedule.one_f_one_b
    base = request(gpus=pp, kind=StrategyKind.ddp, pp=pp, pp_schedule=schedule, virtual_stages=virtual)
    held = sum(rank_parameter_elements(base.at_pipeline_rank(r)) for r in range(pp))
    assert held == total_parameters(base.model)


def test_one_f_one_b_keeps_pp_minus_rank_micro_batches():
    parallel = ParallelSpec(pp=4)
    assert [in_flight_chunks(parallel, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_chunks(parallel, r, 2) for r in range(4)] == [2, 2, 2, 1]
    gpipe = ParallelSpec(pp=4, pp_schedule=PipelineSchedule.gpipe)
    assert [in_flight_chunks(gpipe, r, 8) for r in range(4)] == [8] * 4


@pytest.mark.parametrize("pp,v", [(4, 2), (8, 2), (8, 4)])
def test_interleaved_first_rank_is_korthikanti_4_2_3(pp, v):
    # Korthikanti et al. 2022 sec. 4.2.3: the first stage keeps L (1 + (p - 1) / (p m)) blocks'
    # activations with m model chunks per rank: chunks x L / (p v) blocks.
    parallel = ParallelSpec(pp=pp, pp_schedule=PipelineSchedule.interleaved_1f1b, virtual_stages=v)
    chunks = in_flight_chunks(parallel, 0, 64)
    assert Fraction(chunks, pp * v) == 1 + Fraction(pp - 1, pp * v)


def test_bubbles_follow_narayanan_and_zero_bubble():
    assert bubble_fraction(ParallelSpec(pp=4), 8) == Fraction(3, 8)
    assert bubble_fraction(ParallelSpec(pp=4, pp_schedule=PipelineSchedule.interleaved_1f1b, virtual_stages=2), 8) == Fraction(3, 16)
    assert bubble_fraction(ParallelSpec(pp=4, pp_schedule=PipelineSchedule.zero_bubble, virtual_stages=2), 8) == Fraction(1, 16)
    assert bubble_fraction(ParallelSpec(), 8) == 0


def test_the_first_rank_peaks_under_1f1b_without_checkpointing():
    r = request(gpus=32, tp=8, pp=4, batch=BatchSpec(seq_len=4096, grad_accum_steps=8))
    p = plan(r)
    assert p.parallel.pipeline_rank == 0
    assert len(p.pipeline_rank_peak_bytes) == 4
    assert p.memory.peak_bytes == max(p.pipeline_rank_peak_bytes)
    assert "pipeline rank 0 of 4" in p.peak_rank_reason


def test_a_deeper_pipeline_holds_fewer_parameters_per_rank():
    shallow = memory_breakdown(request(gpus=16, pp=2, kind=StrategyKind.ddp))[0]
    deep = memory_breakdown(request(gpus=16, pp=4, kind=StrategyKind.ddp))[0]
    assert deep.parameter_bytes < shallow.parameter_bytes


# --- communication --------------------------------------------------------------------------

def test_tensor_parallel_collectives_per_block():
    r = request(gpus=8, tp=8, kind=StrategyKind.ddp, batch=BatchSpec(seq_len=4096))
    blocks = r.model.num_layers
    activation = 4096 * r.model.hidden_size * 2
    per_block = [c for c in tensor_parallel_collectives(r) if c.what == "tensor-parallel activations"]
    assert {c.op for c in per_block} == {CollectiveOp.all_reduce}
    # Two forward; backward one per column-parallel input module: the reference model's q, k, v,
    # gate and up are separate (five; the harness measured five on gloo), Megatron fuses them (two).
    assert sum(c.calls for c in per_block) == (2 + 5) * blocks
    assert all(c.buffer_bytes == c.calls * activation and c.blocking for c in per_block)
    sp = request(gpus=8, tp=8, kind=StrategyKind.ddp, batch=BatchSpec(seq_len=4096), sequence_parallel=True)
    ops = {c.op for c in tensor_parallel_collectives(sp) if c.what == "tensor-parallel activations"}
    assert ops == {CollectiveOp.all_gather, CollectiveOp.reduce_scatter}


def test_pipeline_sends_one_activation_per_micro_batch_and_boundary():
    r = request(gpus=4, pp=4, kind=StrategyKind.ddp, batch=BatchSpec(seq_len=2048, grad_accum_steps=8))
    first = pipeline_collectives(r.at_pipeline_rank(0))
    middle = pipeline_collectives(r.at_pipeline_rank(1))
    assert [c.what for c in first] == ["pipeline activations"]
    assert sorted(c.what for c in middle) == ["pipeline activation gradients", "pipeline activations"]
    assert first[0].sent_bytes_per_step == 8 * 2048 * r.model.hidden_size * 2


def test_the_pipeline_bubble_lengthens_the_step():
    p = plan(request(gpus=4, pp=4, kind=StrategyKind.ddp, batch=BatchSpec(grad_accum_steps=4)))
    assert p.time.pipeline_bubble_s > 0
    assert p.time.step_with_overlap_s >= p.time.compute_s + p.time.pipeline_bubble_s


def test_the_data_parallel_group_is_the_world_over_the_model_parallel_degrees():
    r = request(gpus=64, tp=8, pp=2, cp=2, batch=BatchSpec(seq_len=8192, grad_accum_steps=2))
    assert r.data_parallel_size == 2
    assert r.state_group_size == 4
    assert r.shard_group_size == 4


# --- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("parallel,field", [
    (dict(tp=3), "parallel"),
    (dict(tp=16), "parallel.tp"),  # 16 GPUs, but a node holds 8
    (dict(pp=64), "parallel"),
    (dict(cp=2, tp=2), None),
    (dict(sequence_parallel=True), "parallel.sequence_parallel"),
    (dict(pp=2, pp_schedule=PipelineSchedule.interleaved_1f1b), "parallel.virtual_stages"),
    (dict(pp=2, virtual_stages=2), "parallel.virtual_stages"),
])
def test_layouts_the_stacks_cannot_build_are_refused_naming_the_field(parallel, field):
    if field is None:
        request(**parallel)
        return
    with pytest.raises(ZeroplanError) as error:
        request(**parallel)
    assert error.value.field == field


def test_zero3_does_not_run_under_a_pipeline():
    with pytest.raises(ZeroplanError, match="does not run under pipeline parallelism"):
        request(kind=StrategyKind.zero3, pp=2)


def test_fit_under_a_pipeline_plans_only_the_strategies_that_run_there():
    report = fit(request(gpus=16, pp=2, kind=StrategyKind.ddp))
    assert {p.strategy.value for p in report.plans} <= {"ddp", "zero1", "fsdp-full-shard", "fsdp-shard-grad-op", "hsdp"}


def test_hf_is_not_modelled_under_tensor_parallelism():
    with pytest.raises(ZeroplanError, match="not modelled for hf"):
        request(training=TrainingSpec(framework=Framework.hf), tp=2)


# --- the command line -----------------------------------------------------------------------

def test_fit_answers_the_405b_question(capsys):
    code = main(["fit", "--detail", "llama-3.1-405b", "--gpus", "128", "--gpu", "h100-80gb", "--framework", "torchtitan",
                 "--tp", "8", "--pp", "4", "--micro-batch", "1", "--seq-len", "8192", "--activation-checkpointing", "full",
                 "--grad-accum", "16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tp 8 + sequence parallel" in out and "pp 4" in out
    assert "peak on pipeline rank" in out


def test_fit_refuses_a_bad_layout_in_one_line(capsys):
    code = main(["fit", "llama-3.1-8b", "--tp", "3"])
    err = capsys.readouterr().err
    assert code != 0
    # The request's field (parallel) is named by the flags that set it.
    assert err.count("\n") == 1 and "--tp/--cp/--pp: " in err and "allowed" in err


def test_checkpointing_full_keeps_only_block_inputs_per_micro_batch():
    training = TrainingSpec(activation_checkpointing=ActivationCheckpointing.full)
    r = request(gpus=8, tp=8, training=training, batch=BatchSpec(seq_len=4096), sequence_parallel=True)
    terms = micro_batch_bytes(r, reference_activations)
    assert terms.per_block == 4096 * r.model.hidden_size * 2 // 8
    assert terms.recompute > terms.per_block


def test_fsdp_under_a_pipeline_keeps_the_stage_gathered_and_its_gradients_unsharded():
    # torch 2.13 pipelining/stage.py: no gradient sync and no reshard after backward until
    # perform_reduce_grad; FSDP2 keeps the unsharded gradient in the reduce dtype (fp32).
    from zeroplan.core.buffers import backward_held_buffer_bytes
    from zeroplan.core.communication import data_parallel_collectives

    r = request(gpus=16, pp=2, batch=BatchSpec(grad_accum_steps=4), training=TrainingSpec(framework=Framework.torchtitan))
    elements = rank_parameter_elements(r)
    gathered = elements * 2  # bf16; every Llama-3.1-8B tensor's rows divide by the 8 ranks
    assert backward_held_buffer_bytes(r) == gathered + elements * 4
    by_what = {(c.op, c.phase): c.occurrences_per_step for c in data_parallel_collectives(r)}
    assert by_what[(CollectiveOp.reduce_scatter, Phase.backward)] == 1
    assert by_what[(CollectiveOp.all_gather, Phase.forward)] == 1
    assert by_what[(CollectiveOp.all_gather, Phase.backward)] == 4
    without = request(gpus=16, batch=BatchSpec(grad_accum_steps=4), training=TrainingSpec(framework=Framework.torchtitan))
    assert backward_held_buffer_bytes(without) == 0


def test_the_api_names_fields_and_the_command_line_names_flags(capsys):
    with pytest.raises(ZeroplanError) as error:
        request(tp=2, sequence_parallel=True, batch=BatchSpec(seq_len=4095))
    assert error.value.field == "parallel.sequence_parallel"
    assert main(["fit", "llama-3.1-8b", "--seq-len", "131073"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len: 131,073 exceeds" in err and "batch.seq_len" not in err


def test_a_request_without_a_sequence_length_fits_the_models_positions():
    # As the command line's --seq-len default: min(4096, max_positions); given, it is kept.
    gpt2 = dict(model=get_model("gpt2"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8), strategy=StrategySpec(kind="ddp"))
    assert PlanRequest(**gpt2).batch.seq_len == 1024
    assert PlanRequest(**gpt2, batch=BatchSpec(micro_batch_size=2)).batch.seq_len == 1024
    assert PlanRequest(**gpt2, batch={"micro_batch_size": 2}).batch.seq_len == 1024
    with pytest.raises(ZeroplanError, match="batch.seq_len"):
        PlanRequest(**gpt2, batch=BatchSpec(seq_len=4096))
    assert request(batch=BatchSpec()).batch.seq_len == 4096


GPUS = ["a100-80gb", "a10g", "b200", "h100-80gb", "h200-141gb", "l40s", "mi300x", "rtx-4090", "v100-32gb"]


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("layout", [dict(tp=8), dict(tp=4, pp=2), dict(tp=2, cp=2, pp=2)])
def test_every_strategy_answers_or_refuses_on_every_gpu(gpu, layout):
    # A layout that leaves one rank of a data-parallel group per node once divided by zero in the
    # NCCL model (DeepSpeed ZeRO-1/2's collectives lost the group's placement).
    base = PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu(gpu), 64),
                       batch=BatchSpec(grad_accum_steps=4, seq_len=4096), strategy=StrategySpec(kind="ddp"),
                       parallel=ParallelSpec(**layout))
    report = fit(base)
    assert report.plans and all(p.time.step_with_overlap_s > 0 for p in report.plans)
    if "pp" not in layout:
        zero = fit(base, [StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero2_offload])
        assert all(p.time.step_with_overlap_s > 0 for p in zero.plans)


def test_sequence_parallel_adds_the_embedding_gradient_gather_and_the_norm_gradient_reduction():
    # Measured on the harness's gloo runs (docs/validation.md, "Model parallelism"): the
    # embedding's reduce-scatter is gathered again in backward; the sequence-parallel norms'
    # weight gradients are all-reduced over tp once a step (Megatron-LM finalize_model_grads),
    # which torchtitan leaves to FSDP.
    r = request(gpus=8, tp=8, sequence_parallel=True, batch=BatchSpec(seq_len=4096))
    whats = {c.what: c for c in tensor_parallel_collectives(r)}
    assert whats["vocab-parallel embedding gradient"].op is CollectiveOp.all_gather
    norms = whats["sequence-parallel norm gradients"]
    assert norms.occurrences_per_step == 1
    assert norms.buffer_bytes == (2 * r.model.num_layers + 1) * r.model.hidden_size * 4  # fp32 gradients under FSDP2
    titan = request(gpus=8, tp=8, sequence_parallel=True, training=TrainingSpec(framework=Framework.torchtitan))
    assert "sequence-parallel norm gradients" not in {c.what for c in tensor_parallel_collectives(titan)}


@pytest.mark.parametrize("framework, parallel, distinct", [
    (Framework.zeroplan, {"tp": 2, "sequence_parallel": True, "pp": 2}, 2),  # none and selective alike
    (Framework.megatron, {"tp": 4, "cp": 2}, 2),
    (Framework.torchtitan, {"tp": 2, "cp": 2, "pp": 2}, 2),  # full and selective-op alike (no experts)
])
def test_checkpointing_policies_that_rerun_the_same_collectives_make_the_same_ones(framework, parallel, distinct):
    # The plan search keys its blocking calls on collective_recomputation, not on the policy.
    base = request(gpus=16, kind=StrategyKind.ddp, batch=BatchSpec(seq_len=4096, grad_accum_steps=4), **parallel)
    by_reruns: dict = {}
    for policy in profile(framework).checkpointing:
        training = TrainingSpec(framework=framework, activation_checkpointing=policy)
        at = base.model_copy(update={"training": training}).at_pipeline_rank(parallel.get("pp", 1) - 1)
        by_reruns.setdefault(collective_recomputation(at), []).append(model_parallel_collectives(at))
    assert all(made == made[:1] * len(made) for made in by_reruns.values())
    # Policies that rerun different collectives make different ones.
    assert len({tuple(made[0]) for made in by_reruns.values()}) == distinct


def test_moe_token_all_to_alls_rerun_under_full_recomputation_only():
    base = PlanRequest(model=get_model("mixtral-8x7b"), batch=BatchSpec(seq_len=4096),
                       training=TrainingSpec(framework=Framework.torchtitan),
                       cluster=cluster_from_gpus(get_gpu("h100-80gb"), 16),
                       strategy=StrategySpec(kind=StrategyKind.fsdp_full_shard), parallel=ParallelSpec(ep=2))
    by_reruns: dict = {}
    for policy in profile(Framework.torchtitan).checkpointing:
        at = base.model_copy(update={"training": base.training.model_copy(update={"activation_checkpointing": policy})})
        by_reruns.setdefault(collective_recomputation(at), []).append(model_parallel_collectives(at))
    assert all(made == made[:1] * len(made) for made in by_reruns.values())
    # Without tensor or context parallelism only full recomputation reruns a collective.
    rerun = by_reruns[True, True][0]
    assert all(made[0] != rerun for key, made in by_reruns.items() if key != (True, True))
