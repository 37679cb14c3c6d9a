"""Candidate step-time mechanisms for the sources a one-row calibration still misses (issue 30:
median <= 5 %, max <= 15 % per source; docs/validation.md, "Step time", "Mechanisms tried for
the sources over the target"). Each variant changes one planner function for the run (nothing
in zeroplan changes), and the calibrated figures (zeroplan.validate.step_calibration, the rule's
anchor, scored on the source's other rows), the anchor floor (how many of a source's rows would
meet the target as its anchor: a diagnostic of the model's spread within the source) and the
fitted default's leave-one-source-out figures are printed beside the planner as it is.

    python benchmarks/step_time_mechanisms.py            # every variant, ~12 min on 2 cores
    python benchmarks/step_time_mechanisms.py --variant contention

Variants whose constant comes from a publication or a measurement (not from these rows):

- recompute-forward-rate: full recomputation's second attention forward at the kernel's forward
  rate instead of its forward + backward one. The rate ratios: FlashAttention-2 on H100, causal,
  head dim 128, 2k tokens: forward 298 TFLOP/s (flash-attention assets/flash3_fp16_fwd.png,
  panel d) against forward + backward 265 (assets/flash2_h100_fwd_bwd_benchmark.png, panel d),
  so a recomputed forward costs 265/298 = 0.89 of what the combined rate charges; the Triton
  kernel: Triton's fused-attention tutorial (triton-lang.org, 06-fused-attention, causal d 64,
  2k tokens) runs its forward at 136.5 and its backward at 76.2 TFLOP/s (ratio 1.79), so with the
  backward 2.5x the forward's FLOPs a forward costs 3.5 / (1 + 2.5 x 1.79) = 0.63 of the combined
  rate's charge (flash_attn_triton.py's docstring: its forward faster, its backward slower).
  Eager attention keeps its charge.
- contention: compute that runs while collectives overlap it is slowed by 18.9 %, the average
  compute slowdown under overlap measured on A100 and H100 (Lee et al. 2025, "Characterizing
  Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114,
  abstract): a phase with compute c and collectives k takes max(k, c + k x 0.189 / 1.189).
- eager-memory-x2, eager-memory-x2-mpt: the memory-bound kernels take 1.99x the copy-bandwidth
  model's time, what the project's H200 profile measured for the FSDP step at 2 x 4,096 tokens
  (benchmarks/gpu-step-profile-records: 35.85 ms of memory kernels against 17.98 predicted);
  on every row, then on llm-foundry's MPT rows only (the stack that runs them eager).

- gemm-operand-traffic: each matrix product also moves its operands, A and B read and C written
  (2 bytes each, bf16), at the GPU's copy bandwidth (zeroplan.core.roofline.ceilings, the rate the
  memory-bound kernels are timed at), added to its math rather than hidden under it: the additive
  roofline, t = FLOPs / (peak x HFU) + bytes / bandwidth. Its share of a product's time is about
  ridge x (1/M + 1/N + 1/K) with ridge = (peak x HFU) / bandwidth, so a narrow model's products
  (MPT-760M: h 1,536) pay several times a wide one's (h 8,192), and H100 (ridge 272 FLOP/byte)
  more than A100 (151 on the 80GB, 198 on the 40GB). Every block product on the rank (q/k/v, output, MLP up (and gate),
  down; its share of tensor-parallel widths), forward, recomputed forward (the recomputed share
  of the forward FLOPs), data gradient and weight gradient, per micro-batch, and the output
  head's three without pipeline parallelism; no constant, nothing fitted. A diagnostic of the
  misses' width scaling (a per-token cost in proportion to h, where the FLOPs go as h^2), not a
  measured mechanism: the H200 profile (docs/validation.md, "Step time, kernel by kernel") timed
  the products of a 2,048-wide model at 8,192 tokens within 0-3 % of the matmul ceiling, where
  this variant adds 15 % to them (ridge 189 FLOP/byte there; H100 272, A100 80GB 151, A100 40GB 198).
  gemm-operand-traffic+contention: that and the contention variant together.

- optimizer-loop: llm-foundry's MPT rows pay Composer's optimizer step as a host loop: Composer
  0.16-0.17's DecoupledAdamW (composer/optim/decoupled_weight_decay.py) steps each parameter
  tensor in Python and reads its GPU step count with .item() first, so the GPU drains at every
  tensor and waits on the host's launches. The tensors the busiest rank steps under FSDP1 with
  use_orig_params=True (Composer's default, trainer/dist_strategy.py: every original tensor that
  meets the rank's shard of its unit's flat parameter; the torch 1.13.1 rows, without
  use_orig_params, one flat shard per unit), each at the host time per tensor of torch's
  single-tensor AdamW on the project's H200 (step_overhead_fit.measured_optimizer_s_per_tensor,
  0.23 ms; a lower bound for Composer's loop, which also waits at every tensor), added to the step.
- fsdp-edge: each micro-batch's first FSDP all-gather and the step's last reduce-scatter exposed
  (one call each, the phase's collective time over its calls), where the planner hides a phase's
  collectives behind its compute as a whole; no constant.

- gemm-waves-largest, gemm-waves-largest-splitk, gemm-waves-any-tile: tile and wave
  quantization of every block product (NVIDIA, "Matrix Multiplication Background User's Guide",
  DU-09799-001, secs. 2.3 and 3: a GEMM's output is cut into tiles, one thread block each, run in
  waves of one tile per SM; a partial last tile or wave is paid in full). A product of output
  M x N on a GPU of S SMs (A100 108, H100 and H200 SXM 132, V100 80: NVIDIA's A100 and H100
  whitepapers, the V100 one) with a tile tm x tn keeps M N / (ceil(ceil(M/tm) ceil(N/tn) / S) S tm tn)
  of its time busy. Per block weight (K in, N out on the rank: column-parallel q/k/v and up,
  row-parallel o and down) the forward's output is T x N, the data gradient's T x K and the weight
  gradient's N x K (T the micro-batch's tokens). cuBLAS chooses among tile shapes (the guide's
  sec. 2.3: 256x128 and 128x256 the most efficient, down to 64x64; larger tiles reuse more,
  smaller ones give more tiles to fill the SMs): -largest takes the better-quantized of the two
  largest tiles for every product (the most the effect can be with large tiles); -largest-splitk
  the same with the weight gradient's long reduction over T split to fill the SMs (cuBLAS's
  split-K / stream-K kernels for small outputs with a long K), so only the forward and data
  gradient quantize; -any-tile the best-quantized of the guide's eight tiles, each at the same
  rate (the least the effect can be: a small tile's lower reuse is not charged). No constant
  from the rows; the HFU then covers a product at full waves.

A fraction of the hidden communication fitted per GPU generation x stack (and the contention
above beside it) is benchmarks/step_time_hidden_communication.py: its f is fitted without the
scored source, which one patched planner function cannot know.

Exploratory, constants picked by hand and so in sample (labelled so; never a shipped figure):

- gemm-k: a matrix product of inner dimension K runs at K / (K + K0) of the HFU (a fixed
  prologue/epilogue per output tile against a main loop over K), per GPU generation:
  K0 768 on both; A100 256 and H100 1024; A100 128 and H100 1536.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

RECOMPUTE_FORWARD_CHARGE = {"flash-attn-2": 265 / 298, "flash-attn-triton": 3.5 / (1 + 2.5 * 136.5 / 76.2)}
"""A recomputed attention forward's seconds over what the forward + backward rate charges it."""
OVERLAP_SLOWDOWN = 0.189
"""Compute slowdown while collectives overlap it (Lee et al. 2025, arXiv 2507.03114)."""
EAGER_MEMORY_FACTOR = 35.85 / 17.98
"""Measured over predicted memory-bound kernel time, the H200 FSDP step (gpu-step-profile-records)."""

