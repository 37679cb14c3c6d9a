"""Where DeepSpeed's activation checkpointing (``deepspeed.checkpointing.checkpoint``, what
Megatron-DeepSpeed's --deepspeed-activation-checkpointing and the Megatron-LM of DeepSpeed's
examples run) keeps each checkpointed block's input, under its two memory options:
``partition_activations`` (TrainingSpec.partition_activations) and ``cpu_checkpointing``
(TrainingSpec.cpu_checkpointing). Rules read from DeepSpeed 0.19.8
runtime/activation_checkpointing/checkpointing.py and offload_activations.py; the bytes are
those of the block input the planner's full recomputation keeps (Korthikanti et al. 2022,
sec. 5), so every term here moves that tensor between the device, the host and the
recomputing block's backward.

This module does not import torch."""

from __future__ import annotations

from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import TrainingSpec


def moves_checkpoints(training: TrainingSpec) -> bool:
    """Whether DeepSpeed's checkpointing keeps less than each block's whole input on the device."""
    return training.partition_activations or training.cpu_checkpointing


# checkpointing.py CheckpointFunction.forward (lines 611-614, 632-643): under
# partition_activations each floating-point input is cut to its rank's numel / mp_size slice
# (partition_activations, lines 387-439; get_partition_size, 268-273), cloned, and moved to the
# host under cpu_checkpointing (line 436); get_partitioned_activations_for_backward then empties
# the input's own storage (line 454, arg.data = torch.empty([])). cpu_checkpointing alone copies
# the input to the host (copy_to_device, line 614; get_cpu_activations_for_backward, 484-495) or,
# on a device with side streams (CUDA: _get_cpu_offload_engine, 498-511), hands it to the offload
# engine, which empties it on the device too (get_offloaded_activations_for_backward, 519-547).
def device_checkpoint_bytes(block_input_bytes: int, tp: int, training: TrainingSpec) -> int:
    """What the device keeps of one checkpointed block input from its forward to its backward
    (``tp``: the model-parallel ranks the partition splits it over)."""
    if training.cpu_checkpointing:
        return 0
    if training.partition_activations:
        return block_input_bytes // tp
    return block_input_bytes


# checkpointing.py CheckpointFunction.backward (lines 699-716): the saved partition comes back to
# the device (t.saved_data.to(t.device)) and gather_partitioned_activations (276-312) all-gathers
# it into a whole zeroed input (flat_tensor), which replaces the partition's storage
# (item.data = input_tensor.data); a host copy is moved back whole (move_to_device). Either way
# the recomputing block holds its whole input again, beside the other blocks' kept parts.
def restored_input_bytes(block_input_bytes: int, tp: int, training: TrainingSpec) -> int:
    """What a block's recompute brings back to the device beyond what it kept."""
    if offload_engine_keeps_newest(training):
        # The last two blocks' inputs are the engine's (newest_device_input_bytes); every other
        # block's comes back from the host once those two blocks' backwards have freed theirs.
        return 0
    return block_input_bytes - device_checkpoint_bytes(block_input_bytes, tp, training)


# offload_activations.py _ActivationOffloadEngine (keep_last_count=1 from _get_cpu_offload_engine,
# line 509; max_fwd_stash_count 2, its default, line 70): offload_input (lines 218-230) keeps the
# newest input on the device and starts the copy of the one before, which _start_offload (183-210)
# also keeps in the forward stash until a newer one is registered (_reap_forward_stash, 132-138:
# ids above newest - 2). So from the second block's forward to the last block's backward the
# device holds two whole inputs, the last block's and the one before; the backward takes both back
# from there (_restore_tensor, 236-260) and every earlier block's from the host, one at a time.
# Used only by cpu_checkpointing without partitioning (line 505) on a device with side streams.
ENGINE_DEVICE_INPUTS = 2
"""Block inputs the offload engine holds on the device: its kept newest and its one stashed."""


def offload_engine_keeps_newest(training: TrainingSpec) -> bool:
    """Whether DeepSpeed's offload engine runs (cpu_checkpointing alone, on a GPU)."""
    return training.cpu_checkpointing and not training.partition_activations


def newest_device_input_bytes(block_input_bytes: int, training: TrainingSpec) -> int:
    """The block inputs the offload engine keeps on the device, from the forward's end to the
    last block's backward (0 where the engine does not run)."""
    return ENGINE_DEVICE_INPUTS * block_input_bytes if offload_engine_keeps_newest(training) else 0


def checkpoint_terms(block_input_bytes: int, tp: int, training: TrainingSpec) -> tuple[int, int]:
    """(bytes each block keeps no longer, bytes its recompute adds) of DeepSpeed's checkpointing
    against the planner's whole block input on the device (the offload engine's inputs, kept once
    on the rank, are newest_device_input_bytes)."""
    if not moves_checkpoints(training):
        return 0, 0
    return (block_input_bytes - device_checkpoint_bytes(block_input_bytes, tp, training),
            restored_input_bytes(block_input_bytes, tp, training))


# checkpointing.py partition_activations (line 436): each block's partition on the host; the
# offload engine's pinned host copy of every input but the newest (offload_activations.py
# _start_offload, 183-210: the copy starts when a newer input is registered).
def host_checkpoint_bytes_per_block(block_input_bytes: int, tp: int, training: TrainingSpec) -> int:
    """What host memory holds of one block's checkpointed input under cpu_checkpointing."""
    if not training.cpu_checkpointing:
        return 0
    return block_input_bytes // tp if training.partition_activations else block_input_bytes


# checkpointing.py: partition_activations' partition.cpu() (line 436) is a blocking device-to-host
# copy on the compute stream, and CheckpointFunction.backward's t.saved_data.to(t.device) (line
# 702) the blocking copy back: each block's partition crosses the host link once each way per
# micro-batch, with nothing to overlap it. The offload engine (cpu_checkpointing alone) copies
# to the host on its own stream, hidden behind the forward, but restores every block's input but
# the two it keeps with the compute stream waiting on the copy (offload_activations.py
# _restore_tensor, lines 262-275): one crossing a block, exposed.
def exposed_host_copy_bytes(request: PlanRequest, block_input_bytes: int, blocks: int) -> int:
    """Bytes of checkpoint copies over the host link that the compute waits for, per step
    (``block_input_bytes``: one block's input on this rank; ``blocks``: the rank's blocks)."""
    training = request.training
    if not training.cpu_checkpointing:
        return 0
    accumulation = request.batch.grad_accum_steps
    on_host = host_checkpoint_bytes_per_block(block_input_bytes, request.parallel.tp, training)
    if training.partition_activations:
        return 2 * accumulation * blocks * on_host
    return accumulation * max(0, blocks - ENGINE_DEVICE_INPUTS) * on_host
