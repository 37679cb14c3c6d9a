"""What transformers' own modules keep for backward where the hf profile's block terms depended on
the model's code: the GELU forms of ACT2FN (zeroplan.core.hf_activation), the one normed tensor
a parallel block's attention and MLP both read, and the eager attention's output, which nothing
but the output projection keeps (zeroplan.core.finetune.activations). Measured with saved-tensor
hooks on transformers 4.56.2 and peft 0.17.1 on the CPU: every storage autograd keeps, by
storage, parameters and buffers left out, and the constants the block is handed (RoPE's cos and
sin, Bloom's ALiBi bias), which the planner leaves out too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zeroplan.core.frameworks import framework_layer_bytes
from zeroplan.core.hf_activation import gelu_extra_bytes, gelu_saved_bytes_per_element
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import parse_hf_config
from zeroplan.specs import BatchSpec, FineTuneSpec, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import LoraTarget
from zeroplan.specs.model import EagerSoftmax, GeluForm
from zeroplan.specs.training import Kernels, Precision

S, B, RANK = 16, 2, 8
ROWS, WIDTH = 4, 8


def _saved(torch, call) -> dict[int, tuple[int, object]]:
    saved: dict[int, tuple[int, object]] = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = (tensor.untyped_storage().nbytes(), tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return saved


@pytest.mark.parametrize("form", list(GeluForm))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_gelu_form_keeps_what_is_planned(form: GeluForm, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    from transformers.activations import ACT2FN

    x = torch.randn(ROWS, WIDTH, dtype=getattr(torch, dtype), requires_grad=True)
    fc1_output = x * 1  # a non-leaf input, as the first linear's output is
    saved = _saved(torch, lambda: ACT2FN[form.value](fc1_output))
    e = fc1_output.element_size()
    assert sum(n for n, _ in saved.values()) == gelu_saved_bytes_per_element(form, e, fp32_pow=False) * ROWS * WIDTH


def _cuda_fp32_ops() -> set[str]:
    """The op names of AT_FORALL_FP32, CUDA autocast's run-in-fp32 list, in the installed torch."""
    torch = pytest.importorskip("torch")
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("torch's headers are not installed")
    block = re.search(r"#define AT_FORALL_FP32\(_\)(.*?)\n\n", header.read_text(), re.S)
    assert block is not None
    return set(re.findall(r"_\((\w+)", block.group(1)))


