"""FSDP1's root unit in the allocator's step schedule (zeroplan.allocator.fsdp_schedule): gathered
once a micro-batch, from its forward to its post-backward (torch 2.13 distributed/fsdp/
_runtime_utils.py _post_forward_reshard), where FSDP2's root is resharded after the forward and
gathered again for the loss's backward. Reads a committed JSON record only; no torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.allocator.schedule import step_trace
from zeroplan.allocator.trace import Stream
from zeroplan.core.peak import peak_allocated_bytes
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.communication import collectives
from zeroplan.core.plan import checked_peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.harness.record import read_record
from zeroplan.specs import StrategyKind
from zeroplan.validate.compare import request_for

FSDP1_RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "tiny-llama-fsdp-full-shard-torch-fsdp1-fp32-n2-accum4-keep"
ROOT_BYTES = 4 * (2 * 8192 * 384 + 384)  # tiny-llama's fp32 embedding, head and final norm


def _root_gathers(request) -> tuple[int, int]:
    """(the root's all-gather outputs in the two-step trace, its requested peak)."""
    trace = step_trace(request, *checked_peak_terms(request))
    gathers = sum(1 for e in trace.events
                  if e.kind == "alloc" and e.stream == Stream.all_gather and e.size_bytes == ROOT_BYTES)
    return gathers, trace.requested_peak_bytes()


def test_the_fsdp1_root_is_gathered_once_a_step_and_kept_through_the_loss() -> None:
    request = request_for(read_record(FSDP1_RUN / "rank00000.json").description)
    assert request.strategy.fsdp1_root_stays_gathered
    fsdp2 = request.with_strategy(request.strategy.model_copy(update={"fsdp1_root_stays_gathered": False}))
    fsdp1_gathers, fsdp1_peak = _root_gathers(request)
    fsdp2_gathers, _ = _root_gathers(fsdp2)
    # Two steps traced, each of two micro-batches under no_sync (one before the last, and the
    # last, which reduce-scatters): once a micro-batch under FSDP1, twice under FSDP2.
    assert (fsdp1_gathers, fsdp2_gathers) == (4, 8)
    # The loss's moments leave the root out (the schedule holds it): the trace's peak, at the
    # loss's backward, is the planner's allocated peak, not one root above it.
    states, terms = checked_peak_terms(request)
    assert fsdp1_peak == peak_allocated_bytes(states, terms, request.batch.grad_accum_steps)[0]


def _fit_request(*flags: str):
    args = build_parser().parse_args(["fit", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", *flags])
    return request_from_args(args, StrategyKind.fsdp_full_shard)


def _backward_gather_calls(request) -> int:
    return sum(c.calls for c in collectives(request) if c.op.value == "all_gather" and c.phase.value == "backward")


def test_fsdp_version_1_plans_the_reference_model_with_fsdp1s_root() -> None:
    fsdp1, fsdp2 = _fit_request("--fsdp-version", "1"), _fit_request()
    assert fsdp1.strategy.fsdp1_root_stays_gathered and not fsdp2.strategy.fsdp1_root_stays_gathered
    # The root (embedding and head, two of the planner's units) is not gathered again in backward.
    assert _backward_gather_calls(fsdp2) - _backward_gather_calls(fsdp1) == 2
    # litgpt runs FSDP1 through Lightning: its profile says so, and the flag is refused there.
    assert _backward_gather_calls(_fit_request("--framework", "litgpt")) == _backward_gather_calls(fsdp1)
    with pytest.raises(ZeroplanError, match="fsdp-version"):
        _fit_request("--framework", "litgpt", "--fsdp-version", "1")


def test_the_emitted_fsdp_configs_refuse_an_fsdp1_plan() -> None:
    """accelerate.yaml runs the reference model's FSDP2, and not its FSDP1 (the harness's
    torch-fsdp1 engine: accelerate's FSDP1 is written for hf's plans only)."""
    from zeroplan.emit.formats import NotApplicable, accelerate_config

    assert accelerate_config(_fit_request())["fsdp_config"]["fsdp_version"] == 2
    with pytest.raises(NotApplicable, match="FSDP1"):
        accelerate_config(_fit_request("--fsdp-version", "1"))
