"""Python's cyclic garbage collector paused over a stretch of work that allocates many
short-lived objects and frees them by reference counting (specs, terms, collectives, numpy
rows): its collections there would walk every live object again and find nothing to free."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The collector disabled inside, restored to what it was after (what the work leaves in
    cycles is freed when it runs again)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
