"""The default precision on a GPU whose tensor cores take no bf16 (a V100): what its framework
runs there (fp16-mixed, or fp32 where the stack has no fp16), not the bf16 default torch would
run emulated; a precision the user names is kept (every modelled stack runs bf16 on a V100:
their checks read torch.cuda.is_bf16_supported(), True there through emulation)."""

from __future__ import annotations

import pytest

from zeroplan.cli.fit import add_fit_arguments, request_from_args
from zeroplan.cli.parser import OneLineParser
from zeroplan.presets.gpus import get_gpu, gpu_names
from zeroplan.presets.models import get_model
from zeroplan.specs.hardware import ClusterSpec
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.strategy import StrategySpec
from zeroplan.specs.training import Precision, TrainingSpec


def _request(*argv: str) -> PlanRequest:
    parser = OneLineParser(prog="zeroplan fit")
    add_fit_arguments(parser)
    return request_from_args(parser.parse_args(list(argv)))


def test_only_the_v100s_and_the_t4_lack_bf16_tensor_cores() -> None:
    assert sorted(n for n in gpu_names() if not get_gpu(n).has_bf16_tensor_cores) == [
        "t4", "v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb"]


@pytest.mark.parametrize(("framework", "expected"), [
    ("zeroplan", Precision.fp16_mixed), ("hf", Precision.fp16_mixed), ("megatron", Precision.fp16_mixed),
    ("megatron-deepspeed", Precision.fp16_mixed), ("litgpt", Precision.fp16_mixed), ("fairseq", Precision.fp16_mixed),
    ("torchtune", Precision.fp32), ("torchtitan", Precision.fp32),
])
@pytest.mark.parametrize("gpu", ["v100-16gb", "v100-32gb", "v100-pcie-32gb", "t4"])
def test_command_line_default_on_a_v100(framework: str, expected: Precision, gpu: str) -> None:
    model = "gpt2" if framework == "fairseq" else "llama-2-7b"
    assert _request(model, "--framework", framework, "--gpu", gpu).training.precision is expected


@pytest.mark.parametrize(("framework", "expected"), [
    ("zeroplan", Precision.bf16_mixed), ("hf", Precision.bf16_mixed), ("torchtune", Precision.bf16_pure),
    ("torchtitan", Precision.bf16_mixed), ("litgpt", Precision.bf16_pure),
])
def test_command_line_default_with_bf16_tensor_cores_is_the_frameworks(framework: str, expected: Precision) -> None:
    assert _request("llama-2-7b", "--framework", framework, "--gpu", "a100-80gb").training.precision is expected


def test_a_named_bf16_is_kept_on_a_v100() -> None:
    assert _request("llama-2-7b", "--gpu", "v100-32gb", "--precision", "bf16-mixed").training.precision is Precision.bf16_mixed


def test_api_default_on_a_v100() -> None:
    v100, a100 = ClusterSpec(gpu=get_gpu("v100-32gb")), ClusterSpec(gpu=get_gpu("a100-80gb"))
    model, zero3 = get_model("llama-2-7b"), StrategySpec(kind="zero3")
    assert PlanRequest(model=model, cluster=v100, strategy=zero3).training.precision is Precision.fp16_mixed
    assert PlanRequest(model=model, cluster=a100, strategy=zero3).training.precision is Precision.bf16_mixed
    tune = PlanRequest(model=model, cluster=v100, strategy=zero3, training=TrainingSpec(framework="torchtune"))
    assert tune.training.precision is Precision.fp32
    named = PlanRequest(model=model, cluster=v100, strategy=zero3, training=TrainingSpec(precision="bf16-pure"))
    assert named.training.precision is Precision.bf16_pure
    as_dict = PlanRequest.model_validate({"model": model, "cluster": v100, "strategy": zero3,
                                          "training": {"framework": "hf"}})
    assert as_dict.training.precision is Precision.fp16_mixed
    # Revalidated under another strategy (revalidated): the precision chosen stays.
    assert as_dict.with_strategy(StrategySpec(kind="ddp")).training.precision is Precision.fp16_mixed