VARIANTS = {
    "planner": "the planner as it is",
    "recompute-forward-rate": "recomputed attention forward at the forward rate",
    "contention": f"compute slowed {OVERLAP_SLOWDOWN:.1%} under overlapped collectives",
    "eager-memory-x2": f"memory-bound kernels x{EAGER_MEMORY_FACTOR:.2f}, every row",
    "eager-memory-x2-mpt": f"memory-bound kernels x{EAGER_MEMORY_FACTOR:.2f}, llm-foundry's MPT rows",
    "gemm-operand-traffic": "GEMM operands at the copy bandwidth, not hidden under the math (no constant)",
    "gemm-operand-traffic+contention": "GEMM operands at the copy bandwidth and compute slowed under overlap",
    "optimizer-loop": "MPT rows: Composer's per-tensor AdamW loop at the H200's host time per tensor (no constant from the rows)",
    "fsdp-edge": "each micro-batch's first FSDP gather and the step's last reduce-scatter exposed (no constant)",
    "gemm-waves-largest": "GEMM tile and wave quantization, the largest tiles, weight gradients too (no constant)",
    "gemm-waves-largest-splitk": "GEMM tile and wave quantization, the largest tiles, weight gradients split over K (no constant)",
    "gemm-waves-any-tile": "GEMM tile and wave quantization, the best of the guide's eight tiles (no constant)",
    "gemm-k768": "GEMM K/(K+768), both generations (exploratory, in sample)",
    "gemm-k256-1024": "GEMM K/(K+K0), K0 A100 256, H100 1024 (exploratory, in sample)",
    "gemm-k128-1536": "GEMM K/(K+K0), K0 A100 128, H100 1536 (exploratory, in sample)",
}


