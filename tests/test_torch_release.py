"""TrainingSpec.torch_release: before torch 2.0 zero_grad() zeroes the gradients in place, so they
stay allocated through the next forward (zeroplan.core.torch_release). The mechanism measured on
torch 2.13 itself, zero_grad(set_to_none=False) being what 1.x's default did: the harness's
reference model stepped twice on the CPU under the live-storage tracker, its live bytes at the
end of the second forward against the planner's loss-backward moment."""

from __future__ import annotations

import pytest

from tests.live_storages import live_storage_tracker
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.buffers import optimizer_loop
from zeroplan.core.peak import peak_moments
from zeroplan.core.plan import checked_peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.results import PeakMoment
from zeroplan.specs import StrategyKind
from zeroplan.specs.training import OptimizerLoop

FLAGS = "--gpus 1 --precision fp32 --micro-batch 2 --seq-len 16 --framework zeroplan"


def _request(extra: str = "", kind: StrategyKind = StrategyKind.ddp, flags: str = FLAGS, model: str = "llama-2-7b"):
    return request_from_args(build_parser().parse_args(["fit", model, *flags.split(), *extra.split()]), kind)


def _loss_moment(request):
    states, terms = checked_peak_terms(request)
    return states, peak_moments(states, terms, request.batch.grad_accum_steps)[PeakMoment.loss_backward]


def test_before_2_0_the_gradients_are_alive_at_the_loss_and_the_step_loops_tensor_by_tensor() -> None:
    new_states, new = _loss_moment(_request())
    old_states, old = _loss_moment(_request("--torch-release 1.13"))
    assert new.gradients == 0 and new_states.gradient_bytes > 0
    assert old.gradients == old_states.gradient_bytes == new_states.gradient_bytes
    assert old.total - new.total == new_states.gradient_bytes
    assert optimizer_loop(_request()) is OptimizerLoop.foreach
    assert optimizer_loop(_request("--torch-release 1.13")) is OptimizerLoop.for_loop
    assert optimizer_loop(_request("--torch-release 1.13 --optimizer-loop foreach")) is OptimizerLoop.foreach
    # Hugging Face's recipe fuses AdamW today (the Trainer's adamw_torch_fused); a 1.x loop did not.
    hf = FLAGS.replace("zeroplan", "hf")
    assert optimizer_loop(_request("", flags=hf)) is OptimizerLoop.fused
    assert optimizer_loop(_request("--torch-release 1.13", flags=hf)) is OptimizerLoop.for_loop
    # 2.0 and later plan as the default does.
    assert _loss_moment(_request("--torch-release 2.0"))[1] == new


def test_zero_stages_keep_deepspeed_s_own_zero_grad() -> None:
    flags = FLAGS.replace("--gpus 1", "--gpus 8")
    assert _loss_moment(_request("--torch-release 1.13", StrategyKind.zero2, flags))[1].gradients == \
        _loss_moment(_request("", StrategyKind.zero2, flags))[1].gradients


@pytest.mark.parametrize("extra,kind,field", [
    ("--torch-release 1.6", StrategyKind.ddp, "--torch-release"),
    ("--torch-release 2.14", StrategyKind.ddp, "--torch-release"),
    ("--torch-release latest", StrategyKind.ddp, "--torch-release"),
    ("--torch-release 1.13", StrategyKind.fsdp_full_shard, "--torch-release"),
    ("--torch-release 1.13 --framework torchtune --precision bf16-pure", StrategyKind.ddp, "--torch-release"),
])
def test_refusals_name_the_flag(extra, kind, field) -> None:
    from zeroplan.cli.parser import user_error_line

    with pytest.raises(ZeroplanError) as caught:
        _loss_moment(_request(extra, kind, FLAGS.replace("--gpus 1", "--gpus 8")))
    assert user_error_line(caught.value).count(field) >= 1


def _measured_forward_end_bytes(set_to_none: bool) -> tuple[int, int]:
    """(live bytes at the end of the second step's forward, gradient bytes) of the harness's
    micro-llama in fp32 under AdamW, every tensor made inside the tracker."""
    import torch

    from zeroplan.harness.model import build_model, next_token_loss
    from zeroplan.harness.presets import harness_model

    tracker = live_storage_tracker(set())
    seen: dict[str, int] = {}
    with tracker:
        model = build_model(harness_model("micro-llama"))
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        tokens = torch.randint(0, 101, (2, 16))
        for step in range(2):
            logits = model(tokens)
            if step == 1:
                seen["forward_end"] = sum(tracker.live.values())
            loss = next_token_loss(logits, tokens)
            del logits
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    return seen["forward_end"], gradients


@pytest.mark.slow  # the harness's model under a Python dispatch mode: about 15 s on the CPU
def test_zeroed_gradients_are_alive_at_the_end_of_the_next_forward_as_planned() -> None:
    kept, gradient_bytes = _measured_forward_end_bytes(set_to_none=False)
    dropped, _ = _measured_forward_end_bytes(set_to_none=True)
    # Measured: the only difference at the forward's end is every gradient, allocated.
    assert kept - dropped == gradient_bytes
    # Planned for the same model: the loss moment carries exactly its model states' gradients.
    from zeroplan.harness.presets import harness_model

    micro = harness_model("micro-llama")
    new_states, new = _loss_moment(_request().model_copy(update={"model": micro}))
    _, old = _loss_moment(_request("--torch-release 1.13").model_copy(update={"model": micro}))
    assert new_states.gradient_bytes == gradient_bytes
    assert old.total - new.total == gradient_bytes


def test_the_trainer_fuses_adamw_only_from_transformers_4_54_under_torch_2_8() -> None:
    # transformers 4.54.0 training_args.py:1286-1291 (4.56.2 :1296-1301): adamw_torch_fused where
    # torch >= 2.8, else adamw_torch (torch.optim.AdamW unfused: foreach on CUDA from torch 2.0).
    hf = FLAGS.replace("zeroplan", "hf")
    cases = {
        "": OptimizerLoop.fused,
        "--torch-release 2.7": OptimizerLoop.foreach,
        "--torch-release 2.1": OptimizerLoop.foreach,
        "--transformers-version 4.53.3": OptimizerLoop.foreach,
        "--transformers-version 4.54.0 --torch-release 2.8": OptimizerLoop.fused,
        "--transformers-version 4.36 --torch-release 2.1 --optimizer-loop fused": OptimizerLoop.fused,
    }
    for extra, loop in cases.items():
        assert optimizer_loop(_request(extra, flags=hf)) is loop, extra
    # The foreach step's _foreach_sqrt output is one state-sized temporary: an fp32 AdamW over
    # every parameter of a full fine-tune on one GPU (fp32 precision: 4 bytes an element).
    states, terms = checked_peak_terms(_request("--torch-release 2.1", flags=hf))
    assert terms.step_temporary == states.optimizer_elements * 4
    assert checked_peak_terms(_request("", flags=hf))[1].step_temporary == 0
