"""The eager memory-bound kernels of a block timed below the copy bandwidth, per stack, against
the published rows (issue 30; docs/validation.md, "Eager memory-bound kernels per stack").

The planner times a block's memory passes (zeroplan.core.roofline.operations.block_memory_passes:
norms, residual adds, activation, rotary embedding, autograd's gradient sums, the final norm) at
the GPU's copy bandwidth. The stacks whose blocks run them as torch's eager kernels, uncompiled,
are llm-foundry (MPT: LPLayerNorm, GELU, residual adds; flash-attn's fused cross-entropy),
torchtitan, torchtune and HF (nn.RMSNorm, SwiGLU, rotary in eager ops when not compiled); the
fused stacks (Megatron-LM's TransformerEngine and Megatron-DeepSpeed's apex kernels, llm.c's CUDA
kernels, TinyLlama's flash-attn kernels) and every compiled row keep the planner's time. Three
variants, each changing only those rows' memory-bound time, nothing in zeroplan:

- source count: llm-foundry's MPT block counted from its source (llm_foundry_extra_elements: bias
  gradients, the Wqkv split's backward, the Triton kernel's or flash_attn_fn's copies, less the
  gradient sums a fused Wqkv does not run), at the copy bandwidth;
- measured: that, and each pass at the fraction of the copy bandwidth torch's eager kernels of
  its class reached on the project's H200 (benchmarks/eager_kernel_bandwidth.py: pointwise kernels
  1.00, the norm's forward 0.69, its backward 0.34, the roofline's bytes over their device time),
  on every GPU generation; no constant from the published rows;
- fitted: that count, and one bandwidth fraction per (GPU generation x stack) for all the block's
  passes, leave-one-source-out: for each source, the fraction of its mechanism is the one on GRID
  that makes the HFUs calibrate step solves on the other sources of that mechanism most alike (the
  mean |log| deviation of each row's HFU from its source's median: what a one-row calibration
  needs), its rows never in it; the copy bandwidth (fraction 1) where no other source has that
  mechanism. Each source is then scored (calibrated on one row, and the fitted default held out)
  with every mechanism at the fraction fitted without it.

    python benchmarks/eager_memory_fit.py          # ~4 min on 2 cores

``--run '{"measured": true, "every_stack": true}'`` prints one variant's rows as JSON with the
fused stacks' uncompiled rows at the measured fractions too.

One process per planner variant (the study's caches keep the planner they first ran).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

EAGER_STACKS = ("llm-foundry", "torchtitan", "torchtune", "hf")
"""Stacks whose blocks run their memory-bound kernels as torch's eager kernels unless compiled."""
BLOCK_PASSES = frozenset({"norms", "final norm", "residual adds", "activation", "rotary embedding", "gradient sums",
                          "expert dispatch and combine"})
"""The block's eager memory passes (block_memory_passes and head_operations' final norm)."""
NORM_PASSES = frozenset({"norms", "final norm"})
EVERY = "every source"
"""The key of the HFUs solved at the attention efficiencies fitted on every source."""
GRID = (1.0, 0.8, 0.67, 0.5, 0.4, 0.33, 0.25, 0.2, 0.15, 0.1)
"""Bandwidth fractions tried by the fit (1: the copy bandwidth, the planner as it is)."""


def row_mechanism(row, every_stack: bool = False) -> str | None:  # type: ignore[no-untyped-def]
    """'GENERATION x STACK' for a row whose block runs eager memory kernels (an eager stack, not
    compiled, neither in its timed request nor in what it ran), else None; ``every_stack``: the
    fused stacks' uncompiled rows too."""
    from zeroplan.core.default_efficiency import generation_of
    from zeroplan.validate.step_calibration import default_request, stack_of

    stack = stack_of(row)
    if (stack not in EAGER_STACKS and not every_stack) or row.compile or default_request(row).training.compile:
        return None
    return f"{generation_of(row.gpu)} x {stack}"


def request_key(request) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    """What tells the published rows' requests apart, whatever their HFU or attention rate."""
    return (request.model, request.cluster.gpu.name, request.cluster.num_nodes, request.cluster.gpus_per_node,
            request.batch, request.strategy, request.parallel, request.training)


