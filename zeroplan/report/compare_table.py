"""Plain-text table of communication and step time per strategy (``zeroplan compare``)."""

from __future__ import annotations

from zeroplan.core.network import node_nics
from zeroplan.core.timing import nccl_algorithms
from zeroplan.answers import FitReport
from zeroplan.report.table import framework_layout_caution, fsdp_version_lines, left_out_lines, parameter_count_caution
from zeroplan.results import StrategyPlan


def _row(plan: StrategyPlan, num_parameters: int, roofline: bool, model_parallel: bool) -> list[str]:
    t = plan.time
    optimizer = [f"{t.optimizer_step_s:.3f}"] if roofline else []
    blocking = [f"{t.model_parallel_communication_s:.3f}", f"{t.pipeline_bubble_s:.3f}"] if model_parallel else []
    return [
        plan.strategy.value,
        f"{plan.communication_volume_elements / num_parameters:.1f}",
        f"{plan.sent_bytes_per_step / 1e9:.1f}",
        f"{t.communication_s:.3f}",
        f"{t.host_transfer_s:.3f}",
        f"{t.cpu_optimizer_s:.3f}",
        f"{t.compute_s:.3f}",
        *optimizer,
        *blocking,
        f"{t.exposed_communication_s:.3f}",
        f"{t.step_with_overlap_s:.3f}",
        f"{t.step_without_overlap_s:.3f}",
        f"{t.tokens_per_s_per_gpu:,.0f}",
        f"{t.model_flops_utilization:.3f}",
        "yes" if plan.fits else "no",
        nccl_algorithms(plan.time),
    ]


def _nics(report: FitReport) -> str:
    """The node's NICs, which a ring spanning nodes shares (zeroplan/core/network.py)."""
    nics, nic_bytes_per_s = node_nics(report.cluster.gpu, report.cluster.gpus_per_node)
    return f" (node: {nics} x {nic_bytes_per_s / 1e9:g} GB/s NICs)"


def _compute_legend(report: FitReport) -> str:
    mfu = "MFU = model FLOPs (6N + attention, PaLM App. B) / (step x peak); tok/s/GPU = tokens / step."
    from zeroplan.core.roofline.ceilings import CEILINGS, gpu_ceilings

    if report.compute_model != "roofline":
        hfu = report.plans[0].time.hardware_flops_utilization or 0.0
        if report.cluster.gpu.name not in CEILINGS:
            return (f"compute = executed FLOPs (recomputation included) at HFU {hfu:.2g} of peak bf16 FLOP/s (no measured "
                    f"memory bandwidth: the HFU covers every kernel); {mfu}")
        bandwidth = gpu_ceilings(report.cluster.gpu).memory_bytes_per_s
        return (f"compute = executed matrix-product and attention FLOPs (recomputation included) at HFU {hfu:.2g} of peak "
                f"bf16 FLOP/s, memory-bound kernels at {bandwidth / 1e12:.2f} TB/s (copy bandwidth)"
                + ("; opt-step = the optimizer step on the GPU, at that bandwidth" if any(
                    p.time.optimizer_step_s for p in report.plans) else "") + f"; {mfu}")
    ceilings = gpu_ceilings(report.cluster.gpu)
    return (f"compute = the step's kernels, each at the longer of its FLOPs at {ceilings.matmul_flops_per_s / 1e12:.0f} "
            f"TFLOP/s (measured matmul ceiling) and its bytes at {ceilings.memory_bytes_per_s / 1e12:.2f} TB/s "
            "(docs/communication-time.md, 'Compute, operation by operation'); opt-step = the optimizer step on the "
            f"GPU; {mfu}")


def render_compare_table(report: FitReport) -> str:
    c, b = report.cluster, report.batch
    gpu = c.gpu
    lines = [
        f"{report.model.name} on {c.world_size} x {gpu.display_name} ({c.num_nodes} node(s) x {c.gpus_per_node}); "
        f"micro-batch {b.micro_batch_size} x seq {b.seq_len} x grad-accum {b.grad_accum_steps} per GPU",
        f"intra-node {gpu.intra_node_link.name}: {gpu.intra_node_link.bandwidth_bytes_per_s / 1e9:g} GB/s; "
        f"inter-node {gpu.inter_node_link.name}: {gpu.inter_node_link.bandwidth_bytes_per_s / 1e9:g} GB/s per GPU{_nics(report)}; "
        f"host {gpu.host_link.name}: {gpu.host_link.bandwidth_bytes_per_s / 1e9:g} GB/s",
        f"host CPUs: {c.host.cores_per_node} cores, {c.host.memory_bandwidth_bytes_per_s / 1e9:g} GB/s memory per node, "
        "shared by its GPUs (cpu-step = offload's CPU optimizer step)",
        "volume = per-step volume of what the engine sends, in units of Psi, counted as the ZeRO paper does (sec. 7); sent = GB each GPU sends per step (ring); times in s.",
        "nccl = the algorithm NCCL's tuning model picks for each collective (AR all-reduce, AG all-gather, RS reduce-scatter, "
        "BC broadcast, P2P pipeline send/receive, A2A all-to-all; a+b: calls of different sizes differ); * = at a published or calibrated nccl-tests busbw "
        "(docs/gpus.md), else at the datasheet link rates.",
        _compute_legend(report),
        "",
    ]
    # The GPU's optimizer step: the roofline's, or the flat-HFU model's memory-bound pass.
    roofline = report.compute_model == "roofline" or any(p.time.optimizer_step_s for p in report.plans)
    # Tensor, context and pipeline parallelism add parts of the step no data-parallel plan has:
    # their columns appear only then, so that every column adds up to the step.
    model_parallel = any(p.time.model_parallel_communication_s or p.time.pipeline_bubble_s for p in report.plans)
    if model_parallel:
        lines.insert(-1, "mp-comm = the tensor/context/pipeline-parallel collectives compute waits on; bubble = the "
                         "pipeline schedule's idle time (docs/parallelism.md).")
    lines.insert(-1, "step = compute" + (" + opt-step" if roofline else "") + (" + mp-comm + bubble" if model_parallel else "")
                 + " + exposed (communication and host copies the compute does not hide) + cpu-step; "
                 "no-overlap = the same with every collective and copy in full.")
    names = ["strategy", "volume", "sent", "comm", "host", "cpu-step", "compute", *(["opt-step"] if roofline else []),
             *(["mp-comm", "bubble"] if model_parallel else []),
             "exposed", "step", "no-overlap", "tok/s/GPU", "MFU", "fits", "nccl"]
    rows = [_row(p, report.num_parameters, roofline, model_parallel) for p in report.plans]
    widths = [max(len(names[i]), *(len(r[i]) for r in rows)) for i in range(len(names))]

    def line(cells: list[str]) -> str:
        middle = (x.rjust(w) for x, w in zip(cells[1:-1], widths[1:-1]))
        return "  ".join([cells[0].ljust(widths[0]), *middle, cells[-1].ljust(widths[-1])]).rstrip()

    lines += [line(names), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    lines += parameter_count_caution(report.model)
    lines += framework_layout_caution(report)
    lines += fsdp_version_lines(report)
    lines += left_out_lines(report)
    return "\n".join(lines)
