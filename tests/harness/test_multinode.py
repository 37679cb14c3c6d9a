"""Measurement across nodes: SLURM's node lists, the multi-node flags of ``zeroplan measure``, and
``zeroplan validate`` merging (or refusing) the records of several nodes. The launches that
really start two "nodes" on this machine are in test_multinode_launch.py."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.harness.cli import build_parser, multinode_from_args
from zeroplan.harness.placement import MultiNode, hostnames, parse_endpoint, parse_nodelist, slurm_multinode
from zeroplan.harness.record import RankRecord, read_record, write_record
from zeroplan.validate.load import load_record_files, merge_runs

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "records" / "tiny-llama-zero1-zeroplan-fp32-n2"


# --- SLURM's compressed node lists -------------------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),  # no padding: widths follow the numbers
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),  # padded to the low bound's width
    ("a[1-2],b,c[5]", ["a1", "a2", "b", "c5"]),
    ("gpu-a[1-2]b[1-2]", ["gpu-a1b1", "gpu-a1b2", "gpu-a2b1", "gpu-a2b2"]),  # first group outermost
    ("rack[1-2]-n[3]-ib", ["rack1-n3-ib", "rack2-n3-ib"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ("dgx-h100-[0003,0005-0006]", ["dgx-h100-0003", "dgx-h100-0005", "dgx-h100-0006"]),
    ("node[3, 1]", ["node3", "node1"]),  # order kept, as written
])
def test_nodelist_expands(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("text,says", [
    ("", "empty host name"),
    ("a,,b", "empty host name"),
    ("node[1-3", "'[' without ']'"),
    ("node1-3]", "']' without '['"),
    ("node[[1-2]]", "nested"),
    ("node[3-1]", "runs backwards"),
    ("node[a-c]", "not a list of numbers"),
    ("node[]", "not a list of numbers"),
    ("node[1-2-3]", "not a list of numbers"),
    ("node[1-99999999]", "more than"),
    ("two words", "space"),
])
def test_a_bad_nodelist_is_one_line_naming_the_variable(text: str, says: str) -> None:
    with pytest.raises(ZeroplanError) as caught:
        parse_nodelist(text, "SLURM_STEP_NODELIST")
    message = str(caught.value)
    assert message.startswith("SLURM_STEP_NODELIST: ") and says in message and "\n" not in message


def test_scontrol_expands_what_the_parser_does_not_know(tmp_path, monkeypatch) -> None:
    """A form outside the parser's grammar goes to `scontrol show hostnames` when it is installed."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho hostA\necho hostB\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("scontrol") == str(scontrol)
    assert hostnames("odd[a-b]", "SLURM_JOB_NODELIST") == ["hostA", "hostB"]
    assert hostnames("node[1-2]", "SLURM_JOB_NODELIST") == ["node1", "node2"]  # the parser's own answer first
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ZeroplanError, match="^SLURM_JOB_NODELIST: "):
        hostnames("odd[a-b]", "SLURM_JOB_NODELIST")


@pytest.mark.parametrize("text,expected", [
    ("node01:29500", ("node01", 29500)), ("127.0.0.1:1", ("127.0.0.1", 1)), ("[::1]:65535", ("::1", 65535)),
])
def test_endpoint_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["node01", ":29500", "node01:", "node01:0", "node01:65536", "node01:http", "a b:1", "node:-1"])
def test_a_bad_endpoint_names_the_flag_and_the_form(text: str) -> None:
    with pytest.raises(ZeroplanError) as caught:
        parse_endpoint(text)
    assert str(caught.value).startswith("--rdzv-endpoint: expected HOST:PORT with PORT in 1..65535")


# --- SLURM's environment, one srun task per node ----------------------------------------------

def _slurm(node: int, **changes: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "4", "SLURM_STEP_NUM_NODES": "4",
           "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
           "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[01-03,07]", "SLURM_STEP_NODELIST": "gpu[01-03,07]"}
    env.update(changes)
    return {k: v for k, v in env.items() if v != ""}


