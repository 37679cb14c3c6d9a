"""What torchtune's OffloadActivations leaves on the device at the end of the forward, where the
loss's backward finds it (zeroplan.core.frameworks.offload_forward_stash_bytes and
offloaded_head_input_bytes): the planner's rule, and the same against torchtune's own llama3_2 and
lora_llama3_2 with its offloading and checkpointing on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live_storages import live_storage_tracker
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.frameworks import offload_forward_stash_bytes, offloaded_head_input_bytes
from zeroplan.specs import StrategyKind

LLAMA32_3B = str(Path(__file__).resolve().parents[1] / "benchmarks" / "published_memory" / "configs" / "llama-3.2-3b.json")
TT = ("--gpus 1 --framework torchtune --precision bf16-pure --micro-batch 2 --seq-len 4096 --activation-checkpointing full"
      " --activation-offloading --compile")


def _request(flags: str = ""):
    return request_from_args(build_parser().parse_args(["fit", LLAMA32_3B, *TT.split(), *flags.split()]), StrategyKind.ddp)


def test_a_trainable_final_norm_releases_every_block_input_and_a_frozen_one_keeps_the_last() -> None:
    sb, h = 2 * 4096, 3072
    x_fp32, rsqrt, block_input = 4 * sb * h, 4 * sb, 2 * sb * h
    # Full fine-tune: the fp32 input, its fp32 normalised product and the rsqrt; the head's input.
    assert offload_forward_stash_bytes(_request()) == 2 * x_fp32 + rsqrt
    assert offloaded_head_input_bytes(_request()) == block_input
    # LoRA and QLoRA (scale and head frozen): the last block's input, the fp32 input, the rsqrt.
    for flags in ("--lora-rank 64", "--lora-rank 64 --quantize nf4"):
        assert offload_forward_stash_bytes(_request(flags)) == block_input + x_fp32 + rsqrt
        assert offloaded_head_input_bytes(_request(flags)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_torchtunes_forward_stash_on_the_cpu(lora: bool) -> None:
    """torchtune 0.6.1's llama3_2 / lora_llama3_2 (tied head, 8 loss chunks), bf16, its
    checkpointing and get_act_offloading_ctx_manager: the storages made in the forward and still
    on the device after it, beside the logit chunks and the host copies, are the planner's stash
    and head input, to the byte."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtune")

    from torchtune import modules, training
    from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
    from torchtune.modules.peft import get_adapter_params, set_trainable_params
    from torchtune.training._activation_offloading import get_act_offloading_ctx_manager

    from zeroplan.frameworks._cuda_streams import host_cuda_streams

    vocab, hidden, seq, batch = 512, 64, 256, 2  # every block input and rsqrt >= min_offload_size
    shape = dict(vocab_size=vocab, num_layers=8, num_heads=4, num_kv_heads=2, embed_dim=hidden, max_seq_len=512,
                 intermediate_dim=128)
    torch.manual_seed(0)
    if lora:
        model = lora_llama3_2(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                              lora_rank=8, lora_alpha=16, **shape)
        set_trainable_params(model, get_adapter_params(model))
    else:
        model = llama3_2(**shape)
    model = model.to(torch.bfloat16)
    model.set_num_output_chunks(8)
    training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    with host_cuda_streams():  # OffloadActivations' CUDA stream calls, ordering nothing on the CPU
        offload = get_act_offloading_ctx_manager(model, True)
    offload.use_pin_memory = False
    before = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    mode = live_storage_tracker(before)

    tokens = torch.randint(0, vocab, (batch, seq))
    with mode, host_cuda_streams():
        with offload:
            logits = model(tokens)
        host = {t.untyped_storage().data_ptr() for t, offloaded in offload.tracker.values() if offloaded}
        chunks = {c.untyped_storage().data_ptr() for c in logits}
        device = sum(n for key, n in mode.live.items() if key not in host and key not in chunks)

    request = _request("--lora-rank 8" if lora else "")
    request = request.model_copy(update={
        "model": request.model.model_copy(update={"hidden_size": hidden}),
        "batch": request.batch.model_copy(update={"seq_len": seq, "micro_batch_size": batch}),
    })
    assert device == offload_forward_stash_bytes(request) + offloaded_head_input_bytes(request)
