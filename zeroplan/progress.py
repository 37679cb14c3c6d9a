"""Progress on stderr for work that runs longer than about a second (the plan search, a
simulated step), and nothing at all when stderr is not a terminal: a pipe, a file or a test
reads exactly what it read before.

tqdm draws the bar; it is imported only when a bar is shown, so that importing the planner
(and every command that finishes in under a second) does not pay for it."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

PROGRESS_DELAY_S = 1.0
"""A bar appears only once its work has run this long: a quick answer stays one clean screen."""


class _Silent:
    """The bar's interface where no bar is shown."""

    def update(self, steps: int = 1) -> None:
        pass

    def set_description_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shown() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def shown() -> bool:
    """Whether a bar would be drawn: stderr is a terminal."""
    return _shown()


def steps(total: int, description: str, enabled: bool = True, delay_s: float | None = None, unit: str = "it"):
    """A bar of ``total`` steps on stderr (``update()`` after each, a context manager that
    clears it on exit), or a silent stand-in when ``enabled`` is false or stderr is no terminal.
    It appears once ``delay_s`` (default PROGRESS_DELAY_S) has passed."""
    if not (enabled and _shown()):
        return _Silent()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, file=sys.stderr, leave=False, dynamic_ncols=True, unit=unit,
                delay=PROGRESS_DELAY_S if delay_s is None else delay_s)


def progress(items: Iterable[T], total: int, description: str, enabled: bool = True) -> Iterator[T]:
    """``items``, advancing a bar of ``total`` steps on stderr as each is taken (see ``steps``)."""
    with steps(total, description, enabled) as bar:
        for item in items:
            yield item
            bar.update()