# llm-foundry's MPT block (llmfoundry/models/mpt/modeling_mpt.py MPTBlock, layers/attention.py,
# layers/flash_attn_triton.py; v0.3.0 for the triton rows, main at #838 with flash-attn 2.4.2 for
# the large-scale table's flash rows), what its eager kernels move per token beyond or short of
# the roofline's block count, in bf16 elements (q, kv the projection widths, F the MLP's):
#   forward, flash-attn 2 only (flash_attn_fn): index_first_axis gathers q, k and v out of the
#     padded batch (read and write each, 2(q + 2kv)) and pad_input scatters the output back into
#     zeros (write q, read q, write q: 3q); the triton path passes views (rearrange), no copy;
#   backward: each Linear's bias gradient (addmm's backward sums dy over the tokens: read q + 2kv,
#     h, F and h), the split of Wqkv's output into q, k, v (its backward concatenates dq, dk, dv:
#     2(q + 2kv)); the triton kernel's backward (_flash_attn_backward) reads o and do in its
#     preprocess (2q), zeroes an fp32 dq accumulator (init_to_zero: 4 bytes, 2q) and copies it to
#     bf16 (dq.copy_: read 4 write 2 bytes, 3q); flash-attn 2's gathers' backward zero-fill and
#     scatter (3(q + 2kv)) and the pad's gathers dout (2q); and none of the gradient sums the
#     roofline counts for q, k and v read apart (MPT's Wqkv is one product: its normed input has
#     one reader in the attention and one in the MLP). Dropout is 0 in every yaml (F.dropout at
#     p = 0 returns its input: no kernel).
def llm_foundry_extra_elements(request) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(forward, backward) bf16 elements per token per block MPT's eager kernels move beyond the
    roofline's count (negative: the roofline counts more)."""
    from zeroplan.core.roofline.operations import input_readers
    from zeroplan.specs.training import AttentionImplementation

    model = request.model
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    qkv = q + 2 * kv
    flash2 = request.training.attention_implementation is AttentionImplementation.flash_attn_2
    forward = (2 * qkv + 3 * q) if flash2 else 0.0
    # under float8 TransformerEngine's te.Linear sums the bias gradient in its cast kernel
    # (fp8_cast_dbias), no kernel of its own
    bias_gradients = 0 if request.training.float8 is not None else qkv + h + f + h
    backward = bias_gradients + 2 * qkv - 3 * h * (input_readers(model, False, False) - 2)
    backward += (3 * qkv + 2 * q) if flash2 else 7 * q
    return forward, backward


def _pass_factor(name: str, op_pass, fractions: dict[str, float], fraction: float | None) -> float:  # type: ignore[no-untyped-def]
    """Seconds at the measured or fitted bandwidth over seconds at the copy bandwidth."""
    from zeroplan.core.roofline.operations import OpPass

    if fraction is not None:
        return 1 / fraction
    if name in NORM_PASSES:
        return 1 / fractions["norm backward" if op_pass is OpPass.backward else "norm forward"]
    return 1 / fractions["pointwise"]


def patch(variant: dict) -> None:  # type: ignore[type-arg]
    """Time the eager rows' block memory passes as ``variant`` says: {"measured": true} or
    {"fractions": {mechanism: bandwidth fraction}}."""
    import zeroplan.core.timing as timing
    from zeroplan.core.roofline.operations import OpPass
    from zeroplan.core.roofline.step import memory_bound_step
    from zeroplan.validate.step_calibration import default_request
    from zeroplan.validate.step_time import load_published_throughput

    mechanisms: dict[tuple, str | None] = {}  # type: ignore[type-arg]
    for row in load_published_throughput().rows:
        key, mechanism = request_key(default_request(row)), row_mechanism(row, variant.get("every_stack", False))
        # a compiled row whose timed request is an uncompiled row's (fms-fsdp's, whose compile the
        # planner does not time) leaves that request at the planner's time
        mechanisms[key] = mechanism if mechanisms.get(key, mechanism) == mechanism else None
    measured = {}
    if variant.get("measured"):
        from eager_kernel_bandwidth import measured_fractions

        measured = measured_fractions()
    fitted = variant.get("fractions", {})
    memory = timing.memory_bound_time_s

    @functools.lru_cache(maxsize=4096)
    def added_s(key: tuple, request) -> tuple[float, float]:  # type: ignore[no-untyped-def, type-arg]
        mechanism = mechanisms.get(key)
        counted = variant.get("llm_foundry_source", False) and mechanism is not None and mechanism.endswith("llm-foundry")
        if mechanism is None or (not measured and fitted.get(mechanism, 1.0) == 1.0 and not counted):
            return 0.0, 0.0
        fraction = None if measured else fitted.get(mechanism, 1.0)
        extra_forward, extra_backward = llm_foundry_extra_elements(request) if counted else (0.0, 0.0)
        forward = backward = 0.0
        for term in memory_bound_step(request).terms:
            name, op_pass = term.operation.name, term.operation.op_pass
            if name not in BLOCK_PASSES:
                continue
            factor = _pass_factor(name, op_pass, measured, fraction) if measured or fraction != 1.0 else 1.0
            extra = term.seconds * (factor - 1)
            if name == "residual adds":
                # the source's extra elements at the residual adds' seconds per element (6h a token
                # both ways: the same tokens, blocks and ranks), as pointwise kernels
                per_element = term.seconds / (6 * request.model.hidden_size)
                pointwise = _pass_factor("", op_pass, measured, fraction) if measured or fraction != 1.0 else 1.0
                extra += per_element * (extra_backward if op_pass is OpPass.backward else extra_forward) * pointwise
            if op_pass is OpPass.forward:
                forward += extra
            else:
                backward += extra
        return forward, backward

    def patched(request):  # type: ignore[no-untyped-def]
        forward_s, backward_s = memory(request)
        if not forward_s and not backward_s:
            return forward_s, backward_s
        forward, backward = added_s(request_key(request), request)
        return forward_s + forward, backward_s + backward

    timing.memory_bound_time_s = patched


