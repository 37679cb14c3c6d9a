"""The Muon optimizer (zeroplan.core.muon) against the frameworks' own code, recorded on CPU by
benchmarks/muon_records.py (benchmarks/muon-records/records.json; JSON only here): torch.optim.Muon's
momentum and Newton-Schulz peak per matrix, DeepSpeed's use_muon rule, its Muon group's order,
momentum, staged momentum and held updates per rank, and its auxiliary AdamW's states; then the planner's
terms built from them, and the one-line refusals of what is not modelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core import muon
from zeroplan.core.deepspeed_buckets import flat_group_elements
from zeroplan.core.deepspeed_step import norm_copy_bytes
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.param_tensors import ParamTensor, ParamUnit
from zeroplan.core.plan import peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.specs import StrategyKind
from zeroplan.specs.deepspeed_config import deepspeed_config_of

RECORDS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "muon-records" / "records.json").read_text())
BF16_PURE_RECORDS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "muon-records"
                                / "bf16-pure-records.json").read_text())


@pytest.mark.parametrize("record", RECORDS["torch_muon"], ids=lambda r: f"{r['shape'][0]}x{r['shape'][1]}-{r['grad_bytes']}B")
def test_newton_schulz_peak_matches_torch_optim_muon(record: dict) -> None:
    shape = tuple(record["shape"])
    assert muon.newton_schulz_peak_bytes(shape, record["grad_bytes"]) == record["step_peak_bytes"]
    # One momentum buffer of the gradient's size and dtype; nothing else kept.
    assert record["state"] == {"momentum_buffer": [shape[0] * shape[1], record["grad_bytes"]]}
    assert record["left_bytes"] == 0


def _unit_name(name: str) -> str:
    """The zeroplan unit of a parameter of the recorded model (named as Hugging Face names them)."""
    if name.startswith("embed_tokens"):
        return "embedding"
    if name.startswith("layers."):
        return f"block.{name.split('.')[1]}"
    return "head"


def _recorded_tensors(run: dict) -> tuple[list[ParamTensor], list[ParamTensor]]:
    """(Muon's, AdamW's) tensors of the recorded model by zeroplan's rule, in registration order."""
    muon_tensors, adamw_tensors = [], []
    for name, shape in run["shapes"].items():
        tensor = ParamTensor(name=name, shape=tuple(shape))
        (muon_tensors if muon.muon_steps(ParamUnit(name=_unit_name(name), tensors=(tensor,)), tensor) else adamw_tensors).append(tensor)
    return muon_tensors, adamw_tensors


@pytest.mark.parametrize("run", RECORDS["deepspeed_runs"], ids=lambda r: f"zero{r['stage']}-rank{r['rank']}")
def test_deepspeed_muon_states_match_the_engine(run: dict) -> None:
    muon_tensors, adamw_tensors = _recorded_tensors(run)
    assert {t.name for t in muon_tensors} == {name for name, flag in run["use_muon"].items() if flag}
    muon_group, adamw_group = (next(g for g in run["groups"] if g["use_muon"] is flag) for flag in (True, False))
    ordered = [t.numel for t in muon.deepspeed_muon_order(muon_tensors)]
    assert ordered == muon_group["group_params"]
    world, rank = run["world_size"], run["rank"]
    whole = muon.deepspeed_muon_whole_elements_by_rank(ordered, world)[rank]
    assert whole == sum(muon_group["params_in_partition"])
    # The momentum and its staged copy: the whole matrices, in the model's dtype (bf16).
    assert muon_group["state"] == {"momentum_buffer": [whole, 2]}
    assert muon_group["staged_momentum"] == [whole, 2]
    # Between the backward and the step: one new bf16 update per whole matrix, apart from the
    # gradient buffer the AdamW group's views share.
    assert muon_group["held_storages_bytes"] == sorted(2 * n for n in muon_group["params_in_partition"])
    assert sum(muon_group["held_storages_bytes"]) == whole * 2
    adamw_partition = flat_group_elements(sum(t.numel for t in adamw_tensors), world) // world
    assert adamw_group["state"] == {"exp_avg": [adamw_partition, 4], "exp_avg_sq": [adamw_partition, 4]}


