"""benchmarks/gpu_step_profile.py, kept ready for a lent GPU: its smoke run on the CPU writes
step records that zeroplan.validate.step_profile reads, and a kernel-timing file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a small fake-process-group run and the kernel timings, in subprocesses
def test_smoke_run_writes_records_the_validation_reads(tmp_path: Path) -> None:
    from zeroplan.specs import ActivationCheckpointing, StrategyKind
    from zeroplan.validate.step_profile import load_step_profile

    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_step_profile.py"), "--smoke", "--world-size", "2",
         "--cases", "fsdp-full-shard:torch:1:32:full", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = sorted((tmp_path / "steps").glob("*.json.gz"))
    assert [r.name for r in records] == ["fsdp-full-shard-torch-1-32-full.json.gz"]
    profile = load_step_profile(records[0])
    assert (profile.strategy, profile.activation_checkpointing) == (StrategyKind.fsdp_full_shard, ActivationCheckpointing.full)
    # No CUDA events on the CPU: the phases have no device times, the kernels no categories' device time.
    assert profile.micro_batch_size == 1 and profile.seq_len == 32 and profile.forward_backward_s is None
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert len(kernels["gemm"]) == 21 and len(kernels["attention"]) == 2
    assert kernels["square_gemm"]["seconds"] > 0 and kernels["copy"]["tb_per_s"] > 0