@pytest.mark.parametrize("form", [GeluForm.gelu_new, GeluForm.gelu_accurate])
def test_cuda_autocast_keeps_the_tanh_forms_in_fp32(form: GeluForm) -> None:
    # CUDA autocast casts pow's input to fp32 and leaves tanh and the arithmetic to type
    # promotion (the installed header's list); on the CPU the same casts are applied by hand.
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode
    from transformers.activations import ACT2FN

    fp32_ops = _cuda_fp32_ops()
    assert "pow" in fp32_ops and not {"tanh", "erf", "mul", "add"} & fp32_ops

    class CudaAutocastPow(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.pow and args[0].dtype == torch.bfloat16:
                args = (args[0].float(), *args[1:])
            return func(*args, **(kwargs or {}))

    x = torch.randn(ROWS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    fc1_output = x * 1
    with CudaAutocastPow():
        saved = _saved(torch, lambda: ACT2FN[form.value](fc1_output))
    assert sorted(str(d) for _, d in saved.values()).count("torch.float32") == 3
    assert sum(n for n, _ in saved.values()) == gelu_saved_bytes_per_element(form, 2, fp32_pow=True) * ROWS * WIDTH


def _training(precision: str, **changes) -> TrainingSpec:
    return TrainingSpec(framework="hf", precision=precision, kernels=Kernels.cuda, **changes)


def test_only_the_hf_profile_and_cuda_autocast_change_the_plan() -> None:
    spec = parse_hf_config({"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4,
                            "n_positions": 64}, "gpt2")
    assert spec.gelu_form is GeluForm.gelu_new  # GPT2Config's default activation_function
    f_elements = S * B * spec.ffn_hidden_size
    assert gelu_extra_bytes(spec, _training("bf16-pure"), S, B) == 3 * 2 * f_elements
    assert gelu_extra_bytes(spec, _training("bf16-mixed"), S, B, autocast=True) == (3 * 4 + 2 - 2) * f_elements
    cpu = TrainingSpec(framework="hf", precision="bf16-mixed", kernels=Kernels.cpu)
    assert gelu_extra_bytes(spec, cpu, S, B, autocast=True) == 3 * 2 * f_elements
    assert gelu_extra_bytes(spec, TrainingSpec(framework="litgpt", precision="bf16-pure"), S, B) == 0
    plain = spec.model_copy(update={"gelu_form": GeluForm.gelu_pytorch_tanh})
    assert gelu_extra_bytes(plain, _training("bf16-pure"), S, B) == 0


@pytest.mark.parametrize("raw,key", [
    ({"model_type": "gpt2", "activation_function": "relu"}, "config.activation_function"),
    ({"model_type": "phi", "hidden_act": "silu"}, "config.hidden_act"),
])
def test_an_activation_outside_the_gelu_forms_is_refused(raw: dict, key: str) -> None:
    base = {"vocab_size": 128, "hidden_size": 64, "n_embd": 64, "num_hidden_layers": 2, "n_layer": 2,
            "num_attention_heads": 4, "n_head": 4, "intermediate_size": 256, "max_position_embeddings": 64,
            "n_positions": 64}
    with pytest.raises(ZeroplanError) as error:
        parse_hf_config({**base, **raw}, "x")
    assert error.value.field == key and "allowed" in str(error.value) and "\n" not in str(error.value)


def test_a_gelu_form_needs_a_gelu_mlp() -> None:
    spec = parse_hf_config({"model_type": "phi", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 256, "max_position_embeddings": 64}, "phi")
    with pytest.raises(ZeroplanError, match="model.gelu_form"):
        type(spec).model_validate({**spec.model_dump(), "mlp": "swiglu"})


PHI = {"model_type": "phi", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "intermediate_size": 256, "max_position_embeddings": 64, "partial_rotary_factor": 0.5,
       "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}
BLOOM = {"model_type": "bloom", "vocab_size": 128, "hidden_size": 64, "n_layer": 2, "n_head": 4,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}
PEFT_NAMES = {"phi": {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "dense"},
              "bloom": {"q": "query_key_value", "k": "query_key_value", "v": "query_key_value", "o": "dense"}}


def _block_saved_bytes(raw: dict, attention: str, dtype: str, targets: tuple[str, ...], dropout: float) -> int:
    """Bytes the second block keeps in a training forward of the tiny model under peft's LoRA
    (``targets``; none: a full fine-tune)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if targets:
        names = sorted({PEFT_NAMES[raw["model_type"]][t] for t in targets})
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=dropout,
                                                           target_modules=names))
    model.train()
    layer = [m for name, m in model.named_modules() if re.search(r"\.(layers|h)\.1$", name)][0]
    return _layer_saved_bytes(torch, model, layer, raw["vocab_size"])


def _layer_saved_bytes(torch, model, layer, vocab_size: int) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the storages autograd saves while ``layer`` runs in one training forward of
    ``model``: not the model's parameters and buffers, nor what the layer is handed."""
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    inside = [False]

    def enter(_module, args, kwargs):
        # The constants the block is handed (cos/sin, ALiBi, the mask) are not its own.
        handed = [*args[1:], *kwargs.values()]
        flat = [t for item in handed for t in (item if isinstance(item, tuple) else (item,))]
        held.update(t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor))
        inside[0] = True

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    saved: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if inside[0] and pointer not in held:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(0, vocab_size, (B, S))).logits.float().sum()
    return sum(saved.values())


def _request(raw: dict, attention: str, precision: str, targets: tuple[str, ...], dropout: float) -> PlanRequest:
    finetune = (FineTuneSpec(lora_rank=RANK, lora_targets=tuple(LoraTarget(t) for t in targets), lora_dropout=dropout)
                if targets else FineTuneSpec())
    training = TrainingSpec(framework="hf", precision=precision, kernels=Kernels.cpu, finetune=finetune,
                            attention_kernel="eager" if attention == "eager" else "flash")
    return PlanRequest(model=parse_hf_config(raw, raw["model_type"]), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1),
                       strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=S, micro_batch_size=B), training=training)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("targets,dropout", [((), 0.0), (("q", "k", "v", "o"), 0.0), (("q", "v"), 0.0),
                                             (("q", "k", "v", "o"), 0.1)])
