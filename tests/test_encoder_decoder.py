"""Encoder-decoders (zeroplan.core.encoder_decoder, zeroplan.presets.hf_encoder_decoder).

META_COUNTS are sum(p.numel() for p in model.parameters()) of AutoModelForSeq2SeqLM.from_config
built under torch.device("meta") with transformers 4.56.2 from each preset's config
(test_meta_counts_are_what_transformers_builds measures them again). The saved-bytes tests run
transformers' own T5ForConditionalGeneration (eager, its only attention) under saved-tensor
hooks and count every floating or bool tensor autograd keeps that is not a parameter (a frozen
stream's tensors too: under LoRA the first block of each stack reads an embedding that needs no
gradient), by storage: one and two blocks of each stack give the per-block terms, one of each
the outside terms. Dropout on the CPU keeps an e-byte noise tensor where CUDA keeps a 1-byte mask
(zeroplan.core.finetune.activations.dropout_mask_bytes, Kernels.cpu here).
"""

from __future__ import annotations

import json

import pytest

from zeroplan.core.params import parameter_units, total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import parse_hf_config
from zeroplan.presets.models import _ENCODER_DECODER_CONFIGS, get_model
from zeroplan.specs.training import Kernels
from tests.transformers_meta import meta_parameter_count

META_COUNTS = {
    "t5-base": 222_903_552, "t5-large": 737_668_096, "t5-3b": 2_851_598_336, "t5-11b": 11_307_321_344,
    "t0-3b": 2_849_757_184, "mt0-xxl": 12_921_057_280, "bart-large": 406_291_456,
}


@pytest.mark.parametrize("name,count", sorted(META_COUNTS.items()))
def test_preset_counts_equal_the_meta_device_counts(name: str, count: int) -> None:
    spec = get_model(name)
    assert spec.parameter_count_exact and spec.is_encoder_decoder
    assert total_parameters(spec) == count


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(META_COUNTS))
def test_meta_counts_are_what_transformers_builds(name: str) -> None:
    assert meta_parameter_count(_ENCODER_DECODER_CONFIGS[name], "AutoModelForSeq2SeqLM") == META_COUNTS[name]


def test_t5_units_put_the_relative_bias_in_each_stacks_first_block() -> None:
    spec = get_model("t0-3b")
    units = parameter_units(spec)
    assert [u.name for u in units][:2] == ["embedding", "block.0"] and units[-1].name == "head"
    with_bias = [u.name for u in units if any(t.name == "attention.relative_bias.weight" for t in u.tensors)]
    assert with_bias == ["block.0", "block.24"]
    assert any(t.name == "cross_attention.q.weight" for t in units[25].tensors)
    assert not any(t.name.startswith("cross_attention") for t in units[24].tensors)
    assert [t.name for t in units[-1].tensors] == ["final_norm.weight", "lm_head.weight"]


def test_umt5_has_a_bias_in_every_self_attention() -> None:
    spec = parse_hf_config({"model_type": "umt5", "vocab_size": 100, "d_model": 64, "d_kv": 16, "d_ff": 128,
                            "num_layers": 2, "num_heads": 4}, "x")
    assert sum(t.name == "attention.relative_bias.weight" for u in parameter_units(spec) for t in u.tensors) == 4


@pytest.mark.parametrize("changes,field", [
    ({"feed_forward_proj": "gated-silu"}, "config.feed_forward_proj"),
    ({"num_layers": "24"}, "config.num_layers"),
    ({"d_model": 0}, "config.d_model"),
])
def test_unmodelled_t5_options_are_refused_in_one_line(changes: dict, field: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        parse_hf_config({**_ENCODER_DECODER_CONFIGS["t0-3b"], **changes}, "x")
    assert error.value.field == field and "\n" not in str(error.value)


@pytest.mark.parametrize("model_type", ["longt5", "switch_transformers", "pegasus"])
def test_other_encoder_decoders_are_refused_by_name(model_type: str) -> None:
    with pytest.raises(ZeroplanError, match=f"config.model_type: '{model_type}' is an encoder-decoder zeroplan does not read"):
        parse_hf_config({"model_type": model_type, "d_model": 64, "is_encoder_decoder": True}, "x")


def _request(model: str, *flags: str):
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser

    return request_from_args(build_parser().parse_args(["fit", model, "--gpus", "1", *flags]))


def test_target_len_is_refused_for_one_stack() -> None:
    from zeroplan.core.plan import plan

    with pytest.raises(ZeroplanError, match="batch.target_len"):
        plan(_request("gpt2", "--seq-len", "64", "--target-len", "8"))


def test_bart_activations_are_refused_in_one_line() -> None:
    from zeroplan.core.plan import plan

    with pytest.raises(ZeroplanError) as error:
        plan(_request("bart-large", "--framework", "hf", "--attention", "eager", "--seq-len", "64"))
    assert error.value.field == "model.encoder_decoder" and "\n" not in str(error.value)


def test_step_time_is_refused_in_one_line_and_memory_planned() -> None:
    from zeroplan.core.communication import collectives
    from zeroplan.core.plan import plan
    from zeroplan.core.timing import step_time

    request = _request("t0-3b", "--framework", "hf", "--attention", "eager", "--precision", "fp32",
                       "--seq-len", "64", "--target-len", "4", "--micro-batch", "8")
    result = plan(request, largest_micro_batch=False)
    assert result.time is None and result.memory.logits_bytes == 3 * 4 * 4 * 8 * 32128
    with pytest.raises(ZeroplanError, match="model: t0-3b is an encoder-decoder, whose step time is not modelled"):
        step_time(request, tuple(collectives(request)))


S, T, B = 48, 16, 2
TINY_T5 = {"model_type": "t5", "vocab_size": 100, "d_model": 64, "d_kv": 16, "num_heads": 4, "d_ff": 256,
           "tie_word_embeddings": False}


def _saved_bytes(torch, model, call) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        if tensor.is_floating_point() or tensor.dtype == torch.bool:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in params:
                storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return sum(storages.values())


def _measure(torch, transformers, raw: dict, encoder: int, decoder: int, dtype, lora_dropout: float | None) -> int:
    config = transformers.AutoConfig.for_model(**raw, num_layers=encoder, num_decoder_layers=decoder)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).to(dtype).train()
    if lora_dropout is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_2_SEQ_LM", r=8, lora_dropout=lora_dropout))
    source, target = torch.randint(0, 100, (B, S)), torch.randint(0, 100, (B, T))
    return _saved_bytes(torch, model, lambda: model(input_ids=source, decoder_input_ids=target))


