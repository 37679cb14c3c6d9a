"""The cyclic collector is paused over a plan search and left as it was found."""

from __future__ import annotations

import gc

from zeroplan.core.collector import cyclic_gc_paused


def test_the_collector_is_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_restores_the_collector() -> None:
    try:
        with cyclic_gc_paused():
            raise ValueError("refused")
    except ValueError:
        pass
    assert gc.isenabled()
