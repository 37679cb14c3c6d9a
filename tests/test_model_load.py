"""--model-load (zeroplan.core.model_load): what a rank holds while the model is loaded, on the
host and on the GPU, and the verdict it decides."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from zeroplan.cli.main import main
from zeroplan.core.finetune.activations import zero3_linear_keeps_input
from zeroplan.core.params import total_parameters
from zeroplan.presets.models import get_model
from tests.refusals import run_refused

# FLAN-T5-XXL's run on 4 V100 16GB under ZeRO-3 with both offloads, fp32 (the published rows').
T5 = ["benchmarks/published_memory/configs/flan-t5-xxl.json", "--gpus", "4", "--gpu", "v100-16gb", "--seq-len", "512",
      "--target-len", "129", "--activation-checkpointing", "full", "--precision", "fp32", "--framework", "hf",
      "--attention", "eager", "--strategies", "zero3-param-offload"]
# GPT-2 XL under ZeRO-3 on 8 A100 80GB: the whole model fits every GPU, and ZeRO-3 keeps nothing on the host.
GPT2 = ["gpt2-xl", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", "1024", "--framework", "hf", "--strategies", "zero3"]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["fit", *argv])
    return code, out.getvalue(), err.getvalue()


def _plan(argv: list[str]) -> dict:
    code, out, err = _run([*argv, "--format", "json"])
    assert code == 0, err
    return json.loads(out)["plans"][0]


@pytest.fixture(autouse=True)
def _at_repository_root(monkeypatch, request) -> None:
    monkeypatch.chdir(request.config.rootpath)


def test_the_default_is_the_sharded_load_and_leaves_the_answer_as_it_was() -> None:
    default, sharded = _plan(T5), _plan([*T5, "--model-load", "sharded"])
    assert default == sharded
    assert "load_gpu_bytes" not in default and "load_host_bytes_per_node" not in default
    assert default["fits"] is True


def test_a_whole_fp32_model_moved_onto_each_gpu_runs_out_at_load() -> None:
    code, out, _ = _run([*T5, "--model-load", "full-per-rank", "--detail"])
    assert code == 0
    plan = _plan([*T5, "--model-load", "full-per-rank"])
    params = total_parameters(get_model("benchmarks/published_memory/configs/flan-t5-xxl.json"))
    assert plan["load_gpu_bytes"] == 4 * params > plan["usable_memory_bytes"]
    # The step alone still fits: it is the load that fails, and no micro-batch changes that.
    assert plan["memory"]["peak_bytes"] <= plan["usable_memory_bytes"]
    assert plan["fits"] is False and plan["max_micro_batch_size"] == 0 and plan["borderline"] is False
    row = next(line for line in out.splitlines() if line.startswith("zero3-param-offload "))
    assert " load " in row
    out = " ".join(out.split())
    assert "Verdict: Nothing fits at load: zero3-param-offload's step fits on the GPU" in out
    assert f"the whole model, {4 * params / 2**30:.1f} GiB, onto each GPU" in out


def test_the_engine_moves_the_module_in_its_16_bit_dtype_after_an_fp32_load() -> None:
    argv = [*GPT2, "--precision", "bf16-mixed", "--model-load", "full-per-rank"]
    plan = _plan(argv)
    params = total_parameters(get_model("gpt2-xl"))
    assert plan["load_gpu_bytes"] == 2 * params
    assert plan["load_host_bytes_per_node"] == 8 * 4 * params  # from_pretrained's float32, every rank
    assert plan["host_bytes_per_node"] == plan["load_host_bytes_per_node"]  # ZeRO-3 offloads nothing
    assert plan["fits"] is True


def test_the_host_peak_is_the_larger_of_the_load_and_the_step() -> None:
    params = total_parameters(get_model("gpt2-xl"))
    load_gib = 8 * 4 * params / 2**30
    short = _plan([*GPT2, "--model-load", "full-per-rank", "--host-memory-gib", f"{load_gib - 1:.1f}"])
    roomy = _plan([*GPT2, "--model-load", "full-per-rank", "--host-memory-gib", f"{load_gib + 1:.1f}"])
    sharded = _plan([*GPT2, "--host-memory-gib", f"{load_gib - 1:.1f}"])
    assert short["host_fits"] is False and roomy["host_fits"] is True and sharded["host_fits"] is True
    code, out, _ = _run([*GPT2, "--model-load", "full-per-rank", "--host-memory-gib", f"{load_gib - 1:.1f}"])
    assert "of host RAM per node at load (each rank the whole model)" in " ".join(out.split())


def test_a_model_loaded_outside_zero_init_keeps_torchs_linear() -> None:
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.specs.strategy import StrategyKind

    def request(*extra: str):
        args = build_parser().parse_args(["fit", *GPT2, "--lora-rank", "8", *extra])
        return request_from_args(args, StrategyKind.zero3)

    assert zero3_linear_keeps_input(request())
    assert not zero3_linear_keeps_input(request("--model-load", "full-per-rank"))


@pytest.mark.parametrize(("extra", "words"), [
    (["--framework", "zeroplan"], "--model-load: not offered by zeroplan"),
    (["--quantize", "nf4", "--lora-rank", "8"], "--model-load: a nf4 base is loaded by bitsandbytes"),
    (["--strategies", "ddp"], "--model-load: is planned under DeepSpeed ZeRO-3 only"),
])
def test_a_load_that_does_not_apply_is_refused_in_one_line(extra: list[str], words: str, capsys) -> None:
    assert words in run_refused(main, ["fit", *GPT2, "--model-load", "full-per-rank", *extra], capsys)