def test_slurm_environment_gives_the_launch() -> None:
    assert slurm_multinode(_slurm(2), None, None) == MultiNode(nnodes=4, node_rank=2, endpoint="gpu01:29500",
                                                               rdzv_id="slurm-4242.0")
    assert slurm_multinode(_slurm(0, MASTER_PORT="31337", SLURM_STEP_ID=""), None, None).endpoint == "gpu01:31337"
    assert slurm_multinode(_slurm(0, SLURM_STEP_ID=""), None, None).rdzv_id == "slurm-4242"
    # The flags win over what SLURM implies.
    assert slurm_multinode(_slurm(3), "gpu01-ib:29400", "mine") == MultiNode(4, 3, "gpu01-ib:29400", "mine")
    # Only the job's variables (an older srun): the job's list and counts.
    job_only = {k: v for k, v in _slurm(1).items() if "STEP_N" not in k}
    assert slurm_multinode(job_only, None, None).endpoint == "gpu01:29500"


@pytest.mark.parametrize("env,variable", [
    ({}, "SLURM_STEP_NUM_NODES"),
    (_slurm(0, SLURM_STEP_NUM_TASKS="32"), "SLURM_STEP_NUM_TASKS"),  # one task per GPU: not this mode
    (_slurm(4), "SLURM_NODEID"),
    (_slurm(0, SLURM_NODEID="x"), "SLURM_NODEID"),
    (_slurm(0, SLURM_STEP_NODELIST="gpu[01-03]"), "SLURM_STEP_NODELIST"),  # 3 hosts for 4 nodes
    (_slurm(0, SLURM_STEP_NODELIST="gpu[01-0x]"), "SLURM_STEP_NODELIST"),
    (_slurm(0, SLURM_STEP_NODELIST="", SLURM_JOB_NODELIST=""), "SLURM_JOB_NODELIST"),
    (_slurm(0, MASTER_PORT="99999"), "MASTER_PORT"),
    (_slurm(0, SLURM_JOB_ID=""), "SLURM_JOB_ID"),
])
def test_a_wrong_slurm_environment_names_the_variable(env: dict[str, str], variable: str, monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol to fall back on
    with pytest.raises(ZeroplanError) as caught:
        slurm_multinode(env, None, None)
    assert str(caught.value).startswith(f"{variable}: ") and "\n" not in str(caught.value)


# --- zeroplan measure's flags -----------------------------------------------------------------

BASE = ["micro-llama", "--strategy", "zero2", "--out", "out"]


def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args([*BASE, *flags])


def test_flags_give_this_nodes_share() -> None:
    assert multinode_from_args(_args(), {}) is None
    nodes = multinode_from_args(_args("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1234",
                                      "--nproc-per-node", "4", "--run-id", "exp"), {})
    assert nodes == MultiNode(nnodes=2, node_rank=1, endpoint="h:1234", rdzv_id="exp")
    assert _args("--nproc-per-node", "4").nproc == 4 == _args("--nproc", "4").nproc
    assert multinode_from_args(_args("--slurm"), _slurm(1)).node_rank == 1


@pytest.mark.parametrize("flags,env,flag", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], {}, "--node-rank"),
    (["--node-rank", "1", "--rdzv-endpoint", "h:1"], {}, "--node-rank"),  # --nnodes defaults to 1
    (["--nnodes", "2", "--node-rank", "0"], {}, "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "h"], {}, "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", " "], {}, "--rdzv-id"),
    (["--rdzv-id", "x"], {}, "--rdzv-id"),
    (["--slurm", "--nnodes", "2"], _slurm(0), "--nnodes"),
    (["--slurm", "--node-rank", "0"], _slurm(0), "--node-rank"),
    (["--slurm", "--rdzv-endpoint", "h"], _slurm(0), "--rdzv-endpoint"),
    (["--slurm"], {}, "SLURM_STEP_NUM_NODES"),
    # srun with several tasks and no node flags: every task would run a separate launch into one --out.
    ([], _slurm(0), "--slurm"),
])
def test_inconsistent_node_flags_are_refused(flags: list[str], env: dict[str, str], flag: str) -> None:
    with pytest.raises(ZeroplanError) as caught:
        multinode_from_args(_args(*flags), env)
    message = str(caught.value)
    assert message.startswith(f"{flag}: "), message
    assert ("allowed" in message or "HOST:PORT" in message) and "\n" not in message, message