def test_a_phi_block_keeps_what_the_hf_plan_counts(attention: str, targets: tuple, dropout: float) -> None:
    # Phi's gelu_new MLP (3 f-wide tensors beside F.gelu's input), its one input_layernorm read by
    # q/k/v and fc1 alike (subtracted once under LoRA), and under eager attention the output o
    # reads, which only o's own readers keep. bf16 without autocast (the MetaMathQA loop's).
    measured = _block_saved_bytes(PHI, attention, "bfloat16", targets, dropout)
    assert measured == framework_layer_bytes(_request(PHI, attention, "bf16-pure", targets, dropout))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,precision,targets", [
    ("float32", "fp32", ()), ("float32", "fp32", ("q", "k", "v")), ("float32", "fp32", ("q", "k", "v", "o")),
    ("bfloat16", "bf16-pure", ()), ("bfloat16", "bf16-pure", ("q", "k", "v")),
])
def test_a_bloom_block_keeps_its_attention_output_only_for_o(dtype: str, precision: str, targets: tuple) -> None:
    # Bloom's own attention (transformers 4.56.2 models/bloom/modeling_bloom.py:301-328): the fp32
    # softmax and its cast to the query's dtype (the same tensor in fp32), bmm, _merge_heads'
    # copy, then self.dense: frozen, dense keeps nothing of it. fp32 is how the PEFT README's
    # bloomz-7b1 rows run.
    measured = _block_saved_bytes(BLOOM, "eager", dtype, targets, 0.0)
    assert measured == framework_layer_bytes(_request(BLOOM, "eager", precision, targets, 0.0))


