"""Fit alpha and achievable bus bandwidth to an nccl-tests sweep, and write a calibrated GPU."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field

from zeroplan.calibrate.parse import NcclTestsLog
from zeroplan.core import algorithms
from zeroplan.core.communication import CollectiveOp
from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen
from zeroplan.specs.hardware import AchievedBusBandwidth, GpuSpec


class LinkFit(Frozen):
    """alpha and bus bandwidth of one collective over one link."""

    collective: str
    """all_reduce, all_gather or reduce_scatter."""
    link: str
    """intra_node or inter_node."""
    num_ranks: int = Field(gt=0)
    """Ranks of the run."""
    num_nodes: int = Field(default=1, gt=0)
    """Nodes of the run (hosts)."""
    alpha_s: float = Field(ge=0)
    """Fitted start-up time of the whole collective, seconds (clamped at 0)."""
    bus_bandwidth_bytes_per_s: float = Field(gt=0)
    """Fitted achievable bus bandwidth, bytes per second."""
    points: int = Field(gt=0)
    """Message sizes used."""
    bandwidth_points: int = Field(gt=0)
    """Of those, the ones the bandwidth was fitted to (the bandwidth regime)."""
    source: str
    """The log file."""
    max_relative_error: float = Field(ge=0)
    """Largest |model time / measured time - 1| over the rows used: how far one alpha-beta line is
    from this sweep somewhere (mid sizes, where NCCL changes protocol, are the usual worst)."""
    largest_size_relative_error: float
    """model time / measured time - 1 at the sweep's largest message (negative: model faster)."""
    reported_avg_busbw_bytes_per_s: float | None = None
    """The log's own ``# Avg bus bandwidth`` (mean over sizes, not an asymptote), bytes per second."""
    nccl_version: str | None = None
    """NCCL version as the log states it."""
    largest_message_bytes: int = Field(default=0, ge=0)
    """Largest message size of the sweep, bytes."""


# nccl-tests doc/PERFORMANCE.md: time = size * factor / busbw on the bandwidth side.
def bus_factor(collective: str, num_ranks: int) -> float:
    """The factor that turns algorithm bandwidth into bus bandwidth (zeroplan.core.algorithms)."""
    return algorithms.bus_factor(CollectiveOp(collective), num_ranks)


