"""OPT's own attention and loss before transformers 4.49 (zeroplan.core.transformers_release.
OPT_OWN_FORWARD_UNTIL: the clamp's kept scores, the fp16-only softmax upcast, the compute-dtype
loss) and DeepSpeed 0.13.3's ZeRO-2 bucket held from the start of backward
(zeroplan.core.buffers.deepspeed_bucket_from_backward_start)."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import backward_held_buffer_bytes, transient_buffer_bytes
from zeroplan.core.framework_loss import framework_logits_tensors
from zeroplan.core.frameworks import eager_attention_extra_bytes
from zeroplan.core.kv_cache import kept_outputs_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.specs import StrategyKind

OPT = ("tests/fixtures/hf/opt-1.3b.json --framework hf --attention eager --gpus 16 --gpus-per-node 8 "
       "--micro-batch 8 --seq-len 512 --activation-checkpointing none")
S, B, V = 512, 8, 50272
SCORES = 32 * S * S * B


def _request(flags: str, kind: StrategyKind = StrategyKind.zero2):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]), kind)


@pytest.mark.parametrize(("flags", "per_score"), [
    ("--precision fp16-mixed", 4),  # 4.56.2: the fp32 softmax output
    ("--precision fp16-mixed --transformers-version 4.49.0", 4),
    ("--precision fp16-mixed --transformers-version 4.31.0", 4 + 2),  # and the clamp's fp16 input
    ("--precision fp16-mixed --transformers-version 4.48", 4 + 2),
    ("--precision bf16-mixed --transformers-version 4.31.0", 2),  # no upcast outside fp16; the clamp's bf16 input
    ("--precision bf16-mixed", 4),
])
def test_opt_eager_attention_keeps_the_clamp_input_before_4_49(flags: str, per_score: int) -> None:
    assert eager_attention_extra_bytes(_request(f"{OPT} {flags}")) == per_score * SCORES


def test_opt_loss_before_4_49_runs_in_the_compute_dtype() -> None:
    old = _request(f"{OPT} --precision fp16-mixed --transformers-version 4.31.0 --keep-outputs")
    shifted = 2 * B * (S - 1) * V
    forward, backward, slice_backward = framework_logits_tensors(old)
    assert forward == (2 * S * B * V, shifted, shifted)
    assert backward == (shifted, shifted, shifted)
    # The slice's backward: the shifted rows' gradient beside the zeroed one of all rows.
    assert slice_backward == (shifted, 2 * S * B * V)
    assert kept_outputs_bytes(old) == 2 * S * B * V  # lm_head's fp16 logits, not fp32 as Llama's before 4.46
    new = _request(f"{OPT} --precision fp16-mixed --transformers-version 4.49.0")
    assert framework_logits_tensors(new)[-1] == (4 * S * B * V,) * 3


def test_opt_loss_under_the_trainers_bf16_autocast_is_cudas_order() -> None:
    """An fp32 OPT under HF's Trainer in bf16 runs its own loss inside accelerate's autocast: on
    CUDA the log-softmax stays bf16 and nll_loss keeps an fp32 copy (zeroplan.core.own_loss), and
    accelerate returns an fp32 copy of the logits, not the three bf16 tensors of a bf16 module."""
    shifted = B * (S - 1) * V
    under = _request(f"{OPT} --precision bf16-mixed --transformers-version 4.31.0", StrategyKind.ddp)
    assert framework_logits_tensors(under) == (
        (2 * S * B * V, 2 * shifted, 2 * shifted, 4 * shifted),
        (2 * S * B * V, 2 * shifted, 4 * shifted, 4 * S * B * V),
        (2 * shifted, 4 * shifted, 4 * shifted),
    )
    # A bf16 module (no fp32 parameters to autocast) keeps the compute-dtype order.
    pure = _request(f"{OPT} --precision bf16-pure --transformers-version 4.31.0", StrategyKind.ddp)
    assert framework_logits_tensors(pure)[1] == (2 * shifted,) * 3


def test_other_non_llama_models_stay_refused_before_4_46() -> None:
    with pytest.raises(ZeroplanError, match=r"^transformers_version: 4.40 is modelled before 4.46 only for the Llama family"):
        _request("gpt2-xl --framework hf --gpus 1 --gpu a100-80gb --seq-len 1024 --transformers-version 4.40")
    assert _request(f"{OPT} --transformers-version 4.40").training.transformers_version == "4.40"


def test_deepspeed_0_13_3_holds_the_zero2_bucket_from_the_start_of_backward() -> None:
    bucket = 500_000_000 * 2  # reduce_bucket_size 5e8 in fp16
    old = _request(f"{OPT} --precision fp16-mixed --deepspeed-release 0.13.3")
    new = _request(f"{OPT} --precision fp16-mixed")
    assert backward_held_buffer_bytes(old) == bucket and transient_buffer_bytes(old) == 0
    assert backward_held_buffer_bytes(new) == 0 and transient_buffer_bytes(new) == bucket
    # ZeRO-3's bucket is resident in both (stage3.py __init__): not this rule.
    assert backward_held_buffer_bytes(_request(f"{OPT} --precision fp16-mixed --deepspeed-release 0.13.3",
                                               StrategyKind.zero3)) == 0
