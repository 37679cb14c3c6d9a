"""Find and read measurement records; a damaged file is a one-line error naming it. Merge the
records of every node of a run, refusing a run whose ranks are missing, duplicated, from
different launches or incomplete."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.harness.record import RankRecord, read_record
from zeroplan.specs.base import first_error


def record_files(paths: list[str]) -> list[Path]:
    """Expand directories into their rank*.json files, in a stable order."""
    files: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found = sorted(path.rglob("rank*.json"))
            if not found:
                raise ZeroplanError("records", f"no rank*.json record under {text!r}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ZeroplanError("records", f"{text!r} is neither a record file nor a directory")
    return files


def load_records(paths: list[str]) -> list[RankRecord]:
    return [record for _, record in load_record_files(paths)]


def load_record_files(paths: list[str]) -> list[tuple[Path, RankRecord]]:
    """Each record with its file; a file named twice (a directory and a file in it) is read once."""
    records = []
    seen: set[Path] = set()
    for path in record_files(paths):
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        try:
            record = read_record(path)
        except ValidationError as error:
            # pydantic's first line only says "1 validation error for RankRecord": name the field.
            raise ZeroplanError("records", f"{str(path)!r} is not a zeroplan record ({first_error(error)})") from None
        except ValueError as error:  # not JSON, or not UTF-8
            first = str(error).splitlines()[0]
            raise ZeroplanError("records", f"{str(path)!r} is not a zeroplan record ({first})") from None
        except OSError as error:
            raise ZeroplanError("records", f"cannot read {str(path)!r}: {error.strerror}") from None
        if not record.steps:
            raise ZeroplanError("records", f"{str(path)!r}: steps: empty (a record needs at least one measured step)")
        records.append((path, record))
    return records


@dataclass(frozen=True)
class MergedRun:
    """Every rank of one launch, in rank order, possibly read from several nodes' directories."""

    run_id: str
    launch_id: str | None
    records: list[RankRecord]
    files: list[Path]

    @property
    def hosts(self) -> list[str]:
        """Host names by node rank (as recorded; empty before schema 3)."""
        by_node = {r.node_rank: r.hostname for r in self.records if r.node_rank is not None and r.hostname}
        return [by_node[node] for node in sorted(by_node)]

    @property
    def name(self) -> str:
        return f"run {self.run_id!r}" + (f" (launch {self.launch_id[:8]})" if self.launch_id else "")


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _group_key(path: Path, record: RankRecord) -> tuple:
    # Records before schema 3 carry no launch id; each came from a single-node launch that wrote
    # all its ranks into one directory, so that directory stands for the launch.
    if record.launch_id is not None:
        return ("launch", record.launch_id)
    return ("directory", str(path.resolve().parent), record.description.run_id)


def _agreeing(group: list[tuple[Path, RankRecord]], name: str) -> None:
    """The ranks of one launch describe the same run."""
    first_path, first = group[0]
    for path, record in group[1:]:
        for field, mine, theirs in (
            ("run_id", record.description.run_id, first.description.run_id),
            ("world_size", record.description.world_size, first.description.world_size),
            ("strategy", record.description.strategy.value, first.description.strategy.value),
            ("engine", record.description.engine, first.description.engine),
            ("model", record.description.model.name, first.description.model.name),
            ("nnodes", record.nnodes, first.nnodes),
        ):
            if mine != theirs:
                raise ZeroplanError("records", f"{name}: {field} is {theirs!r} in {str(first_path)!r} and {mine!r} in "
                                               f"{str(path)!r}: records of different runs cannot be merged")


