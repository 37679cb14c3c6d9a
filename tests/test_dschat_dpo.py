"""DeepSpeed-Chat's DPO step (zeroplan.core.dschat_dpo) against its own get_batch_logps and loop on
the CPU (benchmarks/dschat_dpo_head.py writes benchmarks/dschat-dpo-head-records.json), and
DeepSpeed's FP16_Optimizer around a client FusedAdam at stage 0 (zeroplan.core.deepspeed_fused_fp16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.deepspeed_fused_fp16 import first_group_elements
from zeroplan.core.dschat_dpo import dschat_dpo_logits_tensors, held_outputs_tensors
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.core.plan import peak_terms, plan
from zeroplan.errors import ZeroplanError
from zeroplan.specs.strategy import StrategyKind

ROOT = Path(__file__).resolve().parents[1]
RECORDS = json.loads((ROOT / "benchmarks" / "dschat-dpo-head-records.json").read_text())
OPT_350M = str(ROOT / "tests" / "fixtures" / "hf" / "opt-350m.json")


def _request(*flags: str, rows: int = 4, seq: int = 512, kind: StrategyKind = StrategyKind.ddp):
    args = build_parser().parse_args([
        "fit", OPT_350M, "--gpus", "8", "--gpu", "a100-80gb", "--micro-batch", str(rows), "--seq-len", str(seq),
        "--precision", "fp16-mixed", "--framework", "hf", "--state-convention", "deepspeed", *flags])
    return request_from_args(args, kind)


def _plan(request):
    return plan(request, largest_micro_batch=False, timed=False)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['pairs']}x{r['seq_len']}")
def test_head_and_held_outputs_match_deepspeed_chats_step(record):
    # The records' model: hidden 64, 4 heads, 2 blocks, vocabulary 128 (benchmarks/dschat_dpo_head.py).
    rows, seq, vocab, hidden, layers, e = 2 * record["pairs"], record["seq_len"], 128, 64, 2, 2
    assert record["policy_log_softmax_bytes"] == e * rows * (seq - 1) * vocab
    assert record["policy_logits_bytes"] == record["reference_logits_bytes"] == e * rows * seq * vocab
    assert record["reference_cache_bytes"] == 2 * layers * e * rows * seq * hidden
    request = _request("--objective", "dpo", rows=rows, seq=seq)
    scale = request.model.vocab_size / vocab
    assert dschat_dpo_logits_tensors(request)[0][0] == record["policy_log_softmax_bytes"] * scale
    held = held_outputs_tensors(request)
    assert held[0] == held[1] == record["policy_logits_bytes"] * scale
    assert sum(held[2:]) == record["reference_cache_bytes"] * request.model.num_layers // layers * request.model.hidden_size // hidden


def test_the_reference_model_adds_its_fp16_parameters():
    sft, dpo = _request(), _request("--objective", "dpo")
    added = model_state_bytes(dpo).parameter_bytes - model_state_bytes(sft).parameter_bytes
    assert added == 2 * total_parameters(dpo.model)
    assert peak_terms(dpo)[1].activations - peak_terms(sft)[1].activations == sum(held_outputs_tensors(dpo))
    # The loop's outputs are still bound at the optimizer step (held_through_step_bytes).
    assert peak_terms(dpo)[1].step_temporary - peak_terms(sft)[1].step_temporary == sum(held_outputs_tensors(dpo))


@pytest.mark.parametrize("flags, field", [
    (("--lora-rank", "8"), "finetune"),
    (("--keep-outputs",), "keep_outputs"),
    (("--activation-checkpointing", "full"), "activation_checkpointing"),
])
def test_dschat_dpo_refusals_name_the_field(flags, field):
    with pytest.raises(ZeroplanError, match=field):
        _plan(_request("--objective", "dpo", *flags))


def test_dschat_dpo_needs_deepspeeds_engine():
    with pytest.raises(ZeroplanError, match="objective"):
        _plan(_request("--objective", "dpo", kind=StrategyKind.zero3))


def test_fused_adam_adds_the_first_groups_fp32_copies_at_the_step():
    unfused, fused = _request(), _request("--deepspeed-fused-adam")
    matrices = sum(t.numel for unit in parameter_units(fused.model) for t in unit.tensors if len(t.shape) > 1)
    assert first_group_elements(fused) == matrices < total_parameters(fused.model)
    assert peak_terms(fused)[1].step_temporary == 4 * matrices
    assert peak_terms(unfused)[1].step_gradients == peak_terms(fused)[1].step_gradients


def test_fused_adam_is_refused_outside_fp16():
    with pytest.raises(ZeroplanError, match="deepspeed_fused_adam"):
        _plan(_request("--deepspeed-fused-adam", "--precision", "bf16-mixed"))
