"""float8 in the step time (zeroplan.core.float8_time): which products run at the fp8 peak, the
casts' bytes, and FSDP2's float8 all-gather against the all-gather the records measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zeroplan.core.communication import collectives
from zeroplan.core.float8_time import (
    float8_cast_bytes,
    float8_gemm_flops,
    float8_gemm_saved_seconds,
    float8_linear_count,
    float8_weight_elements,
)
from zeroplan.core.flops import (
    head_forward_flops_per_token,
    layers_linear_forward_flops_per_token,
)
from zeroplan.core.model_states import unit_gather_bytes
from zeroplan.core.timing import step_time
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.float8_record import Float8AllGatherRecord
from zeroplan.frameworks.record import load_records
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec,
    PerformanceAssumptions,
    PlanRequest,
    StrategyKind,
    StrategySpec,
    cluster_from_gpus,
)
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import ActivationCheckpointing, Float8Recipe, TrainingSpec
from zeroplan.validate.rows import FLAT_RESERVE

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "float8-all-gather-records"


def _request(float8: Float8Recipe | None = Float8Recipe.tensorwise, gpu: str = "h100-80gb", model: str = "llama-3.1-8b",
             **training) -> PlanRequest:
    return PlanRequest(
        model=get_model(model), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        # No recomputation unless asked (torchtitan's llama3_8b config's selective-op otherwise).
        training=TrainingSpec(framework=Framework.torchtitan, compile=True, float8=float8,
                              **{"activation_checkpointing": "none", **training}),
        cluster=cluster_from_gpus(get_gpu(gpu), 8), strategy=StrategySpec(kind=StrategyKind.fsdp_full_shard),
        performance=PerformanceAssumptions(hardware_flops_utilization=0.4), assumptions=FLAT_RESERVE,
    )


def test_every_linear_product_runs_in_float8_forward_and_both_backward_ones() -> None:
    request = _request(float8_skips_output=True)
    model, tokens = request.model, 4096
    blocks = layers_linear_forward_flops_per_token(model)
    assert float8_gemm_flops(request) == (tokens * blocks, tokens * 2 * blocks)
    # torchtitan 0.3.0 converts the output projection too unless filter_fqns names it.
    with_head = blocks + head_forward_flops_per_token(model)
    assert float8_gemm_flops(_request()) == (tokens * with_head, tokens * 2 * with_head)
    assert float8_gemm_flops(_request(None)) == (0.0, 0.0)


def test_rowwise_with_gw_hp_runs_the_weight_gradient_in_bf16_without_its_casts() -> None:
    # torchao float8/config.py:312-337: grad_weight = input_t_hp @ grad_output_hp.
    request, rowwise = _request(Float8Recipe.rowwise_with_gw_hp), _request(Float8Recipe.rowwise)
    model, tokens = request.model, 4096
    with_head = layers_linear_forward_flops_per_token(model) + head_forward_flops_per_token(model)
    assert float8_gemm_flops(request) == (tokens * with_head, tokens * with_head)
    # Forward casts are rowwise's; backward drops the saved input's recast and the output
    # gradient's second cast (amax 2 + cast 3 bytes an element each).
    gw_hp, row = float8_cast_bytes(request), float8_cast_bytes(rowwise)
    inputs = 2 * model.hidden_size + model.attention_output_size + model.ffn_hidden_size
    outputs = model.q_size + 2 * model.kv_size + 2 * model.hidden_size + 2 * model.ffn_hidden_size
    assert gw_hp[0] == row[0]
    assert row[1] - gw_hp[1] == tokens * 5 * (model.num_layers * (inputs + outputs) + model.hidden_size + model.vocab_size)


def test_at_twice_the_bf16_peak_the_float8_products_take_half_the_time() -> None:
    request = _request()
    rate = request.cluster.gpu.peak_bf16_flops_per_s * 0.4
    forward, backward = float8_gemm_flops(request)
    # The datasheet's 1,979 and 989 TFLOP/s dense: 2x, each rounded.
    assert request.cluster.gpu.peak_fp8_flops_per_s == pytest.approx(2 * request.cluster.gpu.peak_bf16_flops_per_s, rel=1e-3)
    assert float8_gemm_saved_seconds(request, rate) == (pytest.approx(forward / rate / 2, rel=1e-3),
                                                        pytest.approx(backward / rate / 2, rel=1e-3))
    # No fp8 peak in the catalog: nothing saved (the products at the bf16 rate).
    assert float8_gemm_saved_seconds(_request(gpu="l40s"), rate) == (0.0, 0.0)


def test_casts_and_the_weight_casts_the_float8_all_gather_moves_to_the_shard() -> None:
    gathered, cast = float8_cast_bytes(_request(float8_all_gather=True)), float8_cast_bytes(_request())
    assert float8_linear_count(_request()) == 7 * 32 + 1  # wq, wk, wv, wo, w1, w3, w2 per block, and the head
    assert all(c > g > 0 for c, g in zip(cast, gathered, strict=True))
    # rowwise: the output gradient's two casts are along different axes, an amax each (2 bytes more).
    model = _request().model
    outputs = model.q_size + 2 * model.kv_size + 2 * model.hidden_size + 2 * model.ffn_hidden_size
    rowwise = float8_cast_bytes(_request(Float8Recipe.rowwise))
    assert rowwise[0] == cast[0] and rowwise[1] - cast[1] == 4096 * 2 * (model.num_layers * outputs + model.vocab_size)
    recomputed = float8_cast_bytes(_request(activation_checkpointing=ActivationCheckpointing.full))
    assert recomputed[0] == cast[0] and recomputed[1] > cast[1]


def test_the_float8_all_gather_bytes_are_the_recorded_ones() -> None:
    # The gathered (unsharded) bytes the memory model and the collectives both read: the
    # Float8Linear weights at one byte with the all-gather, the compute dtype without.
    records = load_records(RECORDS, Float8AllGatherRecord, "float8 all-gather record")
    assert {r.float8_all_gather for r in records} == {True, False}
    for record in records:
        request = _request(model=record.model.name, float8_all_gather=record.float8_all_gather)
        block = next(i for i, name in enumerate(u.name for u in _units(request)) if name == "block.0")
        assert unit_gather_bytes(request, record.world_size, 2)[block] == record.gathered_bytes, record.model.name


def _units(request: PlanRequest):  # type: ignore[no-untyped-def]
    from zeroplan.core.parallel.units import rank_parameter_units

    return rank_parameter_units(request)


def test_a_float8_step_is_faster_and_its_gathers_and_amax_all_reduce_are_priced() -> None:
    plain = _request(None)
    float8 = _request(float8_all_gather=True)
    plain_time = step_time(plain, tuple(collectives(plain)))
    float8_time = step_time(float8, tuple(collectives(float8)))
    assert float8_time.compute_s < plain_time.compute_s
    gathers = [c for c in collectives(float8) if c.what == "parameters" and c.phase.value == "forward"]
    plain_gathers = [c for c in collectives(plain) if c.what == "parameters" and c.phase.value == "forward"]
    assert 0.5 < gathers[0].buffer_bytes / plain_gathers[0].buffer_bytes < 0.6
    amax = [c for c in collectives(float8) if c.what == "float8 weight amaxes"]
    assert len(amax) == 1 and amax[0].buffer_bytes == 4 * float8_linear_count(float8)


def test_the_float8_all_gather_needs_the_tensorwise_recipe() -> None:
    from zeroplan.core.compiled import check_compiled

    request = _request(Float8Recipe.rowwise, float8_all_gather=True)
    with pytest.raises(ZeroplanError, match=r"^float8: the FSDP float8 all-gather needs the tensorwise recipe, not "
                                            r"rowwise \(allowed: tensorwise\)$"):
        check_compiled(request.training, request.model)
    request = _request(None, float8_all_gather=True)
    with pytest.raises(ZeroplanError, match=r"^float8: float8_all_gather and float8_skips_output need float8 training"):
        check_compiled(request.training, request.model)


def test_the_float8_flags_reach_the_request_and_bad_combinations_refuse_in_one_line(capsys) -> None:
    import json

    from zeroplan.cli.main import main

    flags = ["fit", "llama-3.1-8b", "--gpus", "32", "--gpu", "h200", "--framework", "torchtitan", "--compile",
             "--float8", "tensorwise", "--format", "json"]
    main(flags + ["--float8-all-gather", "--float8-skip-output"])
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["float8_all_gather"] is True and training["float8_skips_output"] is True
    assert main(["fit", "llama-3.1-8b", "--gpus", "32", "--gpu", "h200", "--framework", "torchtitan", "--compile",
                 "--float8", "rowwise", "--float8-all-gather"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--float8" in error and "allowed: tensorwise" in error


def _te_request(policy: ActivationCheckpointing = ActivationCheckpointing.none, accum: int = 1, **training) -> PlanRequest:
    """llm-foundry's MPT-1B (its FP8 table's architecture at seq 512) under amp_fp8."""
    from zeroplan.validate.step_time import load_published_throughput

    row = next(r for r in load_published_throughput().rows if r.name == "mpt-1b h100 x8 s512 b56x4 no AC fp8")
    return PlanRequest(
        model=row.model_spec, batch=BatchSpec(micro_batch_size=2, seq_len=512, grad_accum_steps=accum),
        training=TrainingSpec(framework=Framework.zeroplan, float8=Float8Recipe.te_delayed,
                              activation_checkpointing=policy, **training),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8), strategy=StrategySpec(kind=StrategyKind.fsdp_full_shard),
        performance=PerformanceAssumptions(hardware_flops_utilization=0.4), assumptions=FLAT_RESERVE,
    )


def test_transformer_engine_runs_the_block_linears_in_float8_and_leaves_the_tied_head_bf16() -> None:
    request = _te_request()
    blocks = layers_linear_forward_flops_per_token(request.model)
    assert float8_gemm_flops(request) == (1024 * blocks, 1024 * 2 * blocks)
    # The weights of the four te.Linear per block (Wqkv, out_proj, up_proj, down_proj), no head
    # (F.linear over the tied embedding).
    h, f = request.model.hidden_size, request.model.ffn_hidden_size
    assert float8_weight_elements(request) == request.model.num_layers * (3 * h * h + h * h + 2 * h * f)


def test_transformer_engine_casts_are_fused_cast_transposes_without_an_amax_pass() -> None:
    # TE v0.10 fp8_cast_transpose_fused: read 2, write 1 + 1 a element; the forward casts each
    # te.Linear input and each weight (every micro-batch), the backward each output's gradient;
    # full checkpointing recasts the inputs and weights.
    request = _te_request()
    model, tokens = request.model, 1024
    h, f, layers = model.hidden_size, model.ffn_hidden_size, model.num_layers
    weights = float8_weight_elements(request)
    forward, backward = float8_cast_bytes(request)
    assert forward == tokens * layers * (3 * h + f) * 4 + weights * 4
    assert backward == tokens * layers * (3 * h + h + f + h) * 4
    accumulating = float8_cast_bytes(_te_request(accum=3))
    assert accumulating[0] == 3 * tokens * layers * (3 * h + f) * 4 + 3 * weights * 4
    full = float8_cast_bytes(_te_request(ActivationCheckpointing.full))
    assert full == (forward, backward + forward)


def test_transformer_engine_float8_is_refused_outside_what_it_models() -> None:
    from zeroplan.core.compiled import check_compiled

    for training, match in [
        (TrainingSpec(framework=Framework.torchtitan, compile=True, float8=Float8Recipe.te_delayed), "allowed only with framework zeroplan"),
        (TrainingSpec(framework=Framework.zeroplan, compile=True, float8=Float8Recipe.te_delayed), "allowed: without compile"),
        (TrainingSpec(float8=Float8Recipe.te_delayed, float8_skips_output=True), "allowed: without it"),
        (TrainingSpec(float8=Float8Recipe.te_delayed, activation_checkpointing=ActivationCheckpointing.selective_op),
         "allowed: none, full"),
        (TrainingSpec(float8=Float8Recipe.te_delayed, float8_all_gather=True), "allowed: tensorwise"),
    ]:
        with pytest.raises(ZeroplanError, match=r"^float8: .*" + re.escape(match)):
            check_compiled(training, get_model("llama-3.1-8b"))
    with pytest.raises(ZeroplanError, match=r"^float8: .*allowed: a dense model"):
        check_compiled(TrainingSpec(float8=Float8Recipe.te_delayed), get_model("mixtral-8x7b"))
    from zeroplan.specs.parallel import ParallelSpec
    from zeroplan.specs.request import check_compiled_layout

    with pytest.raises(ZeroplanError, match=r"^float8: te-delayed .*allowed: tp, cp, pp and ep 1"):
        check_compiled_layout(TrainingSpec(float8=Float8Recipe.te_delayed), ParallelSpec(tp=2))


def test_transformer_engine_step_is_faster_than_bf16_by_its_products_less_its_casts() -> None:
    request = _te_request()
    bf16 = request.model_copy(update={"training": request.training.model_copy(update={"float8": None})})
    from zeroplan.core.float8_time import float8_cast_seconds

    saved = sum(float8_gemm_saved_seconds(request, 0.4 * request.cluster.gpu.peak_bf16_flops_per_s))
    casts = sum(float8_cast_seconds(request))
    assert saved > casts > 0
    te_time = step_time(request, tuple(collectives(request)))
    bf16_time = step_time(bf16, tuple(collectives(bf16)))
    assert bf16_time.compute_s - te_time.compute_s == pytest.approx(saved - casts, rel=1e-9)


def test_transformer_engine_float8_is_planned_but_never_emitted(capsys, tmp_path: Path) -> None:
    from zeroplan.cli.main import main

    flags = ["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--float8", "te-delayed",
             "--strategies", "fsdp-full-shard"]
    import json

    assert main(flags + ["--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["float8"] == "te-delayed"
    assert main(flags + ["--emit", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--emit" in error and "allowed: without --float8 te-delayed" in error
    assert not (tmp_path / "run").exists()