def _patch_recompute_forward_rate() -> None:
    import zeroplan.core.timing as timing
    from zeroplan.core.attention_rate import kernel_name
    from zeroplan.core.flops import attention_backward_over_forward

    compute = timing._flat_compute_time_s

    def patched(flops, request, executed_rate):  # type: ignore[no-untyped-def]
        forward_s, backward_s = compute(flops, request, executed_rate)
        if request.performance.attention_rate == "matmul":
            return forward_s, backward_s
        training = request.training
        charge = RECOMPUTE_FORWARD_CHARGE.get(kernel_name(training.attention_kernel, training.attention_implementation), 1.0)
        recomputed = flops.attention_backward_flops - attention_backward_over_forward(training.attention_kernel) * flops.attention_forward_flops
        rate = timing.attention_flops_per_s(request, executed_rate)
        return forward_s, backward_s - max(0.0, recomputed) * (1 - charge) / rate

    timing._flat_compute_time_s = patched


def _patch_contention() -> None:
    import zeroplan.core.timing as timing
    from zeroplan.core.collective import Phase

    exposed = timing.exposed_communication_s
    share = OVERLAP_SLOWDOWN / (1 + OVERLAP_SLOWDOWN)

    def patched(forward_s, backward_s, collective_s, host_s, maximum=max, nvme_s=None):  # type: ignore[no-untyped-def]
        seconds = exposed(forward_s, backward_s, collective_s, host_s, maximum=maximum, nvme_s=nvme_s)
        for compute_s, phase in ((forward_s, Phase.forward), (backward_s, Phase.backward)):
            busy = maximum(collective_s[phase], host_s[phase])
            if nvme_s is not None:
                busy = maximum(busy, nvme_s[phase])
            past = maximum(0.0, busy - compute_s)
            seconds = seconds + maximum(past, collective_s[phase] * share) - past
        return seconds

    timing.exposed_communication_s = patched


def _patch_memory(factor: float, mpt_only: bool) -> None:
    import zeroplan.core.timing as timing

    memory = timing.memory_bound_time_s

    def patched(request):  # type: ignore[no-untyped-def]
        forward_s, backward_s = memory(request)
        if mpt_only and not request.model.name.startswith("mpt-"):
            return forward_s, backward_s
        return forward_s * factor, backward_s * factor

    timing.memory_bound_time_s = patched


