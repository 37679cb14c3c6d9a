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


def test_a_model_loaded_outside_zero_init_keeps_torchs_linear_before_0_19_4() -> None:
    """Init(module=...), which partitions a model loaded whole, replaces F.linear from DeepSpeed
    0.19.4 on (as zero.Init's __enter__ does): under 0.19.8 both loads keep the base linears'
    inputs, under 0.13.3 only the sharded one; the engine casts the adapters of a model loaded
    whole in either release (it has no ds_id)."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.finetune.activations import adapters_stay_fp32
    from zeroplan.specs.strategy import StrategyKind

    def request(*extra: str):
        args = build_parser().parse_args(["fit", *GPT2, "--lora-rank", "8", *extra])
        return request_from_args(args, StrategyKind.zero3)

    assert zero3_linear_keeps_input(request())
    assert zero3_linear_keeps_input(request("--model-load", "full-per-rank"))
    assert not zero3_linear_keeps_input(request("--model-load", "full-per-rank", "--deepspeed-release", "0.13.3"))
    assert zero3_linear_keeps_input(request("--model-load", "sharded", "--deepspeed-release", "0.13.3"))
    assert adapters_stay_fp32(request()) and not adapters_stay_fp32(request("--model-load", "full-per-rank"))


def test_a_full_per_rank_load_keeps_the_step_of_the_sharded_one() -> None:
    """Under DeepSpeed 0.19.8 a model loaded whole runs the same replaced F.linear as one loaded
    inside zero.Init: in fp32 (peft's adapters fp32 under either load) its step is the sharded
    load's, byte for byte; the load only adds. Before, the full-per-rank load dropped every base
    linear's kept input (Llama-2-7B LoRA, 8 A100-40GB, micro-batch 2 x 4,096, no checkpointing:
    39.9 GiB allocated against 55.2 sharded, in bf16; now 47.2, the engine's cast of the adapters
    alone)."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.plan import plan
    from zeroplan.specs.strategy import StrategyKind

    def step(*extra: str):
        args = build_parser().parse_args(["fit", *GPT2, "--lora-rank", "8", "--precision", "fp32", "--flat-reserve", *extra])
        return plan(request_from_args(args, StrategyKind.zero3), False, False)

    sharded, full = step("--model-load", "sharded"), step("--model-load", "full-per-rank")
    assert full.memory.model_dump() == sharded.memory.model_dump()
    assert full.load_gpu_bytes > 0 and sharded.load_gpu_bytes is None


@pytest.mark.parametrize(("extra", "words"), [
    (["--framework", "zeroplan"], "--model-load: not offered by zeroplan"),
    (["--quantize", "nf4", "--lora-rank", "8"], "--model-load: a nf4 base is loaded by bitsandbytes"),
    (["--strategies", "ddp"], "--model-load: is planned under DeepSpeed ZeRO-3 only"),
])
def test_a_load_that_does_not_apply_is_refused_in_one_line(extra: list[str], words: str, capsys) -> None:
    assert words in run_refused(main, ["fit", *GPT2, "--model-load", "full-per-rank", *extra], capsys)


def _request(release: str, load: str):
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.specs.strategy import StrategyKind

    args = build_parser().parse_args(["fit", "llama-2-7b", "--framework", "hf", "--gpu", "a100-40gb", "--gpus", "8",
                                      "--micro-batch", "2", "--seq-len", "4096", "--activation-checkpointing", "none",
                                      "--lora-rank", "8", "--model-load", load, "--deepspeed-release", release])
    return request_from_args(args, StrategyKind.zero3)


def test_a_model_loaded_whole_under_0_13_3_trains_on_torchs_linear_and_pins_its_released_weights() -> None:
    # Before DeepSpeed 0.19.4 the engine's Init(module=...) does not replace F.linear, so each
    # released base weight stays alive through the view torch's linear saves, to its backward
    # (zeroplan.core.deepspeed_torch_linear); loaded inside zero.Init, or under 0.19.8, it does not.
    from zeroplan.core.deepspeed_coordinator import released_after_forward
    from zeroplan.core.deepspeed_torch_linear import pinned_linear_weight_bytes

    old_full = _request("0.13.3", "full-per-rank")
    pinned = pinned_linear_weight_bytes(old_full)
    released = released_after_forward(old_full)
    # Every released 2-D block weight (q, k, v, o, gate, up, down), none of the norms.
    assert pinned == sum(size for name, size in released.items() if name.startswith("block.") and "norm" not in name)
    assert pinned > 0
    for release, load in (("0.13.3", "sharded"), ("0.19.8", "full-per-rank"), ("0.19.8", "sharded")):
        assert pinned_linear_weight_bytes(_request(release, load)) == 0
