"""benchmarks/gpu_allocator.py: its capacity search (pure) and its profile phase on the CPU."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_allocator import narrow, probe_points  # noqa: E402


def test_probe_points_lie_strictly_inside_the_bracket_and_are_spread() -> None:
    points = probe_points(100, 200, 8)
    assert points == sorted(set(points)) and len(points) == 8
    assert all(100 < p < 200 for p in points)
    assert max(b - a for a, b in zip([100, *points], [*points, 200])) <= 12


def test_probe_points_of_a_closed_bracket_are_none() -> None:
    assert probe_points(100, 101, 8) == []
    assert probe_points(100, 102, 8) == [101]


def test_narrow_takes_the_smallest_completing_and_the_largest_failing_below_it() -> None:
    low, high, inverted = narrow(100, 200, {120: False, 140: False, 160: True, 180: True})
    assert (low, high, inverted) == (140, 160, [])


def test_narrow_reports_a_failure_above_a_completion() -> None:
    low, high, inverted = narrow(100, 200, {120: False, 140: True, 160: False, 180: True})
    assert (low, high, inverted) == (120, 140, [160])


def test_narrow_without_outcomes_keeps_the_bracket() -> None:
    assert narrow(100, 200, {}) == (100, 200, [])


@pytest.mark.slow  # three small fake-process-group runs in subprocesses, seconds each
def test_profile_phase_runs_on_the_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_allocator.py"), "--model", "micro-llama",
                    "--seq-len", "32", "--phases", "profile", "--only", "fsdp-full-shard:torch", "--out", str(tmp_path)],
                   env=env, check=True, capture_output=True, timeout=300)
    with tarfile.open(tmp_path / "profile.tar.gz") as archive:
        archive.extractall(tmp_path / "x", filter="data")
    documents = sorted((tmp_path / "x" / "profile").glob("*.json.gz"))
    assert [d.name for d in documents] == ["fsdp-full-shard-torch.json.gz"]
    for path in documents:
        document = json.load(gzip.open(path, "rt"))
        assert len(document["step_wall_s"]) == 5 and min(document["step_wall_s"]) > 0
        names = {row["name"] for row in document["operators"]}
        assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names
