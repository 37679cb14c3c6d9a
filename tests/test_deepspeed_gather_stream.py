"""DeepSpeed ZeRO-3's gathers allocate on the coordinator's allgather stream under overlap_comm
(zeroplan.allocator.schedule._gather_stream): the hf profile's schedule puts its gathered units
there, apart from the compute stream's blocks."""

from __future__ import annotations

from zeroplan.allocator.schedule import _gather_stream, step_inputs
from zeroplan.allocator.trace import Stream
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import peak_terms
from zeroplan.specs import StrategyKind

FLAGS = "llama-2-7b --gpus 8 --micro-batch 1 --seq-len 1024 --activation-checkpointing full"


def _request(framework: str, kind: StrategyKind):
    return request_from_args(build_parser().parse_args(["fit", *FLAGS.split(), "--framework", framework]), kind)


def test_hf_zero3_gathers_on_their_own_stream_unless_overlap_comm_is_off() -> None:
    hf = _request("hf", StrategyKind.zero3)
    assert _gather_stream(hf) == Stream.all_gather
    assert step_inputs(hf, *peak_terms(hf)).gather_stream == Stream.all_gather
    off = hf.model_copy(update={"strategy": hf.strategy.model_copy(update={"deepspeed_overlap_comm": False})})
    assert _gather_stream(off) == Stream.compute


def test_other_stacks_keep_their_streams() -> None:
    assert _gather_stream(_request("zeroplan", StrategyKind.zero3)) == Stream.compute
    assert _gather_stream(_request("hf", StrategyKind.zero2)) == Stream.compute
    assert _gather_stream(_request("hf", StrategyKind.fsdp_full_shard)) == Stream.all_gather
