"""User-facing errors.

A :class:`ZeroplanError` (deliberately not a ValueError, so pydantic validators raise it
unwrapped) is a mistake in what the user asked for (an unknown model, a
non-positive size, GPUs that do not divide into nodes). Its message is one line that names the
field and the allowed values; the command line prints it and exits with status 2. Internal
invariants use ``assert`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable


class ZeroplanError(Exception):
    """A user's input is invalid; the message is a single line naming the field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        """The request's field (``batch.seq_len``) or, for a command's own input, its flag."""
        self.detail = message
        """The message without the field, so the command line can name its flag instead."""
        super().__init__(f"{field}: {message}")


LISTED_IN_FULL = 40
"""The most names an unknown-name error lists; a longer catalog is named by ``unlisted`` instead."""


def unknown_name_error(field: str, name: str, known: Iterable[str], unlisted: str | None = None) -> ZeroplanError:
    """Build the error for an unknown catalog name, with close matches (case-insensitive, in the
    catalog's own spelling) and the allowed names; where ``unlisted`` is given and the catalog has
    more than LISTED_IN_FULL names, ``unlisted`` (where to find them) stands for the list, so that
    the one line stays readable."""
    import difflib  # only on a user's mistake: a command that runs never loads it

    known_sorted = sorted(known)
    spelled = {known_name.lower(): known_name for known_name in known_sorted}
    close = [spelled[match] for match in difflib.get_close_matches(name.lower(), list(spelled), n=3, cutoff=0.5)]
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    allowed = unlisted if unlisted is not None and len(known_sorted) > LISTED_IN_FULL else ", ".join(known_sorted)
    return ZeroplanError(field, f"unknown {name!r}{hint} (allowed: {allowed})")


def nested_too_deeply_error(field: str, path: object, usual: str) -> ZeroplanError:
    """The error for a JSON file whose nesting passes the decoder's recursion limit (json.loads
    recurses once per nested array or object, and raises RecursionError past about 1,000
    levels); ``usual``: how deep the file's kind nests, e.g. 'a GPU file nests two'."""
    return ZeroplanError(field, f"{str(path)!r} nests arrays or objects more deeply than the JSON decoder reads "
                                f"(allowed: about 1,000 levels; {usual})")
