"""The NCCL communicators DeepSpeed's ZeRO-3 opens under the hf profile
(zeroplan.core.communicators._deepspeed_gathers_on_world) against the process groups its own
engines ran a step's collectives on: benchmarks/deepspeed-groups-records, written by
benchmarks/deepspeed_zero3_groups.py (tests/harness/groups_worker.py on 2 gloo ranks) from
DeepSpeed 0.19.8 and from 0.13.3's source. ProcessGroupNCCL opens one communicator per process
group a collective runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.communicators import communicators
from zeroplan.specs.strategy import StrategyKind

RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-groups-records"


def _record(release: str, rank: int) -> dict:
    return json.loads((RECORDS / release / f"rank{rank}.json").read_text(encoding="utf-8"))


def _groups_of(record: dict, kind: str) -> set[str]:
    return set(record["calls"].get(kind, {}))


def _planned(release: str):
    args = build_parser().parse_args(["fit", "llama-2-7b", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "h100-80gb",
                                      "--framework", "hf", "--precision", "bf16-mixed", "--deepspeed-release", release])
    return communicators(request_from_args(args, StrategyKind.zero3))


@pytest.mark.parametrize("release", ["0.13.3", "0.19.8"])
@pytest.mark.parametrize("rank", [0, 1])
def test_one_communicator_per_group_the_engine_ran_collectives_on(release: str, rank: int) -> None:
    record = _record(release, rank)
    assert record["deepspeed_release"] == release
    groups = set().union(*(set(calls) for calls in record["calls"].values()))
    # Every group spans both ranks: the data-parallel ranks, however many groups carry them.
    assert set(record["group_sizes"]) == groups and set(record["group_sizes"].values()) == {2}
    planned = _planned(release)
    assert len(planned) == len(groups)
    assert all(c.group_size == 2 for c in planned)


def test_0_13_3_gathers_on_the_default_group_and_reduces_on_its_clone() -> None:
    old, new = _record("0.13.3", 0), _record("0.19.8", 0)
    assert _groups_of(old, "all_gather") == {"world"} and "world" not in _groups_of(old, "reduce_scatter")
    assert _groups_of(new, "all_gather") == _groups_of(new, "reduce_scatter") == {"world"}
    names = [c.name for c in _planned("0.13.3")]
    assert names == ["data parallel", "world (ZeRO-3 parameter all-gathers)"]
    assert [c.name for c in _planned("0.19.8")] == ["data parallel"]
