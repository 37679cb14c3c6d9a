"""MODEL as a file of Megatron-LM arguments (zeroplan.presets.megatron_args,
zeroplan.cli.megatron_args): the model and the run's settings read from them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args, strategies_asked
from zeroplan.cli.main import build_parser
from zeroplan.cli.megatron_args import RUN_SETTINGS, ignored_line
from zeroplan.core.params import total_parameters
from zeroplan.errors import ZeroplanError
from zeroplan.presets.megatron_args import (
    CHOICES, DEFAULT_ONLY, DEFAULTS, FLAGS, IGNORED, READ, RUN_ARGUMENTS, read_megatron_arguments, read_megatron_arguments_file,
)
from zeroplan.presets.models import get_model
from zeroplan.specs import StrategyKind
from zeroplan.specs.model import MlpKind, NormKind, PositionKind
from zeroplan.specs.training import ActivationCheckpointing, Precision

ROOT = Path(__file__).resolve().parents[1]
GPT2_755 = ROOT / "benchmarks/published_memory/configs/gpt2_755.args"
FIXTURES = ROOT / "tests/fixtures/megatron"
MODEL = "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --max-position-embeddings 128 --vocab-size 1000"


def _fit_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["fit", *argv])


def test_gpt2_755_reads_the_scripts_shape_and_run() -> None:
    launch = read_megatron_arguments_file(GPT2_755)
    model = launch.model
    assert (model.num_layers, model.hidden_size, model.num_heads, model.max_positions) == (36, 1280, 20, 1024)
    # arguments.py:1320-1327 under --swiglu: int((4 x 1280 x 2/3) / 64) x 64; the run's dump prints 3392.
    assert model.ffn_hidden_size == 3392 and model.mlp is MlpKind.swiglu
    assert model.norm is NormKind.layernorm and model.position is PositionKind.learned
    assert model.bias and model.tied_embeddings and model.kv_heads == 20
    assert (model.attention_dropout, model.hidden_dropout) == (0.1, 0.1)
    assert (launch.tp, launch.pp, launch.micro_batch_size, launch.global_batch_size, launch.seq_len) == (1, 1, 4, 16, 1024)
    assert launch.precision is Precision.fp16_mixed and launch.distributed_optimizer
    assert launch.checkpointing is ActivationCheckpointing.none
    ignored = {line.split(":")[0] for line in launch.ignored}
    assert {"--lr", "--data-path", "--save", "--distributed-backend", "--log-memory-to-tensorboard"} <= ignored


def test_ignored_arguments_are_listed_with_their_reason() -> None:
    line = ignored_line(read_megatron_arguments_file(GPT2_755))
    assert "--lr," in line and "--save," in line and "no tensor's size" in line and "\n" not in line


def test_gpt2_755_parameters_equal_megatrons_own_count() -> None:
    """The run's log (github.com/jindajia/Megatron-LM/blob/9d7b467e/debug/terminal.txt, line 302)
    prints Megatron's own count of the model it built: 771,201,024 parameters, with the
    vocabulary padded from 50,257 to 50,304 (line 286)."""
    request = request_from_args(_fit_args(str(GPT2_755), "--framework", "megatron", "--gpus", "1", "--gpu", "v100-32gb"))
    assert request.model.vocab_size == 50304
    assert total_parameters(request.model) == 771_201_024


_RECORDED = json.loads((ROOT / "benchmarks/megatron-args-records/records.json").read_text())
RECORDS = _RECORDED["records"]
DEFINED = _RECORDED["arguments"]
"""How Megatron-LM d98e8a6's own parser (add_megatron_arguments) defines each argument."""


def test_every_argument_read_or_ignored_is_megatron_lms() -> None:
    assert set(DEFINED) == READ | set(IGNORED)
    unknown = sorted(name for name, definition in DEFINED.items() if definition is None)
    assert not unknown, f"not Megatron-LM d98e8a6 arguments: {unknown}"
    for name, definition in DEFINED.items():
        assert definition["takes_value"] == (name not in FLAGS and not (name in IGNORED and not IGNORED[name][0])), name


