"""Stage outputs that torch's pipeline schedules keep alive, counted on torch's own schedules.

A pipeline stage's output is not saved by the checkpointed blocks that made it (full
recomputation keeps each block's input), yet torch's PipelineStage holds it: in ``fwd_cache``
from its forward to its backward (stage.py forward_one_chunk / backward_one_chunk), and in
``output_chunks`` for the step's merged result, until the next step's ``clear_runtime_states``.
torch 2.6.0 (stage.py:703, the release nearest the torch 1963fc8 that torchtitan 9dec370's
published runs used) appends every stage's output to ``output_chunks``; torch 2.13 (stage.py:907)
only the last stage's and only with ``save_forward_output`` (``return_outputs``, which torchtitan
0.3.0's trainer.py:862 sets to False; 9dec370's train.py calls ``step()`` without it).

Per pipeline rank of a fake process group (every collective returns at once), each stage a
Linear probe built with its shapes given: the schedule's step() is run with the stage's
forward_one_chunk and backward_one_chunk wrapped; every output forward_one_chunk makes is
watched with a weakref finaliser. At each backward the live outputs and the chunks in flight
(forwards done less backwards done) are read, and how many of the rank's stages are between
their first and their m-th backward (FSDP2 keeps a stage's unsharded gradient accumulators over
that span: stage.py backward_maybe_with_nosync reduces at last_backward); after step() the
outputs still alive.

The same run reads each rank's receive buffers (``args_recv_info`` and ``grad_recv_info``, one
per micro-batch, kept after step()), whether each stage input is a buffer's storage, and the
gradients of the stage inputs (``bwd_cache``) alive at each backward and after step().

    python benchmarks/torchtitan_pipeline_outputs.py [--pp 8] [--microbatches 8]

Runs under any torch from 2.6 (only torch is imported). Measured (pp 8, 8 micro-batches; torch
2.13 with return_outputs False as torchtitan 0.3.0 runs it, True as a call without it gets):
at the rank's largest backward, live outputs = chunks in flight on every rank under torch 2.13
with return_outputs False; under torch 2.6.0 every stage's outputs stay, all v x m of a rank at
the end of its forwards (1F1B: 8 on every rank; interleaved 1F1B: 16) and after step().
Interleaved 1F1B accumulates one stage's gradients at a time on every rank at 8 micro-batches
(one round) and two at 16, under both releases.
Receive buffers, both releases: 1F1B rank 0 8 gradient, ranks 1-6 8 + 8, rank 7 8 activation;
interleaved 8 + 16, 16 + 16, 16 + 8; every stage input is a buffer. Input gradients at the
in-flight peak: torch 2.6.0 v m less the chunks in flight (1F1B 0..7 by rank; interleaved
0, 0, 0, 0, 1, 3, 5, 7), all of them after step(); torch 2.13 1 (1F1B) and 0 (interleaved), none
after step().
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import weakref

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.simulate._torch_private import pipeline_stages_static

SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2}
"""Schedules measured and their stages per rank (torchtitan 9dec370's generate_split_points:
one for a single-stage schedule, two for a multi-stage one)."""


@contextlib.contextmanager
def _fake_group(world_size: int, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def rank_outputs(schedule: str, pp: int, microbatches: int, rank: int,
                 return_outputs: bool | None = None, width: int = 8) -> dict[str, object]:
    """One rank's stage outputs under torch's ``schedule``: at each backward (in call order) the
    live outputs and the chunks in flight; after step() the outputs alive; ``return_outputs``
    passed to step() where given (torch 2.13; torch 2.6 has no such argument)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    per_rank = SCHEDULES[schedule]
    num_stages = pp * per_rank
    live = {"outputs": 0, "forwards": 0, "backwards": 0, "input_grads": 0, "inputs": 0, "inputs_in_buffers": 0}
    at_backward: list[tuple[int, int]] = []
    # Backwards run per stage index, to tell how many stages are between their first and their
    # m-th (last_backward) backward at once: those hold FSDP's unsharded gradient accumulators.
    per_stage: dict[int, int] = {}
    accumulating: list[int] = []
    with _fake_group(pp, rank), pipeline_stages_static():
        stages = []
        # torchtitan 9dec370 pipelining_utils.stage_ids_this_rank, style "loop".
        for index in (rank + chunk * pp for chunk in range(per_rank)):
            stage = PipelineStage(
                nn.Linear(width, width, bias=False), index, num_stages, torch.device("cpu"),
                input_args=torch.empty(1, width, requires_grad=index != 0),
                output_args=torch.empty(1, width, requires_grad=True),
            )
            _watch(stage, live, at_backward, per_stage, accumulating, microbatches)
            stages.append(stage)
        cls = get_schedule_class(schedule)
        built = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=_loss)
        kwargs = {}
        if any(s.is_last for s in stages):
            kwargs["target"] = torch.randn(microbatches, width)
        if return_outputs is not None:
            kwargs["return_outputs"] = return_outputs
        args = (torch.randn(microbatches, width),) if any(s.is_first for s in stages) else ()
        built.step(*args, **kwargs)
        after = live["outputs"]
        buffers = _receive_buffers(stages)
    return {"at_backward": at_backward, "after_step": after, "accumulating_stages": max(accumulating),
            "activation_buffers": buffers[0], "gradient_buffers": buffers[1],
            "input_grads_after_step": live["input_grads"],
            "inputs_in_buffers": (live["inputs_in_buffers"], live["inputs"])}