def merge_runs(loaded: list[tuple[Path, RankRecord]]) -> list[MergedRun]:
    """Group the records by launch and check that each launch is whole: every rank
    0..world_size-1 exactly once, every record complete. The first problem is a one-line error."""
    groups: dict[tuple, list[tuple[Path, RankRecord]]] = defaultdict(list)
    for path, record in loaded:
        groups[_group_key(path, record)].append((path, record))
    runs_by_id: dict[str, list[list[tuple[Path, RankRecord]]]] = defaultdict(list)
    for group in groups.values():
        runs_by_id[group[0][1].description.run_id].append(group)
    merged = []
    for group in groups.values():
        run_id, launch_id = group[0][1].description.run_id, group[0][1].launch_id
        name = MergedRun(run_id, launch_id, [], []).name
        _agreeing(group, name)
        by_rank: dict[int, list[Path]] = defaultdict(list)
        for path, record in group:
            by_rank[record.rank].append(path)
        world_size = group[0][1].description.world_size
        for rank, paths in sorted(by_rank.items()):
            if len(paths) > 1:
                raise ZeroplanError("records", f"{name}: rank {rank} appears {len(paths)} times "
                                               f"({', '.join(repr(str(p)) for p in paths)}); give each rank's record once")
            if rank >= world_size:
                raise ZeroplanError("records", f"{name}: rank {rank} in {str(paths[0])!r} is not below the world size "
                                               f"{world_size} (allowed: ranks 0..{world_size - 1})")
        # A fake process group (benchmarks/gpu_measure.py) runs one process that acts as one rank
        # of N: the other ranks never existed, so there is nothing missing.
        fake = all(record.description.backend == "fake" for _, record in group)
        missing = [] if fake else sorted(set(range(world_size)) - set(by_rank))
        if missing:
            launches = [g for g in runs_by_id[run_id] if g[0][1].launch_id is not None]
            if launch_id is not None and len(launches) > 1:
                parts = "; ".join(f"launch {g[0][1].launch_id[:8]}: ranks {_ranks_text([r.rank for _, r in g])}"
                                  for g in launches)
                raise ZeroplanError("records", f"run {run_id!r} mixes {len(launches)} launches ({parts}): records of "
                                               "different runs cannot be merged; give the --out directories of one launch")
            which = f"rank {missing[0]} of {world_size} is" if len(missing) == 1 else f"ranks {_ranks_text(missing)} of {world_size} are"
            raise ZeroplanError("records", f"{name}: {which} missing ({len(by_rank)} present); give the --out "
                                           "directory of every node")
        for path, record in sorted(group, key=lambda item: item[1].rank):
            if not record.complete:
                raise ZeroplanError("records", f"{name}: rank {record.rank} ({str(path)!r}) is marked incomplete "
                                               "(complete=false: it stopped before the end of the run); measure again")
        ordered = sorted(group, key=lambda item: item[1].rank)
        merged.append(MergedRun(run_id, launch_id, [r for _, r in ordered], [p for p, _ in ordered]))
    return merged


def run_labels(runs: list[MergedRun]) -> list[str]:
    """A name per run for the tables, distinct across the runs given: its run id where no other
    run has it, else (zeroplan measure names every run 'local' unless --run-id is given) the
    run id and the directory of its rank-0 record, then that directory's path, then the launch,
    then a count, each only where the shorter name is still shared."""

    def directory(run: MergedRun) -> Path:
        return run.files[0].parent if run.files else Path(".")

    levels = [
        lambda run: run.run_id,
        lambda run: f"{run.run_id} ({directory(run).name})",
        lambda run: f"{run.run_id} ({directory(run)})",
        lambda run: f"{run.run_id} ({directory(run)}" + (f", launch {run.launch_id[:8]})" if run.launch_id else ")"),
    ]
    level = [0] * len(runs)
    labels = [levels[0](run) for run in runs]
    for _ in levels[1:]:
        shared = {label for label in labels if labels.count(label) > 1}
        for index, run in enumerate(runs):
            if labels[index] in shared:
                level[index] += 1
                labels[index] = levels[level[index]](run)
    shared = {label for label in labels if labels.count(label) > 1}
    return [f"{label} #{labels[:index].count(label) + 1}" if label in shared else label
            for index, label in enumerate(labels)]