@pytest.mark.parametrize("flags,flag", [
    (["--node-rank", "-1"], "--node-rank"), (["--node-rank", "x"], "--node-rank"), (["--node-rank", "1.5"], "--node-rank"),
    (["--nnodes", "0"], "--nnodes"), (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "5"], "--node-rank"),
    (["--nnodes", "2", "--node-rank", "1"], "--rdzv-endpoint"), (["--slurm"], "SLURM_STEP_NUM_NODES"),
])
def test_measure_answers_bad_node_flags_in_one_line(flags, flag, zeroplan_cli, monkeypatch, tmp_path) -> None:
    """Through the command line: exit 2, one line naming the flag, no traceback, nothing launched."""
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr("zeroplan.harness.launch.launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.chdir(tmp_path)
    code, _, err = zeroplan_cli("measure", *BASE, "--backend", "gloo", *flags)
    assert code == 2 and err.count("\n") == 1 and flag in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


# --- validate: merging the records of several nodes --------------------------------------------

def _four_ranks(launch: str = "a" * 32, run_id: str = "exp") -> list[RankRecord]:
    """Two nodes of two ranks each, made from a committed record (only the placement differs)."""
    base = read_record(RECORDS / "rank00000.json")
    description = base.description.model_copy(update={"world_size": 4, "run_id": run_id})
    return [base.model_copy(update={"rank": rank, "launch_id": launch, "local_rank": rank % 2, "node_rank": rank // 2,
                                    "nnodes": 2, "hostname": f"node{rank // 2}", "description": description})
            for rank in range(4)]


def _write(directory: Path, records: list[RankRecord]) -> Path:
    for record in records:
        write_record(directory, record)
    return directory


def _merge(*directories: Path):
    return merge_runs(load_record_files([str(d) for d in directories]))


def test_records_merge_from_one_directory_per_node_or_one_shared(tmp_path) -> None:
    records = _four_ranks()
    node0, node1 = _write(tmp_path / "node0", records[:2]), _write(tmp_path / "node1", records[2:])
    (run,) = _merge(node0, node1)
    assert [r.rank for r in run.records] == [0, 1, 2, 3] and run.hosts == ["node0", "node1"]
    (shared,) = _merge(_write(tmp_path / "shared", records))
    assert shared.records == run.records
    # A file named again (a directory and a file in it) is read once.
    (again,) = merge_runs(load_record_files([str(node0), str(node0 / "rank00000.json"), str(node1)]))
    assert len(again.records) == 4


def test_two_whole_runs_of_one_run_id_stay_apart(tmp_path) -> None:
    one, two = _four_ranks("a" * 32), _four_ranks("b" * 32)
    runs = _merge(_write(tmp_path / "one", one), _write(tmp_path / "two", two))
    assert sorted(run.launch_id for run in runs) == ["a" * 32, "b" * 32]


def _refusal(*directories: Path) -> str:
    with pytest.raises(ZeroplanError) as caught:
        _merge(*directories)
    message = str(caught.value)
    assert message.startswith("records: ") and "\n" not in message
    return message


def test_missing_ranks_are_refused(tmp_path) -> None:
    message = _refusal(_write(tmp_path / "node0", _four_ranks()[:2]))
    assert "run 'exp' (launch aaaaaaaa): ranks 2-3 of 4 are missing (2 present)" in message
    assert "rank 3 of 4 is missing" in _refusal(_write(tmp_path / "three", _four_ranks()[:3]))


def test_duplicated_ranks_are_refused(tmp_path) -> None:
    records = _four_ranks()
    node0, node1 = _write(tmp_path / "node0", records[:3]), _write(tmp_path / "node1", records[2:])
    message = _refusal(node0, node1)
    assert "rank 2 appears 2 times" in message and "node0/rank00002.json" in message and "node1/rank00002.json" in message


def test_ranks_of_different_launches_are_refused(tmp_path) -> None:
    node0 = _write(tmp_path / "node0", _four_ranks("a" * 32)[:2])
    node1 = _write(tmp_path / "node1", _four_ranks("b" * 32)[2:])
    message = _refusal(node0, node1)
    assert "run 'exp' mixes 2 launches" in message and "launch aaaaaaaa: ranks 0-1" in message
    assert "launch bbbbbbbb: ranks 2-3" in message and "different runs" in message


def test_a_launch_whose_records_disagree_is_refused(tmp_path) -> None:
    records = _four_ranks()
    other = records[3].description.model_copy(update={"world_size": 8})
    records[3] = records[3].model_copy(update={"description": other})
    assert "world_size is 4" in _refusal(_write(tmp_path / "d", records))


def test_an_incomplete_record_is_refused(tmp_path) -> None:
    records = _four_ranks()
    records[1] = records[1].model_copy(update={"complete": False})
    message = _refusal(_write(tmp_path / "d", records))
    assert "rank 1" in message and "incomplete" in message


def test_a_rank_beyond_the_world_is_refused(tmp_path) -> None:
    records = _four_ranks()
    records.append(records[3].model_copy(update={"rank": 4}))
    assert "rank 4" in _refusal(_write(tmp_path / "d", records))


def test_records_before_schema_3_still_merge_by_directory(tmp_path) -> None:
    """Old records have no launch id: one directory is one launch, as every old launch wrote."""
    old = json.loads((RECORDS / "rank00000.json").read_text(encoding="utf-8"))
    assert old["schema_version"] == 2 and "launch_id" not in old
    (run,) = _merge(RECORDS)
    assert run.launch_id is None and [r.rank for r in run.records] == [0, 1] and run.hosts == []
    shutil.copy(RECORDS / "rank00000.json", tmp_path / "rank00000.json")
    assert "rank 1 of 2 is missing" in _refusal(tmp_path)


def test_validate_prints_the_merge_and_refuses_in_one_line(tmp_path, capsys) -> None:
    from zeroplan.cli.main import main

    records = _four_ranks()
    node0, node1 = _write(tmp_path / "node0", records[:2]), _write(tmp_path / "node1", records[2:])
    assert main(["validate", str(node0), str(node1)]) == 0
    assert "run 'exp' (launch aaaaaaaa): 4 ranks merged from 2 nodes (node0, node1)" in capsys.readouterr().out
    assert main(["validate", str(node0)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "ranks 2-3 of 4 are missing" in captured.err


# --- the launcher's own check of this node's records -----------------------------------------

def test_a_record_an_earlier_launch_left_is_not_counted(tmp_path, monkeypatch) -> None:
    """Node 1 of 2, two ranks (2 and 3), in a directory an earlier launch already wrote: rank 3
    dies before its first record, so its old file must not pass for this launch's."""
    from zeroplan.harness import launch as launch_module

    earlier = _four_ranks("e" * 32)
    _write(tmp_path, earlier)
    now = _four_ranks("f" * 32)
    commands = []

    def torchrun(command, timeout_s):
        commands.append(command)
        write_record(tmp_path, now[2])  # rank 2 writes; rank 3 does not
        return 1, "zeroplan measure: rank 3 failed: RuntimeError: boom\n"

    monkeypatch.setattr(launch_module, "run_torchrun", torchrun)
    nodes = MultiNode(nnodes=2, node_rank=1, endpoint="127.0.0.1:1234", rdzv_id="r")
    result = launch_module.launch(2, ["micro-llama"], tmp_path, 60, nodes=nodes)
    assert result.records == [tmp_path / "rank00002.json"]
    assert result.missing_ranks == [3] and result.stale_ranks == [3]
    assert result.errors == ["zeroplan measure: rank 3 failed: RuntimeError: boom"]
    # Nothing was deleted: the earlier launch's files are all still there.
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == [f"rank{r:05d}.json" for r in range(4)]
    assert commands[0][3:9] == ["--nnodes=2", "--node-rank=1", "--rdzv-backend=static",
                                "--rdzv-endpoint=127.0.0.1:1234", "--rdzv-id=r", "--nproc-per-node=2"]


def test_measure_reports_this_nodes_share(capsys, monkeypatch, tmp_path) -> None:
    from zeroplan.harness import launch as launch_module
    from zeroplan.harness.cli import main

    outcomes = iter([launch_module.LaunchResult(0, [tmp_path / "rank00004.json", tmp_path / "rank00005.json"], [], [], []),
                     launch_module.LaunchResult(1, [tmp_path / "rank00004.json"], [5], [], [], [5])])
    monkeypatch.setattr(launch_module, "launch", lambda *args, **kwargs: next(outcomes))
    argv = [*BASE[:-1], str(tmp_path), "--backend", "gloo", "--nnodes", "3", "--node-rank", "2",
            "--rdzv-endpoint", "h:1", "--nproc-per-node", "2"]
    assert main(argv) == 0
    assert "node 2 of 3: 2 records (ranks 4..5 of 6)" in capsys.readouterr().out
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[5] (the record of rank(s) [5] there is an earlier launch's)" in err, err


def test_one_rank_of_a_fake_process_group_is_a_whole_run(tmp_path) -> None:
    """benchmarks/gpu_measure.py runs rank 0 of N alone on a fake process group: nothing is missing."""
    record = _four_ranks()[0]
    fake = record.model_copy(update={"description": record.description.model_copy(update={"backend": "fake"})})
    (run,) = _merge(_write(tmp_path, [fake]))
    assert [r.rank for r in run.records] == [0]