PEFT_NAMES["gemma"] = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("targets", [(), ("q", "v")])
def test_a_gemma_block_keeps_what_the_hf_plan_counts(kv_heads: int, attention: str, targets: tuple) -> None:
    # Gemma's one K/V head (multi-query) adds nothing unplanned: under eager attention
    # repeat_kv's expand/reshape is a view for one head, and the matmuls' own reshapes copy K and
    # V to every head (eager_attention_extra_bytes counts that copy for any kv_heads); SDPA
    # without a mask takes the grouped K and V (enable_gqa). GemmaRMSNorm scales in fp32 and
    # casts after (ModelSpec.norm_scales_fp32): with a trained weight it keeps the fp32
    # normalised tensor, not Llama's bf16 one. Not planned: each norm's per-token rsqrt and its
    # fp32 (1 + weight), 4 bytes a token and 4 a channel, as for every hf RMSNorm.
    raw = {"model_type": "gemma", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": kv_heads, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 64}
    measured = _block_saved_bytes(raw, attention, "bfloat16", targets, 0.0)
    request = _request(raw, attention, "bf16-pure", targets, 0.0)
    assert request.model.norm_scales_fp32
    vectors = request.model.norms_per_block * 4 * (S * B + request.model.hidden_size)
    assert measured == framework_layer_bytes(request) + vectors


def _outside_blocks_saved(raw: dict, targets: tuple[str, ...]) -> dict[int, tuple[int, object]]:
    """Storages a tiny causal LM keeps outside its blocks in a bf16 training forward (no loss)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if targets:
        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(targets),
                                                           fan_in_fan_out=raw["model_type"] == "gpt2"))
    model.train()
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    depth = [0]
    for name, module in model.named_modules():
        if re.search(r"\.(h|layers)\.\d+$", name):
            module.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
            module.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    saved: dict[int, tuple[int, object]] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if not depth[0] and pointer not in held:
            saved[pointer] = (tensor.untyped_storage().nbytes(), tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(0, raw["vocab_size"], (B, S)))
    return saved


GPT2 = {"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.mark.slow
def test_learned_positions_keep_only_their_int64_indices() -> None:
    # transformers 4.56.2 models/gpt2/modeling_gpt2.py GPT2Model.forward: position_ids =
    # cache_position.unsqueeze(0), [1, s] int64; wpe(position_ids) and wte(input_ids) keep their
    # indices for the tables' gradients (embedding's backward: indices), and inputs_embeds +
    # position_embeds keeps nothing. So beyond outside_layers_bytes (the final norm's input and
    # the head's) a full fine-tune keeps 8 bytes a token and 8 a position, and the final norm's
    # two per-token statistics: kilobytes, not planned. The position table's gradient is a
    # parameter's (counted with the model states). Under LoRA the frozen tables keep nothing.
    from zeroplan.core.activations import outside_layers_bytes

    torch = pytest.importorskip("torch")
    spec = parse_hf_config(GPT2, "gpt2")
    training = TrainingSpec(framework="hf", precision="bf16-pure", kernels=Kernels.cpu)
    full = _outside_blocks_saved(GPT2, ())
    indices = sorted(n for n, dtype in full.values() if dtype == torch.int64)
    assert indices == [8 * S, 8 * B * S]
    statistics = 2 * 2 * B * S  # the final LayerNorm's mean and rstd, bf16 on the CPU
    assert sum(n for n, _ in full.values()) == outside_layers_bytes(spec, training, S, B) + sum(indices) + statistics
    lora = _outside_blocks_saved(GPT2, ("c_attn",))
    assert not any(dtype == torch.int64 for _, dtype in lora.values())


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_frozen_phi_block_keeps_what_frozen_blocks_kept_bytes_counts(attention: str) -> None:
    # A full fine-tune with the first block frozen and the embedding trained: the frozen block
    # still passes the input's gradient down and keeps what a block without adapters keeps under
    # LoRA; its one normed input is q/k/v's and fc1's (subtracted once), and under eager
    # attention nothing keeps o's input.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.core.finetune.activations import frozen_blocks_kept_bytes
    from zeroplan.core.frameworks import block_input_bytes, hf_bf16_norm_savings_bytes

    config = transformers.AutoConfig.for_model(**PHI)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    layer = model.model.layers[0]
    for parameter in layer.parameters():
        parameter.requires_grad_(False)
    measured = _layer_saved_bytes(torch, model, layer, PHI["vocab_size"])
    request = _request(PHI, attention, "bf16-pure", (), 0.0)
    request = request.model_copy(update={"training": request.training.model_copy(
        update={"finetune": FineTuneSpec(frozen_blocks=1)})})
    kept, _ = frozen_blocks_kept_bytes(request, framework_layer_bytes(request), block_input_bytes(request, S, B),
                                       hf_bf16_norm_savings_bytes(request))
    assert measured == kept


BIGCODE = {"model_type": "gpt_bigcode", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _gpt2_block_saved(attention: str, dtype: str, use_cache: bool, softmax_mode=None, raw: dict = GPT2) -> int:  # type: ignore[no-untyped-def]
    """Bytes GPT2Model's (or ``raw``'s) second block keeps in one training forward
    (``softmax_mode``: a TorchFunctionMode the forward runs under)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**raw)
    assert config.use_cache  # GPT2Config's default, which GPT2Model.forward reads
    config.use_cache = use_cache
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).train()
    if softmax_mode is None:
        return _layer_saved_bytes(torch, model, model.transformer.h[1], raw["vocab_size"])
    with softmax_mode:
        return _layer_saved_bytes(torch, model, model.transformer.h[1], raw["vocab_size"])


