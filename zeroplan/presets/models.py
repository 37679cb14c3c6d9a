"""Model presets. Shapes come from each model's published config.json (Hugging Face hub
model cards) or paper; the parameter counts they imply are tested in tests/test_params.py."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from zeroplan.errors import ZeroplanError, unknown_name_error
from zeroplan.specs.model import EagerSoftmax, MlpKind, ModelSpec, NormKind, PositionKind


def _gpt2(name: str, hidden: int, layers: int, heads: int, positions: int = 1024) -> ModelSpec:
    # Radford et al. 2019 / openai-community/gpt2 config.json: n_inner = 4 * n_embd, tied head;
    # n_positions 1024 in gpt2, gpt2-medium, gpt2-large and gpt2-xl alike (learned table: a hard limit).
    return ModelSpec(
        name=name, vocab_size=50257, hidden_size=hidden, num_layers=layers, num_heads=heads,
        ffn_hidden_size=4 * hidden, mlp=MlpKind.gelu, norm=NormKind.layernorm,
        position=PositionKind.learned, max_positions=positions, bias=True, fused_qkv=True,
        tied_embeddings=True, attention_dropout=0.1, hidden_dropout=0.1,
    )


def _llama(
    name: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
    positions: int, experts: int = 1, experts_per_token: int = 1,
) -> ModelSpec:
    return ModelSpec(
        name=name, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, ffn_hidden_size=ffn, mlp=MlpKind.swiglu, norm=NormKind.rmsnorm,
        position=PositionKind.rope, max_positions=positions, bias=False, tied_embeddings=False,
        num_experts=experts, experts_per_token=experts_per_token,
    )


# https://huggingface.co/tiiuae/falcon-7b/blob/898df1396f35e447d5fe44e0a3ccaaaa69f30d36/config.json
# (tests/fixtures/hf/falcon-7b.json): hidden 4544, 32 layers, 71 heads, multi_query (one K/V head),
# parallel_attn with new_decoder_architecture false, bias false, alibi false (rotary), vocab
# 65024; FalconConfig's defaults: ffn_hidden_size 4 x hidden, max_position_embeddings 2048,
# tie_word_embeddings true. transformers 4.56.2 models/falcon/modeling_falcon.py FalconDecoderLayer
# builds one input_layernorm (LayerNorm: weight and bias) that attention and MLP both read and
# adds both outputs to the residual (the parallel block Phi has); its linears carry no bias.
# Its eager softmax runs in hidden_states' dtype (modeling_falcon.py:353, EagerSoftmax.hidden).
def _falcon_7b() -> ModelSpec:
    return ModelSpec(
        name="falcon-7b", vocab_size=65024, hidden_size=4544, num_layers=32, num_heads=71, num_kv_heads=1,
        ffn_hidden_size=4 * 4544, mlp=MlpKind.gelu, norm=NormKind.layernorm, position=PositionKind.rope,
        max_positions=2048, bias=False, parallel_block=True, tied_embeddings=True, fused_qkv=True,
        eager_softmax=EagerSoftmax.hidden,
    )


# https://huggingface.co/stabilityai/stablelm-base-alpha-3b/blob/main/config.json
# (tests/fixtures/hf/stablelm-base-alpha-3b.json): model_type gpt_neox, hidden 4096, 16 layers,
# 32 heads, intermediate 16384, vocab 50688, rotary_pct 0.25 (partial rotary: no parameters),
# use_parallel_residual true, tie_word_embeddings false, max_position_embeddings 4096. GPT-NeoX
# keeps two LayerNorms a block even with the parallel residual (input_layernorm for attention,
# post_attention_layernorm for the MLP, both over the block input) and biased linears:
# zeroplan.presets.hf_config reads it as it reads every gpt_neox config (its note on the one
# s x b x h tensor a block the sequential layout counts twice).
_STABLELM_ALPHA_3B = {
    "model_type": "gpt_neox", "vocab_size": 50688, "hidden_size": 4096, "num_hidden_layers": 16,
    "num_attention_heads": 32, "intermediate_size": 16384, "max_position_embeddings": 4096,
    "rotary_pct": 0.25, "use_parallel_residual": True, "tie_word_embeddings": False,
}


# Encoder-decoders, read by zeroplan.presets.hf_encoder_decoder from the shape keys of each
# published config.json (Hugging Face hub): google-t5/t5-base, t5-large, t5-3b, t5-11b (T5 1.0:
# relu feed-forward, tied head, n_positions 512, 32 relative buckets, dropout_rate 0.1);
# bigscience/T0_3B (T5 1.1 LM-adapted XL: gated-gelu, untied, d_model 2048, d_ff 5120, 32
# heads of 64, 24 + 24 blocks); bigscience/mt0-xxl (mT5-XXL: model_type mt5, vocab 250112,
# d_model 4096, d_ff 10240, 64 heads of 64, 24 + 24 blocks, untied); facebook/bart-large
# (d_model 1024, 12 + 12 layers, 16 heads, ffn 4096, vocab 50265, 1024 learned positions).
# Their counts equal transformers 4.56.2's on the meta device (tests/test_encoder_decoder.py).
_T5_V1 = {"model_type": "t5", "vocab_size": 32128, "n_positions": 512, "relative_attention_num_buckets": 32,
          "feed_forward_proj": "relu", "dropout_rate": 0.1}
_ENCODER_DECODER_CONFIGS = {
    "t5-base": {**_T5_V1, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12, "num_heads": 12},
    "t5-large": {**_T5_V1, "d_model": 1024, "d_kv": 64, "d_ff": 4096, "num_layers": 24, "num_heads": 16},
    "t5-3b": {**_T5_V1, "d_model": 1024, "d_kv": 128, "d_ff": 16384, "num_layers": 24, "num_heads": 32},
    "t5-11b": {**_T5_V1, "d_model": 1024, "d_kv": 128, "d_ff": 65536, "num_layers": 24, "num_heads": 128},
    "t0-3b": {"model_type": "t5", "vocab_size": 32128, "d_model": 2048, "d_kv": 64, "d_ff": 5120, "num_layers": 24,
              "num_decoder_layers": 24, "num_heads": 32, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
              "relative_attention_num_buckets": 32, "dropout_rate": 0.1},
    "mt0-xxl": {"model_type": "mt5", "vocab_size": 250112, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24,
                "num_decoder_layers": 24, "num_heads": 64, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
                "relative_attention_num_buckets": 32, "dropout_rate": 0.1},
    "bart-large": {"model_type": "bart", "vocab_size": 50265, "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
                   "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
                   "decoder_ffn_dim": 4096, "max_position_embeddings": 1024, "dropout": 0.1, "attention_dropout": 0.0},
}


# Qwen families, read by zeroplan.presets.hf_config from the shape keys of each published
# config.json (Hugging Face hub, Qwen/<name>): Qwen2.5 0.5B to 72B (model_type qwen2: q, k, v
# biased, grouped K/V heads; 0.5B to 3B tie the head), Qwen3 0.6B to 32B (qwen3: q/k norms, 128-wide
# heads whatever hidden / heads; 0.6B to 4B tied). Qwen2-0.5B, 1.5B, 7B and 72B have the Qwen2.5
# shapes (aliases below). Qwen-1 (Qwen/Qwen-1_8B, 7B, 14B, 72B: model_type qwen, its own modeling
# code) has the parameters of an untied multi-head Qwen2 of its shapes (c_attn = q, k, v with
# bias; attn c_proj, w1, w2 and mlp c_proj unbiased; its config's intermediate_size is twice the
# width of w1 and w2), so it is read as one; max_position_embeddings as its config (8192; 72B
# 32768; it extrapolates by dynamic NTK). Yi-6B (01-ai/Yi-6B) is a Llama layout. Every count
# equals transformers 4.56.2's on the meta device (tests/test_qwen_presets.py); Qwen-7B's
# 7,721,324,544 is also what ms-swift's benchmark page prints for its full fine-tune.
def _qwen(model_type: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, tied: bool,
          positions: int, **extra) -> dict:
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": positions, **extra}


_QWEN_CONFIGS = {
    "qwen2.5-0.5b": _qwen("qwen2", 896, 4864, 24, 14, 2, 151936, True, 32768),
    "qwen2.5-1.5b": _qwen("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 32768),
    "qwen2.5-3b": _qwen("qwen2", 2048, 11008, 36, 16, 2, 151936, True, 32768),
    "qwen2.5-7b": _qwen("qwen2", 3584, 18944, 28, 28, 4, 152064, False, 32768),
    "qwen2.5-14b": _qwen("qwen2", 5120, 13824, 48, 40, 8, 152064, False, 32768),
    "qwen2.5-32b": _qwen("qwen2", 5120, 27648, 64, 40, 8, 152064, False, 32768),
    "qwen2.5-72b": _qwen("qwen2", 8192, 29568, 80, 64, 8, 152064, False, 32768),
    "qwen3-0.6b": _qwen("qwen3", 1024, 3072, 28, 16, 8, 151936, True, 40960, head_dim=128),
    "qwen3-1.7b": _qwen("qwen3", 2048, 6144, 28, 16, 8, 151936, True, 40960, head_dim=128),
    "qwen3-4b": _qwen("qwen3", 2560, 9728, 36, 32, 8, 151936, True, 40960, head_dim=128),
    "qwen3-8b": _qwen("qwen3", 4096, 12288, 36, 32, 8, 151936, False, 40960, head_dim=128),
    "qwen3-14b": _qwen("qwen3", 5120, 17408, 40, 40, 8, 151936, False, 40960, head_dim=128),
    "qwen3-32b": _qwen("qwen3", 5120, 25600, 64, 64, 8, 151936, False, 40960, head_dim=128),
    "qwen-1.8b": _qwen("qwen2", 2048, 5504, 24, 16, 16, 151936, False, 8192),
    "qwen-7b": _qwen("qwen2", 4096, 11008, 32, 32, 32, 151936, False, 8192),
    "qwen-14b": _qwen("qwen2", 5120, 13696, 40, 40, 40, 152064, False, 8192),
    "qwen-72b": _qwen("qwen2", 8192, 24576, 80, 64, 64, 152064, False, 32768),
    "yi-6b": _qwen("llama", 4096, 11008, 32, 32, 4, 64000, False, 4096),
}


# The presets read from their config.json's shapes (zeroplan.presets.hf_config) are read when
# first asked for: a command plans one model, and reading all 27 at each start imported the four
# config-reader modules and validated 27 specs for none of them (fit llama-2-70b: 990 -> 982 M
# instructions, callgrind).
_READ_PRESETS: dict[str, dict] = {"stablelm-base-alpha-3b": _STABLELM_ALPHA_3B, **_ENCODER_DECODER_CONFIGS,
                                  **_QWEN_CONFIGS}


# Qwen-1 runs its own modeling_qwen.py (trust_remote_code), whose QWenLMHeadModel.forward computes
# its loss on lm_head's compute-dtype output with no fp32 upcast (zeroplan.core.own_loss), and whose
# QWenAttention.__init__ builds c_attn = nn.Linear(hidden_size, 3 * projection_size): q, k and v in
# one module (Qwen/Qwen-7B modeling_qwen.py:269, mirrored at zhangningboo/Qwen-7B@d4efd21; fused_qkv).
# Its own buffers (no causal mask under flash attention; a 64 KiB logn_tensor a block) are not planned:
# docs/memory-model.md, 'Known simplifications'.
_QWEN1_PRESETS = frozenset({"qwen-1.8b", "qwen-7b", "qwen-14b", "qwen-72b"})


@functools.cache
def _read_preset(name: str) -> ModelSpec:
    from zeroplan.presets.hf_config import parse_hf_config

    spec = parse_hf_config(_READ_PRESETS[name], name)
    if name in _QWEN1_PRESETS:
        return spec.model_copy(update={"own_loss_in_compute_dtype": True, "fused_qkv": True})
    return spec


# Each preset is built (validated) the first time it is asked for by name: a command plans one
# model, and validating the other seventeen at every start cost about 4 M instructions.
_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "gpt2": functools.partial(_gpt2, "gpt2", 768, 12, 12),
    "gpt2-medium": functools.partial(_gpt2, "gpt2-medium", 1024, 24, 16),
    "gpt2-large": functools.partial(_gpt2, "gpt2-large", 1280, 36, 20),
    "gpt2-xl": functools.partial(_gpt2, "gpt2-xl", 1600, 48, 25),
    # Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048.
    "gpt3-175b": functools.partial(_gpt2, "gpt3-175b", 12288, 96, 96, positions=2048),
    # meta-llama/Llama-2-*-hf config.json (max_position_embeddings 4096).
    "llama-2-7b": functools.partial(_llama, "llama-2-7b", 32000, 4096, 32, 32, 32, 11008, 4096),
    "llama-2-13b": functools.partial(_llama, "llama-2-13b", 32000, 5120, 40, 40, 40, 13824, 4096),
    "llama-2-70b": functools.partial(_llama, "llama-2-70b", 32000, 8192, 80, 64, 8, 28672, 4096),
    # meta-llama/Meta-Llama-3-* config.json (max_position_embeddings 8192) and Llama-3.1-*
    # config.json (131072, with llama3 rope_scaling from an original 8192).
    "llama-3-8b": functools.partial(_llama, "llama-3-8b", 128256, 4096, 32, 32, 8, 14336, 8192),
    "llama-3-70b": functools.partial(_llama, "llama-3-70b", 128256, 8192, 80, 64, 8, 28672, 8192),
    "llama-3.1-8b": functools.partial(_llama, "llama-3.1-8b", 128256, 4096, 32, 32, 8, 14336, 131072),
    "llama-3.1-70b": functools.partial(_llama, "llama-3.1-70b", 128256, 8192, 80, 64, 8, 28672, 131072),
    "llama-3.1-405b": functools.partial(_llama, "llama-3.1-405b", 128256, 16384, 126, 128, 8, 53248, 131072),
    # mistralai/Mistral-7B-v0.1 and Mixtral-8x7B-v0.1 config.json (max_position_embeddings 32768).
    "mistral-7b": functools.partial(_llama, "mistral-7b", 32000, 4096, 32, 32, 8, 14336, 32768),
    "mixtral-8x7b": functools.partial(_llama, "mixtral-8x7b", 32000, 4096, 32, 32, 8, 14336, 32768, experts=8, experts_per_token=2),
    # https://huggingface.co/01-ai/Yi-34B/blob/main/config.json (model_type llama; copied to
    # tests/fixtures/hf/yi-34b.json): 60 layers, hidden 7168, 56 heads, 8 kv heads, intermediate
    # 20480, vocab 64000, untied, max_position_embeddings 4096.
    "yi-34b": functools.partial(_llama, "yi-34b", 64000, 7168, 60, 56, 8, 20480, 4096),
    # jzhang38/TinyLlama@bf12224 lit_gpt/config.py tiny_LLaMA_1b: 22 layers, n_embd 2048,
    # 32 heads, 4 query groups, LLaMAMLP 5632, vocab 32000, block_size 2048, untied head.
    "tinyllama-1.1b": functools.partial(_llama, "tinyllama-1.1b", 32000, 2048, 22, 32, 4, 5632, 2048),
    "falcon-7b": _falcon_7b,
}


@functools.cache
def _built_preset(name: str) -> ModelSpec:
    return _PRESETS[name]()


_ALIASES = {"gpt2-small": "gpt2", "gpt2-124m": "gpt2", "gpt2-1.5b": "gpt2-xl", "gpt3": "gpt3-175b",
            "bigscience/t0_3b": "t0-3b", "t0_3b": "t0-3b", "bigscience/mt0-xxl": "mt0-xxl", "facebook/bart-large": "bart-large",
            "qwen2-0.5b": "qwen2.5-0.5b", "qwen2-1.5b": "qwen2.5-1.5b", "qwen2-7b": "qwen2.5-7b", "qwen2-72b": "qwen2.5-72b",
            "qwen-1_8b": "qwen-1.8b"}


def model_names() -> list[str]:
    """Preset names."""
    return sorted([*_PRESETS, *_READ_PRESETS])


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json given as a path."""
    key = name_or_path.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _PRESETS:
        return _built_preset(key)
    if key in _READ_PRESETS:
        return _read_preset(key)
    if Path(name_or_path).is_dir():
        raise ZeroplanError(
            "model", f"{name_or_path!r} is a directory; pass its config.json, or a preset name (see `zeroplan models`)"
        )
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        from zeroplan.presets.hf_config import load_hf_config

        return load_hf_config(Path(name_or_path))
    raise unknown_name_error("model", name_or_path, [*_PRESETS, *_READ_PRESETS, *_ALIASES])
