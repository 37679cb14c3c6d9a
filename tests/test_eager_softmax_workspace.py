"""transformers' eager attention under full recomputation, replayed tensor by tensor
(zeroplan.allocator.eager_softmax_workspace): the scores-sized tensors a checkpointed block's
forward and its backward make and free, in the order transformers' own LlamaDecoderLayer makes
and frees them on the CPU (plus the CUDA softmax backward's grad*output product)."""

from __future__ import annotations

import pytest

from zeroplan.allocator.eager_softmax_workspace import eager_softmax_workspace
from zeroplan.allocator.schedule import record_step, step_inputs
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.peak import peak_allocated_bytes
from zeroplan.core.plan import peak_terms
from zeroplan.presets.models import get_model
from zeroplan.specs.training import measured_on

COOKBOOK = ("llama-2-7b --gpus 4 --gpu a100-40gb --micro-batch 4 --seq-len 2048 --activation-checkpointing full "
            "--precision bf16-pure --framework hf --lora-rank 8 --lora-targets q,v --lora-dropout 0.05 "
            "--transformers-version 4.31 --attention eager")
SWIFT = ("qwen-7b --gpus 1 --gpu a100-80gb --micro-batch 1 --seq-len 2048 --grad-accum 16 --activation-checkpointing full "
         "--precision bf16-pure --framework hf --lora-rank 8 --lora-targets q,k,v --lora-dropout 0.05 --attention eager "
         "--transformers-version 4.36 --torch-release 2.1 --no-checkpoint-reentrant")

# In units of the scores' elements (bytes per score): bf16 QK^T, its scaling, the mask's sum, the
# softmax's fp32 copy of its input and its fp32 output, the bf16 cast of the probabilities.
FORWARD = [("+", 2), ("+", 2), ("-", 2), ("+", 2), ("-", 2), ("+", 4), ("+", 4), ("-", 4), ("+", 2), ("-", 2),
           ("-", 4), ("-", 2)]
# The rerun keeps the softmax's output and the cast; then softmax@V's gradient (bf16), its fp32
# cast, the softmax backward's output, CUDA's tmp = grad * output, the cast back, the scaling's.
RERUN = FORWARD[:10]
BACKWARD = [("+", 2), ("-", 2), ("+", 4), ("-", 2), ("+", 4), ("-", 4), ("-", 4), ("+", 2), ("-", 4), ("+", 2),
            ("-", 2), ("-", 2)]
CUDA_TMP = [("+", 4), ("-", 4)]


def _request(flags: str, strategy: str | None = None):
    args = build_parser().parse_args(["fit", *flags.split()])
    return request_from_args(args, strategy) if strategy else request_from_args(args)


