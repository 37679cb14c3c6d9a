"""Plain-text tables of a PlanSearchResult (no pandas, so the CLI stays fast)."""

from __future__ import annotations

from zeroplan.answers import PlanSearchResult
from zeroplan.results import PlanCandidate
from zeroplan.units import GiB

_NAMES = ("#", "strategy", "AC", "tp", "pp", "cp", "dp", "shard", "micro", "accum", "peak GiB", "alloc", "alloc GiB", "step s",
          "compute",
          "exposed", "host", "cpu-step", "tokens/s/GPU", "MFU")


def _pp(c: PlanCandidate) -> str:
    """The pipeline degree, with 'i' for interleaved 1F1B (its stages per rank after it)."""
    if c.pp > 1 and c.pp_schedule.interleaved:
        return f"{c.pp}i{c.virtual_stages}"
    return str(c.pp)


def _row(rank: int, c: PlanCandidate, gpu_optimizer: bool, model_parallel: bool) -> list[str]:
    optimizer = [_seconds(c.optimizer_step_s)] if gpu_optimizer else []
    blocking = [_seconds(c.model_parallel_communication_s), _seconds(c.pipeline_bubble_s)] if model_parallel else []
    return [
        str(rank), c.strategy.value, c.activation_checkpointing.value, str(c.tp), _pp(c), str(c.cp), str(c.dp),
        str(c.shard_group_size),
        str(c.micro_batch_size), str(c.grad_accum_steps), f"{c.peak_bytes / GiB:.1f}",
        "-" if c.allocator_fits is None else ("yes" if c.allocator_fits else "NO"),
        "-" if c.allocator_peak_bytes is None else f"{c.allocator_peak_bytes / GiB:.1f}",
        f"{c.step_time_s:.3f}", _seconds(c.compute_s), *blocking,
        *(_seconds(v) for v in (c.exposed_communication_s, c.host_transfer_s, c.cpu_optimizer_s)),
        *optimizer, f"{c.tokens_per_s_per_gpu:,.0f}", f"{c.model_flops_utilization:.3f}",
    ]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(candidates: tuple[PlanCandidate, ...]) -> list[str]:
    # The GPU's optimizer step is priced by the roofline compute model only: its column shows then.
    gpu_optimizer = any(c.optimizer_step_s for c in candidates)
    # Tensor, context and pipeline parallelism add parts of the step: shown when a row has them.
    model_parallel = any(c.model_parallel_communication_s or c.pipeline_bubble_s for c in candidates)
    names = list(_NAMES)
    if gpu_optimizer:
        names.insert(names.index("cpu-step") + 1, "opt-step")
    if model_parallel:
        names[names.index("compute") + 1:names.index("compute") + 1] = ["mp-comm", "bubble"]
    rows = [_row(i + 1, c, gpu_optimizer, model_parallel) for i, c in enumerate(candidates)]
    widths = [max(len(names[i]), *(len(r[i]) for r in rows)) for i in range(len(names))]

    def line(cells: list[str]) -> str:
        left = [cell.ljust(w) for cell, w in zip(cells[:3], widths[:3])]
        return "  ".join([*left, *(cell.rjust(w) for cell, w in zip(cells[3:], widths[3:]))])

    return [line(names), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def configurations_counted(result: PlanSearchResult, noun: str = "configurations") -> str:
    """'4,245 configurations, 656 fit', or, where the search bounded some out (left them
    unevaluated: none could rank or join the Pareto front), how many of the others fit."""
    counted = f"{result.configurations_evaluated:,} {noun}"
    if not result.configurations_bounded_out:
        return f"{counted}, {result.configurations_fitting:,} fit"
    evaluated = result.configurations_evaluated - result.configurations_bounded_out
    return (f"{counted}, {result.configurations_fitting:,} of the {evaluated:,} evaluated fit "
            f"({result.configurations_bounded_out:,} bounded out: none could rank or join the Pareto front)")


def render_search(result: PlanSearchResult) -> str:
    if result.layouts_searched > 1:
        split = (f"micro x accum x dp = {result.global_batch_size}; {result.layouts_searched} layouts tp x pp x cp x dp, "
                 f"{result.groups_searched:,} groups")
    else:
        split = f"{result.global_batch_size // result.num_gpus} sequences per GPU = micro x accum"
    lines = [
        f"Global batch {result.global_batch_size} x seq {result.seq_len} on {result.num_gpus} GPUs "
        f"({split}): {configurations_counted(result)}.",
        "",
    ]
    if result.ranked:
        gpu_optimizer = any(c.optimizer_step_s for c in result.ranked)
        if gpu_optimizer:
            lines += ["opt-step = the optimizer step on the GPU (a memory-bound pass at the copy bandwidth), in s."]
        if any(c.model_parallel_communication_s or c.pipeline_bubble_s for c in (*result.ranked, *result.pareto)):
            lines += ["mp-comm = the tensor/context/pipeline-parallel collectives compute waits on; bubble = the "
                      "pipeline schedule's idle time, in s (step = compute + mp-comm + bubble + exposed + cpu-step"
                      + (" + opt-step)." if gpu_optimizer else ").")]
        lines += ["peak = allocated + a flat 5 % reserve, what the search ranks on; alloc = whether the step completes "
                  "in a replay of PyTorch's caching allocator (as fit judges), alloc GiB = what it reserves there.",
                  "Fastest that fit (step time with overlap; compute, exposed communication, host = offload's PCIe "
                  "copies (partly hidden), cpu-step = its CPU optimizer step, in s; MFU = model FLOPs / (step x peak), "
                  "docs/communication-time.md; pp 4i2 = interleaved 1F1B, 2 stages per rank):", *_table(result.ranked), ""]
        lines += ["Pareto front (no other fits in less memory and runs faster):", *_table(result.pareto), ""]
    lines.append(result.explanation)
    return "\n".join(lines)
