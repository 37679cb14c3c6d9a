"""The output projection's weight gradient while autograd builds it: summed over torchtune's loss
chunks (zeroplan.core.framework_loss.chunked_head_accumulation_tensors) and, tied to the
embedding under the optimizer in backward, held through every block's backward
(zeroplan.core.buffers.tied_head_gradient_in_backward_bytes); against torchtune's own model and
loss on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live_storages import live_storage_tracker
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import tied_head_gradient_in_backward_bytes
from zeroplan.core.framework_loss import chunked_head_accumulation_tensors, framework_logits_tensors
from zeroplan.specs import StrategyKind

LLAMA32_3B = str(Path(__file__).resolve().parents[1] / "benchmarks" / "published_memory" / "configs" / "llama-3.2-3b.json")
TT = "--gpus 1 --framework torchtune --precision bf16-pure --micro-batch 2 --seq-len 4096 --activation-checkpointing full"


def _request(flags: str, model: str = LLAMA32_3B):
    return request_from_args(build_parser().parse_args(["fit", model, *TT.split(), *flags.split()]), StrategyKind.ddp)


def test_chunked_head_accumulation_is_three_gradients_beside_the_chunks_left() -> None:
    request = _request("")
    head = 128256 * 3072 * 2
    chunk = 2 * 4096 * 128256 * 2 // 8
    (moment,) = chunked_head_accumulation_tensors(request)
    assert sorted(moment) == sorted((chunk,) * 6 + (head,) * 3)
    assert moment in framework_logits_tensors(request)
    # A frozen head (LoRA), one piece or the FSDP2-gathered head (counted there) have none.
    assert chunked_head_accumulation_tensors(_request("--lora-rank 8")) == ()
    assert chunked_head_accumulation_tensors(_request("--unchunked-loss")) == ()
    fsdp = request_from_args(build_parser().parse_args(["fit", LLAMA32_3B, *TT.replace("--gpus 1", "--gpus 8").split()]),
                             StrategyKind.fsdp_full_shard)
    assert chunked_head_accumulation_tensors(fsdp) == ()


def test_tied_head_gradient_is_held_only_under_the_optimizer_in_backward() -> None:
    assert tied_head_gradient_in_backward_bytes(_request("--optimizer-in-backward")) == 128256 * 3072 * 2
    assert tied_head_gradient_in_backward_bytes(_request("")) == 0
    assert tied_head_gradient_in_backward_bytes(_request("--optimizer-in-backward", "llama-3.1-8b")) == 0  # untied


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_torchtunes_chunked_head_and_tied_gradient_on_the_cpu(tied: bool) -> None:
    """torchtune's llama3_2 (tied or not) with CEWithChunkedOutputLoss, bf16, each parameter's
    gradient freed in its post-accumulate-grad hook as optimizer_in_bwd does: the most head-sized
    gradients and bf16 logit-chunk gradients alive together in backward are 3 and n - 2; at the
    first block's backward the tied model holds one head-sized gradient the untied one does not."""
    torch = pytest.importorskip("torch")
    llama3_2 = pytest.importorskip("torchtune.models.llama3_2").llama3_2
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    vocab, hidden, seq, batch, chunks = 8192, 96, 64, 2, 8
    head, chunk = vocab * hidden * 2, batch * seq // chunks * vocab * 2
    torch.manual_seed(0)
    model = llama3_2(vocab_size=vocab, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=hidden, max_seq_len=256,
                     intermediate_dim=128, tie_word_embeddings=tied).to(torch.bfloat16)
    model.set_num_output_chunks(chunks)
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    mode = live_storage_tracker({p.untyped_storage().data_ptr() for p in model.parameters()})
    most = [0, 0, 0]  # head-sized, logit-chunk gradients at the largest sum; head-sized at the first block's backward

    def probe() -> None:
        heads = sum(1 for n in mode.live.values() if n == head)
        logit_chunks = sum(1 for n in mode.live.values() if n == chunk)
        if heads * head + logit_chunks * chunk > most[0] * head + most[1] * chunk:
            most[:2] = heads, logit_chunks

    def first_block(*_):
        most[2] = sum(1 for n in mode.live.values() if n == head)

    model.layers[0].register_full_backward_pre_hook(first_block)
    tokens = torch.randint(0, vocab, (batch, seq))
    with mode:
        loss = CEWithChunkedOutputLoss(num_output_chunks=chunks)(model(tokens), tokens)
        mode.probe = probe
        loss.backward()
    assert most[:2] == [3, chunks - 2]
    assert most[2] == (1 if tied else 0)
