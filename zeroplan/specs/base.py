"""The base class of every spec and result: frozen, validated, no unknown keys."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from zeroplan.errors import ZeroplanError

if TYPE_CHECKING:
    from typing_extensions import Self

_set = object.__setattr__
_REQUIRED = object()
"""A field without a default in Frozen.trusted's template."""


_Item = TypeVar("_Item")


# A record is read back strictly (zeroplan.harness.record.read_record), and where a validator of
# mode "before" sits above a field (PlanRequest's model validators, the records' on ``training``)
# pydantic hands the validator's Python result on to the nested fields: a JSON array reaches them
# as a list, which a strict tuple refuses (pydantic-core src/input/input_python.rs validate_tuple:
# a tuple only when strict; src/input/input_json.rs validate_tuple takes a JSON array either way).
def _array_as_tuple(value: object) -> object:
    """A list (a JSON array, through a before-validator) as the tuple it stands for; anything
    else as given, for the tuple's own validation to take or refuse."""
    return tuple(value) if type(value) is list else value


JsonTuple = Annotated[tuple[_Item, ...], BeforeValidator(_array_as_tuple)]
"""``tuple[X, ...]`` that a JSON array fills in a strict read wherever it sits: every tuple field
of a spec a record or a request carries is one (tests/test_strict_record_tuples.py). Its items
are validated as strictly as before ("2" is no int there); the schema and the dump are the
tuple's."""


class Frozen(BaseModel):
    """Immutable pydantic model; a misspelled key is an error that names it."""

    # The fields' docstrings document the source; pydantic is not asked to read them
    # (use_attribute_docstrings parses every class's source at import: about 50 ms of each
    # command's start, for descriptions nothing reads).
    model_config = ConfigDict(frozen=True, extra="forbid")

    # The modules that define most fields (the specs, results, answers, and the core's models:
    # collectives, layouts, model states, step time, roofline terms, the default efficiency) do
    # not postpone their annotations (no `from __future__ import annotations`): postponed, each
    # field's type is a string that pydantic compiles and evaluates when the class is built
    # (typing.ForwardRef, _typing_extra.eval_type), about 75,000 instructions a field, ~300
    # fields at each command's start (fit llama-2-70b: 1,080 -> 1,063 M instructions, callgrind),
    # and the core's 132 more (1,000 -> 990 M). The same types either way: every model's JSON
    # schema and fields compare equal.

    # The planner's caches key on specs, and pydantic's hash of a frozen model hashes every field
    # again on each call, nested specs included (a request: several microseconds, tens of
    # thousands of times a plan search). A spec never changes, so its hash is kept in a slot
    # once computed: the same value pydantic's hash gives (the fields' values, in order). A
    # slot, not a field: it is not compared, dumped or copied (model_copy builds a new object
    # whose hash is computed afresh from its own fields).
    __slots__ = ("_frozen_hash",)

    # The slot holds None until the first hash: every spec the planner builds has it set, by
    # validation (model_post_init) or by _instance (model_copy, trusted), so the hash reads it as
    # a plain attribute (~70 ns; through the slot's descriptor object, ~400 ns, tens of thousands
    # of times a plan search). A spec built another way (copy.copy, pickle) has it unset: that
    # read falls to pydantic's __getattr__, which raises (~7 us, once per such spec).
    def __hash__(self) -> int:
        try:
            value = self._frozen_hash
        except AttributeError:
            value = None
        if value is None:
            value = hash(type(self)._field_values(self.__dict__))
            _set(self, "_frozen_hash", value)
        return value

    def model_post_init(self, context: Any, /) -> None:
        _set(self, "_frozen_hash", None)

    # pydantic's equality (BaseModel.__eq__) takes its generic steps before comparing the
    # instances' __dict__; the planner's caches compare equal specs that are not the same object
    # (a request built again for another micro-batch) tens of thousands of times a fit. Two
    # models of one type (not generic, no private or extra attributes here) whose __dict__ are
    # equal are what pydantic calls equal; anything else takes pydantic's own answer (a
    # cached_property's value in one __dict__ and not the other, another type).
    def __eq__(self, other: object) -> bool:
        if self is other or (type(other) is type(self) and self.__pydantic_private__ is None
                             and not self.__pydantic_extra__ and self.__dict__ == other.__dict__):
            return True
        return super().__eq__(other)

    # pydantic's model_copy (BaseModel.model_copy, __copy__), for this class's models: no extra
    # fields (extra="forbid") and no private attributes, so the copy is the fields' dict with the
    # update applied and the fields set extended, as pydantic's; without its generic steps it
    # costs half as much, and the planner copies specs tens of thousands of times a plan search.
    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        if deep or self.__pydantic_private__ is not None or self.__pydantic_extra__ is not None:
            return super().model_copy(update=update, deep=deep)
        fields_set = set(self.__pydantic_fields_set__)
        if update:
            fields_set.update(update)
            return _instance(type(self), {**self.__dict__, **update}, fields_set)
        return _instance(type(self), dict(self.__dict__), fields_set)

    # pydantic validates every model it builds, ~15-30 us for a result of twenty fields; the
    # planner builds its results (each plan's breakdown, the plan itself, the allocator's verdict)
    # from values it has itself computed and typed, a dozen of each a fit. model_construct skips
    # the validation but costs as much in its generic steps.
    @classmethod
    def trusted(cls, **values: Any) -> Self:
        """The model of ``values`` unvalidated: for values already of each field's own type (an
        int for an int, a tuple for a tuple, never one pydantic would convert), what validating
        them builds (tests/test_trusted_results.py compares the two over fit's results), the
        fields left out at their defaults. A name that is no field, or a field without a
        default left out, is refused as validation refuses it."""
        cached = cls.__dict__.get("_trusted_template")
        if cached is None:
            template = {name: _REQUIRED if info.is_required() else info.get_default(call_default_factory=True)
                        for name, info in cls.__pydantic_fields__.items()}
            # The fields without a default, each of which ``values`` must name (a set test at C
            # speed, not a scan of every value for the placeholder).
            cached = template, frozenset(name for name, value in template.items() if value is _REQUIRED)
            type.__setattr__(cls, "_trusted_template", cached)
        template, required = cached
        data = {**template, **values}
        if len(data) != len(template) or not required <= values.keys():
            return cls(**values)  # pydantic's own error
        return _instance(cls, data, set(values))

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: object) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # pydantic's own hash of a frozen model (_model_construction.make_hash_func): the tuple
        # of the fields' values (the value itself for one field, 0 for none).
        fields = tuple(cls.__pydantic_fields__)
        cls._field_values = staticmethod(operator.itemgetter(*fields) if fields else (lambda _: 0))


