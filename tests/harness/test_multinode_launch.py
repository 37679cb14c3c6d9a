"""Two "nodes" on this machine: two ``zeroplan measure`` launches (gloo, CPU) that meet at one
rendezvous endpoint on 127.0.0.1, once through the node flags (a directory per node) and once
through SLURM's environment as srun would set it for one task per node (one shared directory).
No real SLURM: the variables are set for the subprocesses. Each launch is a real torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplan.harness.ports import free_local_port
from zeroplan.harness.record import SCHEMA_VERSION, read_record

ROOT = Path(__file__).resolve().parents[2]
RUN = ["micro-llama", "--strategy", "zero2", "--backend", "gloo", "--steps", "1", "--micro-batch", "1",
       "--seq-len", "16", "--timeout-s", "240"]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything a launcher reads (so that the tests behave
    the same inside a real SLURM job or torchrun), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                                                                        "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _start_nodes(argvs_envs: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """Start every node's `python -m zeroplan measure` at once (node 0 must be up for the others
    to join) and wait for all of them."""
    processes = [subprocess.Popen([sys.executable, "-m", "zeroplan", "measure", *argv], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for argv, env in argvs_envs]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


def _validate(*directories: Path) -> tuple[int, str, str]:
    result = subprocess.run([sys.executable, "-m", "zeroplan", "validate", *map(str, directories)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=_clean_env())
    return result.returncode, result.stdout, result.stderr


@pytest.mark.slow  # two torchrun launches, 4 ranks in all
def test_two_nodes_with_the_node_flags(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_local_port()}"
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = _start_nodes([
        ([*RUN, "--run-id", "two-nodes", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
          "--rdzv-endpoint", endpoint, "--rdzv-id", "test-two-nodes", "--out", str(outs[node])], _clean_env())
        for node in (0, 1)
    ])
    for node, result in enumerate(results):
        assert result.returncode == 0, result.stderr[-3000:]
        first = 2 * node
        assert f"node {node} of 2: 2 records (ranks {first}..{first + 1} of 4)" in result.stdout
    # One record per global rank, each node's in its own directory.
    assert sorted(p.name for p in outs[0].iterdir()) == ["rank00000.json", "rank00001.json"]
    assert sorted(p.name for p in outs[1].iterdir()) == ["rank00002.json", "rank00003.json"]
    records = [read_record(path) for out in outs for path in sorted(out.glob("rank*.json"))]
    assert [r.rank for r in records] == [0, 1, 2, 3]
    assert [r.node_rank for r in records] == [0, 0, 1, 1]
    assert [r.local_rank for r in records] == [0, 1, 0, 1]
    assert {r.nnodes for r in records} == {2} and {r.description.world_size for r in records} == {4}
    assert len({r.launch_id for r in records}) == 1 and records[0].launch_id
    assert {r.hostname for r in records} == {socket.gethostname()}
    assert all(r.complete and r.schema_version == SCHEMA_VERSION for r in records)

    code, out, err = _validate(*outs)
    assert code == 0, err
    assert f"run 'two-nodes' (launch {records[0].launch_id[:8]}): 4 ranks merged from 2 nodes" in out
    # One node's directory alone is half a run: refused in one line.
    code, out, err = _validate(outs[1])
    assert code == 2 and out == "" and err.count("\n") == 1 and "ranks 0-1 of 4 are missing" in err, err


@pytest.mark.slow  # two torchrun launches, 2 ranks in all
def test_two_nodes_under_slurm_share_one_directory(tmp_path: Path) -> None:
    """`srun --ntasks-per-node=1 zeroplan measure --slurm ...` on a two-node allocation, as each
    task sees it: node 0's host is the first of the step's node list (127.0.0.1 of
    127.0.0.[1-2]; every 127.x address is this machine) and MASTER_PORT its port."""
    out = tmp_path / "shared"
    slurm = {"SLURM_JOB_ID": "777", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
             "SLURM_LOCALID": "0", "MASTER_PORT": str(free_local_port())}
    results = _start_nodes([
        ([*RUN, "--run-id", "slurm", "--slurm", "--nproc-per-node", "1", "--out", str(out)],
         _clean_env(**slurm, SLURM_NODEID=str(node), SLURM_PROCID=str(node)))
        for node in (0, 1)
    ])
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    records = [read_record(path) for path in sorted(out.glob("rank*.json"))]
    assert [r.rank for r in records] == [0, 1] and [r.node_rank for r in records] == [0, 1]
    assert [r.local_rank for r in records] == [0, 0] and {r.nnodes for r in records} == {2}
    assert len({r.launch_id for r in records}) == 1
    code, out_text, err = _validate(out)
    assert code == 0, err
    assert "run 'slurm' (launch" in out_text and "2 ranks merged from 2 nodes" in out_text


@pytest.mark.slow  # one torchrun launch that waits for a node that never comes
def test_a_node_left_waiting_stops_at_its_limit_and_says_why(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_local_port()}"
    (result,) = _start_nodes([
        ([*RUN[:-2], "--timeout-s", "5", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
          "--rdzv-endpoint", endpoint, "--out", str(tmp_path / "node0")], _clean_env())
    ])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "5 s limit" in result.stderr and f"wait until all 2 nodes have started with --rdzv-endpoint {endpoint}" in result.stderr