def test_the_recorded_partition_cuts_a_matrix() -> None:
    # Otherwise the records could not tell whole matrices from partition elements.
    run = RECORDS["deepspeed_runs"][0]
    group = next(g for g in run["groups"] if g["use_muon"])
    assert sum(group["params_in_partition"]) > group["partition_elements"]


def test_whole_elements_count_a_cut_matrix_on_both_ranks() -> None:
    assert muon.deepspeed_muon_whole_elements_by_rank([6, 6], 2) == [6, 6]
    assert muon.deepspeed_muon_whole_elements_by_rank([8, 4], 2) == [8, 12]
    assert muon.deepspeed_muon_whole_elements_by_rank([], 4) == [0, 0, 0, 0]


def _request(flags: str, kind: StrategyKind):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]), kind)


QWEN = "qwen2.5-3b --gpus 8 --gpu a100-40gb --micro-batch 4 --seq-len 2048 --precision bf16-mixed --framework hf"


def test_deepspeed_zero2_states_are_muon_momenta_beside_adamw() -> None:
    adamw = model_state_bytes(_request(QWEN, StrategyKind.zero2))
    request = _request(f"{QWEN} --optimizer muon", StrategyKind.zero2)
    states = model_state_bytes(request)
    muon_tensors, adamw_tensors = muon.split_tensors(request)
    # Muon takes every block matrix; the embedding (tied head), the norms and the q/k/v biases are AdamW's.
    assert len(adamw_tensors) == 1 + 36 * (2 + 3) + 1
    assert all(len(t.shape) == 2 for t in muon_tensors)
    master = states.optimizer_elements * 4
    assert states.optimizer_state_bytes == master + muon.deepspeed_state_bytes(request, 2, 4)
    assert states.optimizer_state_bytes < adamw.optimizer_state_bytes
    # Parameters and gradients are untouched.
    assert (states.parameter_bytes, states.gradient_bytes) == (adamw.parameter_bytes, adamw.gradient_bytes)
    # The step holds the whole matrices' bf16 updates beside the larger of the norm's fp64 copy and
    # the largest matrix's Newton-Schulz (DeepSpeed's FusedAdam makes none).
    _, terms = peak_terms(request)
    newton_schulz = max(muon.newton_schulz_peak_bytes(t.shape, 2) for t in muon_tensors)
    assert terms.step_temporary == muon.deepspeed_whole_elements(request) * 2 + max(norm_copy_bytes(request), newton_schulz)


@pytest.mark.parametrize("run", BF16_PURE_RECORDS["deepspeed_runs"], ids=lambda r: f"zero{r['stage']}-rank{r['rank']}")
def test_bf16_pure_auxiliary_adamw_states_are_the_partitions_dtype(run: dict) -> None:
    """Under DeepSpeed's bf16 master weights and optimizer states (what bf16-pure stands for there)
    MuonWithAuxAdam's exp_avg and exp_avg_sq are zeros_like of the bf16 partition: 2 bytes an
    element, as the planner's bf16-pure AdamW states, not fp32 (the planner kept 4: gpt2 under hf's
    zero1 on 8 GPUs, bf16-pure, planned Muon's states 86.7 MB against AdamW's 62.2 MB)."""
    from zeroplan.core.layout import element_bytes
    from zeroplan.specs.training import Precision, StateConvention

    eb = element_bytes(Precision.bf16_pure, StateConvention.deepspeed)
    muon_tensors, adamw_tensors = _recorded_tensors(run)
    muon_group, adamw_group = (next(g for g in run["groups"] if g["use_muon"] is flag) for flag in (True, False))
    world = run["world_size"]
    adamw_partition = flat_group_elements(sum(t.numel for t in adamw_tensors), world) // world
    assert adamw_group["state"] == {"exp_avg": [adamw_partition, eb.optimizer_dtype],
                                    "exp_avg_sq": [adamw_partition, eb.optimizer_dtype]}
    whole = muon.deepspeed_muon_whole_elements_by_rank([t.numel for t in muon.deepspeed_muon_order(muon_tensors)],
                                                       world)[run["rank"]]
    assert muon_group["state"] == {"momentum_buffer": [whole, eb.compute_parameter]}
    assert muon_group["staged_momentum"] == [whole, eb.compute_parameter]


