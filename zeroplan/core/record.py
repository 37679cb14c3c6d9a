"""Frozen records: the classes ``@dataclass(frozen=True)`` builds, without compiling source text
when the class is defined.

CPython 3.11's dataclasses writes each method it generates (__init__, __repr__, __eq__,
__hash__, __setattr__, __delattr__) as source text and compiles it (dataclasses._create_fn,
exec): about 4 M instructions a frozen class of five fields (callgrind), parsing included, and
the modules a fit imports defined nineteen such classes at each command's start, most of which
a given command never builds. ``frozen`` lets dataclasses collect the fields as it does
(dataclass() with no method to generate: fields(), replace(), asdict() and is_dataclass() read
them as they read a dataclass's) and gives the class methods written once, here, which read its
field names: the same construction (positional or by name, defaults and default factories),
equality and hash over the compared fields (the hash of the same tuple dataclasses hashes), repr
and refusal of assignment (FrozenInstanceError). Only a class built many times in one process
has its __init__ compiled, as dataclasses would have, when it has been built COMPILE_AFTER
times. A class that needs more of dataclasses' __init__ (__post_init__, a field of init=False
or kw_only) is refused where it is defined. tests/test_record.py compares each with a dataclass's."""

from __future__ import annotations

import operator
import reprlib
from dataclasses import MISSING, Field, FrozenInstanceError, dataclass, fields
from typing import Any, Callable, TypeVar

T = TypeVar("T", bound=type)

_set = object.__setattr__
_FACTORY = object()
"""A compiled __init__'s default for a field with a default factory (dataclasses' _HAS_DEFAULT_FACTORY)."""


def frozen(cls: T | None = None, /, *, slots: bool = False) -> Any:
    """``@dataclass(frozen=True)`` (``slots=True``: ``@dataclass(frozen=True, slots=True)``)."""

    def wrap(cls: T) -> T:
        # dataclasses writes a class without a docstring one from inspect.signature(cls), here
        # object.__init__'s text signature, which it parses with tokenize: the process's first
        # such parse compiles tokenize's token pattern (re), 14 M instructions of a fit's start
        # (callgrind), for the text '_Param()'. Such a class is given its fields' names instead.
        undocumented = not cls.__dict__.get("__doc__")
        if undocumented:
            cls.__doc__ = cls.__name__
        built = _give_methods(dataclass(cls, init=False, repr=False, eq=False, slots=slots))
        if undocumented:
            built.__doc__ = f"{built.__name__}({', '.join(f.name for f in fields(built))})"
        return built

    return wrap if cls is None else wrap(cls)


def _tuple_of(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """The tuple of these attributes of an object (what dataclasses' __eq__ and __hash__ build),
    read at C speed (operator.attrgetter: its value itself for one name, hence the wrapping)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda record: (one(record),)
    return lambda record: ()


COMPILE_AFTER = 64
"""Instances a class builds through the generic __init__ before its own is compiled: binding the
arguments here costs about 1 us a call more than a compiled __init__ (a frozen record of three
fields: 1.8 against 0.7 us), compiling one about 1 M instructions, once."""


def _compiled_init(every: tuple[Field, ...], qualname: str, slotted: bool = True) -> Callable[..., None]:
    """The __init__ dataclasses writes for a frozen class of these fields (CPython 3.11
    dataclasses._init_fn: each field a parameter, its default or a sentinel for its factory,
    each value set past the frozen __setattr__), compiled from its source. A class without
    slots has its instance's __dict__ set at once, the fields in order (what setting them one by
    one leaves in a new instance's __dict__, one object.__setattr__ where there were one per
    field: the planner builds a dozen peak moments a plan)."""
    namespace: dict[str, Any] = {"_set": _set, "_FACTORY": _FACTORY}
    parameters, lines = ["self"], []
    for f in every:
        if f.default is not MISSING:
            namespace[f"_default_{f.name}"] = f.default
            parameters.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            namespace[f"_factory_{f.name}"] = f.default_factory
            parameters.append(f"{f.name}=_FACTORY")
            lines.append(f"    {f.name} = _factory_{f.name}() if {f.name} is _FACTORY else {f.name}")
        else:
            parameters.append(f.name)
        if slotted:
            lines.append(f"    _set(self, {f.name!r}, {f.name})")
    if not slotted:
        lines.append(f"    _set(self, '__dict__', {{{', '.join(f'{f.name!r}: {f.name}' for f in every)}}})")
    exec(f"def __init__({', '.join(parameters)}):\n" + "\n".join(lines or ["    pass"]), namespace)
    init = namespace["__init__"]
    init.__qualname__ = qualname
    return init


# What dataclasses' generated __init__ does beyond taking each field in order, which the methods
# here do not: calling __post_init__, leaving out a field of init=False (its default set, later
# positional arguments moved up), taking a kw_only field by name alone after the others. A class
# that asks for one is refused when it is defined, not given an __init__ that silently differs.
def _refuse_unwritten(cls: type, every: tuple[Field, ...]) -> None:
    """TypeError where ``cls`` needs a dataclass __init__ feature ``frozen`` does not write."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__qualname__}: frozen records do not call __post_init__ (use @dataclass(frozen=True))")
    for f in every:
        if not f.init or f.kw_only is True:
            raise TypeError(f"{cls.__qualname__}.{f.name}: frozen records take every field positionally or by name "
                            "(no init=False or kw_only; use @dataclass(frozen=True))")


