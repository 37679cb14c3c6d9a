"""transformers 4.38.x's b x 1 x P x P causal mask and its P x P boolean buffer
(zeroplan.core.transformers_release.POSITIONS_MASK_RELEASES): which releases, families,
attention kernels and checkpoints plan it, its dtype and size, and the planner against the
record of 4.38.2's own LlamaForCausalLM on the CPU (benchmarks/transformers438-causal-mask-records.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import resident_buffer_bytes
from zeroplan.core.hf_padding_mask import padding_mask_extra_bytes
from zeroplan.core.frameworks import framework_activation_bytes, framework_recompute_bytes, positions_causal_mask_bytes
from zeroplan.core.transformers_release import positions_mask_buffer_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import parse_hf_config
from zeroplan.presets.models import get_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from transformers438_causal_mask import BATCHES, planned_peaks  # noqa: E402

RECORD = json.loads((ROOT / "benchmarks" / "transformers438-causal-mask-records.json").read_text())
MIB = 2**20
# Llama-2-7B (P 4096) LoRA, pure bf16, fully checkpointed, as fsdp_qlora's rows.
BASE = ("--framework hf --gpus 1 --gpu a100-80gb --micro-batch 3 --seq-len 1024 --precision bf16-pure "
        "--activation-checkpointing full --lora-rank 8")


def _request(flags: str, model: str = "llama-2-7b"):
    return request_from_args(build_parser().parse_args(["fit", model, *flags.split()]))


def _mask(flags: str, model: str = "llama-2-7b") -> int:
    return positions_causal_mask_bytes(_request(flags, model))


def test_only_the_4_38_releases_build_it() -> None:
    for version in ("4.38.0", "4.38.1", "4.38.2"):
        assert _mask(f"{BASE} --transformers-version {version}") == 2 * 3 * 4096 * 4096
    for version in ("4.37.2", "4.39.0", "4.40.0"):
        assert _mask(f"{BASE} --transformers-version {version}") == 0
    # No release named: the profile's own 4.56.2.
    assert _mask(BASE) == 0


def test_eager_and_sdpa_both_build_it_and_only_checkpointing_holds_it() -> None:
    flags = f"{BASE} --transformers-version 4.38.2"
    assert _mask(flags + " --attention eager") == _mask(flags) > 0
    assert _mask(flags.replace("full", "none")) == 0


def test_llama_and_gemma_code_build_it_mistral_and_qwen2_do_not() -> None:
    flags = f"{BASE} --transformers-version 4.38.2"
    assert get_model("llama-2-7b").positions_causal_mask and get_model("yi-34b").positions_causal_mask
    assert not get_model("mistral-7b").positions_causal_mask and not get_model("mixtral-8x7b").positions_causal_mask
    assert _mask(flags, "mistral-7b") == 0
    fixtures = ROOT / "tests" / "fixtures" / "hf"
    gemma = parse_hf_config(json.loads((fixtures / "gemma-7b.json").read_text()), "gemma-7b")
    qwen2 = parse_hf_config(json.loads((fixtures / "qwen2.5-7b.json").read_text()), "qwen2.5-7b")
    assert gemma.positions_causal_mask and gemma.max_positions == 8192
    assert not qwen2.positions_causal_mask
    assert not get_model("gemma-2-9b").positions_causal_mask


def test_its_dtype_is_the_embeddings_and_its_side_doubles_once() -> None:
    flags = f"{BASE} --transformers-version 4.38.2"
    # DDP under autocast: the fp32 module's embeddings are fp32.
    assert _mask(flags.replace("bf16-pure", "bf16-mixed").replace("--lora-rank 8", "")) == 4 * 3 * 4096 * 4096
    assert _mask(flags.replace("1024", "6000") + " --allow-longer-seq") == 2 * 3 * 8192 * 8192
    with pytest.raises(ZeroplanError, match="batch.seq_len"):
        _mask(flags.replace("1024", "8193") + " --allow-longer-seq")


def test_the_mask_is_kept_through_backward_and_the_buffer_once() -> None:
    old, new = _request(f"{BASE} --transformers-version 4.38.2"), _request(f"{BASE} --transformers-version 4.39.0")
    mask = positions_causal_mask_bytes(old)
    # Kept: the mask; the recomputed block keeps its SDPA's b x 1 x s x s copy of it (padding_mask_extra_bytes).
    copy = padding_mask_extra_bytes(old)
    assert copy == 2 * 3 * 1024 * 1024 and padding_mask_extra_bytes(new) == 0
    assert framework_activation_bytes(old) - framework_activation_bytes(new) == mask + copy
    assert framework_recompute_bytes(old) - framework_recompute_bytes(new) == copy
    assert positions_mask_buffer_bytes(old.model, old.training) == 4096 * 4096
    assert resident_buffer_bytes(old) - resident_buffer_bytes(new) == 4096 * 4096


def test_the_record_says_checkpoints_hold_it_until_backward() -> None:
    assert RECORD["transformers"] == "4.38.2"
    for row in RECORD["mask_lifetimes"]:
        assert row["mask_dtype"] == "torch.bfloat16" and row["mask_shape"] == [2, 1, 16, 16]
        assert row["alive_after_forward"] == (row["checkpoint"] != "none")
        assert not row["alive_after_backward"]


# The record's peaks against the planner's for the same shapes: what a sample adds agrees within
# 1 MiB (0.6 MiB under at 512 tokens, 0.4 at 256, where the mask alone is 8 to 32 MiB), and the
# level at each micro-batch within 2 MiB.
@pytest.mark.parametrize("shape", RECORD["shapes"], ids=lambda shape: f"s{shape['seq_len']}-P{shape['max_position_embeddings']}")
def test_the_planner_against_the_record(shape: dict) -> None:
    measured = {int(b): peak for b, peak in shape["peak_bytes_by_micro_batch"].items()}
    planned = planned_peaks(shape["seq_len"], shape["max_position_embeddings"])
    for low, high in zip(BATCHES, BATCHES[1:]):
        assert abs((measured[high] - measured[low]) - (planned[high] - planned[low])) < MIB
    for b in BATCHES:
        assert abs(measured[b] - planned[b]) < 2 * MIB


def test_explain_names_the_mask_where_the_activations_hold_it() -> None:
    from zeroplan.core.plan import fit
    from zeroplan.report.explain import render_explain

    flags = f"{BASE} --transformers-version 4.38.2"
    held = render_explain(fit(_request(flags)), "ddp", width=400)
    assert "3 x 1 x 4096 x 4096 causal mask held through backward" in held
    for other in (flags.replace("4.38.2", "4.39.0"), flags.replace("full", "none")):
        assert "causal mask" not in render_explain(fit(_request(other)), "ddp", width=400)


def test_each_sdpa_layer_keeps_its_own_copy_as_the_record_says() -> None:
    rows = {row["attention"]: row for row in RECORD["saved_layer_masks"]}
    flags = "--framework hf --gpus 1 --gpu a100-80gb --micro-batch 2 --seq-len 32 --precision bf16-pure --activation-checkpointing none"
    for attention, kernel in (("sdpa", "flash"), ("eager", "eager")):
        row = rows[attention]
        assert (row["micro_batch"], row["seq_len"]) == (2, 32)
        planned = padding_mask_extra_bytes(_request(f"{flags} --attention {kernel} --transformers-version 4.38.2"))
        assert row["layers"] * planned == row["distinct_storage_bytes"]
    assert rows["sdpa"]["distinct_storage_bytes"] > 0 and rows["sdpa"]["distinct_storages"] == rows["sdpa"]["layers"]
    assert padding_mask_extra_bytes(_request(f"{flags} --transformers-version 4.39.0")) == 0
    assert padding_mask_extra_bytes(_request(f"{flags} --transformers-version 4.38.2", "mistral-7b")) == 0
