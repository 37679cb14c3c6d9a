"""The prepared GPU benchmark imports and runs without CUDA (its fake-PG path, tiny, on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.harness.layout import padded_numel
from zeroplan.harness.model import build_model
from zeroplan.harness.presets import harness_model
from zeroplan.harness.record import read_record, record_path
from zeroplan.harness.zero import unit_modules

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_measure.py"
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")


def test_help_works_without_cuda() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], env=ENV, capture_output=True, text=True, check=True)
    assert "fake process group" in done.stdout


@pytest.mark.slow  # a fake-process-group run in a subprocess, seconds
def test_fake_pg_smoke_run_records_one_rank_of_n(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--model", "micro-llama", "--world-size", "8",
                    "--seq-len", "16", "--precision", "fp32", "--cases", "zero3:zeroplan", "--out", str(tmp_path)],
                   env=ENV, check=True, capture_output=True, timeout=120)
    record = read_record(record_path(tmp_path / "zero3-zeroplan", 0))
    assert record.description.world_size == 8 and record.description.backend == "fake"
    units = unit_modules(build_model(harness_model("micro-llama")))
    shard = sum(padded_numel(sum(p.numel() for p in u.parameters()), 8) // 8 for u in units)
    assert record.steps[-1].model_state.parameters_bytes == 4 * shard
