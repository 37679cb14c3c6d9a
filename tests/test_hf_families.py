"""OPT, Falcon, GPT-J, MPT, GPTBigCode (StarCoder) and StarCoder2 configs (zeroplan.presets.hf_families).

Fixtures are the published config.json values, by hand: facebook/opt-1.3b, tiiuae/falcon-40b,
EleutherAI/gpt-j-6b and mosaicml/mpt-7b whole; bigcode/starcoder and bigcode/starcoder2-3b only
the keys that set the shapes (the others change no parameter). META_COUNTS are
sum(p.numel() for p in model.parameters()) of AutoModelForCausalLM.from_config built under
torch.device("meta") with transformers 4.56.2 from each fixture; test_meta_counts_are_what_transformers_builds
measures them again. The saved-bytes tests run one decoder layer of transformers 4.56.2 (eager
attention, fp32 so no dtype cast adds a copy; MPT in bf16, where its fp32 softmax is the point)
under saved-tensor hooks and count what autograd keeps: the tensors that need a gradient and bool
masks, by storage, parameters left out (the constants autograd also keeps, RoPE's cos and sin and
ALiBi's bias, the planner leaves out too). Dropout is 0: on the CPU, F.dropout multiplies by an
e-byte noise tensor where CUDA's fused kernel keeps the 1-byte mask the planner counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.core.activations import layer_terms
from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config, parse_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import MlpKind, TrainingSpec
from tests.transformers_meta import meta_parameter_count

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

META_COUNTS = {
    "opt-1.3b.json": 1_315_758_080,
    "opt-350m.json": 331_196_416,
    "falcon-7b.json": 6_921_720_704,
    "falcon-40b.json": 41_303_293_952,
    "gpt-j-6b.json": 6_050_882_784,
    "mpt-7b.json": 6_649_286_656,
    "starcoder.json": 15_517_456_384,
    "starcoder2-3b.json": 3_030_371_328,
}


@pytest.mark.parametrize("fixture,count", sorted(META_COUNTS.items()))
def test_counts_equal_the_meta_device_counts(fixture: str, count: int) -> None:
    spec = load_hf_config(FIXTURES / fixture)
    assert spec.parameter_count_exact, spec.parameter_count_caveat
    assert total_parameters(spec) == count


@pytest.mark.slow
@pytest.mark.parametrize("fixture", sorted(META_COUNTS))
def test_meta_counts_are_what_transformers_builds(fixture: str) -> None:
    assert meta_parameter_count(json.loads((FIXTURES / fixture).read_text())) == META_COUNTS[fixture]


def test_every_family_is_a_supported_model_type() -> None:
    assert {"opt", "falcon", "gptj", "mpt", "gpt_bigcode", "starcoder2"} <= set(SUPPORTED_MODEL_TYPES)


def test_opt_has_an_offset_position_table_and_a_relu_mlp() -> None:
    spec = load_hf_config(FIXTURES / "opt-1.3b.json")
    assert spec.mlp is MlpKind.relu and not spec.mlp.gated and spec.tied_embeddings and spec.bias
    embedding = parameter_units(spec)[0]
    assert [t.shape for t in embedding.tensors] == [(50272, 2048), (2048 + 2, 2048)]
    assert spec.max_positions == 2048 and spec.hidden_dropout == 0.1
    # ReLU's saved output is fc2's input: f per token where GELU keeps 2f.
    training = TrainingSpec()
    gelu = spec.model_copy(update={"mlp": MlpKind.gelu})
    f_bytes = 2 * 512 * spec.ffn_hidden_size
    assert layer_terms(gelu, training, 512, 1)["mlp_inner"] - layer_terms(spec, training, 512, 1)["mlp_inner"] == f_bytes


def test_falcon_7b_reads_as_its_preset() -> None:
    read = load_hf_config(FIXTURES / "falcon-7b.json")
    assert read.model_copy(update={"name": "falcon-7b"}) == get_model("falcon-7b")


def test_falcon_40b_is_grouped_query_with_two_norms() -> None:
    spec = load_hf_config(FIXTURES / "falcon-40b.json")
    assert (spec.num_heads, spec.kv_heads, spec.norms_per_block) == (128, 8, 2) and not spec.parallel_block
    assert spec.parallel_residual


def test_gpt_bigcode_dropout_defaults_are_its_config_class_ones() -> None:
    # GPTBigCodeConfig: attn_pdrop, resid_pdrop and embd_pdrop default to 0.1.
    spec = load_hf_config(FIXTURES / "starcoder.json")
    assert (spec.attention_dropout, spec.hidden_dropout, spec.kv_heads) == (0.1, 0.1, 1)


def test_gptj_biases_its_mlp_and_head_only() -> None:
    spec = load_hf_config(FIXTURES / "gpt-j-6b.json")
    block = {t.name for t in parameter_units(spec)[1].tensors}
    assert {"mlp.fc1.bias", "mlp.fc2.bias"} <= block and not any(n.startswith("attention.") and n.endswith(".bias") for n in block)
    assert spec.parallel_block and spec.head_bias and not spec.tied_embeddings


def test_litgpt_refuses_gptj_whose_mlp_alone_is_biased() -> None:
    from zeroplan.core.profiles import litgpt_builds

    assert litgpt_builds(load_hf_config(FIXTURES / "gpt-j-6b.json")) == "biases on the MLP alone or a ReLU MLP"
    assert litgpt_builds(load_hf_config(FIXTURES / "falcon-40b.json")) is None


def test_mpt_norms_have_no_bias() -> None:
    spec = load_hf_config(FIXTURES / "mpt-7b.json")
    assert not spec.norm_bias and spec.position.value == "alibi"
    assert all(not t.name.endswith("norm.bias") for unit in parameter_units(spec) for t in unit.tensors)


def _config(fixture: str, **changes: object) -> dict:
    return {**json.loads((FIXTURES / fixture).read_text()), **changes}


@pytest.mark.parametrize("fixture,changes,field", [
    ("opt-1.3b.json", {"activation_function": "gelu"}, "config.activation_function"),
    ("opt-1.3b.json", {"layerdrop": 0.1}, "config.layerdrop"),
    ("falcon-7b.json", {"alibi": True}, "config.alibi"),
    ("falcon-7b.json", {"hidden_dropout": 0.1}, "config.hidden_dropout"),
    ("falcon-40b.json", {"parallel_attn": False}, "config.parallel_attn"),
    ("gpt-j-6b.json", {"activation_function": "relu"}, "config.activation_function"),
    ("mpt-7b.json", {"expansion_ratio": 8}, "config.expansion_ratio"),
    ("mpt-7b.json", {"no_bias": False}, "config.no_bias"),
    ("mpt-7b.json", {"attn_config": {"alibi": False}}, "config.attn_config.alibi"),
    ("starcoder.json", {"activation_function": "relu"}, "config.activation_function"),
    ("starcoder2-3b.json", {"hidden_act": "silu"}, "config.hidden_act"),
])
def test_unmodelled_options_are_refused_in_one_line(fixture: str, changes: dict, field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        parse_hf_config(_config(fixture, **changes), "x")
    assert error.value.field == field and "\n" not in str(error.value) and "allowed" in str(error.value)


@pytest.mark.parametrize("model_type", ["t5", "mt5", "umt5"])
def test_an_encoder_decoder_is_read_with_two_stacks(model_type: str) -> None:
    # bigscience/T0_3B and mt0-xxl (the PEFT README's rows) are T5 v1.1 and mT5 configs
    # (zeroplan.presets.hf_encoder_decoder; tests/test_encoder_decoder.py).
    config = {"model_type": model_type, "vocab_size": 100, "d_model": 2048, "d_kv": 64, "d_ff": 5120, "num_heads": 32,
              "num_layers": 24, "num_decoder_layers": 24, "is_encoder_decoder": True}
    spec = parse_hf_config(config, "x")
    assert (spec.encoder_layers, spec.decoder_layers) == (24, 24)


def test_mpt_widths_must_be_json_integers() -> None:
    with pytest.raises(ZeroplanError, match="config.d_model: must be a JSON integer"):
        parse_hf_config(_config("mpt-7b.json", d_model="4096"), "x")


@pytest.mark.slow
def test_fit_plans_an_opt_config(zeroplan_cli) -> None:
    code, out, err = zeroplan_cli("fit", "--detail", str(FIXTURES / "opt-1.3b.json"), "--gpus", "8", "--seq-len", "512")
    assert code == 0, err
    assert "1,315,758,080 parameters" in out


@pytest.mark.slow
def test_measure_refuses_a_relu_mlp_before_launching_any_rank(zeroplan_cli, tmp_path) -> None:
    pytest.importorskip("torch")
    code, _, err = zeroplan_cli("measure", str(FIXTURES / "opt-1.3b.json"), "--strategy", "zero3", "--nproc", "2",
                                "--out", str(tmp_path / "runs"))
    assert code == 2 and err.strip().count("\n") == 0 and "model." in err and not (tmp_path / "runs").exists()


S, B = 64, 2
LAYER_KEY = {"gptj": "n_layer", "gpt_bigcode": "n_layer", "mpt": "n_layers"}


def _saved_bytes(torch, layer, call) -> int:
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        if tensor.requires_grad or tensor.dtype == torch.bool:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in params:
                storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return sum(storages.values())


def _layer_and_call(torch, transformers, model_type: str, config):
    """transformers 4.56.2's decoder layer of ``model_type`` and a call of its forward on x."""
    pos = torch.arange(S)[None].expand(B, S)
    if model_type == "opt":
        from transformers.models.opt.modeling_opt import OPTDecoderLayer
        return OPTDecoderLayer(config, 0), lambda layer, x: layer(x, attention_mask=None)
    if model_type == "falcon":
        from transformers.models.falcon.modeling_falcon import FalconDecoderLayer, FalconRotaryEmbedding

        def falcon(layer, x):
            rope = FalconRotaryEmbedding(config)(x, pos)
            return layer(x, alibi=None, attention_mask=torch.zeros(B, 1, S, S), position_ids=pos, position_embeddings=rope)
        return FalconDecoderLayer(config, 0), falcon
    if model_type == "gptj":
        from transformers.models.gptj.modeling_gptj import GPTJBlock
        return GPTJBlock(config, 0), lambda layer, x: layer(x, position_ids=pos)
    if model_type == "gpt_bigcode":
        from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeBlock
        return GPTBigCodeBlock(config, 0), lambda layer, x: layer(x)
    if model_type == "starcoder2":
        from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2DecoderLayer, Starcoder2RotaryEmbedding

        def starcoder2(layer, x):
            rope = Starcoder2RotaryEmbedding(config)(x, pos)
            return layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
        return Starcoder2DecoderLayer(config, 0), starcoder2
    from transformers.models.mpt.modeling_mpt import MptBlock, build_mpt_alibi_tensor

    def mpt(layer, x):
        alibi = build_mpt_alibi_tensor(config.n_heads, S, config.attn_config.alibi_bias_max).to(x.dtype)
        return layer(x, position_bias=alibi, attention_mask=None)
    return MptBlock(config, 0), mpt


