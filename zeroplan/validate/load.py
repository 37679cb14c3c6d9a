"""Find and read measurement records; a damaged file is a one-line error naming it."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.harness.record import RankRecord, read_record


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
    records = []
    for path in record_files(paths):
        try:
            records.append(read_record(path))
        except (ValueError, ValidationError) as error:
            first = str(error).splitlines()[0]
            raise ZeroplanError("records", f"{str(path)!r} is not a zeroplan record ({first})") from None
    return records
