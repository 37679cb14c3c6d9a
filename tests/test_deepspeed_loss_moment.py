"""The loss's moment under DeepSpeed's ZeRO-3 as DeepSpeedExamples' training/bf16_master_weight
train.py runs it, against DeepSpeed 0.19.8's own engine on gloo at the 254M rows' shape over 16
(benchmarks/deepspeed_bf16mw_step.py --torch-linear [--bf16full] --shape 254m --gpus 4 --record,
benchmarks/deepspeed-bf16mw-records): the parameters the coordinator keeps gathered from the
forward (zeroplan.core.deepspeed_coordinator.loss_gathered_bytes), the loss's tensors in the
logits' dtype outside autocast and, under autocast, in CUDA's order rather than the gloo
record's CPU autocast order (zeroplan.core.uncast_loss), and the logits the loop holds
(TrainingSpec.keep_outputs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.scripts import load_script
from tests.test_deepspeed_bf16_autocast import _autocast_lists
from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.deepspeed_coordinator import loss_gathered_bytes, replay
from zeroplan.core.kv_cache import kept_outputs_bytes
from zeroplan.core.peak import peak_moments
from zeroplan.core.plan import peak_terms
from zeroplan.core.uncast_loss import loss_element_bytes, uncast_logits_parts
from zeroplan.errors import ZeroplanError
from zeroplan.results import PeakMoment
from zeroplan.specs.strategy import StrategyKind

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks/deepspeed-bf16mw-records"
CONFIGS = "benchmarks/published_memory/deepspeed/deepspeedexamples-bf16mw-{}.json"
LOSS_OPS = ("aten::_log_softmax", "aten::nll_loss_backward", "aten::_log_softmax_backward_data")


def _row(mode: str, gpus: int = 4, *extra: str, model: str = "254m"):
    """A dsx-bf16mw row's request (rows.csv's flags) in ``mode`` (baseline, bf16full)."""
    precision = "bf16-pure" if mode == "bf16full" else "bf16-mixed"
    micro_batch = "4" if model == "254m" else "1"
    argv = ["fit", f"benchmarks/published_memory/configs/deepspeedexamples-bf16mw-simple-{model}.json",
            "--gpus", str(gpus), "--gpus-per-node", str(gpus), "--gpu", "a100-80gb", "--micro-batch", micro_batch,
            "--seq-len", "512", "--precision", precision, "--framework", "zeroplan", "--attention", "eager",
            "--torch-multihead-attention", "--state-convention", "deepspeed", "--deepspeed-config",
            CONFIGS.format(mode), "--deepspeed-torch-linear", "--uncast-loss", "--keep-outputs", *extra]
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        args = build_parser().parse_args(argv)
        check_options_apply(args)
        return request_from_args(args, StrategyKind.zero3)
    finally:
        os.chdir(old)


def _record(mode: str, model: str = "254m") -> dict:
    return json.loads((RECORDS / f"{model}-n4-torch-linear-{mode}.json").read_text())


def _live(record: dict, op: str) -> list[int]:
    """The sizes, unscaled, of the tensors ``op`` made that are alive at the record's peak."""
    return [size for size, made_by, _, count in record["live_at_peak"] if made_by == op for _ in range(count)]


@pytest.mark.parametrize("mode, model", [("baseline", "254m"), ("bf16full", "254m"), ("bf16full", "6.86b")])
def test_the_loss_runs_beside_what_the_forward_left_gathered(mode: str, model: str) -> None:
    """The engine's gathered parameters once the loss is formed, scaled back, are the coordinator
    replay's after the forward, from the second step on (the first records the trace, releasing
    each module's parameters after use): at the default reuse distance nothing of a 254M model is
    released, and of the 6.86B what the prefetch and reuse rules keep. Within 1 %: biases shrink
    by the square root of the scale, and the rows plan DeepSpeed's persistence threshold (1e5)
    where the engine runs the config's 0."""
    record = _record(mode, model)
    planned = loss_gathered_bytes(_row(mode, model=model))
    assert record["gathered_at_loss"][0] == 0
    for gathered in record["gathered_at_loss"][1:]:
        assert abs(record["shape"]["scale"] * gathered / planned - 1) < 0.01, (gathered, planned)


def test_one_rank_gathers_nothing() -> None:
    """A partition world of 1 hands the gather to _no_gather_coalesced: param.data is the partition."""
    assert loss_gathered_bytes(_row("baseline", 1)) == 0
    assert replay(_row("baseline", 1)).after_forward_bytes > 0


@pytest.mark.parametrize("mode", ["baseline", "bf16full"])
def test_the_loss_moment_holds_them(mode: str) -> None:
    request = _row(mode)
    states, terms = peak_terms(request)
    assert terms.loss_held_buffers == loss_gathered_bytes(request) > 0
    loss = peak_moments(states, terms, 1)[PeakMoment.loss_backward]
    assert loss.buffers == terms.resident_buffers + terms.backward_held_buffers + terms.loss_held_buffers