def test_bf16_pure_plans_the_auxiliary_adamw_in_bf16() -> None:
    flags = "gpt2 --framework hf --gpu l40s --gpus 8 --micro-batch 2 --seq-len 1024 --precision bf16-pure"
    request = _request(f"{flags} --optimizer muon", StrategyKind.zero1)
    states = model_state_bytes(request)
    # No fp32 master under bf16-pure: the momentum and its staged copy of the whole matrices, and
    # AdamW's two bf16 states on its own group's partition.
    assert states.optimizer_state_bytes == (2 * 2 * muon.deepspeed_whole_elements(request)
                                            + 2 * 2 * muon.deepspeed_adamw_partition_elements(request))
    assert states.optimizer_state_bytes == 66_938_496


def test_ddp_states_step_counters_and_temporary() -> None:
    flags = "gpt2-small --gpus 2 --micro-batch 1 --seq-len 128"
    adamw = model_state_bytes(_request(flags, StrategyKind.ddp))
    request = _request(f"{flags} --optimizer muon", StrategyKind.ddp)
    states = model_state_bytes(request)
    muon_tensors, adamw_tensors = muon.split_tensors(request)
    muon_elements = sum(t.numel for t in muon_tensors)
    # One fp32 momentum instead of two fp32 states on Muon's matrices; AdamW's step counters only.
    assert adamw.optimizer_state_bytes - states.optimizer_state_bytes == (
        4 * muon_elements + 4 * (adamw.step_counter_bytes // 4 - len(adamw_tensors)))
    assert states.step_counter_bytes == 4 * len(adamw_tensors)
    _, terms = peak_terms(request)
    largest = max(muon.newton_schulz_peak_bytes(t.shape, 4) for t in muon_tensors)
    # foreach AdamW's sqrt over its own tensors, or the largest matrix's Newton-Schulz.
    assert terms.step_temporary == max(largest, 4 * sum(t.numel for t in adamw_tensors))


@pytest.mark.parametrize(("flags", "kind", "field"), [
    (QWEN, StrategyKind.zero3, "training.optimizer"),
    (QWEN, StrategyKind.fsdp_full_shard, "training.optimizer"),
    (QWEN, StrategyKind.zero2_offload, "training.optimizer"),
    (f"{QWEN} --state-convention deepspeed", StrategyKind.ddp, "training.optimizer"),
    ("llama-2-7b --gpus 8 --micro-batch 1 --seq-len 1024 --framework megatron", StrategyKind.zero1, "optimizer"),
    ("llama-2-7b --gpus 8 --micro-batch 1 --seq-len 1024 --framework torchtune", StrategyKind.fsdp_full_shard, "training.optimizer"),
    (f"{QWEN} --tp 2", StrategyKind.zero2, "parallel"),
    (f"{QWEN} --deepspeed-release 0.13.3", StrategyKind.zero2, "training.deepspeed_release"),
    ("mixtral-8x7b --gpus 8 --micro-batch 1 --seq-len 1024 --framework hf", StrategyKind.zero2, "training.optimizer"),
])
def test_what_is_not_modelled_is_refused_in_one_line(flags: str, kind: StrategyKind, field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        _request(f"{flags} --optimizer muon", kind)
    assert error.value.field == field
    assert "\n" not in str(error.value) and "allowed" in str(error.value)


def test_deepspeed_config_names_muon() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Muon", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    assert deepspeed_config_of(config, hf_auto=False).optimizer.value == "muon"
    config["optimizer"]["params"]["per_head_muon"] = True
    with pytest.raises(ZeroplanError, match="per_head_muon"):
        deepspeed_config_of(config, hf_auto=False)