# (feed_forward_proj, dropout_rate, precision, LoRA dropout or None for a full fine-tune)
SAVED_CASES = [
    ("relu", 0.0, "fp32", None), ("gated-gelu", 0.0, "fp32", None), ("gated-gelu", 0.1, "fp32", None),
    ("relu", 0.0, "bf16-pure", None), ("gated-gelu", 0.1, "bf16-pure", None),
    ("gated-gelu", 0.0, "fp32", 0.0), ("gated-gelu", 0.1, "fp32", 0.1), ("relu", 0.1, "fp32", 0.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("proj,dropout,precision,lora_dropout", SAVED_CASES)
def test_t5_blocks_save_what_the_plan_counts(proj: str, dropout: float, precision: str, lora_dropout, tmp_path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.core import encoder_decoder as ed

    raw = {**TINY_T5, "feed_forward_proj": proj, "dropout_rate": dropout}
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    one = _measure(torch, transformers, raw, 1, 1, dtype, lora_dropout)
    encoder = _measure(torch, transformers, raw, 2, 1, dtype, lora_dropout) - one
    decoder = _measure(torch, transformers, raw, 1, 2, dtype, lora_dropout) - one
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "num_layers": 1, "num_decoder_layers": 1}))
    lora = [] if lora_dropout is None else ["--lora-rank", "8", "--lora-dropout", str(lora_dropout), "--base-dtype", "fp32"]
    request = _request(str(path), "--framework", "hf", "--attention", "eager", "--precision", precision,
                       "--seq-len", str(S), "--target-len", str(T), "--micro-batch", str(B), *lora)
    # Measured on the CPU: its dropout keeps the e-byte noise (dropout_mask_bytes).
    request = request.model_copy(update={"training": request.training.model_copy(update={"kernels": Kernels.cpu})})
    assert (encoder, decoder) == (ed.encoder_block_bytes(request), ed.decoder_block_bytes(request))
    assert one == encoder + decoder + ed.outside_kept_bytes(request)


@pytest.mark.slow
def test_fit_prints_no_step_time_and_compare_refuses(zeroplan_cli) -> None:
    args = ("t0-3b", "--gpus", "1", "--framework", "hf", "--attention", "eager", "--precision", "fp32",
            "--seq-len", "64", "--target-len", "4", "--micro-batch", "8", "--strategies", "ddp")
    code, out, err = zeroplan_cli("fit", *args)
    assert code == 0, err
    assert "step time: not modelled for an encoder-decoder" in out
    code, _, err = zeroplan_cli("compare", *args)
    assert code == 2 and "model: t0-3b is an encoder-decoder" in err and err.strip().count("\n") == 0


@pytest.mark.slow
def test_explain_and_csv_show_the_missing_step_time(zeroplan_cli) -> None:
    args = ("t0-3b", "--gpus", "1", "--framework", "hf", "--attention", "eager", "--precision", "fp32",
            "--seq-len", "64", "--target-len", "4", "--micro-batch", "8", "--strategies", "ddp")
    code, out, err = zeroplan_cli("fit", *args, "--explain", "ddp")
    assert code == 0, err
    assert any(line.split()[:2] == ["step", "-"] and "not modelled for an encoder-decoder" in line
               for line in out.splitlines())
    code, out, err = zeroplan_cli("fit", *args, "--format", "csv")
    assert code == 0, err
    header, row = out.strip().splitlines()[:2]
    columns = dict(zip(header.split(","), row.split(",")))
    assert columns["step_with_overlap_s"] == "" and int(columns["peak_bytes"]) > 0


@pytest.mark.slow
def test_time_figures_refuse_an_encoder_decoder_in_one_line() -> None:
    pytest.importorskip("matplotlib")
    from zeroplan.core.plan import fit
    from zeroplan.report.plots import step_time_figure

    report = fit(_request("t0-3b", "--framework", "hf", "--attention", "eager", "--precision", "fp32",
                          "--seq-len", "64", "--target-len", "4", "--micro-batch", "8", "--strategies", "ddp"))
    with pytest.raises(ZeroplanError, match="model: t0-3b has no modelled step time") as error:
        step_time_figure(report)
    assert "\n" not in str(error.value)
