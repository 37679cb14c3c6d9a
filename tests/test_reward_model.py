"""DeepSpeed-Chat's reward-model head (zeroplan.core.reward_model) against its own RewardModel on
the CPU (benchmarks/reward_model_head.py writes benchmarks/reward-model-head-records.json), and
the objective's place in the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import framework_logits_tensors
from zeroplan.core.plan import max_micro_batch_size, plan
from zeroplan.core.reward_model import reward_forward_tensors
from zeroplan.errors import ZeroplanError
from zeroplan.specs.strategy import StrategyKind

ROOT = Path(__file__).resolve().parents[1]
RECORDS = json.loads((ROOT / "benchmarks" / "reward-model-head-records.json").read_text())
OPT_13B = str(ROOT / "tests" / "fixtures" / "hf" / "opt-1.3b.json")


def _request(*flags: str, rows: int = 8, seq: int = 512, kind: StrategyKind = StrategyKind.zero2):
    # DeepSpeed-Chat's step 1 and 2 releases (benchmarks/published_memory/rows.csv dschat-step1-*),
    # unless a flag names another framework.
    hf = () if "--framework" in flags else ("--framework", "hf", "--attention", "eager", "--transformers-version", "4.31.0")
    args = build_parser().parse_args([
        "fit", OPT_13B, "--gpus", "16", "--gpu", "v100-32gb", "--micro-batch", str(rows), "--seq-len", str(seq),
        "--precision", "fp16-mixed", *hf, *flags])
    return request_from_args(args, kind)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['pairs']}x{r['seq_len']}")
def test_head_terms_match_deepspeed_chats_reward_model(record):
    request = _request("--objective", "reward", rows=2 * record["pairs"], seq=record["seq_len"])
    rewards, sigmoids, _, _ = reward_forward_tensors(request)
    assert rewards == 2 * record["v_head_output_elements"]  # fp16 scores, one a position
    assert sigmoids == record["head_saved_bytes"]


def test_reward_head_holds_no_vocabulary_logits():
    sft, reward = _request(), _request("--objective", "reward")
    b, s, v = 8, 512, sft.model.vocab_size
    largest = max(sum(moment) for moment in framework_logits_tensors(reward))
    assert largest < b * s * 2 * 3  # a few b x s score tensors
    assert max(sum(moment) for moment in framework_logits_tensors(sft)) >= 2 * b * (s - 1) * v
    # The blocks' backward sets this allocated peak; the cached segments the logits left go.
    reward_memory = plan(reward, largest_micro_batch=False, timed=False).memory
    sft_memory = plan(sft, largest_micro_batch=False, timed=False).memory
    assert reward_memory.allocated_peak_bytes <= sft_memory.allocated_peak_bytes
    assert reward_memory.reserved_peak_bytes < sft_memory.reserved_peak_bytes


def test_reward_runs_at_stage_zero():
    request = _request("--objective", "reward", "--state-convention", "deepspeed", kind=StrategyKind.ddp)
    assert plan(request, largest_micro_batch=False, timed=False).memory.allocated_peak_bytes > 0


def test_reward_micro_batch_is_pairs():
    request = _request("--objective", "reward", rows=2, seq=2048)
    assert max_micro_batch_size(request) % 2 == 0
    with pytest.raises(ZeroplanError, match="--micro-batch"):
        _request("--objective", "reward", rows=3)


@pytest.mark.parametrize("flags, field", [
    (("--framework", "zeroplan"), "objective"),
    (("--keep-outputs",), "keep_outputs"),
    (("--lora-rank", "8"), "finetune"),
])
def test_reward_refusals_name_the_field(flags, field):
    with pytest.raises(ZeroplanError, match=field):
        plan(_request("--objective", "reward", *flags), largest_micro_batch=False, timed=False)


def test_reward_under_ddp_without_deepspeed_is_refused():
    with pytest.raises(ZeroplanError, match="objective"):
        plan(_request("--objective", "reward", kind=StrategyKind.ddp), largest_micro_batch=False, timed=False)


def test_reward_step_runs_a_v_head_not_the_vocabulary_projection():
    from zeroplan.core.flops import step_flops

    sft, reward = _request(), _request("--objective", "reward")
    tokens, h, v = 8 * 512, sft.model.hidden_size, sft.model.vocab_size
    # the forward: h x V against h x 1 per token, 2 FLOPs a multiply-add
    saved = step_flops(sft).forward_flops - step_flops(reward).forward_flops
    assert saved == pytest.approx(2 * h * (v - 1) * tokens)