def _scores_steps(steps: tuple[int, ...], scores: int) -> list[tuple[str, int]]:
    """The steps' scores-sized allocations and frees, in bytes per score; what is left alive
    at the end freed last (the schedule frees it with the block)."""
    sizes: list[int] = []
    alive: set[int] = set()
    out = []
    for step in steps:
        size = step if step > 0 else sizes[~step]
        if step > 0:
            sizes.append(step)
            alive.add(len(sizes) - 1)
        else:
            alive.discard(~step)
        if size % scores == 0 and size >= 2 * scores:
            out.append(("+" if step > 0 else "-", size // scores))
    return out + [("-", sizes[i] // scores) for i in sorted(alive) if sizes[i] % scores == 0 and sizes[i] >= 2 * scores]


def test_the_scores_tensors_in_their_order() -> None:
    request = _request(COOKBOOK, "fsdp-full-shard")
    _, terms = peak_terms(request)
    forward, backward = eager_softmax_workspace(request, terms.workspace)
    scores = 32 * 2048 * 2048 * 4
    assert _scores_steps(forward, scores) == FORWARD
    # The rerun's softmax output and cast stay to the backward; the probabilities' cast goes
    # after softmax@V's backward, the output after the softmax's.
    rerun = _scores_steps(backward, scores)
    assert rerun[:10] == RERUN
    assert rerun[10:] == BACKWARD[:5] + CUDA_TMP + BACKWARD[5:]


def test_the_steps_reach_the_workspace_and_no_more() -> None:
    request = _request(COOKBOOK, "fsdp-full-shard")
    _, terms = peak_terms(request)
    alive = peak = 0
    sizes: list[int] = []
    for step in eager_softmax_workspace(request, terms.workspace)[1]:
        if step > 0:
            sizes.append(step)
        alive += step if step > 0 else -sizes[~step]
        peak = max(peak, alive)
    assert peak == terms.workspace


def test_the_trace_peak_stays_the_planners() -> None:
    request = _request(SWIFT, "ddp")
    states, terms = peak_terms(request)
    inputs = step_inputs(request, states, terms)
    assert inputs.workspace_steps and inputs.block_forward_steps
    assert record_step(inputs).requested_peak_bytes == peak_allocated_bytes(states, terms, request.batch.grad_accum_steps)[0]


def test_one_tensor_elsewhere() -> None:
    assert eager_softmax_workspace(_request(COOKBOOK.replace(" --attention eager", ""), "fsdp-full-shard"), 1 << 40) == ((), ())
    no_recompute = _request(COOKBOOK.replace("--activation-checkpointing full", "--activation-checkpointing none"),
                            "fsdp-full-shard")
    assert eager_softmax_workspace(no_recompute, 1 << 40) == ((), ())


@pytest.mark.slow
def test_transformers_llama_block_makes_and_frees_them_so() -> None:
    """transformers' own LlamaDecoderLayer (eager, bf16, CPU) under torch's non-reentrant
    checkpoint: every storage of at least the bf16 scores' size an operator makes, and when it
    goes (weak references polled after each operator), is FORWARD then RERUN and BACKWARD (the
    CPU softmax backward makes no grad*output product)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    h, heads, ffn, s, b = 64, 4, 96, 256, 1
    scores = heads * s * s * b
    config = LlamaConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=ffn,
                         num_hidden_layers=1, vocab_size=64, attention_dropout=0.0)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16).train()
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(s)[None].expand(b, s))
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None].to(torch.bfloat16)

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[StorageWeakRef, int]] = {}
            self.events: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key, (ref, n) in list(self.live.items()):
                if ref.expired():
                    self.events.append(("-", n // scores))
                    del self.live[key]
            for tensor in torch.utils._pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    key = storage.data_ptr()
                    if storage.nbytes() >= 2 * scores and (key not in self.live or self.live[key][0].expired()):
                        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                        self.events.append(("+", storage.nbytes() // scores))
            return out

    def block(t):
        out = layer(t, attention_mask=mask, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    mode = Log()
    with mode:
        y = checkpoint(block, x, use_reentrant=False)
        y.backward(torch.randn_like(y))
        torch.zeros(1)
    assert mode.events == FORWARD + RERUN + BACKWARD

    # The planner's steps for the same block say the same, with CUDA's product.
    model = get_model("llama-2-7b").model_copy(update={
        "hidden_size": h, "num_heads": heads, "num_kv_heads": heads, "head_dim": None, "num_layers": 1,
        "ffn_hidden_size": ffn})
    request = _request(f"llama-2-7b --gpus 2 --precision bf16-pure --activation-checkpointing full --framework hf "
                       f"--attention eager --seq-len {s} --micro-batch {b}", "fsdp-full-shard")
    request = request.model_copy(update={"model": model, "training": measured_on(request.training, "cpu")})
    _, terms = peak_terms(request)
    forward, backward = eager_softmax_workspace(request, terms.workspace)
    rerun = _scores_steps(backward, scores)
    assert _scores_steps(forward, scores) == FORWARD
    assert rerun[:10] + rerun[10:15] + rerun[17:] == RERUN + BACKWARD and rerun[15:17] == CUDA_TMP