def test_defaults_and_choices_are_megatron_lms() -> None:
    for name, default in DEFAULTS.items():
        assert DEFINED[name]["default"] == default, name
    for name, default in DEFAULT_ONLY.items():
        assert DEFINED[name]["default"] == default, name
    for name, choices in CHOICES.items():
        assert DEFINED[name]["choices"] == list(choices), name


@pytest.mark.parametrize("record", RECORDS, ids=lambda record: Path(record["file"]).stem)
def test_parameters_equal_megatron_lms_own_build(record: dict) -> None:
    """Megatron-LM d98e8a6's own parse_args, validate_args and gpt_builder counted each file's
    model at tp 1 (benchmarks/megatron_args_counts.py); zeroplan's reading, padded as Megatron
    pads it, counts the same."""
    model = read_megatron_arguments_file(ROOT / record["file"]).model
    assert model.vocab_size == record["vocab_size"]
    assert total_parameters(model.model_copy(update={"vocab_size": record["padded_vocab_size"]})) == record["parameters"]


def test_gpt2_755_run_settings_reach_the_request() -> None:
    args = _fit_args(str(GPT2_755), "--framework", "megatron", "--gpus", "1", "--gpu", "v100-32gb")
    assert strategies_asked(args) == (StrategyKind.zero1,)
    request = request_from_args(args, StrategyKind.zero1)
    assert (request.batch.micro_batch_size, request.batch.grad_accum_steps, request.batch.seq_len) == (4, 4, 1024)
    assert request.training.precision is Precision.fp16_mixed
    assert (request.parallel.tp, request.parallel.pp) == (1, 1)


def test_example_scripts_give_the_presets() -> None:
    """Megatron-LM's GPT-3 175B and Llama-3-8B examples (tests/fixtures/megatron) describe the
    presets' shapes; Megatron's qkv and gated fc1 are one module each (fused_qkv, fused_gate_up),
    Hugging Face's Llama has separate ones, and its 4.38 code builds a positions-wide causal mask
    Megatron's does not (positions_causal_mask)."""
    gpt3 = read_megatron_arguments_file(FIXTURES / "gpt3_175b.args")
    assert gpt3.model.model_copy(update={"name": "gpt3-175b"}) == get_model("gpt3-175b")
    assert (gpt3.tp, gpt3.pp) == (8, 16)
    llama = read_megatron_arguments_file(FIXTURES / "llama3_8b.args").model
    assert llama.fused_qkv and llama.fused_gate_up
    assert not llama.positions_causal_mask
    unfused = llama.model_copy(update={"name": "llama-3-8b", "fused_qkv": False, "fused_gate_up": False,
                                       "positions_causal_mask": True})
    assert unfused == get_model("llama-3-8b")


@pytest.mark.parametrize(("extra", "ffn"), [("", 4 * 4096), ("--swiglu", 10880)])
def test_ffn_width_defaults_as_megatron(extra: str, ffn: int) -> None:
    # arguments.py:1320-1329: 4h, or int((4h x 2/3) / 64) x 64 with --swiglu (4096: 10922.7 -> 10880).
    text = f"--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --max-position-embeddings 128 --vocab-size 1000 {extra}"
    assert read_megatron_arguments(text, "m").model.ffn_hidden_size == ffn


def test_query_groups_count_only_with_group_query_attention() -> None:
    # argument_utils.py:330-333: num_query_groups is None without --group-query-attention.
    assert read_megatron_arguments(f"{MODEL} --num-query-groups 2", "m").model.kv_heads == 4
    assert read_megatron_arguments(f"{MODEL} --group-query-attention --num-query-groups 2", "m").model.kv_heads == 2


