"""Expert parallelism: per-rank model states against torchtitan's own DeepSeek module under its
EP + FSDP2 placement, the token all-to-alls, torchtitan's EP rules, and fit answering for
Mixtral-8x7B and DeepSeek-V2-Lite config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.main import main
from zeroplan.core.collective import CollectiveOp, Phase
from zeroplan.core.communication import collectives
from zeroplan.core.flops import head_forward_flops_per_token, layers_linear_forward_flops_per_token
from zeroplan.core.layout import ShardLayout
from zeroplan.core.model_states import held_elements, model_state_bytes
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.core.params import active_parameters, parameter_units
from zeroplan.core.plan import peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import load_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, TrainingSpec
from zeroplan.specs.framework import Framework
from zeroplan.specs.hardware import cluster_from_gpus
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.units import ceil_div

FIXTURES = Path(__file__).parent / "fixtures"
TORCHTITAN_16B = json.loads((FIXTURES / "moe_parameter_counts.json").read_text())["torchtitan-deepseek-16b"]


def _model(name: str):
    return load_hf_config(FIXTURES / "hf" / f"{name}.json")


def request(model="deepseek-v2-lite", gpus=16, ep=8, framework=Framework.torchtitan, kind=StrategyKind.fsdp_full_shard,
            batch=None, **parallel) -> PlanRequest:
    spec = _model(model) if isinstance(model, str) and model.startswith(("deepseek", "mixtral", "qwen")) else get_model(model)
    return PlanRequest(
        model=spec, training=TrainingSpec(framework=framework), batch=batch or BatchSpec(seq_len=4096),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus), strategy=StrategySpec(kind=kind),
        parallel=ParallelSpec(ep=ep, **parallel),
    )


# torchtitan 0.3.0 distributed/fsdp.py with ep > 1: every parameter Shard(0) over the fsdp mesh
# (dp_shard x cp ranks), except the routed experts' grouped weights: their E/ep local experts
# (ExpertParallel's Shard(0) over ep) Shard(0) over efsdp when efsdp x ep <= E, else Shard(1).
# DTensor/FSDP2 shards like torch.chunk padded to equal shards: ceil(n / N) per rank.
def torchtitan_rank0_elements(fsdp: int, ep: int) -> int:
    efsdp = fsdp // ep
    total = 0
    for name, shape in TORCHTITAN_16B["shapes"].items():
        if ".inner_experts." in name:
            experts, rows, cols = shape
            local = experts // ep
            if efsdp * ep <= experts:
                total += ceil_div(local, efsdp) * rows * cols
            else:
                total += local * ceil_div(rows, efsdp) * cols
        else:
            rest = 1
            for n in shape[1:]:
                rest *= n
            total += ceil_div(shape[0], fsdp) * rest
    return total


def test_torchtitan_16b_is_the_same_model_as_transformers_deepseek_v2_lite() -> None:
    assert TORCHTITAN_16B["total_parameters"] == sum(unit.numel for unit in parameter_units(_model("deepseek-v2-lite")))


# 16 GPUs: efsdp 2 (Shard(0), divides the 8 local experts); 24: efsdp 3 (Shard(0), padded: 8
# experts in 3 shards of 3); 128: efsdp 16 > 64 / 8 (Shard(1) on f, or h for w2).
@pytest.mark.parametrize("gpus", [16, 24, 128])
def test_rank_parameters_equal_torchtitan_ep_fsdp_shards(gpus: int) -> None:
    req = request(gpus=gpus, ep=8)
    held = held_elements(rank_parameter_units(req), req.shard_group_size, ShardLayout.dim0)
    assert held == torchtitan_rank0_elements(gpus, 8)
    states = model_state_bytes(req)
    # FSDP2 under bf16-mixed keeps fp32 parameters and gradients, AdamW two fp32 moments.
    assert states.parameter_bytes == 4 * held and states.gradient_bytes == 4 * held


def test_ep_holds_the_local_experts_only() -> None:
    model = _model("mixtral-8x7b")
    whole = sum(unit.numel for unit in parameter_units(model))
    experts = sum(t.numel for unit in parameter_units(model) for t in unit.tensors if t.name.startswith("mlp.experts."))
    req = request("mixtral-8x7b", gpus=32, ep=8, kind=StrategyKind.fsdp_shard_grad_op)
    held = sum(unit.numel for unit in rank_parameter_units(req))
    assert held == whole - experts + experts // 8


def test_all_to_all_bytes_per_moe_block() -> None:
    req = request(gpus=8, ep=8, batch=BatchSpec(seq_len=4096, micro_batch_size=2))
    model = req.model
    a2a = [c for c in collectives(req) if c.op is CollectiveOp.all_to_all]
    assert {c.phase for c in a2a} == {Phase.forward, Phase.backward}
    buffer = 2 * 4096 * model.experts_per_token * model.hidden_size * 2  # tokens x k x h x bf16
    for c in a2a:
        # dispatch and combine in each of the 26 MoE blocks; (ep - 1)/ep of each leaves the rank
        assert c.calls == 2 * 26 and c.group_size == 8
        assert c.buffer_bytes == 2 * 26 * buffer
        assert c.sent_bytes_per_call_sum == 2 * 26 * buffer * 7 // 8


def test_dispatch_buffers_join_the_workspace() -> None:
    with_ep, without = peak_terms(request(gpus=16, ep=8))[1], peak_terms(request(gpus=16, ep=1))[1]
    model = _model("deepseek-v2-lite")
    # send and receive buffers of one MoE block's T x k routed copies, bf16
    assert with_ep.workspace - without.workspace == 2 * 4096 * model.experts_per_token * model.hidden_size * 2
    # balanced routing: the saved activations are the same but for the int64 permuted_indices
    # of the T x k received copies that torchtitan's _permute saves under EP only
    # (core/frameworks.py torchtitan_moe_block_extra_bytes), in every block the framework path
    # counts (each as the larger, MoE, block: docs/moe.md)
    assert with_ep.activations - without.activations == model.num_layers * 8 * 4096 * model.experts_per_token


def test_active_parameters_are_what_flops_count() -> None:
    model = _model("deepseek-v2-lite")
    weights = sum(t.numel for unit in parameter_units(model) for t in unit.tensors
                  if len(t.shape) == 2 and t.name != "token.weight" and not t.name.startswith("mlp.experts."))
    active_experts = model.moe_layer_count * model.experts_per_token * 3 * model.hidden_size * model.expert_ffn_hidden_size
    assert layers_linear_forward_flops_per_token(model) + head_forward_flops_per_token(model) == 2 * (weights + active_experts)
    norms = sum(t.numel for unit in parameter_units(model) for t in unit.tensors if len(t.shape) == 1)
    assert active_parameters(model) == weights + active_experts + norms + model.vocab_size * model.hidden_size


@pytest.mark.parametrize("kwargs,field", [
    (dict(model="llama-3.1-8b", ep=2), "parallel.ep"),
    (dict(ep=3), "parallel.ep"),
    (dict(ep=8, gpus=4), "parallel.ep"),
    (dict(ep=2, tp=2), "parallel.ep"),
    (dict(ep=8, kind=StrategyKind.ddp), "strategy"),
    (dict(ep=8, kind=StrategyKind.zero2), "strategy"),
    (dict(ep=8, framework=Framework.hf), "parallel.ep"),
    (dict(ep=1, tp=2), "parallel.tp"),
])
def test_ep_rules_are_refused_in_one_line(kwargs, field) -> None:
    with pytest.raises(ZeroplanError, match=field) as error:
        request(**kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv", [
    # torchtitan 0.3.0 has no Mixtral (its MoE models are Qwen3's and DeepSeek's): the reference model.
    ["fit", str(FIXTURES / "hf" / "mixtral-8x7b.json"), "--gpus", "32", "--gpu", "h100-80gb", "--ep", "8",
     "--activation-checkpointing", "full"],
    ["fit", str(FIXTURES / "hf" / "deepseek-v2-lite.json"), "--gpus", "8", "--gpu", "h100-80gb", "--ep", "8",
     "--framework", "torchtitan"],
    ["fit", str(FIXTURES / "hf" / "deepseek-v2-lite.json"), "--gpus", "16", "--ep", "8"],
])
def test_fit_answers_with_ep(capsys, argv) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Expert parallel: ep 8" in out and "Mixture of experts:" in out
    assert "Recommended:" in out


def test_fit_refuses_ep_for_a_dense_model(capsys) -> None:
    assert main(["fit", "llama-3.1-8b", "--ep", "2"]) != 0
    err = capsys.readouterr().err
    assert "--ep: 2" in err and err.count("\n") == 1


@pytest.mark.parametrize("fmt", ["table", "json", "csv"])
def test_compare_times_the_all_to_all(capsys, fmt) -> None:
    # The token dispatch's all-to-all is a collective of the step like any other: the table's
    # nccl column names it (A2A, in the CSV's nccl_algorithms too); JSON lists its costs.
    argv = ["compare", "--detail", str(FIXTURES / "hf" / "mixtral-8x7b.json"), "--gpus", "16", "--gpu", "h100-80gb", "--ep", "8",
            "--strategies", "fsdp-full-shard", "--format", fmt]
    assert main(argv) == 0
    out = capsys.readouterr().out
    if fmt == "json":
        ops = {cost["op"] for plan in json.loads(out)["plans"] for cost in plan["time"]["collective_times"]}
        assert "all_to_all" in ops
    else:
        assert "A2A ring" in out


def test_every_collective_op_has_a_short_name_in_the_compare_table() -> None:
    from zeroplan.core.collective import CollectiveOp
    from zeroplan.core.timing import COLLECTIVE_SHORT_NAMES

    assert set(COLLECTIVE_SHORT_NAMES) == set(CollectiveOp)
    assert len(set(COLLECTIVE_SHORT_NAMES.values())) == len(CollectiveOp)