def test_the_loss_tensors_are_the_engines_without_autocast() -> None:
    """The log-softmax and its two gradients alive at the engine's peak, one tensor each, scaled
    back: bf16 on the bf16 module without autocast."""
    record = _record("baseline")
    planned = uncast_logits_parts(_row("baseline"))
    assert loss_element_bytes(_row("baseline")) == 2
    for op, part in zip(LOSS_OPS, planned):
        assert [record["shape"]["scale"] * size for size in _live(record, op)] == [part]


def test_under_torch_autocast_the_plan_is_cudas_order_not_the_gloo_records() -> None:
    """The bf16full record's three loss tensors are fp32: CPU autocast casts cross_entropy_loss
    whole. CUDA's autocast keeps the log-softmax in bf16 and casts only nll_loss's input
    (zeroplan.core.uncast_loss): the plan holds the bf16 log-softmax, nll_loss's fp32 copy and
    nll_loss_backward's fp32 gradient, 10 bytes a logit where the record holds 12."""
    record = _record("bf16full")
    scale = record["shape"]["scale"]
    fp32 = [scale * size for size in _live(record, "aten::nll_loss_backward")]
    assert all([scale * size for size in _live(record, op)] == fp32 for op in LOSS_OPS)
    assert uncast_logits_parts(_row("bf16full")) == (fp32[0] // 2, fp32[0], fp32[0])
    assert loss_element_bytes(_row("bf16full")) == 2


def test_cuda_autocast_keeps_the_explicit_dtype_of_cross_entropys_log_softmax() -> None:
    """The plan's premise in the installed torch: cross_entropy_loss has an AutocastCPU kernel and
    no AutocastCUDA one; on CUDA its composite's log_softmax is on the set-opt-dtype list (an
    explicit dtype kept) and nll_loss on the fp32 list."""
    torch = pytest.importorskip("torch")
    lists = _autocast_lists()
    assert "log_softmax" in lists["AT_FORALL_FP32_SET_OPT_DTYPE"] and "nll_loss" in lists["AT_FORALL_FP32"]
    assert "cross_entropy_loss" not in set().union(*lists.values())
    dump = torch._C._dispatch_dump("aten::cross_entropy_loss")
    assert "AutocastCPU" in dump and "AutocastCUDA" not in dump
    assert "AutocastCUDA" in torch._C._dispatch_dump("aten::log_softmax.int")
    assert "AutocastCUDA" in torch._C._dispatch_dump("aten::nll_loss")


def test_the_cuda_order_reproduced_on_the_cpu_holds_the_planned_tensors() -> None:
    """benchmarks/cuda_autocast_loss_tensors.py runs the ops CUDA's autocast makes of the uncast
    loss on CPU tensors: what autograd saves, and what is alive at the backward's peak in fp32
    logit blocks, are the planned parts over the row's logits."""
    pytest.importorskip("torch")
    script = load_script(ROOT / "benchmarks/cuda_autocast_loss_tensors.py")
    result = script.run("uncast, CUDA autocast order, bf16", 2)
    assert sorted(dtype for dtype, _ in result["saved"]) == ["bfloat16", "float32"]
    request = _row("bf16full")
    block = 4 * request.batch.micro_batch_size * request.batch.seq_len * request.model.vocab_size
    planned = sorted(part / block for part in uncast_logits_parts(request))
    # By allocating op, to the 1e-3 block: nll_loss also makes a scalar or two.
    assert sorted(round(size, 3) for size, _ in result["live"]) == planned == [0.5, 1.0, 1.0]


@pytest.mark.parametrize("mode", ["baseline", "bf16full"])
def test_the_loop_holds_the_bf16_logits(mode: str) -> None:
    """train.py's ``logits = model_engine(input_ids)``: the output projection's bf16 addmm, alive at
    the peak, is what keep_outputs holds."""
    record = _record(mode)
    shape = record["shape"]
    logits = 2 * shape["micro_batch"] * shape["seq"] * shape["vocab"]
    assert logits in _live(record, "aten::addmm")
    assert kept_outputs_bytes(_row(mode)) == shape["scale"] * logits


def test_the_uncast_loss_without_the_flag_is_fp32() -> None:
    for mode in ("baseline", "bf16full"):
        request = _row(mode)
        plain = request.model_copy(update={"training": request.training.model_copy(update={"uncast_loss": False})})
        assert loss_element_bytes(plain) == 4 and loss_element_bytes(request) == 2


def test_refused_beside_the_fused_loss() -> None:
    request = _row("baseline")
    fused = request.model_copy(update={"training": request.training.model_copy(update={"fused_cross_entropy": True})})
    with pytest.raises(ZeroplanError, match="uncast_loss"):
        peak_terms(fused)
