"""DeepSpeed 0.19.8's reduce bucket under Hugging Face's two ways of running it (accelerate's
DeepSpeedPlugin, a Trainer "auto" config), measured from the libraries' own code against the
planner's figure for the same request (benchmarks/hf_deepspeed_buckets.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_deepspeed_buckets.py"


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("deepspeed", "transformers", "accelerate")),
                    reason="needs deepspeed, transformers and accelerate")
def test_hf_reduce_bucket_is_measured_as_planned() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(("accelerate-plugin", "trainer-auto"))]
    assert len(rows) == 4
    for way, stage, size, measured, planned, trainable in rows:
        assert measured == planned == size, (way, stage)
    # The plugin's bucket is DeepSpeed's 5e8 whatever the model's size; "auto" is h^2 (h 64).
    assert {(r[0], r[2]) for r in rows} == {("accelerate-plugin", "500,000,000"), ("trainer-auto", "4,096")}