def run(variant: dict) -> dict:  # type: ignore[type-arg]
    """Every row's out-of-sample errors under ``variant``, and, per held-out source, the HFU
    calibrate step solves on every row (at the attention efficiencies fitted without it)."""
    patch(variant)
    return scored()


def scored() -> dict:  # type: ignore[type-arg]
    """Every row's out-of-sample errors under the planner as patched now, and, per held-out
    source, the HFU calibrate step solves on every row (step_overhead_fit reads it too)."""
    from zeroplan.validate.step_calibration import (
        DEFAULT_ATTENTION_RATE, calibration_study, held_out_fit, mode_implied_hfus, source_of,
    )
    from zeroplan.validate.step_time import load_published_throughput

    table = load_published_throughput()
    sources, errors = calibration_study(table)
    implied = {source: held_out_fit(DEFAULT_ATTENTION_RATE, table, source)[1] for source in {source_of(r) for r in table.rows}}
    implied[EVERY] = mode_implied_hfus(DEFAULT_ATTENTION_RATE, table)
    return {"errors": [{"name": e.name, "source": e.source, "label": e.label, "calibrated": e.calibrated_error,
                        "kernel": e.kernel_error} for e in errors],
            "anchors": {s.source: s.calibration_row for s in sources}, "implied": implied}