def _gpt2_request(attention: str, precision: str, use_cache: bool, raw: dict = GPT2) -> PlanRequest:
    request = _request(raw, attention, precision, (), 0.0)
    return request.model_copy(update={"training": request.training.model_copy(update={"use_cache": use_cache})})


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype,precision", [("float32", "fp32"), ("bfloat16", "bf16-pure")])
def test_a_gpt2_block_keeps_what_the_hf_plan_counts(use_cache: bool, attention: str, dtype: str, precision: str) -> None:
    # GPT-2's eager softmax runs in the scores' dtype (EagerSoftmax.scores: no fp32
    # probabilities beside the bf16 ones), and with the cache SDPA keeps the cache's K and V
    # copies beside the fused c_attn output q views (fused_qkv_cache_copies_bytes). Not planned:
    # the 0-dim divisor eager attention's scaling keeps (e bytes), and without a cache the
    # b x 1 x s x s causal mask 4.56.2 builds (masking_utils.py create_causal_mask: with
    # position_ids and no cache the packed-sequence check forbids SDPA's is_causal), which SDPA
    # converts to the compute dtype and keeps in every block.
    e = 4 if dtype == "float32" else 2
    measured = _gpt2_block_saved(attention, dtype, use_cache)
    request = _gpt2_request(attention, precision, use_cache)
    assert request.model.eager_softmax is EagerSoftmax.scores
    unplanned = e if attention == "eager" else (0 if use_cache else e * B * S * S)
    assert measured == framework_layer_bytes(request) + unplanned


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("multi_query", [True, False])
@pytest.mark.parametrize("dtype,precision", [("float32", "fp32"), ("bfloat16", "bf16-pure")])
def test_a_gpt_bigcode_sdpa_block_keeps_the_cache_copies_beside_its_fused_output(
        use_cache: bool, multi_query: bool, dtype: str, precision: str) -> None:
    # GPTBigCode's c_attn views and cache update, multi-query or not: the same extra K and V as
    # GPT-2's (fused_qkv_cache_copies_bytes); without a cache the unplanned causal mask.
    raw = {**BIGCODE, "multi_query": multi_query}
    e = 4 if dtype == "float32" else 2
    measured = _gpt2_block_saved("sdpa", dtype, use_cache, raw=raw)
    request = _gpt2_request("sdpa", precision, use_cache, raw=raw)
    assert request.model.eager_softmax is EagerSoftmax.fp32 and (request.model.kv_heads == 1) is multi_query
    assert measured == framework_layer_bytes(request) + (0 if use_cache else e * B * S * S)


