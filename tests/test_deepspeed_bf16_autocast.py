"""DeepSpeed's bf16 master weights under torch_autocast (zeroplan.core.deepspeed_bf16_autocast):
the config's mapping, the model states against DeepSpeed's own engine's record, and the CUDA-only
activation terms against torch's autocast op lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core import deepspeed_bf16_autocast as mode
from zeroplan.core.deepspeed_stage3_step import step_gradient_bytes
from zeroplan.core.model_states import model_state_bytes
from zeroplan.errors import ZeroplanError
from zeroplan.specs.deepspeed_config import deepspeed_config_of, read_deepspeed_json
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import Precision

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "benchmarks/published_memory/deepspeed/deepspeedexamples-bf16mw-bf16full.json"
RECORD = ROOT / "benchmarks/deepspeed-bf16mw-records/6.86b-n4-torch-linear-bf16full.json"
DTYPE_BYTES = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}


def _request(*flags: str, config: Path = CONFIG, model: str = "6.86b", micro_batch: int = 1):
    argv = ["fit", f"benchmarks/published_memory/configs/deepspeedexamples-bf16mw-simple-{model}.json", "--gpus", "4",
            "--gpu", "a100-80gb", "--micro-batch", str(micro_batch), "--seq-len", "512", "--precision", "bf16-pure",
            "--attention", "eager", "--torch-multihead-attention", "--state-convention", "deepspeed",
            "--deepspeed-config", str(config), "--deepspeed-torch-linear", *flags]
    args = build_parser().parse_args(argv)
    check_options_apply(args)
    return request_from_args(args, StrategyKind.zero3)


def _at_root(**shape):
    import os

    old = os.getcwd()
    os.chdir(ROOT)
    try:
        return _request(**shape)
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def request_686b():
    return _at_root()


def test_the_example_config_maps_onto_the_mode() -> None:
    config = deepspeed_config_of(read_deepspeed_json(CONFIG), hf_auto=False)
    assert config.bf16_autocast and config.precision is Precision.bf16_pure and config.kind is StrategyKind.zero3


@pytest.mark.parametrize("change, key", [
    (lambda c: c["bf16"].pop("bf16_optimizer_states"), "bf16.bf16_master_weights_and_grads"),
    (lambda c: c["bf16"].pop("bf16_master_weights_and_grads"), "bf16.bf16_optimizer_states"),
    (lambda c: c["torch_autocast"].update(enabled=False), "torch_autocast.enabled"),
    (lambda c: c["torch_autocast"].pop("dtype"), "torch_autocast.dtype"),
    (lambda c: c["torch_autocast"].update(lower_precision_safe_modules=["torch.nn.Linear"]),
     "torch_autocast.lower_precision_safe_modules"),
    (lambda c: c["zero_optimization"].update(stage=2), "zero_optimization.stage"),
])
def test_a_partial_or_other_mode_is_refused_in_one_line(change, key) -> None:
    config = read_deepspeed_json(CONFIG)
    change(config)
    with pytest.raises(ZeroplanError) as error:
        deepspeed_config_of(config, hf_auto=False)
    assert key in str(error.value) and "allowed" in str(error.value) and "\n" not in str(error.value)


def test_autocast_alone_stays_refused() -> None:
    config = read_deepspeed_json(CONFIG)
    for key in mode_keys():
        config["bf16"].pop(key)
    with pytest.raises(ZeroplanError, match="torch_autocast.enabled: true over fp32 master weights"):
        deepspeed_config_of(config, hf_auto=False)


def mode_keys() -> tuple[str, ...]:
    from zeroplan.specs.deepspeed_config import BF16_AUTOCAST_KEYS

    return BF16_AUTOCAST_KEYS


def test_model_states_are_the_engines_dtypes(request_686b) -> None:
    """The bytes per optimizer element DeepSpeed 0.19.8's engine keeps
    (benchmarks/deepspeed_bf16mw_step.py --torch-linear --bf16full --record): module partition,
    a separate master partition, gradient partition and Adam's two states."""
    dtypes = json.loads(RECORD.read_text())["dtypes"]
    assert dtypes["master_is_16bit_partition"] is False
    engine = (DTYPE_BYTES[dtypes["module_parameters"][0]] + DTYPE_BYTES[dtypes["master_partitions"][0]]
              + DTYPE_BYTES[dtypes["gradient_partitions"]] + 2 * DTYPE_BYTES[dtypes["optimizer_states"][0]])
    states = model_state_bytes(request_686b)
    planned = states.parameter_bytes + states.gradient_bytes + states.optimizer_state_bytes - states.step_counter_bytes
    assert planned == engine * states.optimizer_elements == 10 * states.optimizer_elements


