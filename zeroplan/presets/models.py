"""Model presets. Shapes come from each model's published config.json (Hugging Face hub
model cards) or paper; the parameter counts they imply are tested in tests/test_params.py,
tests/test_qwen_presets.py, tests/test_added_presets.py and tests/test_open_presets.py."""

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
    positions: int, experts: int = 1, experts_per_token: int = 1, llama_code: bool = True,
) -> ModelSpec:
    # llama_code: the checkpoint's model_type is llama (its transformers code LlamaModel's, which
    # 4.38.x builds its causal mask in: ModelSpec.positions_causal_mask); False for mistral, mixtral.
    return ModelSpec(
        name=name, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, ffn_hidden_size=ffn, mlp=MlpKind.swiglu, norm=NormKind.rmsnorm,
        position=PositionKind.rope, max_positions=positions, positions_causal_mask=llama_code, bias=False,
        tied_embeddings=False, num_experts=experts, experts_per_token=experts_per_token,
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
def _decoder_config(model_type: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, vocab: int,
                    tied: bool, positions: int, **extra) -> dict:
    """A decoder's config.json shape keys, as the config reader reads them."""
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": positions, **extra}


_QWEN_CONFIGS = {
    "qwen2.5-0.5b": _decoder_config("qwen2", 896, 4864, 24, 14, 2, 151936, True, 32768),
    "qwen2.5-1.5b": _decoder_config("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 32768),
    "qwen2.5-3b": _decoder_config("qwen2", 2048, 11008, 36, 16, 2, 151936, True, 32768),
    "qwen2.5-7b": _decoder_config("qwen2", 3584, 18944, 28, 28, 4, 152064, False, 32768),
    "qwen2.5-14b": _decoder_config("qwen2", 5120, 13824, 48, 40, 8, 152064, False, 32768),
    "qwen2.5-32b": _decoder_config("qwen2", 5120, 27648, 64, 40, 8, 152064, False, 32768),
    "qwen2.5-72b": _decoder_config("qwen2", 8192, 29568, 80, 64, 8, 152064, False, 32768),
    "qwen3-0.6b": _decoder_config("qwen3", 1024, 3072, 28, 16, 8, 151936, True, 40960, head_dim=128),
    "qwen3-1.7b": _decoder_config("qwen3", 2048, 6144, 28, 16, 8, 151936, True, 40960, head_dim=128),
    "qwen3-4b": _decoder_config("qwen3", 2560, 9728, 36, 32, 8, 151936, True, 40960, head_dim=128),
    "qwen3-8b": _decoder_config("qwen3", 4096, 12288, 36, 32, 8, 151936, False, 40960, head_dim=128),
    "qwen3-14b": _decoder_config("qwen3", 5120, 17408, 40, 40, 8, 151936, False, 40960, head_dim=128),
    "qwen3-32b": _decoder_config("qwen3", 5120, 25600, 64, 64, 8, 151936, False, 40960, head_dim=128),
    "qwen-1.8b": _decoder_config("qwen2", 2048, 5504, 24, 16, 16, 151936, False, 8192),
    "qwen-7b": _decoder_config("qwen2", 4096, 11008, 32, 32, 32, 151936, False, 8192),
    "qwen-14b": _decoder_config("qwen2", 5120, 13696, 40, 40, 40, 152064, False, 8192),
    "qwen-72b": _decoder_config("qwen2", 8192, 24576, 80, 64, 64, 152064, False, 32768),
    "yi-6b": _decoder_config("llama", 4096, 11008, 32, 32, 4, 64000, False, 4096),
}


# Open decoder families read by zeroplan.presets.hf_config from the keys of each model's published
# config.json (Hugging Face hub) that the reader reads: shapes, tying, dropouts, activations and
# layout switches; keys the reader treats as neutral (token ids, epsilons, RoPE bases, init) are
# left out, as they change nothing it plans. Each preset is what a user's copy of that
# config.json gives (tests/test_open_presets.py reads the fixtures of tests/fixtures/hf and
# benchmarks/published_memory/configs both ways), and its count equals transformers 4.56.2's
# on the meta device.
def _llama_config(hidden: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, positions: int,
                  tied: bool = False, **extra) -> dict:
    return _decoder_config("llama", hidden, ffn, layers, heads, kv, vocab, tied, positions, **extra)


def _opt(hidden: int, ffn: int, layers: int, heads: int, **extra) -> dict:
    # Every facebook/opt-* config.json: vocab 50272, 2048 positions, relu, dropout 0.1,
    # attention_dropout 0.0, activation_dropout 0.0, layerdrop 0.0, pre-norm (350m aside).
    return {"model_type": "opt", "vocab_size": 50272, "hidden_size": hidden, "ffn_dim": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "max_position_embeddings": 2048, "word_embed_proj_dim": hidden,
            "do_layer_norm_before": True, "activation_function": "relu", "dropout": 0.1, "attention_dropout": 0.0,
            "activation_dropout": 0.0, "layerdrop": 0.0, **extra}


def _bloom(hidden: int, layers: int, heads: int) -> dict:
    # bigscience/bloom-* config.json: vocab 250880, hidden_dropout and attention_dropout 0.0,
    # apply_residual_connection_post_layernorm false (BloomMLP is 4 x hidden whatever n_inner says).
    return {"model_type": "bloom", "vocab_size": 250880, "hidden_size": hidden, "n_layer": layers, "n_head": heads,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "apply_residual_connection_post_layernorm": False}


def _pythia(hidden: int, layers: int, heads: int, vocab: int) -> dict:
    # EleutherAI/pythia-* config.json: intermediate 4 x hidden, rotary_pct 0.25, parallel
    # residual, untied embed_out, 2048 positions, no dropout (GPTNeoXConfig's 0.0 defaults).
    return {"model_type": "gpt_neox", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "max_position_embeddings": 2048,
            "rotary_pct": 0.25, "use_parallel_residual": True, "tie_word_embeddings": False}


def _gemma(model_type: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, head_dim: int, **extra) -> dict:
    # google/gemma-* config.json: vocab 256000, 8192 positions, tied head (GemmaConfig's default).
    return {"model_type": model_type, "vocab_size": 256000, "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "max_position_embeddings": 8192, **extra}


def _starcoder2(hidden: int, ffn: int, layers: int, heads: int, kv: int, **extra) -> dict:
    # bigcode/starcoder2-* config.json: vocab 49152, 16384 positions, gelu_pytorch_tanh, biased.
    return {"model_type": "starcoder2", "vocab_size": 49152, "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": 16384, "hidden_act": "gelu_pytorch_tanh", "use_bias": True, **extra}


_GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

_OPEN_CONFIGS = {
    # https://huggingface.co/huggyllama/llama-7b/blob/main/config.json (and llama-13b, llama-30b,
    # llama-65b): LLaMA-1, multi-head, untied, 2048 positions.
    "llama-7b": _llama_config(4096, 11008, 32, 32, 32, 32000, 2048),
    "llama-13b": _llama_config(5120, 13824, 40, 40, 40, 32000, 2048),
    "llama-33b": _llama_config(6656, 17920, 60, 52, 52, 32000, 2048),
    "llama-65b": _llama_config(8192, 22016, 80, 64, 64, 32000, 2048),
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json and Llama-3.2-3B
    # (benchmarks/published_memory/configs/llama-3.2-1b.json, llama-3.2-3b.json): tied head.
    "llama-3.2-1b": _llama_config(2048, 8192, 16, 32, 8, 128256, 131072, tied=True, head_dim=64),
    "llama-3.2-3b": _llama_config(3072, 8192, 28, 24, 8, 128256, 131072, tied=True, head_dim=128),
    # https://huggingface.co/codellama/CodeLlama-7b-hf/blob/main/config.json, CodeLlama-13b-hf and
    # CodeLlama-34b-hf: 16384 positions; 7B and 13B vocab 32016 (infilling tokens), 34B 32000 with
    # 8 K/V heads.
    "codellama-7b": _llama_config(4096, 11008, 32, 32, 32, 32016, 16384),
    "codellama-13b": _llama_config(5120, 13824, 40, 40, 40, 32016, 16384),
    "codellama-34b": _llama_config(8192, 22016, 48, 64, 8, 32000, 16384),
    # https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json: Mistral-7B-v0.1's
    # shapes with vocab 32768.
    "mistral-7b-v0.3": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "max_position_embeddings": 32768, "tie_word_embeddings": False},
    # https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json.
    "mixtral-8x22b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 6144, "intermediate_size": 16384,
                      "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
                      "max_position_embeddings": 65536, "num_local_experts": 8, "num_experts_per_tok": 2,
                      "tie_word_embeddings": False},
    # https://huggingface.co/google/gemma-2b/blob/main/config.json (benchmarks/published_memory/
    # configs/gemma-2b.json), google/gemma-7b (tests/fixtures/hf/gemma-7b.json).
    "gemma-2b": _gemma("gemma", 2048, 16384, 18, 8, 1, 256),
    "gemma-7b": _gemma("gemma", 3072, 24576, 28, 16, 16, 256),
    # https://huggingface.co/google/gemma-2-2b/blob/main/config.json, gemma-2-9b
    # (tests/fixtures/hf/gemma-2-2b.json, gemma-2-9b.json) and gemma-2-27b (head_dim 128).
    "gemma-2-2b": _gemma("gemma2", 2304, 9216, 26, 8, 4, 256, **_GEMMA2_CAPS),
    "gemma-2-9b": _gemma("gemma2", 3584, 14336, 42, 16, 8, 256, **_GEMMA2_CAPS),
    "gemma-2-27b": _gemma("gemma2", 4608, 36864, 46, 32, 16, 128, **_GEMMA2_CAPS),
    # https://huggingface.co/microsoft/phi-1_5/blob/main/config.json and microsoft/phi-2
    # (tests/fixtures/hf/phi-1_5.json, phi-2.json).
    "phi-1.5": {"model_type": "phi", "vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192,
                "num_hidden_layers": 24, "num_attention_heads": 32, "max_position_embeddings": 2048,
                "partial_rotary_factor": 0.5, "hidden_act": "gelu_new", "resid_pdrop": 0.0, "attention_dropout": 0.0,
                "tie_word_embeddings": False},
    "phi-2": {"model_type": "phi", "vocab_size": 51200, "hidden_size": 2560, "intermediate_size": 10240,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
              "partial_rotary_factor": 0.4, "hidden_act": "gelu_new", "resid_pdrop": 0.1, "attention_dropout": 0.0,
              "tie_word_embeddings": False},
    # https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json
    # (tests/fixtures/hf/phi-3-mini-4k.json).
    "phi-3-mini-4k": {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                      "max_position_embeddings": 4096, "resid_pdrop": 0.0, "attention_dropout": 0.0,
                      "tie_word_embeddings": False},
    # https://huggingface.co/facebook/opt-125m/blob/main/config.json and opt-350m, opt-1.3b,
    # opt-2.7b, opt-6.7b, opt-13b, opt-30b, opt-66b (tests/fixtures/hf/opt-350m.json, opt-1.3b.json).
    # OPT-350m norms after its residual adds and projects a 512-wide embedding (ModelSpec.embedding_projection).
    "opt-125m": _opt(768, 3072, 12, 12),
    "opt-350m": _opt(1024, 4096, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
    "opt-1.3b": _opt(2048, 8192, 24, 32),
    "opt-2.7b": _opt(2560, 10240, 32, 32),
    "opt-6.7b": _opt(4096, 16384, 32, 32),
    "opt-13b": _opt(5120, 20480, 40, 40),
    "opt-30b": _opt(7168, 28672, 48, 56),
    "opt-66b": _opt(9216, 36864, 64, 72),
    # https://huggingface.co/bigscience/bloom-560m/blob/main/config.json and bloom-1b1, bloom-1b7,
    # bloom-3b, bloom-7b1, bigscience/bloom (176B) (tests/fixtures/hf/bloom-560m.json, bloom-7b1.json).
    "bloom-560m": _bloom(1024, 24, 16),
    "bloom-1b1": _bloom(1536, 24, 16),
    "bloom-1b7": _bloom(2048, 24, 16),
    "bloom-3b": _bloom(2560, 30, 32),
    "bloom-7b1": _bloom(4096, 30, 32),
    "bloom-176b": _bloom(14336, 70, 112),
    # https://huggingface.co/tiiuae/falcon-40b/blob/main/config.json (tests/fixtures/hf/falcon-40b.json):
    # new_decoder_architecture (8 K/V groups, ln_attn and ln_mlp over one block input), no biases.
    "falcon-40b": {"model_type": "falcon", "vocab_size": 65024, "hidden_size": 8192, "num_hidden_layers": 60,
                   "num_attention_heads": 128, "num_kv_heads": 8, "new_decoder_architecture": True,
                   "parallel_attn": True, "multi_query": True, "bias": False, "alibi": False, "hidden_dropout": 0.0,
                   "attention_dropout": 0.0},
    # https://huggingface.co/EleutherAI/gpt-j-6b/blob/main/config.json (tests/fixtures/hf/gpt-j-6b.json).
    "gpt-j-6b": {"model_type": "gptj", "vocab_size": 50400, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                 "n_positions": 2048, "rotary_dim": 64, "activation_function": "gelu_new", "attn_pdrop": 0.0,
                 "resid_pdrop": 0.0, "tie_word_embeddings": False},
    # https://huggingface.co/EleutherAI/gpt-neox-20b/blob/main/config.json (tests/fixtures/hf/gpt-neox-20b.json).
    "gpt-neox-20b": {"model_type": "gpt_neox", "vocab_size": 50432, "hidden_size": 6144, "intermediate_size": 24576,
                     "num_hidden_layers": 44, "num_attention_heads": 64, "max_position_embeddings": 2048,
                     "rotary_pct": 0.25, "use_parallel_residual": True, "tie_word_embeddings": False,
                     "attention_dropout": 0.0, "hidden_dropout": 0.0},
    # https://huggingface.co/EleutherAI/pythia-70m/blob/main/config.json and pythia-160m, 410m, 1b,
    # 1.4b, 2.8b, 6.9b, 12b (tests/fixtures/hf/pythia-1.4b.json): vocab 50304, 6.9B 50432, 12B 50688.
    "pythia-70m": _pythia(512, 6, 8, 50304),
    "pythia-160m": _pythia(768, 12, 12, 50304),
    "pythia-410m": _pythia(1024, 24, 16, 50304),
    "pythia-1b": _pythia(2048, 16, 8, 50304),
    "pythia-1.4b": _pythia(2048, 24, 16, 50304),
    "pythia-2.8b": _pythia(2560, 32, 32, 50304),
    "pythia-6.9b": _pythia(4096, 32, 32, 50432),
    "pythia-12b": _pythia(5120, 36, 40, 50688),
    # https://huggingface.co/mosaicml/mpt-7b/blob/main/config.json (tests/fixtures/hf/mpt-7b.json).
    "mpt-7b": {"model_type": "mpt", "vocab_size": 50432, "d_model": 4096, "n_layers": 32, "n_heads": 32,
               "max_seq_len": 2048, "expansion_ratio": 4, "no_bias": True,
               "attn_config": {"alibi": True, "attn_pdrop": 0, "qk_ln": False, "prefix_lm": False}},
    # https://huggingface.co/bigcode/starcoder/blob/main/config.json (tests/fixtures/hf/starcoder.json):
    # GPTBigCode, multi-query, 8192 learned positions (GPTBigCodeConfig's dropouts, 0.1).
    "starcoder": {"model_type": "gpt_bigcode", "vocab_size": 49152, "n_embd": 6144, "n_inner": 24576, "n_layer": 40,
                  "n_head": 48, "n_positions": 8192, "multi_query": True, "activation_function": "gelu_pytorch_tanh"},
    # https://huggingface.co/bigcode/starcoder2-3b/blob/main/config.json (tests/fixtures/hf/
    # starcoder2-3b.json holds its shape keys) and starcoder2-7b: attention and residual dropout
    # 0.1, tied head; starcoder2-15b: untied head, attention dropout 0.0, no residual_dropout key.
    "starcoder2-3b": _starcoder2(3072, 12288, 30, 24, 2, attention_dropout=0.1, residual_dropout=0.1),
    "starcoder2-7b": _starcoder2(4608, 18432, 32, 36, 4, attention_dropout=0.1, residual_dropout=0.1),
    "starcoder2-15b": _starcoder2(6144, 24576, 40, 48, 4, attention_dropout=0.0, tie_word_embeddings=False),
    # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json
    # (tests/fixtures/hf/deepseek-v2-lite.json): 64 routed experts of 1408, 2 shared, 6 a token,
    # the first block dense, MLA without a query low-rank (q_lora_rank null).
    "deepseek-v2-lite": {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
                         "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "max_position_embeddings": 163840, "n_routed_experts": 64,
                         "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None, "kv_lora_rank": 512,
                         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "tie_word_embeddings": False, "attention_dropout": 0.0},
    # https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json (tests/fixtures/hf/qwen1.5-moe-a2.7b.json).
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
                          "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "max_position_embeddings": 8192, "num_experts": 60,
                          "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                          "tie_word_embeddings": False, "attention_dropout": 0.0},
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (tests/fixtures/hf/qwen3-30b-a3b.json).
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "tie_word_embeddings": False, "attention_dropout": 0.0},
}


# The presets read from their config.json's shapes (zeroplan.presets.hf_config) are read when
# first asked for: a command plans one model, and reading all 27 at each start imported the four
# config-reader modules and validated 27 specs for none of them (fit llama-2-70b: 990 -> 982 M
# instructions, callgrind).
_READ_PRESETS: dict[str, dict] = {"stablelm-base-alpha-3b": _STABLELM_ALPHA_3B, **_ENCODER_DECODER_CONFIGS,
                                  **_QWEN_CONFIGS, **_OPEN_CONFIGS}


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
    "mistral-7b": functools.partial(_llama, "mistral-7b", 32000, 4096, 32, 32, 8, 14336, 32768, llama_code=False),
    "mixtral-8x7b": functools.partial(_llama, "mixtral-8x7b", 32000, 4096, 32, 32, 8, 14336, 32768, experts=8, experts_per_token=2,
                                      llama_code=False),
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


# Hugging Face hub ids (and their -Instruct, -chat, -it or -hf twins of identical shapes) of each
# preset, matched case-insensitively by get_model: `zeroplan fit meta-llama/Llama-2-7b-hf` plans
# the llama-2-7b preset. A twin whose config.json differs in a key the reader reads (a vocabulary,
# a position limit) is not listed: CodeLlama-*-Python (vocab 32000), Mixtral-8x22B-Instruct-v0.1
# (32768), Qwen3-30B-A3B-Instruct-2507 (262144 positions).
_HUB_IDS: dict[str, tuple[str, ...]] = {
    "gpt2": ("openai-community/gpt2",),
    "gpt2-medium": ("openai-community/gpt2-medium",),
    "gpt2-large": ("openai-community/gpt2-large",),
    "gpt2-xl": ("openai-community/gpt2-xl",),
    "llama-7b": ("huggyllama/llama-7b",),
    "llama-13b": ("huggyllama/llama-13b",),
    "llama-33b": ("huggyllama/llama-30b", "llama-30b"),
    "llama-65b": ("huggyllama/llama-65b",),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b"),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf", "meta-llama/Llama-2-13b"),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-70b"),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B",
                     "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Meta-Llama-3.1-70B",
                      "meta-llama/Meta-Llama-3.1-70B-Instruct"),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct",
                       "meta-llama/Meta-Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B-Instruct"),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
    "codellama-7b": ("codellama/CodeLlama-7b-hf", "codellama/CodeLlama-7b-Instruct-hf", "codellama-7b-instruct"),
    "codellama-13b": ("codellama/CodeLlama-13b-hf", "codellama/CodeLlama-13b-Instruct-hf", "codellama-13b-instruct"),
    "codellama-34b": ("codellama/CodeLlama-34b-hf", "codellama/CodeLlama-34b-Instruct-hf", "codellama-34b-instruct"),
    "tinyllama-1.1b": ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
                       "TinyLlama/TinyLlama_v1.1", "tinyllama"),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1",
                   "mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b-v0.1"),
    "mistral-7b-v0.3": ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-v0.1",),
    "gemma-2b": ("google/gemma-2b", "google/gemma-2b-it", "gemma-2b-it"),
    "gemma-7b": ("google/gemma-7b", "google/gemma-7b-it", "gemma-7b-it"),
    "gemma-2-2b": ("google/gemma-2-2b", "google/gemma-2-2b-it", "gemma-2-2b-it"),
    "gemma-2-9b": ("google/gemma-2-9b", "google/gemma-2-9b-it", "gemma-2-9b-it"),
    "gemma-2-27b": ("google/gemma-2-27b", "google/gemma-2-27b-it", "gemma-2-27b-it"),
    "phi-1.5": ("microsoft/phi-1_5", "phi-1_5"),
    "phi-2": ("microsoft/phi-2",),
    "phi-3-mini-4k": ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini-4k-instruct"),
    "opt-125m": ("facebook/opt-125m",),
    "opt-350m": ("facebook/opt-350m",),
    "opt-1.3b": ("facebook/opt-1.3b",),
    "opt-2.7b": ("facebook/opt-2.7b",),
    "opt-6.7b": ("facebook/opt-6.7b",),
    "opt-13b": ("facebook/opt-13b",),
    "opt-30b": ("facebook/opt-30b",),
    "opt-66b": ("facebook/opt-66b",),
    "bloom-560m": ("bigscience/bloom-560m",),
    "bloom-1b1": ("bigscience/bloom-1b1",),
    "bloom-1b7": ("bigscience/bloom-1b7",),
    "bloom-3b": ("bigscience/bloom-3b",),
    "bloom-7b1": ("bigscience/bloom-7b1",),
    "bloom-176b": ("bigscience/bloom", "bloom"),
    "falcon-7b": ("tiiuae/falcon-7b", "tiiuae/falcon-7b-instruct", "falcon-7b-instruct"),
    "falcon-40b": ("tiiuae/falcon-40b", "tiiuae/falcon-40b-instruct", "falcon-40b-instruct"),
    "gpt-j-6b": ("EleutherAI/gpt-j-6b", "gpt-j", "gptj-6b"),
    "gpt-neox-20b": ("EleutherAI/gpt-neox-20b",),
    **{f"pythia-{size}": (f"EleutherAI/pythia-{size}", f"EleutherAI/pythia-{size}-deduped", f"pythia-{size}-deduped")
       for size in ("70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")},
    "mpt-7b": ("mosaicml/mpt-7b",),
    "starcoder": ("bigcode/starcoder", "bigcode/starcoderbase", "starcoderbase"),
    "starcoder2-3b": ("bigcode/starcoder2-3b",),
    "starcoder2-7b": ("bigcode/starcoder2-7b",),
    "starcoder2-15b": ("bigcode/starcoder2-15b",),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-v2-lite-chat"),
    "qwen1.5-moe-a2.7b": ("Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen1.5-MoE-A2.7B-Chat"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B",),
    # Qwen2-0.5B, 1.5B, 7B and 72B have the Qwen2.5 shapes (see _QWEN_CONFIGS).
    **{f"qwen2.5-{size}": (f"Qwen/Qwen2.5-{size.upper()}", f"Qwen/Qwen2.5-{size.upper()}-Instruct",
                           *((f"Qwen/Qwen2-{size.upper()}", f"Qwen/Qwen2-{size.upper()}-Instruct")
                             if size in ("0.5b", "1.5b", "7b", "72b") else ()))
       for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")},
    **{f"qwen3-{size}": (f"Qwen/Qwen3-{size.upper()}",) for size in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")},
    "qwen-1.8b": ("Qwen/Qwen-1_8B", "Qwen/Qwen-1_8B-Chat"),
    **{f"qwen-{size}": (f"Qwen/Qwen-{size.upper()}", f"Qwen/Qwen-{size.upper()}-Chat") for size in ("7b", "14b", "72b")},
    "yi-6b": ("01-ai/Yi-6B", "01-ai/Yi-6B-Chat"),
    "yi-34b": ("01-ai/Yi-34B", "01-ai/Yi-34B-Chat"),
    "stablelm-base-alpha-3b": ("stabilityai/stablelm-base-alpha-3b",),
    **{f"t5-{size}": (f"google-t5/t5-{size}",) for size in ("base", "large", "3b", "11b")},
    "t0-3b": ("bigscience/T0_3B", "t0_3b"),
    "mt0-xxl": ("bigscience/mt0-xxl",),
    "bart-large": ("facebook/bart-large",),
}

_ALIASES = {"gpt2-small": "gpt2", "gpt2-124m": "gpt2", "gpt2-1.5b": "gpt2-xl", "gpt3": "gpt3-175b",
            "qwen2-0.5b": "qwen2.5-0.5b", "qwen2-1.5b": "qwen2.5-1.5b", "qwen2-7b": "qwen2.5-7b", "qwen2-72b": "qwen2.5-72b",
            "qwen-1_8b": "qwen-1.8b", **{hub_id.lower(): name for name, hub_ids in _HUB_IDS.items() for hub_id in hub_ids}}


def model_names() -> list[str]:
    """Preset names."""
    return sorted([*_PRESETS, *_READ_PRESETS])


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, a Hugging Face config.json given as a path, or a file of Megatron-LM
    arguments (zeroplan.presets.megatron_args; its model only: fit plans its run settings too)."""
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
    from zeroplan.presets.megatron_args import megatron_arguments_path, model_only

    megatron = megatron_arguments_path(name_or_path)
    if megatron is not None:
        return model_only(megatron)
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        from zeroplan.presets.hf_config import load_hf_config

        return load_hf_config(Path(name_or_path))
    raise unknown_name_error("model", name_or_path, known_model_names(), UNLISTED_MODELS)


def is_preset_name(name: str) -> bool:
    """Whether get_model reads ``name`` as a preset (or an alias or hub id of one), not a path."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key in _PRESETS or key in _READ_PRESETS


UNLISTED_MODELS = ("a preset `zeroplan models` lists, its Hugging Face hub id, a config.json path, or a file of "
                   "Megatron-LM arguments")
"""What an unknown model's error names instead of the ~300 preset names and hub ids."""


def known_model_names() -> list[str]:
    """Every name get_model takes: presets, short aliases, and hub ids as the hub spells them."""
    hub_ids = [hub_id for hub_ids in _HUB_IDS.values() for hub_id in hub_ids]
    return [*_PRESETS, *_READ_PRESETS, *(alias for alias in _ALIASES if "/" not in alias), *hub_ids]