def _patch_gemm(k0_ampere: float, k0_hopper: float) -> None:
    def multipliers(request) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        architecture = request.cluster.gpu.architecture
        k0 = k0_hopper if architecture is not None and architecture.value == "hopper" else k0_ampere
        model, tp = request.model, request.parallel.tp
        h, f = model.hidden_size, model.ffn_hidden_size
        tokens = request.batch.micro_batch_size * request.batch.seq_len
        # (inner, outer) of each block weight on one rank: column-parallel q/k/v and up, row-parallel o and down.
        weights = [(h, (model.q_size + 2 * model.kv_size) // tp), (model.q_size // tp, h)]
        weights += [(h, f // tp)] * ((3 if model.mlp.gated else 2) - 1) + [(f // tp, h)]

        def slowed(k: float) -> float:
            return (k + k0) / k

        forward = sum(i * o * slowed(i) for i, o in weights) / sum(i * o for i, o in weights)
        backward = sum(i * o * (slowed(o) + slowed(tokens)) for i, o in weights) / sum(2 * i * o for i, o in weights)
        return forward, backward

    _patch_matrix_products(multipliers)


def _patch_matrix_products(multipliers) -> None:  # type: ignore[no-untyped-def]
    """Slow the block's matrix products (not attention) of the flat model by ``multipliers``
    (request -> forward, backward time over the unslowed time; recomputation at the forward's)."""
    import zeroplan.core.timing as timing
    from zeroplan.core.flops import attention_backward_over_forward

    compute = timing._flat_compute_time_s

    def patched(flops, request, rate):  # type: ignore[no-untyped-def]
        forward_s, backward_s = compute(flops, request, rate)
        forward_m, backward_m = multipliers(request)
        recomputed_attention = max(0.0, flops.attention_backward_flops
                                   - attention_backward_over_forward(request.training.attention_kernel) * flops.attention_forward_flops)
        recomputed = (flops.recompute_flops - recomputed_attention) / rate
        forward = (flops.forward_flops - flops.attention_forward_flops) / rate
        backward = (flops.backward_flops - flops.attention_backward_flops) / rate - recomputed
        return (forward_s + forward * (forward_m - 1),
                backward_s + backward * (backward_m - 1) + recomputed * (forward_m - 1))

    timing._flat_compute_time_s = patched


SMS = {"ampere": 108, "hopper": 132, "volta": 80}
"""SMs per GPU (NVIDIA's A100, H100 SXM5 and V100 whitepapers; the H200 has the H100's die)."""
LARGEST_TILES = ((256, 128), (128, 256))
GUIDE_TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))
"""The tile shapes the Matrix Multiplication Background guide (sec. 2.3) lists for cuBLAS, most efficient first."""


def quantized_busy(m: float, n: float, sms: int, tiles: tuple[tuple[int, int], ...]) -> float:
    """The busy share of an M x N output's waves under the best-quantized of ``tiles``."""
    import math

    best = 0.0
    for tm, tn in tiles:
        count = math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, m * n / (math.ceil(count / sms) * sms * tm * tn))
    return best


def wave_multipliers(request, tiles, split_weight_gradient: bool) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(forward, backward) time over the full-wave time of the rank's block products."""
    architecture = request.cluster.gpu.architecture
    sms = SMS.get(architecture.value if architecture is not None else "", 0)
    if not sms:
        return 1.0, 1.0
    model, tp = request.model, request.parallel.tp
    h, f = model.hidden_size, model.ffn_hidden_size
    tokens = request.batch.micro_batch_size * request.batch.seq_len / request.parallel.cp
    weights = [(h, (model.q_size + 2 * model.kv_size) / tp), (model.q_size / tp, h)]
    weights += [(h, f / tp)] * (2 if model.mlp.gated else 1) + [(f / tp, h)]
    flops = sum(k * n for k, n in weights)
    forward = sum(k * n / quantized_busy(tokens, n, sms, tiles) for k, n in weights) / flops
    data = sum(k * n / quantized_busy(tokens, k, sms, tiles) for k, n in weights) / flops
    weight = 1.0 if split_weight_gradient else sum(k * n / quantized_busy(n, k, sms, tiles) for k, n in weights) / flops
    return forward, (data + weight) / 2


def _patch_gemm_waves(tiles, split_weight_gradient: bool) -> None:  # type: ignore[no-untyped-def]
    _patch_matrix_products(lambda request: wave_multipliers(request, tiles, split_weight_gradient))


def gemm_operand_bytes(request) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(forward, backward with recomputation) bytes of the matrix products' operands on one rank
    per step: A and B read, C written, 2 bytes an element."""
    model, tp, batch = request.model, request.parallel.tp, request.batch
    tokens = batch.micro_batch_size * batch.seq_len / request.parallel.cp
    h, f = model.hidden_size, model.ffn_hidden_size
    # (inner K, outer N) of each block weight on one rank: column-parallel q/k/v, up (and gate), row-parallel o and down.
    weights = [(h, (model.q_size + 2 * model.kv_size) / tp), (model.q_size / tp, h)]
    weights += [(h, f / tp)] * (2 if model.mlp.gated else 1) + [(f / tp, h)]

    def moved(m: float, n: float, k: float) -> float:
        return 2.0 * (m * k + k * n + m * n)

    layers = model.num_layers / request.parallel.pp
    forward = layers * sum(moved(tokens, n, k) for k, n in weights)
    # data gradient (M x K from M x N and N x K) and weight gradient (K x N from K x M and M x N): the same three sizes
    backward = 2 * forward
    if request.parallel.pp == 1:
        head = moved(tokens, model.vocab_size / tp, h)
        forward, backward = forward + head, backward + 2 * head
    return forward, backward


def _patch_gemm_operand_traffic() -> None:
    import zeroplan.core.timing as timing
    from zeroplan.core.roofline.ceilings import gpu_ceilings, times_memory_bound

    compute = timing._flat_compute_time_s

    def patched(flops, request, rate):  # type: ignore[no-untyped-def]
        forward_s, backward_s = compute(flops, request, rate)
        if not times_memory_bound(request):
            return forward_s, backward_s
        bandwidth = gpu_ceilings(request.cluster.gpu).memory_bytes_per_s
        forward, backward = gemm_operand_bytes(request)
        recomputed_share = flops.recompute_flops / flops.forward_flops if flops.forward_flops else 0.0
        accumulation = request.batch.grad_accum_steps
        return (forward_s + accumulation * forward / bandwidth,
                backward_s + accumulation * (backward + recomputed_share * forward) / bandwidth)

    timing._flat_compute_time_s = patched


# torch/distributed/fsdp/_runtime_utils.py (FSDP1) and _fully_shard (FSDP2): a unit's all-gather
# is issued at its pre-forward hook (or prefetched by the unit before it), so the first unit of
# each micro-batch's forward gathers with nothing to hide behind; the last unit's reduce-scatter
# is waited on before the optimizer step. The planner hides each phase's collectives behind that
# phase's compute as a whole (exposed_communication_s); this variant exposes at least one call
# of the forward gather per micro-batch and one call of the backward reduce-scatter per step.
def slower_by(time, added_s: float, *also: str):  # type: ignore[no-untyped-def]
    """``time`` (the planner's StepTime) with ``added_s`` more on its step, and on each field
    named in ``also``: the same tokens and FLOPs over a longer step, so tokens/s and MFU fall in
    proportion (the variants here and benchmarks/step_overhead_fit.py add time this way)."""
    step_s = time.step_with_overlap_s + added_s
    return time.model_copy(update={
        **{name: getattr(time, name) + added_s for name in also},
        "step_with_overlap_s": step_s,
        "tokens_per_s_per_gpu": time.tokens_per_s_per_gpu * time.step_with_overlap_s / step_s,
        "model_flops_utilization": time.model_flops_utilization * time.step_with_overlap_s / step_s})


def _patch_fsdp_edge() -> None:
    import zeroplan.core.timing as timing
    from zeroplan.core.collective import CollectiveOp, Phase

    step_time = timing.step_time

    def patched(request, collectives):  # type: ignore[no-untyped-def]
        time = step_time(request, collectives)
        if not request.strategy.kind.is_fsdp:
            return time
        edge = 0.0
        for collective, cost in zip(collectives, time.collective_times):
            if collective.blocking or not collective.calls:
                continue
            per_call_s = cost.seconds / (collective.occurrences_per_step * collective.calls)
            if collective.op is CollectiveOp.all_gather and collective.phase is Phase.forward:
                edge += per_call_s * collective.occurrences_per_step
            elif collective.op is CollectiveOp.reduce_scatter and collective.phase is Phase.backward:
                edge += per_call_s
        added = max(0.0, edge - time.exposed_communication_s)
        return slower_by(time, added, "exposed_communication_s") if added else time

    timing.step_time = patched


def rank_stepped_tensors(request) -> int:  # type: ignore[no-untyped-def]
    """Parameter tensors the busiest rank steps under FSDP1 with use_orig_params=True (Composer's
    default from torch 2.0): each unit is one flat parameter split into N equal shards, and a
    rank steps every original tensor whose elements meet its shard (torch/distributed/fsdp/
    _flat_param.py, FlatParamHandle._use_sharded_views; the others get no gradient)."""
    from zeroplan.core.parallel.units import rank_trainable_units

    if request.training.checkpoint_early_stop is False:
        # the torch 1.13.1 rows (checkpoint_early_stop false marks them): FSDP1 without
        # use_orig_params steps one flat shard per unit
        return len(rank_trainable_units(request))
    n = request.shard_group_size
    per_rank = [0] * n
    for unit in rank_trainable_units(request):
        total = sum(t.numel for t in unit.tensors)
        shard = -(-total // n)
        start = 0
        for tensor in unit.tensors:
            end = start + tensor.numel
            for rank in range(start // shard, min(n, -(-end // shard))):
                per_rank[rank] += 1
            start = end
    return max(per_rank)


# composer 0.16 optim/decoupled_weight_decay.py (DecoupledAdamW, llm-foundry's decoupled_adamw;
# Composer's FSDP default use_orig_params=True, trainer/dist_strategy.py): the step loops over
# the parameter tensors in Python, keeps each tensor's step count on the GPU and reads it with
# .item() before its update, so the GPU drains at every tensor and waits on the host's launches.
def _patch_optimizer_loop() -> None:
    import zeroplan.core.timing as timing
    from step_overhead_fit import measured_optimizer_s_per_tensor

    # torch's single-tensor AdamW on the H200's host (gpu-step-profile-records' DDP step), a
    # lower bound for Composer's loop, which also waits on the GPU at every tensor
    per_tensor_s = measured_optimizer_s_per_tensor()
    step_time = timing.step_time

    def patched(request, collectives):  # type: ignore[no-untyped-def]
        time = step_time(request, collectives)
        if not request.model.name.startswith("mpt-"):
            return time
        return slower_by(time, rank_stepped_tensors(request) * per_tensor_s)

    timing.step_time = patched


def apply(variant: str) -> None:
    if variant == "recompute-forward-rate":
        _patch_recompute_forward_rate()
    elif variant == "contention":
        _patch_contention()
    elif variant.startswith("eager-memory-x2"):
        _patch_memory(EAGER_MEMORY_FACTOR, variant.endswith("-mpt"))
    elif variant == "gemm-operand-traffic":
        _patch_gemm_operand_traffic()
    elif variant == "gemm-operand-traffic+contention":
        _patch_gemm_operand_traffic()
        _patch_contention()
    elif variant == "optimizer-loop":
        _patch_optimizer_loop()
    elif variant == "fsdp-edge":
        _patch_fsdp_edge()
    elif variant == "gemm-waves-largest":
        _patch_gemm_waves(LARGEST_TILES, False)
    elif variant == "gemm-waves-largest-splitk":
        _patch_gemm_waves(LARGEST_TILES, True)
    elif variant == "gemm-waves-any-tile":
        _patch_gemm_waves(GUIDE_TILES, False)
    elif variant == "gemm-k768":
        _patch_gemm(768, 768)
    elif variant == "gemm-k256-1024":
        _patch_gemm(256, 1024)
    elif variant == "gemm-k128-1536":
        _patch_gemm(128, 1536)


def figures(variant: str) -> dict:  # type: ignore[type-arg]
    """The calibrated figures per source, the anchor floor and the fitted default's LOSO
    figures of the planner under ``variant``."""
    apply(variant)
    from zeroplan.validate.step_calibration import anchor_floor, calibration_study
    from zeroplan.validate.step_time import load_published_throughput

    table = load_published_throughput()
    sources, errors = calibration_study(table)
    per_source, every = {}, []
    for source in sources:
        scored = [abs(e.calibrated_error) for e in errors if e.source == source.source and e.calibrated_error is not None]
        floor = anchor_floor(table, source.source)
        per_source[source.label] = (statistics.median(scored), max(scored), floor.meeting_target, floor.anchors)
        every += scored
    kernel = [abs(e.kernel_error) for e in errors]
    return {"per_source": per_source, "calibrated": (statistics.median(every), max(every)),
            "fitted_default": (statistics.median(kernel), max(kernel))}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Candidate step-time mechanisms against the published rows.")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="one variant, as JSON (default: every one, as a table)")
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(figures(args.variant)))
        return 0
    results = {}
    for variant in VARIANTS:
        # One process per variant: the study's caches hold the planner they first ran.
        done = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True, check=True)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    print("Calibrated on one row (median | max |error|; 'meets': anchors of the source that would meet 5 % / 15 %):")
    print()
    print("| source | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for label in results["planner"]["per_source"]:
        cells = []
        for variant in VARIANTS:
            median, worst, meets, anchors = results[variant]["per_source"][label]
            cells.append(f"{median:.1%} / {worst:.1%} ({meets} of {anchors})")
        print(f"| {label[:70]} | " + " | ".join(cells) + " |")
    for key, title in (("calibrated", "every calibrated row"), ("fitted_default", "fitted default, leave-one-source-out")):
        print(f"| {title} | " + " | ".join(f"{results[v][key][0]:.1%} / {results[v][key][1]:.1%}" for v in VARIANTS) + " |")
    print()
    for variant, meaning in VARIANTS.items():
        print(f"{variant}: {meaning}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