def _give_methods(cls: T) -> T:
    every = fields(cls)
    _refuse_unwritten(cls, every)
    names = tuple(f.name for f in every)
    compared = _tuple_of(tuple(f.name for f in every if f.compare))
    hashed = _tuple_of(tuple(f.name for f in every if (f.compare if f.hash is None else f.hash)))
    shown = tuple(f.name for f in every if f.repr)
    known = frozenset(names)
    defaults = {f.name: f.default for f in every if f.default is not MISSING}
    factories = {f.name: f.default_factory for f in every if f.default_factory is not MISSING}
    title = f"{cls.__qualname__}.__init__()"

    def bind(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every field's value from the arguments as given, defaults and factories filled in,
        refused as the generated __init__'s signature refuses them."""
        if len(args) > len(names):
            raise TypeError(f"{title} takes {len(names) + 1} positional arguments but {len(args) + 1} were given")
        values = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in values:
                raise TypeError(f"{title} got multiple values for argument {name!r}")
            if name not in known:
                raise TypeError(f"{title} got an unexpected keyword argument {name!r}")
            values[name] = value
        missing = [name for name in names if name not in values and name not in defaults and name not in factories]
        if missing:
            raise TypeError(f"{title} missing {len(missing)} required argument(s): {', '.join(map(repr, missing))}")
        for name in names:
            if name not in values:
                values[name] = defaults[name] if name in defaults else factories[name]()
        return values

    slotted = "__slots__" in cls.__dict__
    built = [0]

    # Every field by name (dataclasses.replace's call) or every one in order take no binding step.
    # A class built more than COMPILE_AFTER times in one process (the plan search builds its peak
    # moments tens of thousands of times) gets the compiled __init__ dataclasses would have given it.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        built[0] += 1
        if built[0] > COMPILE_AFTER:
            compiled = _compiled_init(every, f"{cls.__qualname__}.__init__", slotted)
            type.__setattr__(cls, "__init__", compiled)
            compiled(self, *args, **kwargs)
            return
        if not args and kwargs.keys() == known:
            values = kwargs
        elif not kwargs and len(args) == len(names):
            values = dict(zip(names, args))
        else:
            values = bind(args, kwargs)
        if slotted:
            for name in names:
                _set(self, name, values[name])
        else:
            _set(self, "__dict__", {name: values[name] for name in names})

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
    if slotted:
        # A frozen slotted dataclass's pickling and copying state (dataclasses._dataclass_getstate
        # and _dataclass_setstate): the default would restore each slot through __setattr__.
        def __getstate__(self) -> list:
            return [getattr(self, name) for name in names]

        def __setstate__(self, state: list) -> None:
            for name, value in zip(names, state):
                _set(self, name, value)

        methods.update(__getstate__=__getstate__, __setstate__=__setstate__)
    # As dataclasses: a method the class writes itself is kept, and a frozen class may not write
    # __setattr__ or __delattr__; the __hash__ = None Python sets beside a class's own __eq__ is
    # not one it wrote (dataclasses' has_explicit_hash), so the fields' hash replaces it.
    written = set(cls.__dict__)
    if cls.__dict__.get("__hash__", 0) is None and "__eq__" in written:
        written.discard("__hash__")
    for name, method in methods.items():
        if name in written:
            if name in ("__setattr__", "__delattr__"):
                raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
            continue
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, method)
    return cls
