"""The runner's NCCL-log plumbing on CPU: offsets taken around setup and each step, the log read
back into the record, disagreements kept per step.

No NCCL runs here (there is no GPU): a dispatch mode outside the runner's own writes a
FORMAT-DERIVED NCCL COLL line (tests/test_nccl_log.py builds it from NCCL's format string) to a
line-buffered file for every c10d call of a one-rank gloo run, as NCCL would while enqueuing.
This checks where the runner marks the log and what it attaches, not NCCL itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = r"""
import importlib.util, json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

spec = importlib.util.spec_from_file_location("fmt", sys.argv[1])
fmt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fmt)
out, drop = Path(sys.argv[2]), int(sys.argv[3])
# uint8: the launch id rank 0 broadcasts (broadcast_object_list) before setup.
ENUM = {torch.float32: 7, torch.bfloat16: 9, torch.int64: 4, torch.int32: 2, torch.uint8: 1}


class NcclLike(TorchDispatchMode):
    def __init__(self, path):
        super().__init__()
        self.file = open(path, "a", buffering=1)
        self.reduce_scatters = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.namespace != "c10d":
            return result
        raw = func._schema.name.split("::")[-1]
        group = dist.get_world_size()  # one rank, one group
        if raw == "_allgather_base_":
            calls = [("AllGather", args[1])]  # (output, input): NCCL logs the input's count
        elif raw == "_reduce_scatter_base_":
            calls = [("ReduceScatter", args[0])]  # NCCL logs the output's count
            self.reduce_scatters += 1
            if self.reduce_scatters == drop:
                calls = []
        elif raw in ("allreduce_", "broadcast_"):
            calls = [("AllReduce" if raw == "allreduce_" else "Broadcast", t) for t in args[0]]
        else:
            raise AssertionError(raw)
        for name, tensor in calls:
            self.file.write(fmt.coll_line(name, tensor.numel(), ENUM[tensor.dtype], group))
        return result


from zeroplan.harness.engines import EngineKind
from zeroplan.harness.presets import HARNESS_PRESETS
from zeroplan.harness.runner import RunConfig, run_rank
from zeroplan.specs import BatchSpec, StrategyKind, TrainingSpec

dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
log = out / "nccl-rank00000.log"
config = RunConfig(model=HARNESS_PRESETS["micro-llama"], strategy=StrategyKind("zero3"), engine=EngineKind("zeroplan"),
                   training=TrainingSpec(precision="fp32"), batch=BatchSpec(micro_batch_size=1, seq_len=8), steps=3)
with NcclLike(log):
    record, _ = run_rank(config, out, gather_full=True, nccl_log=log)
dist.destroy_process_group()
print(json.dumps({"lines": len(log.read_text().splitlines())}))
"""


def _run(tmp_path: Path, drop: int) -> tuple[dict, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(REPO / "tests" / "test_nccl_log.py"), str(tmp_path), str(drop)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return summary, json.loads((tmp_path / "rank00000.json").read_text())


@pytest.fixture(scope="module")
def undropped(tmp_path_factory) -> tuple[dict, dict]:
    """The run with every call logged, which both tests below read (one subprocess, not two)."""
    return _run(tmp_path_factory.mktemp("undropped"), drop=0)


@pytest.mark.slow  # a rank in a subprocess, seconds
def test_step_spans_hold_each_steps_calls(undropped) -> None:
    summary, record = undropped
    log = record["nccl_log"]
    assert log["agrees"], [d for c in log["checks"] for d in c["disagreements"]]
    assert [c["phase"] for c in log["checks"]] == ["setup", "step 0", "step 1", "step 2"]
    per_step = [len(s["collectives"]) for s in log["steps"]]
    assert per_step == [len(s["collectives"]) for s in record["steps"]] and min(per_step) > 0
    # The launch id's broadcast before setup and the gather after the last step are in the file but in no span.
    assert summary["lines"] > sum(per_step) + len(log["setup"]["collectives"])
    assert log["communicators"] and set(log["communicators"].values()) == {1}


@pytest.mark.slow  # a rank in a subprocess, seconds
def test_a_missing_call_shows_in_its_step_only(tmp_path: Path, undropped) -> None:
    _, first = undropped
    per_step = sum(1 for c in first["steps"][0]["collectives"] if c["op"] == "reduce_scatter")
    _, record = _run(tmp_path, drop=per_step + 1)  # the first reduce_scatter of step 1
    checks = record["nccl_log"]["checks"]
    assert [c["phase"] for c in checks if not c["agrees"]] == ["step 1"]
    assert checks[2]["disagreements"][0].startswith(f"step 1: reduce_scatter: {per_step} call(s)")
    assert checks[2]["nccl"]["reduce_scatter"]["calls"] == per_step - 1