def test_bias_switches() -> None:
    biased = read_megatron_arguments(MODEL, "m").model
    assert biased.bias and not biased.qkv_bias
    qkv = read_megatron_arguments(f"{MODEL} --disable-bias-linear --add-qkv-bias", "m").model
    assert not qkv.bias and qkv.qkv_bias
    assert total_parameters(biased) > total_parameters(qkv) > total_parameters(
        read_megatron_arguments(f"{MODEL} --disable-bias-linear", "m").model)


@pytest.mark.parametrize(("text", "named"), [
    (f"{MODEL} --foo-bar 3", "--foo-bar"),
    (f"{MODEL} --position-embedding-type yarn", "--position-embedding-type"),
    (f"{MODEL} --normalization ScaleNorm", "--normalization"),
    (f"{MODEL} --make-vocab-size-divisible-by 64", "--make-vocab-size-divisible-by"),
    (f"{MODEL} --attention-backend fused", "--attention-backend"),
    (f"{MODEL} --rotary-percent 0.5 --position-embedding-type rope", "--rotary-percent"),
    (f"{MODEL} --recompute-granularity full --recompute-method uniform --recompute-num-layers 2", "--recompute-method"),
    (MODEL.replace("--num-layers 2", "--num-layers two"), "--num-layers"),
    (MODEL.replace("--num-attention-heads 4", "--num-attention-heads 3"), "--num-attention-heads"),
    (MODEL.replace(" --vocab-size 1000", ""), "--vocab-size"),
    (MODEL.replace("--max-position-embeddings 128", ""), "--max-position-embeddings"),
    (f"{MODEL} --fp16 --bf16", "--bf16"),
    (f"{MODEL} --seq-length 256", "--seq-length"),
    (f"{MODEL} --swiglu 1", "--swiglu"),
    # Megatron-LM's parser (allow_abbrev=False) knows --num-layers only.
    (f"{MODEL} --num_layers 3", "--num_layers"),
])
def test_refusals_name_the_argument(text: str, named: str) -> None:
    with pytest.raises(ZeroplanError) as error:
        read_megatron_arguments(text, "m")
    assert error.value.field == named and "\n" not in str(error.value)


def test_recomputation_maps_onto_checkpointing() -> None:
    def policy(extra: str) -> ActivationCheckpointing:
        return read_megatron_arguments(f"{MODEL} {extra}", "m").checkpointing

    assert policy("--recompute-activations") is ActivationCheckpointing.selective
    assert policy("--recompute-granularity selective") is ActivationCheckpointing.selective
    assert policy("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1") is ActivationCheckpointing.full
    assert policy("--recompute-granularity full --recompute-method block --recompute-num-layers 2") is ActivationCheckpointing.full


def test_flags_must_agree_with_the_arguments(tmp_path: Path) -> None:
    with pytest.raises(ZeroplanError) as error:
        request_from_args(_fit_args(str(GPT2_755), "--framework", "megatron", "--gpus", "1", "--tp", "2"))
    assert error.value.field == "--tp"
    with pytest.raises(ZeroplanError) as error:  # 16 sequences are not a multiple of 4 x 8 ranks
        request_from_args(_fit_args(str(GPT2_755), "--framework", "megatron", "--gpus", "8"))
    assert error.value.field == "--global-batch-size"
    with pytest.raises(ZeroplanError) as error:
        request_from_args(_fit_args(str(GPT2_755), "--gpus", "1"))
    assert error.value.field == "--framework"


def test_run_settings_map_onto_fits_flags_with_their_defaults() -> None:
    assert set(RUN_SETTINGS) == set(RUN_ARGUMENTS)
    defaults = _fit_args("gpt2")
    for attribute, flag, default in RUN_SETTINGS.values():
        assert getattr(defaults, attribute) == default, flag


def test_model_only_commands_refuse_run_settings(tmp_path: Path) -> None:
    path = tmp_path / "shape.args"
    path.write_text(MODEL + "\n")
    assert get_model(str(path)).num_layers == 2
    with pytest.raises(ZeroplanError) as error:
        get_model(str(GPT2_755))
    assert error.value.field == "--tensor-model-parallel-size"