def _receive_buffers(stages) -> tuple[int, int]:
    """The receive buffers the rank's stages hold after step(): one per micro-batch for each
    activation a non-first stage receives (``args_recv_info``) and for each gradient a non-last
    stage receives (``grad_recv_info``), allocated once and kept for every later step."""
    def tensors(infos):
        return sum(1 for chunk in infos.values() for info in chunk
                   if isinstance(getattr(info, "buffer", None), torch.Tensor))
    return sum(tensors(s.args_recv_info) for s in stages), sum(tensors(s.grad_recv_info) for s in stages)


def _watch(stage, live: dict[str, int], at_backward: list[tuple[int, int]], per_stage: dict[int, int],
           accumulating: list[int], microbatches: int) -> None:
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def watched_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        live["outputs"] += 1
        live["forwards"] += 1
        weakref.finalize(output, _drop, live)
        return output

    def watched_backward(chunk_id, *args, **kwargs):
        at_backward.append((live["outputs"], live["forwards"] - live["backwards"], live["input_grads"]))
        live["backwards"] += 1
        per_stage[stage.stage_index] = per_stage.get(stage.stage_index, 0) + 1
        accumulating.append(sum(1 for done in per_stage.values() if done < microbatches) + (
            per_stage[stage.stage_index] == microbatches))
        result = backward(chunk_id, *args, **kwargs)
        # The gradients of the stage's inputs this backward made (bwd_cache, sent to the
        # previous stage): watched until freed (torch 2.13 drops the input's .grad at once,
        # torch 2.6.0 keeps it on the receive buffer until clear_runtime_states).
        for grad in stage.bwd_cache.get(chunk_id, ()):
            if isinstance(grad, torch.Tensor):
                live["input_grads"] += 1
                weakref.finalize(grad, _drop_grad, live)
        return result

    def stage_input(module, inputs):
        # Whether the tensor the stage's module runs on is the receive buffer itself (so the
        # first checkpointed block saves that buffer, not a copy).
        if stage.is_first:
            return
        buffers = {info.buffer.untyped_storage().data_ptr() for chunk in stage.args_recv_info.values()
                   for info in chunk if isinstance(getattr(info, "buffer", None), torch.Tensor)}
        live["inputs"] += 1
        live["inputs_in_buffers"] += inputs[0].untyped_storage().data_ptr() in buffers

    stage.submod.register_forward_pre_hook(stage_input)
    stage.forward_one_chunk, stage.backward_one_chunk = watched_forward, watched_backward


def _drop_grad(live: dict[str, int]) -> None:
    live["input_grads"] -= 1


def _drop(live: dict[str, int]) -> None:
    live["outputs"] -= 1


def _summary(result: dict[str, object]) -> str:
    pairs = result["at_backward"]
    peak_in_flight = max(chunks for _, chunks, _ in pairs)
    outputs_at_peak, _, grads_at_peak = max(p for p in pairs if p[1] == peak_in_flight)
    return (f"in flight {peak_in_flight:2d}, live outputs then {outputs_at_peak:2d}, "
            f"after step {result['after_step']:2d}; stages accumulating gradients at once "
            f"{result['accumulating_stages']}; receive buffers {result['activation_buffers']:2d} "
            f"activation + {result['gradient_buffers']:2d} gradient; input gradients at that "
            f"backward {grads_at_peak:2d}, most {max(p[2] for p in pairs):2d}, after step "
            f"{result['input_grads_after_step']:2d}; stage inputs that are receive buffers "
            "{}/{}".format(*result["inputs_in_buffers"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    options = parser.parse_args(argv)
    has_flag = "return_outputs" in inspect.signature(
        __import__("torch.distributed.pipelining.schedules", fromlist=["x"]).PipelineScheduleSingle.step).parameters
    print(f"torch {torch.__version__}, pp {options.pp}, {options.microbatches} micro-batches")
    for schedule in SCHEDULES:
        for flag in ((False, True) if has_flag else (None,)):
            label = f"{schedule}" + ("" if flag is None else f", return_outputs={flag}")
            print(label)
            for rank in range(options.pp):
                print(f"  rank {rank}: " + _summary(rank_outputs(schedule, options.pp, options.microbatches, rank, flag)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
