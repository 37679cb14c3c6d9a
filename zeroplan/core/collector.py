"""Python's cyclic garbage collector paused over a stretch of work that allocates many
short-lived objects and frees them by reference counting (specs, terms, collectives, numpy
rows): its collections there would walk every live object again and find nothing to free."""

from __future__ import annotations

import gc


# A class, not contextlib.contextmanager: the generator's context manager cost ~1.1 us a use
# against ~0.2 (timeit, Python 3.11), and every allocator verdict pauses the collector (a default
# fit ~13 times a request).
class _Paused:
    """The collector disabled inside, restored to what it was after (what the work leaves in
    cycles is freed when it runs again)."""

    __slots__ = ("enabled",)

    def __enter__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *_: object) -> None:
        if self.enabled:
            gc.enable()


def cyclic_gc_paused() -> _Paused:
    """A context in which the collector is disabled, restored to what it was after (what the
    work leaves in cycles is freed when it runs again); one for each ``with``, so they nest."""
    return _Paused()
