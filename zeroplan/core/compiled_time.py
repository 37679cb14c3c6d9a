"""torch.compile in the step time (docs/communication-time.md, "Compile in the step time").

Inductor leaves a block's matrix products and attention kernel as they are (extern mm and SDPA
calls) and fuses the memory-bound operators between them (norms, rotary embedding, activation,
residual adds, casts, autograd's gradient sums) into a few kernels, each reading its inputs and
writing its outputs once. So compile changes the step through device-memory traffic: a compiled
block moves fewer bytes than the eager one, and the difference costs no time.

The bytes were measured on each framework's own block (zeroplan.frameworks.compiled_traffic,
benchmarks/compiled_block_traffic.py, record benchmarks/compiled-traffic-records/traffic.json):
eager, every aten operator's tensors; compiled, inductor's own byte count of each kernel its
scheduler fuses. Every kernel is elementwise per token over tensors of the block's widths, so
one block's bytes per token are w_h h + w_kv kv + w_F F + w_0 (h the width, which is also the
query width of every measured model; kv the key/value projection width; F the MLP's hidden
width), with w in bytes per element: the four coefficients are solved exactly from the four
measured Llama widths (3.2 3B, 2 7B, 3 8B, 2 70B), nothing fitted to a throughput.

The flat-HFU compute model takes its HFU to cover an eager step, memory-bound kernels included,
so a compiled step is the eager one less the saved bytes at the GPU's copy bandwidth
(zeroplan.core.roofline.ceilings); the roofline model prices the compiled block's own bytes.
Only the blocks are compiled (torchtitan's, torchtune's and transformers' per-block compile);
embedding, final norm and loss stay eager. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.core.record import frozen
from zeroplan.specs.framework import Framework
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.request import PlanRequest

@frozen
class WidthBytes:
    """Bytes per token of one block's memory-bound kernels in one pass: w_h h + w_kv kv + w_F F + w_0."""

    per_h: float
    per_kv: float
    per_f: float
    constant: float

    def bytes_per_token(self, hidden: int, kv: int, mlp_width: int) -> float:
        return self.per_h * hidden + self.per_kv * kv + self.per_f * mlp_width + self.constant


@frozen
class BlockTrafficModel:
    """One framework's block, eager and compiled, forward and backward."""

    eager_forward: WidthBytes
    eager_backward: WidthBytes
    compiled_forward: WidthBytes
    compiled_backward: WidthBytes
    measured_as: Framework
    """The framework whose block was measured (torchtitan's is the reference transformer's: its
    FlexAttention block is not lowered by inductor on the CPU)."""


# Solved from benchmarks/compiled-traffic-records/traffic.json by benchmarks/compiled_block_traffic.py (tests/test_compiled_time.py
# solves them again from the record).
_TRAFFIC: dict[Framework, tuple[WidthBytes, WidthBytes, WidthBytes, WidthBytes]] = {
    # (eager forward, eager backward, compiled forward, compiled backward): w_h, w_kv, w_F, w_0
    Framework.zeroplan: (
        WidthBytes(38.0078, 18.0, 10.0, 5154.0),
        WidthBytes(74.0156, 28.0, 18.0, 1032.0),
        WidthBytes(22.0078, 4.0, 6.0, 8.0),
        WidthBytes(42.0781, 4.0, 10.0, 16.0),
    ),
    Framework.hf: (
        WidthBytes(104.0078, 28.0, 10.0, 1072.0),
        WidthBytes(250.0156, 32.0, 18.0, 1104.0),
        WidthBytes(28.0078, 9.8333, 6.0, 1202.6667),
        WidthBytes(42.0781, 11.8333, 10.0, 1210.6667),
    ),
    Framework.torchtune: (
        WidthBytes(144.0078, 41.3333, 10.0, 13018.6667),
        WidthBytes(338.0469, 84.0, 18.0, 18512.0),
        WidthBytes(34.0078, 6.5, 6.0, 6664.0),
        WidthBytes(50.8781, -2.3667, 9.2, -632.5333),
    ),
}

BLOCK_TRAFFIC: dict[Framework, BlockTrafficModel] = {
    framework: BlockTrafficModel(*widths, measured_as=framework) for framework, widths in _TRAFFIC.items()
}
# torchtitan's block (nn.RMSNorm, fused QKV, complex RoPE, SDPA at its tables' commit) is
# priced as the reference transformer's, whose operators are the closest measured (one fused
# RMSNorm kernel each way, no fp32 upcasts of the whole activation).
BLOCK_TRAFFIC[Framework.torchtitan] = BlockTrafficModel(*_TRAFFIC[Framework.zeroplan], measured_as=Framework.zeroplan)


def block_traffic_model(framework: Framework) -> BlockTrafficModel | None:
    """The measured block traffic of ``framework`` (None where its block was not measured)."""
    return BLOCK_TRAFFIC.get(framework)


def _widths(model: ModelSpec, moe: bool) -> tuple[int, int, int]:
    from zeroplan.core.roofline.operations import _mlp_width

    return model.hidden_size, model.kv_size, _mlp_width(model, moe)