# (model_type, config, precision, bytes transformers keeps beyond layer_terms, as a function of the
# spec, e and the tokens). K and V expanded to every query head (Falcon, GPTBigCode and StarCoder2
# eager attention, as Llama's repeat_kv: zeroplan.core.frameworks.eager_attention_extra_bytes
# counts it under --framework hf); Falcon-40B's two norms read one block input, saved once
# (ModelSpec.parallel_residual); gelu_new (transformers' NewGELUActivation, spelled out in Python)
# keeps its input, the tanh, the sum and 0.5 x input: 3 f more than F.gelu's input.
def _repeated_kv(spec, e: int, tokens: int) -> int:
    return 2 * e * tokens * (spec.q_size - spec.kv_size)


CASES = [
    ("opt", {"hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 256, "max_position_embeddings": 128,
             "dropout": 0.0, "word_embed_proj_dim": 64}, "fp32", lambda spec, e, t: 0),
    ("falcon", {"hidden_size": 64, "num_attention_heads": 4, "multi_query": True}, "fp32", _repeated_kv),
    ("falcon", {"hidden_size": 64, "num_attention_heads": 4, "multi_query": False, "parallel_attn": False, "bias": True},
     "fp32", lambda spec, e, t: 0),
    ("falcon", {"hidden_size": 64, "num_attention_heads": 4, "new_decoder_architecture": True, "num_kv_heads": 2},
     "fp32", _repeated_kv),
    ("gptj", {"n_embd": 64, "n_head": 4, "rotary_dim": 8, "n_positions": 128}, "fp32",
     lambda spec, e, t: 3 * e * t * spec.ffn_hidden_size),
    ("gpt_bigcode", {"n_embd": 64, "n_head": 4, "n_positions": 128, "attn_pdrop": 0.0, "resid_pdrop": 0.0},
     "fp32", _repeated_kv),
    ("starcoder2", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},
     "fp32", _repeated_kv),
    ("mpt", {"d_model": 64, "n_heads": 4, "max_seq_len": 128}, "bf16-pure", lambda spec, e, t: 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,shape,precision,extra", CASES)
def test_a_layer_saves_what_the_plan_counts(model_type: str, shape: dict, precision: str, extra) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = {"model_type": model_type, "vocab_size": 100, LAYER_KEY.get(model_type, "num_hidden_layers"): 1, **shape}
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = "eager"
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    layer, call = _layer_and_call(torch, transformers, model_type, config)
    layer = layer.to(dtype).train()
    x = torch.randn(B, S, config.hidden_size, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(torch, layer, lambda: call(layer, x))
    spec = parse_hf_config(raw, "tiny")
    training = TrainingSpec(attention_kernel="eager", precision=precision)
    planned = sum(layer_terms(spec, training, S, B).values())
    e = training.precision.compute_bytes
    assert measured == planned + extra(spec, e, S * B), (measured, planned)
    if model_type == "falcon" and shape.get("new_decoder_architecture"):
        assert spec.parallel_residual and spec.saved_norm_inputs == 1  # ln_attn and ln_mlp read one input


# The same layers in bf16 against what `--framework hf --attention eager` plans: layer_terms plus
# zeroplan.core.frameworks.eager_attention_extra_bytes (transformers' fp32 softmax output beside
# its 16-bit copy, and K and V repeated to every head). OPT (the DeepSpeed-Chat row's
# model), GPTBigCode, StarCoder2 and MPT keep exactly that. Falcon's eager path softmaxes in the
# input dtype (F.softmax(..., dtype=hidden_states.dtype)): no fp32 probabilities in bf16, which
# ModelSpec.eager_softmax (EagerSoftmax.hidden) plans. GPT-J's _attn upcasts q and k to fp32 before the
# scores (2 more bytes an element of each): not planned; its gelu_new keeps 3 f more, which the
# hf profile plans (ModelSpec.gelu_form, zeroplan.core.hf_activation).
def _scores(spec, e, t) -> int:
    return spec.num_heads * S * t


HF_EAGER_CASES = [
    (CASES[0], lambda spec, e, t: 0),
    (CASES[1], lambda spec, e, t: 0),
    (CASES[2], lambda spec, e, t: 0),
    (CASES[3], lambda spec, e, t: 0),
    (CASES[4], lambda spec, e, t: (4 - e) * t * (spec.q_size + spec.kv_size)),
    (CASES[5], lambda spec, e, t: 0),
    (CASES[6], lambda spec, e, t: 0),
    (CASES[7], lambda spec, e, t: 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,extra", HF_EAGER_CASES, ids=[f"{c[0]}-{i}" for i, (c, _) in enumerate(HF_EAGER_CASES)])
def test_a_bf16_layer_against_the_hf_eager_plan(case, extra, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.frameworks import eager_attention_extra_bytes

    model_type, shape = case[0], case[1]
    raw = {"model_type": model_type, "vocab_size": 100, LAYER_KEY.get(model_type, "num_hidden_layers"): 1, **shape}
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer, call = _layer_and_call(torch, transformers, model_type, config)
    layer = layer.to(torch.bfloat16).train()
    x = torch.randn(B, S, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    measured = _saved_bytes(torch, layer, lambda: call(layer, x))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    request = request_from_args(build_parser().parse_args([
        "fit", str(path), "--framework", "hf", "--attention", "eager", "--precision", "bf16-pure",
        "--seq-len", str(S), "--micro-batch", str(B), "--gpus", "1", "--allow-longer-seq"]))
    planned = sum(layer_terms(request.model, request.training, S, B).values()) + eager_attention_extra_bytes(request)
    assert measured == planned + extra(request.model, 2, S * B), (measured, planned)


@pytest.mark.slow
def test_a_whole_opt_forward_keeps_its_layers_and_the_outside_terms() -> None:
    # OPTForCausalLM (2 blocks, bf16, eager, no loss): the embedding sum with the offset
    # positions keeps nothing of its own; the final norm's input and the head's input are
    # outside_layers_bytes; each block adds the fp32 softmax output of --framework hf's eager path.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.core.activations import outside_layers_bytes

    raw = {"model_type": "opt", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "ffn_dim": 256, "max_position_embeddings": 128, "dropout": 0.0, "word_embed_proj_dim": 64}
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 100, (B, S))
    measured = _saved_bytes(torch, model, lambda: model(input_ids=ids))
    spec = parse_hf_config(raw, "tiny")
    training = TrainingSpec(attention_kernel="eager", precision="bf16-pure")
    fp32_probabilities = 4 * spec.num_heads * S * S * B
    planned = spec.num_layers * (sum(layer_terms(spec, training, S, B).values()) + fp32_probabilities)
    assert measured == planned + outside_layers_bytes(spec, training, S, B)
