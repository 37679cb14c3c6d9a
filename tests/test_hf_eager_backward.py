"""transformers' eager softmax backward on CUDA (zeroplan.core.hf_eager_backward): the scores'
gradients and the kernel's `grad * output` product beside the block's backward, against what is
alive when transformers' own LlamaDecoderLayer reaches _softmax_backward_data on the CPU."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.activations import backward_workspace_bytes
from zeroplan.core.frameworks import framework_layer_bytes
from zeroplan.core.hf_eager_backward import (
    freed_before_softmax_backward_bytes, softmax_backward_extra_bytes, softmax_backward_gradient_bytes,
    softmax_element_bytes,
)
from zeroplan.core.peak import peak_allocated_bytes
from zeroplan.core.plan import peak_terms
from zeroplan.presets.models import get_model
from zeroplan.results import PeakMoment
from zeroplan.specs.training import measured_on

GIB = 2**30
COOKBOOK = ("llama-2-7b --gpus 4 --gpu a100-40gb --micro-batch 4 --seq-len 2048 --activation-checkpointing full "
            "--precision bf16-pure --framework hf --lora-rank 8 --lora-targets q,v --lora-dropout 0.05 "
            "--transformers-version 4.31")


def _request(flags: str, strategy: str | None = None):
    args = build_parser().parse_args(["fit", *flags.split()])
    return request_from_args(args, strategy) if strategy else request_from_args(args)


def test_bf16_scores_gradients_are_three_fp32_tensors() -> None:
    # Llama-2-7B, 4 x 2048, 32 heads: the fp32 gradient of the probabilities, the CUDA kernel's
    # product and the gradient it writes (fp32: the bf16 input was converted before the softmax).
    request = _request(COOKBOOK + " --attention eager", "fsdp-full-shard")
    scores = 32 * 2048 * 2048 * 4
    assert softmax_backward_gradient_bytes(request) == 3 * 4 * scores
    # Freed by then: the bf16 probabilities softmax@V kept, V, and what the block saved after
    # the attention (the MLP norm, the SiLU MLP's tensors; LoRA freezes o, gate, up and down,
    # which then keep no input, and the MLP norm's frozen weight leaves its fp32 input). o's
    # input is kept by nothing under eager attention with o frozen
    # (zeroplan.core.finetune.activations.input_kept_anyway), so it is not freed here either.
    sbh, sbf = 4 * 2048 * 4096, 4 * 2048 * 11008
    freed = 2 * scores + 2 * sbh + 4 * sbh + 2 * 3 * sbf
    assert freed_before_softmax_backward_bytes(request) == freed
    assert softmax_backward_extra_bytes(request) == 12 * scores - freed


def test_fp16_writes_the_input_gradient_in_fp16_and_fp32_frees_no_probabilities() -> None:
    fp16 = _request(COOKBOOK.replace("bf16-pure", "fp16-mixed") + " --attention eager", "fsdp-full-shard")
    scores = 32 * 2048 * 2048 * 4
    assert softmax_backward_gradient_bytes(fp16) == (4 + 4 + 2) * scores
    fp32 = _request(COOKBOOK.replace("bf16-pure", "fp32") + " --attention eager", "fsdp-full-shard")
    assert softmax_element_bytes(fp32) == 4
    assert softmax_backward_gradient_bytes(fp32) == 12 * scores


def test_nothing_outside_hf_eager() -> None:
    assert softmax_backward_extra_bytes(_request(COOKBOOK, "fsdp-full-shard")) == 0  # SDPA
    torchtune = COOKBOOK.replace("--framework hf", "--framework torchtune").replace(" --transformers-version 4.31", "")
    assert softmax_backward_extra_bytes(_request(torchtune + " --attention eager", "fsdp-full-shard")) == 0


def test_the_block_backward_moment_carries_it() -> None:
    """The cookbook's PR 41 run (llama-recipes, transformers 4.31's eager LlamaAttention): the
    softmax's backward, not the loss's, sets the allocated peak once its gradients are counted."""
    eager, moment = peak_allocated_bytes(*peak_terms(_request(COOKBOOK + " --attention eager", "fsdp-full-shard")), 1)
    assert moment is PeakMoment.block_backward
    sdpa, _ = peak_allocated_bytes(*peak_terms(_request(COOKBOOK, "fsdp-full-shard")), 1)
    assert eager > sdpa + 4 * GIB


@pytest.mark.slow
@pytest.mark.parametrize(("kv_heads", "lora", "recompute"), [
    (4, "", False), (2, "", True), (4, "q,v", True), (2, "q,k,v,o,gate,up,down", True)])
def test_alive_at_softmax_backward_in_transformers_llama_block(kv_heads: int, lora: str, recompute: bool) -> None:
    """transformers' own LlamaDecoderLayer (eager, bf16, CPU), under torch's non-reentrant
    checkpoint or not, with peft's LoRA or not: every storage an operator made and that is alive
    once _softmax_backward_data has returned (weak references to the storages; the parameters'
    gradients, the block's output, which the next block keeps as its input, and RoPE's constants
    left out) is the planner's block (framework_layer_bytes) with its two residual-stream
    gradients (backward_workspace_bytes) plus softmax_backward_gradient_bytes less
    freed_before_softmax_backward_bytes, but for the CUDA kernel's product, which the CPU kernel
    does not make, and the norm's fp32 per-token rsqrt, a statistic the planner leaves out."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    h, heads, ffn, s, b, rank = 192, 4, 256, 80, 2, 8
    config = LlamaConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=ffn, num_hidden_layers=1, vocab_size=64, attention_dropout=0.0)
    config._attn_implementation = "eager"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16).train()
    flags = f"--framework hf --attention eager --seq-len {s} --micro-batch {b}"
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                 "down": "down_proj"}
        layer = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.05,
                                                   target_modules=[names[t] for t in lora.split(",")]), layer)
        layer = layer.to(torch.bfloat16)
        for name, parameter in layer.named_parameters():
            parameter.requires_grad_("lora_" in name)
        flags += f" --lora-rank {rank} --lora-targets {lora} --lora-dropout 0.05 --base-dtype bf16"
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(s)[None].expand(b, s))
    grad = torch.randn(b, s, h, dtype=torch.bfloat16)
    parameters = list(layer.parameters())
    outside = {t.untyped_storage().data_ptr() for t in (x, cos, sin, grad, *parameters)}

    class Alive(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
            self.at_softmax_backward: int | None = None

        def alive(self) -> int:
            grads = {p.grad.untyped_storage().data_ptr() for p in parameters if p.grad is not None}
            return sum(n for key, (ref, n) in self.storages.items() if not ref.expired() and key not in grads)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    key = storage.data_ptr()
                    # A freed storage's address is reused: a new storage there replaces it.
                    if key not in outside and (key not in self.storages or self.storages[key][0].expired()):
                        self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
            if func is torch.ops.aten._softmax_backward_data.default:
                self.at_softmax_backward = self.alive()
            return out

    def block(t):
        out = layer(t, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    mode = Alive()
    with mode:
        y = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        mode.storages.pop(y.untyped_storage().data_ptr())
        y.backward(grad)

    model = get_model("llama-2-7b").model_copy(update={
        "hidden_size": h, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": None, "num_layers": 1,
        "ffn_hidden_size": ffn})
    # Under FSDP the adapters compute in bf16 as this block's do (zeroplan.core.finetune.activations.
    # adapters_copy_their_input: under the Trainer's DDP each makes an fp32 copy of its input).
    request = _request(f"llama-2-7b --gpus 2 --precision bf16-pure --activation-checkpointing full {flags}",
                       "fsdp-full-shard")
    request = request.model_copy(update={"model": model, "training": measured_on(request.training, "cpu")})
    cuda_product = softmax_element_bytes(request) * heads * s * s * b
    rsqrt = 4 * s * b
    planned = (framework_layer_bytes(request) + backward_workspace_bytes(model, request.training, s, b)
               + softmax_backward_gradient_bytes(request) - freed_before_softmax_backward_bytes(request))
    assert mode.at_softmax_backward == planned - cuda_product + rsqrt
