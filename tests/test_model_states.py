"""Model-state bytes: the ZeRO paper's Figure 1, and invariants across stages and group sizes."""

from __future__ import annotations

import pytest

from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.optimizer_states import adafactor_state_bytes
from zeroplan.core.params import ParamTensor
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.core.zero_paper import zero_communication_volume, zero_model_state_bytes
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, ModelSpec, Optimizer, PlanRequest, Precision, StateConvention, StrategyKind, StrategySpec,
    TrainingSpec, cluster_from_gpus,
)
from zeroplan.units import GB, GiB


# ZeRO paper (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N_d = 64, K = 12.
@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, expected_gb: float) -> None:
    assert round(zero_model_state_bytes(7_500_000_000, 12, 64, stage) / GB, 1) == expected_gb


def test_zero_paper_communication_volume() -> None:
    assert zero_communication_volume(10, 0) == zero_communication_volume(10, 2) == 20
    assert zero_communication_volume(10, 3) == 30


ZERO_KINDS = [StrategyKind.ddp, StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero3]
DIVISIBLE_MODEL = ModelSpec(
    # Every unit's size is a multiple of 64, so no padding: the planner must equal the paper.
    name="divisible", vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, ffn_hidden_size=1024,
)


def _request(gpu, model, kind: StrategyKind, gpus: int, **training) -> PlanRequest:
    # Model states do not depend on the sequence; it only has to fit the model (GPT-2: 1,024).
    return PlanRequest(
        model=model, training=TrainingSpec(**training), batch=BatchSpec(seq_len=min(4096, model.max_positions)),
        cluster=cluster_from_gpus(gpu, gpus, gpus_per_node=min(gpus, 8)),
        strategy=StrategySpec(kind=kind),
    )


@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_equals_paper_without_padding(gpu_80gib, gpus: int, stage: int) -> None:
    request = _request(gpu_80gib, DIVISIBLE_MODEL, ZERO_KINDS[stage], gpus, state_convention=StateConvention.zero)
    psi = total_parameters(DIVISIBLE_MODEL)
    assert model_state_bytes(request).gpu_bytes_without_counters == zero_model_state_bytes(psi, 12, gpus, stage)


@pytest.mark.parametrize("model_name", ["gpt2", "llama-2-7b", "mixtral-8x7b"])
# Muon is modelled under DDP or DeepSpeed's ZeRO-1/2 only (specs.request.check_muon; tests/test_muon.py).
@pytest.mark.parametrize("optimizer", [o for o in Optimizer if o is not Optimizer.muon])
@pytest.mark.parametrize("convention", list(StateConvention))
def test_one_gpu_every_stage_equals_ddp(gpu_80gib, model_name, optimizer, convention) -> None:
    model = get_model(model_name)
    ddp = model_state_bytes(_request(gpu_80gib, model, StrategyKind.ddp, 1, optimizer=optimizer, state_convention=convention))
    for kind in ZERO_KINDS[1:] + [StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op]:
        sharded = model_state_bytes(_request(gpu_80gib, model, kind, 1, optimizer=optimizer, state_convention=convention))
        assert sharded.gpu_bytes_without_counters == ddp.gpu_bytes_without_counters, kind


@pytest.mark.parametrize("gpus", [2, 3, 4, 8, 64, 1024])
@pytest.mark.parametrize("model_name", ["gpt2", "llama-2-70b", "mixtral-8x7b"])
@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("convention", list(StateConvention))
def test_stages_never_grow_and_stage3_covers_ddp(gpu_80gib, gpus, model_name, precision, convention) -> None:
    model = get_model(model_name)
    sizes = [
        model_state_bytes(_request(gpu_80gib, model, kind, gpus, precision=precision, state_convention=convention)).gpu_bytes_without_counters
        for kind in ZERO_KINDS
    ]
    assert sizes == sorted(sizes, reverse=True)
    # Stage 3 splits everything, so N shards hold at least DDP's one copy. Under DeepSpeed in
    # fp32 its ZeRO stages clone an fp32 master that its stage 0 (ddp) does not (measured:
    # benchmarks/deepspeed-accumulation-records records-zero0-fp32.json): 4 bytes an element more.
    clone = 4 * total_parameters(model) if (convention, precision) == (StateConvention.deepspeed, Precision.fp32) else 0
    assert sizes[3] * gpus >= sizes[0] + clone
    # Padding adds fewer than N elements per unit, at most 18 bytes each.
    assert sizes[3] * gpus - sizes[0] - clone < (model.num_layers + 2) * gpus * 18


def test_70b_zero3_model_states_about_128_gib(gpu_80gib) -> None:
    request = _request(gpu_80gib, get_model("llama-2-70b"), StrategyKind.zero3, 8)
    # 16 bytes per parameter (2 + 2 + 12) over 8 GPUs.
    assert model_state_bytes(request).gpu_bytes / GiB == pytest.approx(16 * 68_976_648_192 / 8 / GiB, rel=1e-6)
    assert round(model_state_bytes(request).gpu_bytes / GiB) == 128


def test_deepspeed_convention_is_18_bytes_at_stage_3(gpu_80gib) -> None:
    request = _request(gpu_80gib, DIVISIBLE_MODEL, StrategyKind.zero3, 8, state_convention=StateConvention.deepspeed)
    assert model_state_bytes(request).gpu_bytes_without_counters == 18 * total_parameters(DIVISIBLE_MODEL) // 8


