"""``zeroplan validate RECORDS...``: predicted against measured, per category and collective."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroplan.harness.record import RankRecord


def add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", nargs="+",
                        help="record files or directories of rank*.json (from zeroplan measure); the records of a "
                             "multi-node run may sit in one directory or in one per node: every rank must be there once")
    parser.add_argument("--all-ranks", action="store_true",
                        help="a row per rank (default: rank 0 of each run, and the first rank of each pipeline stage)")
    parser.add_argument("--plot", help="save a predicted-vs-measured PNG here")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1, naming each row, when a row is outside the harness's tolerance "
                             "(model states and collectives 0.1 %%, saved activations 2 %%, allocator peaks 5 %%; "
                             "docs/harness.md, 'Tolerance')")
    parser.add_argument("--from-log", metavar="FILE",
                        help="instead of records: a run's own log (torchtitan, torchtune, HF Trainer, DeepSpeed), "
                             "followed by the fit flags of its setup (zeroplan validate --from-log FILE --help)")


def nccl_summary(records: list[RankRecord], labels: dict[int, str] | None = None) -> list[str]:
    """One line per record that carries NCCL's own count (NCCL runs): agreement, or every
    disagreement with the dispatch-mode count. labels: run label by id(record) (run_labels)."""
    lines = []
    for record in records:
        log = record.nccl_log
        if log is None:
            continue
        name = f"{(labels or {}).get(id(record), record.description.run_id)} rank {record.rank}"
        if log.agrees:
            lines.append(f"NCCL log check, {name}: agrees with the dispatch-mode count (setup and {len(log.steps)} steps)")
        else:
            lines.append(f"NCCL log check, {name}: DISAGREES with the dispatch-mode count:")
            lines += [f"  {d}" for check in log.checks for d in check.disagreements]
    return lines


def default_ranks(records: list[RankRecord]) -> list[RankRecord]:
    """The rows shown without --all-ranks: rank 0, and under a pipeline the first rank of every
    pipeline rank (each plans differently: PlanRequest.at_pipeline_rank)."""
    first: dict[int, RankRecord] = {}
    for record in sorted(records, key=lambda r: r.rank):
        first.setdefault(record.description.parallel.pipeline_rank, record)
    return sorted(first.values(), key=lambda r: r.rank)


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_plot_path(text: str) -> None:
    """Refuse a plot path before any work: a format matplotlib would not write, a missing folder
    or a missing matplotlib."""
    from zeroplan.atomic import writable_file
    from zeroplan.errors import ZeroplanError

    path = Path(text)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ZeroplanError("plot", f"{text!r} must end in one of {', '.join(PLOT_SUFFIXES)}")
    if path.is_dir():
        raise ZeroplanError("plot", f"{text!r} is a directory; give a file name ending in .png")
    writable_file(path, "plot")  # a device, FIFO or socket is refused before any work
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ZeroplanError("plot", "needs matplotlib (pip install 'zeroplan[plots]')") from None


def _compared(compare_record, record: RankRecord, path: Path) -> list:
    """compare_record's rows; a record the planner refuses is named with its file and its own
    field (description.parallel.tp), not the flags of fit that the user never typed."""
    from zeroplan.errors import ZeroplanError

    try:
        return compare_record(record)
    except ZeroplanError as error:
        field = error.field if error.field.startswith("description.") else f"description.{error.field}"
        raise ZeroplanError("records", f"{str(path)!r}: {field}: {error.detail}") from None


def run_validate(args: argparse.Namespace) -> int:
    from zeroplan.validate.compare import compare_record
    from zeroplan.validate.load import load_record_files, merge_runs, run_labels
    from zeroplan.validate.report import comparison_frame, render_validation_table, save_validation_plot

    if args.plot:
        check_plot_path(args.plot)
    runs = merge_runs(load_record_files(args.records))
    records = [record for run in runs for record in run.records]
    chosen = records if args.all_ranks else [r for run in runs for r in default_ranks(run.records)] or records
    file_of = {id(record): path for run in runs for record, path in zip(run.records, run.files)}
    # Runs that share a run id ('local', measure's default) are told apart by their directory.
    labels = {id(record): label for run, label in zip(runs, run_labels(runs)) for record in run.records}
    rows = [row.model_copy(update={"run_id": labels[id(record)]})
            for record in chosen for row in _compared(compare_record, record, file_of[id(record)])]
    if args.format == "csv":
        sys.stdout.write(comparison_frame(rows).to_csv(index=False))
    elif args.format == "json":
        sys.stdout.write(comparison_frame(rows).to_json(orient="records", indent=1) + "\n")
    else:
        sys.stdout.write(render_validation_table(rows) + "\n")
        for line in nccl_summary(chosen, labels):
            sys.stdout.write(line + "\n")
        for run in runs:
            if len(run.hosts) > 1:
                sys.stdout.write(f"{run.name}: {len(run.records)} ranks merged from {len(run.hosts)} nodes "
                                 f"({', '.join(run.hosts)})\n")
    if args.plot:
        path = save_validation_plot(rows, Path(args.plot))
        sys.stderr.write(f"zeroplan: wrote {path}\n")
    if args.check:
        from zeroplan.validate.tolerance import describe, outside

        failed = outside(rows)
        for row in failed:
            sys.stderr.write(f"zeroplan: outside tolerance: {describe(row)}\n")
        if failed:
            return 1
        sys.stderr.write(f"zeroplan: all {len(rows)} rows within the harness's tolerance\n")
    return 0