def test_the_step_makes_no_cast_of_bf16_gradients(request_686b) -> None:
    """stage3.py _prepare_fp32_grad_for_sub_group: `.to(bf16)` of a bf16 flat gradient is no copy,
    so the step holds the largest sub-group's flat copy alone (2 bytes an element)."""
    from zeroplan.core.deepspeed_stage3_step import sub_group_steps
    from zeroplan.core.nvme import sub_group_tensor_elements

    groups = sub_group_tensor_elements(request_686b)
    assert len(groups) == 2  # 1.71 billion elements a rank, cut at sub_group_size 1e9
    assert sub_group_steps(request_686b) == tuple((2 * sum(group), 0) for group in groups)
    assert step_gradient_bytes(request_686b) == 2 * max(sum(group) for group in groups)


def _autocast_lists() -> dict[str, set[str]]:
    """torch's CUDA autocast lists as the installed release's header defines them."""
    import torch

    header = (Path(torch.__file__).parent / "include/ATen/autocast_mode.h").read_text()
    lists = {}
    for name in ("AT_FORALL_LOWER_PRECISION_FP", "AT_FORALL_FP32", "AT_FORALL_FP32_SET_OPT_DTYPE"):
        start = header.index(f"#define {name}(_)")
        body = header[start:header.index("\n\n", start)]
        lists[name] = set(re.findall(r"_\((\w+)", body))
    return lists


def test_the_terms_rest_on_torchs_cuda_autocast_lists() -> None:
    """The ops the mode's terms say autocast changes (layer_norm, softmax) and those it says run
    in bf16 unchanged (linear, bmm over bf16 inputs; gelu and add on no list)."""
    lists = _autocast_lists()
    assert "layer_norm" in lists["AT_FORALL_FP32"] and "native_layer_norm" in lists["AT_FORALL_FP32"]
    assert {"softmax", "log_softmax"} <= lists["AT_FORALL_FP32_SET_OPT_DTYPE"]
    assert {"linear", "bmm", "baddbmm"} <= lists["AT_FORALL_LOWER_PRECISION_FP"]
    assert not {"gelu", "add", "embedding"} & set().union(*lists.values())


def test_the_activation_terms_of_the_686b_row(request_686b) -> None:
    """Per block at b 1, s 512, h 4,096, 32 heads: fp32 scores and their bf16 copy, 4 b heads s^2
    beyond bf16-pure; two LayerNorms' fp32 inputs, 2 x 2 sbh; after the first block two more bf16
    in-projection inputs, 2 x 2 sbh."""
    sbh, scores = 512 * 4096, 32 * 512 * 512
    assert mode.block_extra_bytes(request_686b, first=True) == 4 * scores + 4 * sbh
    assert mode.block_extra_bytes(request_686b, first=False) == 4 * scores + 8 * sbh
    assert mode.activation_extra_bytes(request_686b) == 32 * (4 * scores + 4 * sbh) + 31 * 4 * sbh


def test_a_full_checkpoint_keeps_fp32_inputs_and_one_block(request_686b) -> None:
    from zeroplan.specs.training import ActivationCheckpointing

    training = request_686b.training.model_copy(update={"activation_checkpointing": ActivationCheckpointing.full})
    checkpointed = request_686b.model_copy(update={"training": training})
    sbh = 512 * 4096
    assert mode.activation_extra_bytes(checkpointed) == 31 * 2 * sbh + mode.block_extra_bytes(checkpointed, first=False)


@pytest.mark.parametrize("record, shape", [
    ("6.86b-n4-torch-linear-bf16full.json", {}),
    ("254m-n4-torch-linear-bf16full.json", {"model": "254m", "micro_batch": 4}),
])
def test_the_step_moment_is_the_engines(record, shape) -> None:
    """The optimizer step's moment (the states, the gradient partition and bucket, the step's flat
    gradient copy) against the largest optimizer-step peak of DeepSpeed's engine, scaled back by
    the record's factor (weights and activations shrink by the same factor; biases, a few MiB,
    by less): within 1 %. The CPU's autocast lists do not reach the step. train.py's loop holds
    its bf16 logits through the step to the next forward, which the planner's step moment leaves
    out (keep_outputs counts them through backward, zeroplan.core.kv_cache): added here."""
    from zeroplan.core.peak import _moment_pieces
    from zeroplan.core.plan import peak_terms

    data = json.loads((RECORD.parent / record).read_text())
    measured = data["shape"]["scale"] * max(peak for phase, peak in data["peaks"].items() if "optimizer_step" in phase)
    request = _at_root(**shape)
    states, terms = peak_terms(request)
    held_logits = 2 * request.batch.micro_batch_size * request.batch.seq_len * request.model.vocab_size
    planned = _moment_pieces(states, terms, 1)[-1].total + held_logits
    assert abs(planned / measured - 1) < 0.01, (planned / 2**30, measured / 2**30)
