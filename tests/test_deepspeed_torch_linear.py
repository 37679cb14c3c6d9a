"""Under torch's own F.linear DeepSpeed's ZeRO-3 engine keeps every released linear's gathered
weight from its forward to its backward (zeroplan.core.deepspeed_torch_linear), against DeepSpeed
0.19.8's own engine on gloo with torch's F.linear put back (benchmarks/deepspeed_mha_pinned_records.py
--torch-linear, its committed records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_deepspeed_mha_views import SETUP, _record_request, _request, _row
from zeroplan.core.deepspeed_coordinator import released_after_forward
from zeroplan.core.deepspeed_mha_views import pinned_in_projection_bytes
from zeroplan.core.deepspeed_torch_linear import pinned_linear_weight_bytes
from zeroplan.core.plan import memory_breakdown
from zeroplan.errors import ZeroplanError

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "deepspeed-mha-records" / "torch-linear.json"
TORCH_LINEAR = " --torch-multihead-attention --deepspeed-torch-linear"


def test_only_under_deepspeeds_zero3_with_torch_linear() -> None:
    assert pinned_linear_weight_bytes(_row(TORCH_LINEAR)) > 0
    assert pinned_linear_weight_bytes(_row()) == 0
    unfiled = f"{SETUP} --framework zeroplan --state-convention deepspeed"
    assert pinned_linear_weight_bytes(_row(TORCH_LINEAR, kind="zero3", flags=unfiled)) > 0
    assert pinned_linear_weight_bytes(_row(TORCH_LINEAR, kind="zero2", flags=unfiled)) == 0
    # A full block checkpoint saves nothing in the blocks; the output projection stays gathered.
    assert pinned_linear_weight_bytes(_row(TORCH_LINEAR + " --activation-checkpointing full")) == 0


def test_every_released_weight_but_no_bias_nor_embedding() -> None:
    request = _row(TORCH_LINEAR)
    released = released_after_forward(request)
    weights = {name: size for name, size in released.items()
               if name.startswith("block.") and name.endswith("weight") and "_norm." not in name}
    # Past 'block.<index>.': nn.MultiheadAttention's packed in-projection and out_proj, the FFN's two.
    assert {name.split(".", 2)[2] for name in weights} == {
        "attention.in_proj_weight", "attention.o.weight", "mlp.fc1.weight", "mlp.fc2.weight"}
    assert any(name.startswith("embedding.") for name in released)
    assert pinned_linear_weight_bytes(request) == sum(weights.values())


def test_the_weights_replace_the_in_projection_views_in_the_activations() -> None:
    plain, torch_linear = (memory_breakdown(request)[0] for request in (_row(""), _row(TORCH_LINEAR)))
    assert pinned_in_projection_bytes(_row(TORCH_LINEAR)) == 0
    assert torch_linear.activation_bytes - plain.activation_bytes == pinned_linear_weight_bytes(_row(TORCH_LINEAR))


def test_a_gpt_without_torch_attention_pins_its_separate_projections() -> None:
    flags = f"{SETUP} --framework zeroplan --state-convention deepspeed --deepspeed-torch-linear"
    request = _request("gpt2-xl", flags)
    released = released_after_forward(request)
    assert pinned_linear_weight_bytes(request) == sum(
        size for name, size in released.items() if name.startswith("block.") and name.endswith(".weight")
        and "_norm." not in name)


def test_refused_outside_framework_zeroplan() -> None:
    with pytest.raises(ZeroplanError, match="deepspeed_torch_linear"):
        memory_breakdown(_request("gpt2-xl", f"{SETUP} --framework hf --deepspeed-torch-linear", kind="zero3"))


def _records() -> dict:
    return json.loads(RECORDS.read_text())


@pytest.mark.parametrize("setting", sorted(json.loads(RECORDS.read_text())))
def test_the_planner_keeps_what_deepspeeds_engine_kept(setting: str, tmp_path: Path) -> None:
    record = _records()[setting]
    assert record["torch_linear"] and record["after_backward"] == {}
    request = _record_request(record, tmp_path)
    request = request.model_copy(update={"training": request.training.model_copy(
        update={"deepspeed_torch_linear": True})})
    engine_bytes = sum(record["after_forward"].values())
    if record["checkpointing"] == "full":
        assert engine_bytes == 0 and record["most_in_backward"] == {}
        assert pinned_linear_weight_bytes(request) == 0
        return
    # Pinned from the forward to each block's backward, never more at once.
    assert sum(record["most_in_backward"].values()) == engine_bytes
    # The biases stay free: each kind's bytes are whole weights of the pinned blocks.
    released = released_after_forward(request)
    h = record["shape"]["hidden"]
    in_proj_blocks = sum(state.startswith("pinned") for state in record["in_proj_after_forward"])
    assert record["after_forward"]["attention_in_proj"] == in_proj_blocks * 3 * h * h * 2
    assert record["after_forward"]["ffn_linear"] % (2 * 4 * h * h * 2) == 0
    # As under DeepSpeed's linear (tests/test_deepspeed_mha_views.py), the engine may release one
    # block's in_proj_weight the replay keeps gathered: the planner falls short by at most that.
    planned = pinned_linear_weight_bytes(request)
    assert 0 <= engine_bytes - planned <= released["block.0.attention.in_proj_weight"]
