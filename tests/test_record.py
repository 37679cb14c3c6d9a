"""zeroplan.core.record.frozen builds what @dataclass(frozen=True) builds: each behaviour below is
compared with a dataclass of the same fields."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from zeroplan.core.record import COMPILE_AFTER, frozen


def _namespace() -> dict:
    """A class body: fields with and without defaults, one with a factory left out of equality
    and repr, a method."""
    return {"__annotations__": {"a": int, "b": float, "c": tuple, "cache": dict}, "__qualname__": "Record",
            "__doc__": "A record.", "b": 1.5, "c": (),
            "cache": dataclasses.field(default_factory=dict, compare=False, repr=False),
            "total": lambda self: self.a + self.b}


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_frozen_record_behaves_as_a_frozen_dataclass(slots: bool, compiled: bool) -> None:
    made = frozen(type("Record", (), _namespace()), slots=slots)
    generic = made.__init__
    for _ in range(COMPILE_AFTER + 1 if compiled else 0):
        made(1)
    assert (made.__init__ is not generic) == compiled
    reference = dataclasses.dataclass(frozen=True, slots=slots)(type("Record", (), _namespace()))
    for cls in (made, reference):
        one, same, other = cls(1), cls(a=1, b=1.5, c=()), cls(1, 2.5, (3,))
        assert (one == same, one == other, one != other) == (True, False, True)
        assert hash(one) == hash(same) == hash((1, 1.5, ()))  # the compared fields' tuple
        assert one.cache == {} and one.cache is not same.cache  # a factory's value per record
        assert one.total() == 2.5
        assert dataclasses.replace(one, b=2.5, c=(3,)) == other
        assert dataclasses.astuple(other) == (1, 2.5, (3,), {})
        assert copy.deepcopy(other) == other and copy.copy(other) == other
        with pytest.raises(dataclasses.FrozenInstanceError):
            one.a = 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            del one.a
        with pytest.raises(TypeError):
            cls()  # a field without a default
        with pytest.raises(TypeError):
            cls(1, d=2)  # no such field
        with pytest.raises(TypeError):
            cls(1, a=1)
        with pytest.raises(TypeError):
            cls(1, 2, 3, {}, 5)
    assert repr(made(1, 2.5, (3,))) == repr(reference(1, 2.5, (3,))) == "Record(a=1, b=2.5, c=(3,))"
    assert [f.name for f in dataclasses.fields(made)] == ["a", "b", "c", "cache"]
    assert made(1) != reference(1)  # another class, as two dataclasses of the same fields
    assert ("__slots__" in vars(made)) == slots == ("__dict__" not in dir(made(1)))


def test_a_record_keeps_the_methods_its_class_writes_and_refuses_its_own_setattr() -> None:
    @frozen
    class Shown:
        a: int

        def __repr__(self) -> str:
            return "shown"

    @frozen
    class Compared:
        a: int

        def __eq__(self, other: object) -> bool:
            return True

    assert repr(Shown(1)) == "shown" and Shown(1) == Shown(1)
    assert Compared(1) == Compared(2) and hash(Compared(1)) == hash((1,))  # as a dataclass's
    reference = dataclasses.dataclass(frozen=True)(type("Compared", (), {"__annotations__": {"a": int},
                                                                          "__eq__": lambda self, other: True}))
    assert hash(reference(1)) == hash((1,))
    with pytest.raises(TypeError, match="__setattr__"):
        frozen(type("Writes", (), {"__annotations__": {"a": "int"}, "__setattr__": lambda self, n, v: None}))


@frozen(slots=True)
class _Slotted:
    a: int
    b: tuple = ()


@frozen
class _Plain:
    a: int
    b: tuple = ()


@pytest.mark.parametrize("cls", [_Slotted, _Plain])
def test_a_record_pickles_as_a_frozen_dataclass(cls: type) -> None:
    import pickle

    record = cls(1, (2,))
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        loaded = pickle.loads(pickle.dumps(record, protocol))
        assert loaded == record and type(loaded) is cls and loaded.b == (2,)
        with pytest.raises(dataclasses.FrozenInstanceError):
            loaded.a = 2


@pytest.mark.parametrize("body", [
    {"__annotations__": {"a": "int"}, "__post_init__": lambda self: None},
    {"__annotations__": {"a": "int", "b": "int"}, "a": dataclasses.field(init=False, default=0)},
    {"__annotations__": {"a": "int", "b": "int"}, "a": dataclasses.field(kw_only=True, default=0)},
])
def test_a_record_refuses_what_its_init_would_not_do_as_a_dataclass_does(body: dict) -> None:
    # A dataclass's __init__ would call __post_init__, or take b as the first positional
    # argument; the record's would not: refused when the class is defined, not built differently.
    with pytest.raises(TypeError, match="use @dataclass"):
        frozen(type("Differs", (), body))


def test_a_record_and_its_subclass_compare_as_dataclasses_do() -> None:
    # dataclasses' __eq__ compares instances of the very same class only; a subclass that adds a
    # field gets the base's methods over every field, its own included.
    reference = dataclasses.dataclass(frozen=True)(type("Base", (), {"__annotations__": {"a": int}}))
    for base in (frozen(type("Base", (), {"__annotations__": {"a": int}})), reference):
        plain = type("Sub", (base,), {})
        assert base(1) != plain(1) and plain(1) == plain(1) and hash(plain(1)) == hash(base(1))
        wider = (frozen if base is not reference else dataclasses.dataclass(frozen=True))(
            type("Wider", (base,), {"__annotations__": {"b": int}}))
        assert wider(1, 2) == wider(1, 2) != wider(1, 3) and repr(wider(1, 2)) == "Wider(a=1, b=2)"
        with pytest.raises(dataclasses.FrozenInstanceError):
            plain(1).a = 2


def test_a_record_without_a_docstring_is_documented_by_its_fields_without_parsing_a_signature(monkeypatch) -> None:
    import inspect

    def refuse(*args, **kwargs):
        raise AssertionError("inspect.signature called")

    monkeypatch.setattr(inspect, "signature", refuse)
    namespace = {**_namespace(), "__doc__": None}
    for slots in (False, True):
        made = frozen(type("Record", (), dict(namespace)), slots=slots)
        assert made.__doc__ == "Record(a, b, c, cache)"
        assert made(1) == made(1, 1.5, ())
    assert frozen(type("Record", (), _namespace())).__doc__ == "A record."