# The planner's caches key on specs and meet a key's spec by identity first: an equal spec that
# is another object is compared field by field at every lookup (a training's ~35 values, ~4 us;
# a strategy's ~2 us), and a fit asks its caches ~100 times per strategy. fit's strategies and a
# suggestion's changed training are copies made afresh for every request; made once, each is the
# same object for every request that asks for it.
def kept_copy(spec: Frozen, **update: Any) -> Any:
    """``spec.model_copy(update=update)``, the same object for every spec equal to ``spec`` with
    the same fields set (what PlanRequest's validators read of a spec beyond its values) and the
    same update (hashable values)."""
    key = (type(spec), spec, frozenset(spec.__pydantic_fields_set__), tuple(update.items()))
    copy = _KEPT_COPIES.get(key)
    if copy is None:
        if len(_KEPT_COPIES) >= 1024:
            _KEPT_COPIES.clear()
        copy = _KEPT_COPIES[key] = spec.model_copy(update=update)
    return copy


_KEPT_COPIES: dict[tuple, Any] = {}
"""kept_copy's copies by what makes them."""


# The slots every model of this class stores, set through their own descriptors (the member
# descriptors of BaseModel's and Frozen's __slots__): what object.__setattr__ finds for each after
# a lookup through the class's MRO, which a plan's dozen results each paid five times.
_SET_FROZEN_HASH = Frozen.__dict__["_frozen_hash"].__set__
_SET_FIELDS_SET = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_SET_EXTRA = BaseModel.__dict__["__pydantic_extra__"].__set__
_SET_PRIVATE = BaseModel.__dict__["__pydantic_private__"].__set__


def _instance(cls: type[Frozen], data: dict[str, Any], fields_set: set[str]) -> Any:
    """A model of ``cls`` whose fields are ``data``, as pydantic stores one of this class's (no
    extra fields, no private attributes), built without its generic steps: model_copy's and
    trusted's one construction."""
    built = object.__new__(cls)
    _SET_FROZEN_HASH(built, None)
    _set(built, "__dict__", data)
    _SET_FIELDS_SET(built, fields_set)
    _SET_EXTRA(built, None)
    _SET_PRIVATE(built, None)
    return built


def first_error(error: ValidationError, prefix: str = "") -> ZeroplanError:
    """Turn pydantic's multi-line report into one line naming the first bad field."""
    detail = error.errors()[0]
    original = detail.get("ctx", {}).get("error")
    if isinstance(original, ZeroplanError):
        return original
    location = ".".join(str(part) for part in detail["loc"]) or "input"
    field = f"{prefix}.{location}" if prefix else location
    message = detail["msg"]
    if detail["type"] == "extra_forbidden":
        message = "unknown field"
    return ZeroplanError(field, message)
