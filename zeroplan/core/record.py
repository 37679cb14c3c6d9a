"""Frozen records: the classes ``@dataclass(frozen=True)`` builds, without compiling source text
when the class is defined.

CPython 3.11's dataclasses writes each method it generates (__init__, __repr__, __eq__,
__hash__, __setattr__, __delattr__) as source text and compiles it (dataclasses._create_fn,
exec): about 4 M instructions a frozen class of five fields (callgrind), parsing included, and
the modules a fit imports defined fifteen such classes at each command's start. ``frozen`` lets
dataclasses collect the fields as it does (dataclass() with no method to generate: fields(),
replace(), asdict() and is_dataclass() read them as they read a dataclass's) and gives the class
methods written once, here, which read its field names: the same construction (positional or by
name, defaults and default factories), equality and hash over the compared fields (the hash of
the same tuple dataclasses hashes), repr and refusal of assignment (FrozenInstanceError).
tests/test_record.py compares each with a dataclass's."""

from __future__ import annotations

import reprlib
from dataclasses import MISSING, FrozenInstanceError, dataclass, fields
from typing import Any, Callable, TypeVar

T = TypeVar("T", bound=type)

_set = object.__setattr__


def frozen(cls: T | None = None, /, *, slots: bool = False) -> Any:
    """``@dataclass(frozen=True)`` (``slots=True``: ``@dataclass(frozen=True, slots=True)``)."""

    def wrap(cls: T) -> T:
        return _give_methods(dataclass(cls, init=False, repr=False, eq=False, slots=slots))

    return wrap if cls is None else wrap(cls)


def _tuple_of(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """The tuple of these attributes of an object (what dataclasses' __eq__ and __hash__ build)."""
    return lambda record: tuple([getattr(record, name) for name in names])


def _give_methods(cls: T) -> T:
    every = fields(cls)
    names = tuple(f.name for f in every)
    compared = _tuple_of(tuple(f.name for f in every if f.compare))
    hashed = _tuple_of(tuple(f.name for f in every if (f.compare if f.hash is None else f.hash)))
    shown = tuple(f.name for f in every if f.repr)
    known = frozenset(names)
    defaults = {f.name: f.default for f in every if f.default is not MISSING}
    factories = {f.name: f.default_factory for f in every if f.default_factory is not MISSING}
    title = f"{cls.__qualname__}.__init__()"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{title} takes {len(names) + 1} positional arguments but {len(args) + 1} were given")
        values = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in values:
                raise TypeError(f"{title} got multiple values for argument {name!r}")
            if name not in known:
                raise TypeError(f"{title} got an unexpected keyword argument {name!r}")
            values[name] = value
        if len(values) < len(names):
            missing = [name for name in names if name not in values and name not in defaults and name not in factories]
            if missing:
                raise TypeError(f"{title} missing {len(missing)} required argument(s): {', '.join(map(repr, missing))}")
        for name in names:
            if name in values:
                _set(self, name, values[name])
            elif name in defaults:
                _set(self, name, defaults[name])
            else:
                _set(self, name, factories[name]())

    @reprlib.recursive_repr()
    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return compared(self) == compared(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(hashed(self))

    def __setattr__(self, name: str, value: Any) -> None:
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    methods = {"__init__": __init__, "__repr__": __repr__, "__eq__": __eq__, "__hash__": __hash__,
               "__setattr__": __setattr__, "__delattr__": __delattr__}
    if "__slots__" in cls.__dict__:
        # A frozen slotted dataclass's pickling and copying state (dataclasses._dataclass_getstate
        # and _dataclass_setstate): the default would restore each slot through __setattr__.
        def __getstate__(self) -> list:
            return [getattr(self, name) for name in names]

        def __setstate__(self, state: list) -> None:
            for name, value in zip(names, state):
                _set(self, name, value)

        methods.update(__getstate__=__getstate__, __setstate__=__setstate__)
    for name, method in methods.items():
        # As dataclasses: a method the class writes itself is kept (its __hash__ too, beside its
        # own __eq__ or not), and a frozen class may not write __setattr__ or __delattr__.
        if name in cls.__dict__:
            if name in ("__setattr__", "__delattr__"):
                raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
            continue
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, method)
    return cls