def test_deepspeed_convention_in_fp32_keeps_a_separate_master(gpu_80gib) -> None:
    # DeepSpeed clones an fp32 master partition even when the model is fp32 (measured:
    # tests/harness/test_deepspeed.py); the other conventions use the parameter itself.
    psi = total_parameters(DIVISIBLE_MODEL)
    deepspeed = _request(gpu_80gib, DIVISIBLE_MODEL, StrategyKind.zero3, 8, precision=Precision.fp32,
                         state_convention=StateConvention.deepspeed)
    zero = _request(gpu_80gib, DIVISIBLE_MODEL, StrategyKind.zero3, 8, precision=Precision.fp32)
    assert model_state_bytes(deepspeed).gpu_bytes_without_counters == 20 * psi // 8
    assert model_state_bytes(zero).gpu_bytes_without_counters == 16 * psi // 8


def test_fsdp2_convention_is_fp32_params_and_grads(gpu_80gib) -> None:
    request = _request(gpu_80gib, DIVISIBLE_MODEL, StrategyKind.fsdp_full_shard, 8)
    states = model_state_bytes(request)
    psi = total_parameters(DIVISIBLE_MODEL)
    assert (states.parameter_bytes, states.gradient_bytes, states.optimizer_state_bytes - states.step_counter_bytes) == (4 * psi // 8, 4 * psi // 8, 8 * psi // 8)
    # One fp32 step counter per parameter tensor (torch/optim/adamw.py).
    assert states.step_counter_bytes == 4 * sum(len(u.tensors) for u in parameter_units(DIVISIBLE_MODEL))


def test_flat_padding_is_per_unit(gpu_80gib) -> None:
    # GPT-2's units are not multiples of 7: each unit is padded up to the next multiple.
    from zeroplan.core.params import parameter_units
    from zeroplan.units import ceil_div

    model = get_model("gpt2")
    request = _request(gpu_80gib, model, StrategyKind.zero3, 7)
    expected_elements = sum(ceil_div(u.numel, 7) for u in parameter_units(model))
    assert model_state_bytes(request).parameter_elements == expected_elements
    assert expected_elements * 7 > total_parameters(model)


@pytest.mark.parametrize(
    "optimizer,bytes_per_element", [(Optimizer.sgd, 0), (Optimizer.sgd_momentum, 4), (Optimizer.lion, 4), (Optimizer.adam, 8)]
)
def test_optimizer_bytes_in_ddp(gpu_80gib, optimizer, bytes_per_element) -> None:
    psi = total_parameters(DIVISIBLE_MODEL)
    request = _request(gpu_80gib, DIVISIBLE_MODEL, StrategyKind.ddp, 1, optimizer=optimizer, precision=Precision.fp32)
    assert request.convention is StateConvention.fsdp2
    states = model_state_bytes(request)
    assert states.optimizer_state_bytes - states.step_counter_bytes == bytes_per_element * psi


def test_factored_and_8bit_states_are_smaller_than_adam(gpu_80gib) -> None:
    model = get_model("llama-2-7b")
    sizes = {
        opt: model_state_bytes(_request(gpu_80gib, model, StrategyKind.ddp, 1, optimizer=opt, precision=Precision.fp32)).optimizer_state_bytes
        for opt in (Optimizer.adamw, Optimizer.adam_8bit, Optimizer.adafactor)
    }
    psi = total_parameters(model)
    # 8-bit Adam: 2 bytes per element plus one fp32 absmax per 256 per state.
    assert sizes[Optimizer.adam_8bit] == pytest.approx(2 * psi * (1 + 4 / 256), rel=1e-3)
    assert sizes[Optimizer.adafactor] < psi * 4 / 100


def test_adafactor_states_factor_the_last_two_dims_and_count_step_tensors(gpu_80gib) -> None:
    """torch.optim.Adafactor (torch/optim/_adafactor.py): row_var (..., r, 1) and col_var
    (..., 1, c) per matrix of a tensor, the full variance of a vector, and a 0-dim fp32 step
    per tensor (tests/harness/test_accumulation.py checks these against torch itself)."""
    assert adafactor_state_bytes(ParamTensor(name="v", shape=(6,)), 4) == 6 * 4
    assert adafactor_state_bytes(ParamTensor(name="m", shape=(5, 7)), 4) == (5 + 7) * 4
    assert adafactor_state_bytes(ParamTensor(name="e", shape=(3, 4, 5)), 4) == 3 * (4 + 5) * 4
    request = _request(gpu_80gib, DIVISIBLE_MODEL, StrategyKind.ddp, 1, optimizer=Optimizer.adafactor, precision=Precision.fp32)
    states = model_state_bytes(request)
    tensors = [t for u in parameter_units(DIVISIBLE_MODEL) for t in u.tensors]
    assert states.step_counter_bytes == 4 * len(tensors)
    assert states.optimizer_state_bytes == sum(adafactor_state_bytes(t, 4) for t in tensors) + 4 * len(tensors)


def test_offload_moves_states_to_host(gpu_80gib) -> None:
    model = get_model("llama-2-70b")
    psi = total_parameters(model)
    opt = model_state_bytes(_request(gpu_80gib, model, StrategyKind.zero3_offload, 8))
    assert opt.gradient_bytes == opt.optimizer_state_bytes == 0
    assert opt.parameter_bytes == pytest.approx(2 * psi / 8, rel=1e-6)
    # fp32 master + Adam (12) + fp32 gradient (4) per element of the shard.
    assert opt.host_bytes == pytest.approx(16 * psi / 8, rel=1e-6)  # counters are a few hundred bytes
    both = model_state_bytes(_request(gpu_80gib, model, StrategyKind.zero3_param_offload, 8))
    assert both.gpu_bytes == 0 and both.host_bytes == pytest.approx(18 * psi / 8, rel=1e-6)