def in_process(variant: dict) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, __file__, "--run", json.dumps(variant, sort_keys=True)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def dispersion(implied: dict[str, float], rows, sources: set[str]) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Mean |log(HFU / its source's median HFU)| over the rows of ``sources`` calibrate step
    solves, and how many of their rows it refuses."""
    from zeroplan.validate.step_calibration import source_of

    deviations, refused = [], 0
    for source in sources:
        members = [row for row in rows if source_of(row) == source]
        solved = [implied[row.name] for row in members if row.name in implied]
        refused += len(members) - len(solved)
        if solved:
            median = statistics.median(solved)
            deviations += [abs(math.log(hfu / median)) for hfu in solved]
    return (statistics.fmean(deviations) if deviations else 0.0), refused


def fit(by_fraction: dict[float, dict], rows, mechanism_sources: dict[str, set[str]], held_out: str | None) -> dict[str, float]:  # type: ignore[no-untyped-def, type-arg]
    """Each mechanism's fraction on GRID fitted on its sources but ``held_out`` (None: all); a
    fraction at which calibrate step refuses more of those rows than at the copy bandwidth is
    not taken (a refused row would leave the dispersion, not join it)."""
    return fitted_on_grid(by_fraction, rows, mechanism_sources, held_out, GRID, neutral=1.0)


def fitted_on_grid(by_value: dict[float, dict], rows, mechanism_sources: dict[str, set[str]],  # type: ignore[no-untyped-def, type-arg]
                   held_out: str | None, grid: tuple[float, ...], neutral: float) -> dict[str, float]:
    """Each mechanism's value on ``grid`` fitted on its sources but ``held_out`` (None: all):
    the least dispersion of the implied HFUs, ties to the value nearest ``neutral`` (the
    planner as it is); a value at which calibrate step refuses more of those rows than at
    ``neutral`` is not taken, and a mechanism with no source left keeps ``neutral``."""
    values = {}
    for mechanism, sources in mechanism_sources.items():
        fitting = sources - {held_out}
        if not fitting:
            values[mechanism] = neutral
            continue
        # the implied HFUs at the attention efficiencies fitted without the held-out source
        key = held_out if held_out is not None else EVERY
        scored = {value: dispersion(by_value[value]["implied"][key], rows, fitting) for value in grid}
        allowed = [v for v in grid if scored[v][1] <= scored[neutral][1]]
        values[mechanism] = min(allowed, key=lambda v: (scored[v][0], abs(v - neutral)))
    return values


def _figures(errors: list[dict]) -> tuple[str, str]:  # type: ignore[type-arg]
    calibrated = [abs(e["calibrated"]) for e in errors if e["calibrated"] is not None]
    kernel = [abs(e["kernel"]) for e in errors]
    return (f"{statistics.median(calibrated):.1%} / {max(calibrated):.1%}" if calibrated else "-",
            f"{statistics.median(kernel):.1%} / {max(kernel):.1%}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Eager memory-bound kernels below the copy bandwidth, per stack.")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        print(json.dumps(run(json.loads(args.run))))
        return 0
    from zeroplan.validate.step_calibration import source_label, source_of
    from zeroplan.validate.step_time import load_published_throughput

    rows = load_published_throughput().rows
    mechanism_sources: dict[str, set[str]] = {}
    for row in rows:
        mechanism = row_mechanism(row)
        if mechanism is not None:
            mechanism_sources.setdefault(mechanism, set()).add(source_of(row))
    labels = {source_of(row): source_label(row) for row in rows}
    by_fraction = {fraction: in_process({"fractions": {m: fraction for m in mechanism_sources}, "llm_foundry_source": True})
                   for fraction in GRID}
    planner = in_process({"fractions": {}})
    counted = by_fraction[1.0]
    measured = in_process({"measured": True, "llm_foundry_source": True})
    # Each source scored with every mechanism at the fraction fitted without it.
    held_out_errors: list[dict] = []  # type: ignore[type-arg]
    runs: dict[str, dict] = {}  # type: ignore[type-arg]
    fitted_without: dict[str, dict[str, float]] = {}
    for source in labels:
        fractions = fit(by_fraction, rows, mechanism_sources, source)
        fitted_without[source] = fractions
        key = json.dumps(fractions, sort_keys=True)
        if key not in runs:
            uniform = {f for f in fractions.values()}
            runs[key] = (by_fraction[uniform.pop()] if len(uniform) == 1
                         else in_process({"fractions": fractions, "llm_foundry_source": True}))
        held_out_errors += [e for e in runs[key]["errors"] if e["source"] == source]
    every = fit(by_fraction, rows, mechanism_sources, None)
    print("Bandwidth fraction per mechanism fitted on every source (in sample, not a figure): "
          + ", ".join(f"{m} {f:g}" for m, f in sorted(every.items())))
    print()
    print("Each cell: calibrated on one row (median / max |error|), then the fitted default held out "
          "(leave-one-source-out); 'source count': llm-foundry's MPT kernels counted from its source at the copy "
          "bandwidth; 'measured': that and every eager pass at the H200's measured fraction of its class; 'fitted': "
          "that count and the block's passes at the fraction fitted without the source:")
    print()
    print("| source | eager mechanism | fraction fitted without it | planner | | source count | | measured | | "
          "fitted | |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    mechanisms_of: dict[str, set[str]] = {}
    for row in rows:
        mechanisms_of.setdefault(source_of(row), set()).add(row_mechanism(row) or "-")
    results = (planner["errors"], counted["errors"], measured["errors"], held_out_errors)
    for source, label in labels.items():
        cells = []
        for result in results:
            cells += _figures([e for e in result if e["source"] == source])
        eager = sorted(m for m in mechanisms_of[source] if m != "-")
        fraction = ", ".join(f"{fitted_without[source][m]:g}" for m in eager) or "-"
        print(f"| {label[:70]} | {', '.join(sorted(mechanisms_of[source]))} | {fraction} | " + " | ".join(cells) + " |")
    cells = []
    for result in results:
        cells += _figures(result)
    print("| every row | | | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