@pytest.mark.slow
def test_gpt2_eager_keeps_fp32_probabilities_only_where_something_upcasts_the_softmax() -> None:
    # Emulates CUDA autocast's softmax on the CPU (AT_FORALL_FP32_SET_OPT_DTYPE in the installed
    # header: a softmax given no dtype runs with dtype=float), which then keeps the fp32
    # probabilities beside their bf16 cast as Llama's eager attention does: 4 bytes a score.
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    from zeroplan.core.frameworks import eager_attention_extra_bytes

    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("torch's headers are not installed")
    block = re.search(r"#define AT_FORALL_FP32_SET_OPT_DTYPE\(_\)(.*?)\n\n", header.read_text(), re.S)
    assert block is not None and "_(softmax, int)" in block.group(1)

    class CudaAutocastSoftmax(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.nn.functional.softmax and kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.float32
            return func(*args, **kwargs)

    plain = _gpt2_block_saved("eager", "bfloat16", True)
    upcast = _gpt2_block_saved("eager", "bfloat16", True, CudaAutocastSoftmax())
    scores = GPT2["n_head"] * B * S * S
    assert upcast - plain == 4 * scores
    pure = _gpt2_request("eager", "bf16-pure", True)
    cuda_mixed = pure.model_copy(update={"training": pure.training.model_copy(
        update={"precision": Precision.bf16_mixed, "kernels": Kernels.cuda})})
    assert cuda_mixed.runs_under_autocast
    cpu_mixed = cuda_mixed.model_copy(update={"training": cuda_mixed.training.model_copy(update={"kernels": Kernels.cpu})})
    assert eager_attention_extra_bytes(cuda_mixed) - eager_attention_extra_bytes(pure) == 4 * scores
    assert eager_attention_extra_bytes(cpu_mixed) == eager_attention_extra_bytes(pure) == 0


def test_gpt2s_and_falcons_eager_softmax_runs_in_the_compute_dtype() -> None:
    # transformers 4.56.2: GPT-2's eager_attention_forward (modeling_gpt2.py:141) passes no dtype,
    # Llama's (modeling_llama.py:189) dtype=torch.float32; reorder_and_upcast_attn runs GPT-2's
    # fp32 path (_upcast_and_reordered_attn).
    assert parse_hf_config(GPT2, "gpt2").eager_softmax is EagerSoftmax.scores
    assert parse_hf_config({**GPT2, "reorder_and_upcast_attn": True}, "gpt2").eager_softmax is EagerSoftmax.fp32
    assert parse_hf_config({**PHI, "model_type": "llama"}, "llama").eager_softmax is EagerSoftmax.fp32
    assert parse_hf_config(FALCON, "falcon").eager_softmax is EagerSoftmax.hidden


FALCON = {"model_type": "falcon", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "new_decoder_architecture": False, "multi_query": False, "parallel_attn": True, "bias": False, "alibi": False,
          "hidden_dropout": 0.0, "attention_dropout": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("dtype,precision", [("float32", "fp32"), ("bfloat16", "bf16-pure")])
def test_a_falcon_eager_block_keeps_its_softmax_in_the_compute_dtype(use_cache: bool, dtype: str, precision: str) -> None:
    # Falcon's rotary attention (modeling_falcon.py:350-355): F.softmax(..., dtype=hidden_states.dtype),
    # bf16 in a bf16 module: one bf16 probabilities tensor, no fp32 one (EagerSoftmax.hidden).
    measured = _gpt2_block_saved("eager", dtype, use_cache, raw=FALCON)
    request = _gpt2_request("eager", precision, use_cache, raw=FALCON)
    assert measured == framework_layer_bytes(request)


def test_falcons_softmax_is_fp32_under_either_autocast() -> None:
    # Its input is input_layernorm's output, fp32 under CPU autocast too (CUDA's lists layer_norm
    # in AT_FORALL_FP32), where GPT-2's softmax stays bf16 on the CPU.
    torch = pytest.importorskip("torch")
    from zeroplan.core.transformers_release import upcasts_softmax

    norm = torch.nn.LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(2, 8)).dtype == torch.float32
        assert torch.nn.functional.softmax(torch.randn(2, 8, dtype=torch.bfloat16), dim=-1).dtype == torch.bfloat16
    falcon, gpt2 = parse_hf_config(FALCON, "falcon"), parse_hf_config(GPT2, "gpt2")
    for kernels in Kernels:
        training = TrainingSpec(framework="hf", precision=Precision.bf16_mixed, kernels=kernels)
        assert upcasts_softmax(falcon, training, autocast=True)
        assert upcasts_softmax(gpt2, training, autocast=True) is (kernels is Kernels.cuda)
        assert not upcasts_softmax(falcon, training) and not upcasts_softmax(gpt2, training)