def block_bytes_per_token(request: PlanRequest, moe: bool, backward: bool, compiled: bool) -> float:
    """One block's memory-bound bytes per token in one pass (0 where the framework's block was not measured)."""
    traffic = block_traffic_model(request.training.framework)
    if traffic is None:
        return 0.0
    widths = (traffic.compiled_backward if backward else traffic.compiled_forward) if compiled else \
        (traffic.eager_backward if backward else traffic.eager_forward)
    return widths.bytes_per_token(*_widths(request.model, moe))


def _block_tokens(request: PlanRequest) -> list[tuple[bool, float]]:
    """(has experts, block-tokens of one pass over the step) per kind of block: blocks x
    micro-batches x tokens per micro-batch, spread over the model-parallel ranks."""
    from zeroplan.core.roofline.operations import _block_kinds

    batch = request.batch
    tokens = batch.micro_batch_size * batch.seq_len * batch.grad_accum_steps / request.parallel.model_parallel_size
    return [(moe, blocks * tokens) for moe, blocks in _block_kinds(request.model)]


def recomputed_block_share(request: PlanRequest) -> float:
    """The share of the blocks' forwards the backward reruns (full recomputation and
    selective-layer's checkpointed blocks; selective policies rerun a few kernels, counted as
    none)."""
    from zeroplan.specs.training import ActivationCheckpointing

    policy = request.training.activation_checkpointing
    if policy is ActivationCheckpointing.full:
        return 1.0
    if policy is ActivationCheckpointing.selective_layer:
        layers = request.model.num_layers
        return (layers // request.training.selective_layer_interval) / layers
    return 0.0


# The compiled step moves (eager - compiled) bytes per token less in each block's forward and
# backward, and in each forward the backward reruns under recomputation.
def compile_saved_bytes(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward with its recomputation) device-memory bytes compile saves on one rank
    in one step; (0, 0) uncompiled or for a framework whose block was not measured."""
    if not request.training.compile or block_traffic_model(request.training.framework) is None:
        return 0.0, 0.0
    forward = backward = 0.0
    recomputed = recomputed_block_share(request)
    for moe, block_tokens in _block_tokens(request):
        saved_forward = (block_bytes_per_token(request, moe, False, False)
                         - block_bytes_per_token(request, moe, False, True)) * block_tokens
        saved_backward = (block_bytes_per_token(request, moe, True, False)
                          - block_bytes_per_token(request, moe, True, True)) * block_tokens
        forward += saved_forward
        backward += saved_backward + recomputed * saved_forward
    return forward, backward


def compile_time_note(request: PlanRequest) -> str:
    """'' where compile is timed (or not asked for); else why the step is timed as eager."""
    if not request.training.compile:
        return ""
    from zeroplan.core.roofline.ceilings import CEILINGS

    if block_traffic_model(request.training.framework) is None:
        return f"compile not timed: no measured block traffic for framework {request.training.framework.value}"
    if request.cluster.gpu.name not in CEILINGS:
        return f"compile not timed: no measured memory bandwidth for gpu {request.cluster.gpu.name}"
    return ""


def compile_saved_seconds(request: PlanRequest) -> tuple[float, float]:
    """(forward, backward) seconds compile saves under the flat-HFU model: the saved bytes at
    the GPU's copy bandwidth; (0, 0) where compile_time_note says it is not timed."""
    if not request.training.compile or compile_time_note(request):
        return 0.0, 0.0
    from zeroplan.core.roofline.ceilings import gpu_ceilings

    bandwidth = gpu_ceilings(request.cluster.gpu).memory_bytes_per_s
    forward, backward = compile_saved_bytes(request)
    return forward / bandwidth, backward / bandwidth


BLOCK_MEMORY_NAMES = frozenset({"norms", "rotary embedding", "residual adds", "activation", "expert dispatch and combine",
                                "gradient sums"})
"""The roofline's per-block memory passes (zeroplan.core.roofline.operations.block_memory_passes)."""


# The roofline counts each eager operator's tensors once (block_memory_passes); a compiled
# block moves the bytes inductor's kernels move instead: each block pass's memory operations
# are scaled by the compiled block's bytes over the single-pass count of the same pass
# (recomputation by the forward's).
def compiled_roofline_scale(request: PlanRequest, moe: bool, backward: bool) -> float:
    """Compiled bytes over the roofline's single-pass bytes of one block pass (1 uncompiled or unmeasured)."""
    if not request.training.compile or block_traffic_model(request.training.framework) is None:
        return 1.0
    from zeroplan.core.profiles import profile
    from zeroplan.core.roofline.operations import OpPass, block_memory_passes

    op_pass = OpPass.backward if backward else OpPass.forward
    single = sum(op.moved_bytes for op in block_memory_passes(request.model, moe, 1, 2, op_pass, 1,
                                                              profile(request.training.framework).fuses_qkv))
    return block_bytes_per_token(request, moe, backward, True) / single if single else 1.0
