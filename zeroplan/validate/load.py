"""Find and read measurement records; a damaged file is a one-line error naming it."""

from __future__ import annotations

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
    records = []
    for path in record_files(paths):
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
        records.append(record)
    return records
