"""Render the figures the README and docs show into docs/figures/*.png, from the same plans as
notebooks/compare_stages.ipynb (Llama-2-13B, 8 x A100-80GB, micro-batch 1 x 4096 tokens, full
activation checkpointing) and the harness records committed under benchmarks/records/:

    python notebooks/render_figures.py

Each file is written atomically (zeroplan.atomic.write_atomic); the figures' code is in
zeroplan/report/plots.py."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from zeroplan import fit, get_gpu, get_model  # noqa: E402
from zeroplan.atomic import write_atomic  # noqa: E402
from zeroplan.report import plots  # noqa: E402
from zeroplan.specs import (ActivationCheckpointing, BatchSpec, PlanRequest, StrategyKind,  # noqa: E402
                            StrategySpec, TrainingSpec, cluster_from_gpus)

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
RECORDS = ROOT / "benchmarks" / "records"


def seed_request(gpus_per_node: int = 8) -> PlanRequest:
    """The notebook's question: Llama-2-13B on 8 x A100-80GB, in one node or in 8 nodes of one GPU."""
    return PlanRequest(
        model=get_model("llama-2-13b"),
        training=TrainingSpec(activation_checkpointing=ActivationCheckpointing.full),
        batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8, gpus_per_node=gpus_per_node),
        strategy=StrategySpec(kind=StrategyKind.ddp),
    )


def network_reports() -> dict[str, object]:
    """The same 8 GPUs joined by NVLink (one node) and by InfiniBand (one GPU per node)."""
    return {"1 node x 8 GPUs (NVLink)": fit(seed_request(8)), "8 nodes x 1 GPU (InfiniBand)": fit(seed_request(1))}


def validation_rows() -> list:
    from zeroplan.validate.compare import compare_record
    from zeroplan.validate.load import load_records

    records = [r for r in load_records([str(RECORDS)]) if r.rank == 0]
    return [row for record in records for row in compare_record(record)]


def figures() -> dict[str, object]:
    """File name -> figure."""
    networks = network_reports()
    report = next(iter(networks.values()))
    return {
        "memory-by-stage.png": plots.memory_stack_figure(report),
        "communication-by-network.png": plots.network_communication_figure(networks),
        "step-time-by-stage.png": plots.step_time_figure(report),
        "memory-time-tradeoff.png": plots.tradeoff_figure(networks),
        "predicted-vs-measured.png": plots.validation_figure(validation_rows()),
    }


def render(folder: Path = FIGURES) -> list[Path]:
    written = []
    for name, figure in figures().items():
        written.append(write_atomic(folder / name, lambda tmp, f=figure: f.savefig(tmp, dpi=100, format="png"),
                                    "figure"))
        plt.close(figure)
    return written


if __name__ == "__main__":
    for path in render():
        print(f"wrote {path.relative_to(ROOT)}")