# Alpha-beta model t = alpha + x * beta, x = size * factor, by least squares weighted 1/t^2
# (relative error), so small messages pin alpha and large ones beta.
def fit_alpha_beta(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte); alpha clamped at 0 (then beta refitted through the origin)."""
    ws = [1.0 / t**2 for t in ts]
    sw = sum(ws)
    swx = sum(w * x for w, x in zip(ws, xs))
    swt = sum(w * t for w, t in zip(ws, ts))
    swxx = sum(w * x * x for w, x in zip(ws, xs))
    swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * swxx - swx * swx
    alpha = (swt * swxx - swx * swxt) / det if det > 0 else -1.0
    if alpha < 0:
        return 0.0, swxt / swxx
    return alpha, (sw * swxt - swx * swt) / det


# A real sweep is not one straight line: NCCL switches protocol (LL, LL128, Simple) and algorithm
# with size, so one alpha-beta line fitted to every row misses the large messages (by 24% and
# 42% on two of the published logs in tests/fixtures/nccl_tests/real). The bandwidth is therefore
# fitted to the rows at or above this fraction of the sweep's peak printed busbw, and alpha to the
# rows below it given that bandwidth. 0.5 is a choice, not a figure from NCCL.
BANDWIDTH_REGIME_FRACTION = 0.5


def _latency_given_beta(xs: list[float], ts: list[float], beta: float) -> float:
    """alpha minimising the relative error of t = alpha + x * beta with beta fixed (weights 1/t^2),
    clamped at 0."""
    weights = [1.0 / t**2 for t in ts]
    return max(0.0, sum(w * (t - x * beta) for w, x, t in zip(weights, xs, ts)) / sum(weights))


def fit_log(log: NcclTestsLog) -> LinkFit:
    """Fit one run from its out-of-place times (in-place ones are not used): busbw from the rows whose
    printed busbw reaches BANDWIDTH_REGIME_FRACTION of the peak (all rows if fewer than two sizes
    do), alpha from the other rows given that busbw (the bandwidth fit's intercept if there are none)."""
    factor = bus_factor(log.collective, log.num_ranks)
    rows = [row for row in log.rows if row.size_bytes > 0 and row.out_of_place_time_s > 0]
    if len({row.size_bytes for row in rows}) < 2 or factor == 0:
        raise ZeroplanError("calibrate", f"{log.source}: need at least two non-zero message sizes and two ranks to fit "
                                         f"(it has {len({row.size_bytes for row in rows})} size(s), {log.num_ranks} rank(s))")
    xs = [row.size_bytes * factor for row in rows]
    ts = [row.out_of_place_time_s for row in rows]
    peak = max(row.out_of_place_busbw_bytes_per_s for row in rows)
    if peak == 0:
        raise ZeroplanError("calibrate", f"{log.source}: the busbw column is 0 in every row, which a run that moved "
                                         "data cannot print (allowed: nccl-tests output of a run that completed)")
    in_regime = [row.out_of_place_busbw_bytes_per_s >= BANDWIDTH_REGIME_FRACTION * peak for row in rows]
    if len({row.size_bytes for row, inside in zip(rows, in_regime) if inside}) < 2:
        in_regime = [True] * len(rows)
    intercept, beta = fit_alpha_beta([x for x, inside in zip(xs, in_regime) if inside],
                                     [t for t, inside in zip(ts, in_regime) if inside])
    if beta <= 0:
        raise ZeroplanError("calibrate", f"{log.source}: times do not grow with size; cannot fit a bandwidth")
    alpha = intercept
    if not all(in_regime):
        alpha = _latency_given_beta([x for x, inside in zip(xs, in_regime) if not inside],
                                    [t for t, inside in zip(ts, in_regime) if not inside], beta)
    errors = [(alpha + x * beta) / t - 1 for x, t in zip(xs, ts)]
    largest = max(range(len(rows)), key=lambda i: rows[i].size_bytes)
    return LinkFit(collective=log.collective, link=log.link, num_ranks=log.num_ranks, num_nodes=log.num_nodes, alpha_s=alpha,
                   bus_bandwidth_bytes_per_s=1.0 / beta, points=len(rows), source=log.source,
                   bandwidth_points=sum(in_regime), max_relative_error=max(abs(e) for e in errors),
                   largest_size_relative_error=errors[largest],
                   reported_avg_busbw_bytes_per_s=log.reported_avg_busbw_bytes_per_s, nccl_version=log.nccl_version,
                   largest_message_bytes=max(row.size_bytes for row in rows))


# zeroplan.core.timing charges latency_s per ring step: 2(n-1) steps for all-reduce, n-1 for the
# others; the whole-collective alpha is spread over those steps.
def per_step_latency_s(fit: LinkFit) -> float:
    steps = 2 * (fit.num_ranks - 1) if fit.collective == "all_reduce" else fit.num_ranks - 1
    return fit.alpha_s / steps


# zeroplan/core/network.py: without a declared node network a ring with m ranks per node gets
# m x the inter-node link's (per-GPU share) bandwidth, so a log's busbw is stored divided by m.
def link_bandwidth_bytes_per_s(fit: LinkFit) -> float:
    """The figure the calibrated link gets, so that the model gives back the fitted busbw."""
    if fit.link == "inter_node":
        return fit.bus_bandwidth_bytes_per_s / (fit.num_ranks // fit.num_nodes)
    return fit.bus_bandwidth_bytes_per_s


def achieved_from_fit(fit: LinkFit) -> AchievedBusBandwidth:
    """A fitted log as an achievable-bandwidth entry (its asymptotic busbw, at its largest size)."""
    return AchievedBusBandwidth(
        collective=fit.collective, scope=fit.link, bus_bandwidth_bytes_per_s=fit.bus_bandwidth_bytes_per_s,
        num_nodes=fit.num_nodes, gpus_per_node=fit.num_ranks // fit.num_nodes,
        message_bytes=max(fit.largest_message_bytes, 1), nccl_version=fit.nccl_version or "not in the log",
        source=Path(fit.source).name, note=f"fitted by zeroplan calibrate from {fit.points} message sizes",
    )


def calibrated_gpu(base: GpuSpec, fits: list[LinkFit]) -> GpuSpec:
    """``base`` with each calibrated link's bandwidth and latency replaced. The planner has one
    bandwidth per link, so several collectives on one link give the lowest bandwidth and the
    highest per-step latency (the conservative choice)."""
    update: dict = {}
    for link in ("intra_node", "inter_node"):
        on_link = [f for f in fits if f.link == link]
        if not on_link:
            continue
        old = getattr(base, f"{link}_link")
        update[f"{link}_link"] = old.model_copy(update={
            "name": f"{old.name} (calibrated)",
            "bandwidth_bytes_per_s": min(link_bandwidth_bytes_per_s(f) for f in on_link),
            "latency_s": max(per_step_latency_s(f) for f in on_link),
        })
        if link == "inter_node":
            # The measured figure replaces the datasheet NICs (one per GPU at the stored share).
            update["node_network"] = None
    # The fitted busbw of each log also replaces the catalog's published runs: the planner's default
    # (PerformanceAssumptions.bandwidth = achievable) then charges this cluster's own efficiency.
    update["achievable"] = tuple(achieved_from_fit(f) for f in fits)
    sources = ", ".join(sorted({Path(f.source).name for f in fits}))
    update["display_name"] = f"{base.display_name} (calibrated)"
    update["source"] = f"{base.source}; links calibrated from nccl-tests logs: {sources}"
    return GpuSpec.model_validate({**base.model_dump(), **update})


# The catalog's names carry the model as one token with a digit (a100-80gb: A100, rtx-4090:
# 4090); nvidia-smi's names, which nccl-tests prints on its Rank lines, carry it as a word
# ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"; GH200 is not an H200).
def catalog_model_token(catalog_name: str) -> str:
    """The model token of a catalog GPU name."""
    return next((part for part in catalog_name.split("-") if any(c.isdigit() for c in part)), catalog_name).upper()


def device_matches(device_name: str, token: str) -> bool:
    """Whether nccl-tests' device name names the model ``token`` (a whole word: the A10 is not the
    A10G, nor the L40 the L40S)."""
    return re.search(rf"(?<![A-Z0-9]){re.escape(token)}(?![0-9A-Z])", device_name.upper()) is not None


BOARD_TOKENS = ("pcie", "nvl")
"""Catalog name parts naming a board other than the SXM module (a100-pcie-40gb, h100-nvl), which
nvidia-smi's names carry too ("NVIDIA A100-PCIE-40GB", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"),
while the SXM parts' names carry neither ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")."""


def device_is_catalog_gpu(device_name: str, catalog_name: str) -> bool:
    """Whether nccl-tests' device name is the catalog GPU ``catalog_name``'s model and board."""
    if not device_matches(device_name, catalog_model_token(catalog_name)):
        return False
    words = set(re.findall(r"[A-Z0-9]+", device_name.upper()))
    return all((token in catalog_name.split("-")) == (token.upper() in words) for token in BOARD_TOKENS)
