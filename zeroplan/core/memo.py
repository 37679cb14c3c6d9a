"""Caches of the planner's pure functions keyed on what each reads of its request.

Specs are frozen and hashable, so a function of a request alone may be cached on the request.
Many of the planner's functions read the model, the training, the cluster and the strategy
but only part of the batch, or none of it: the model states do not change with the
micro-batch, yet fit() and the largest micro-batch search ask for them at every micro-batch.
``batch_keyed`` caches such a function on the request with its batch cut down to the fields
named, and enforces it: the cached call sees a batch on which every other field raises, and a
call that reads one is answered by the function on the whole request, kept under the whole
request (slower, never a different answer)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TypeVar

from zeroplan.specs.request import PlanRequest

Result = TypeVar("Result")


class UnkeyedRead(BaseException):
    """A cached function read a batch field its cache does not key on. A BaseException, so no
    ``except Exception`` in the planner can turn it into an answer."""


class BatchView:
    """The fields of a BatchSpec (or a TrainingSpec) a cache keys on; reading any other raises UnkeyedRead."""

    def __init__(self, fields: tuple[tuple[str, object], ...]) -> None:
        # The kept fields are the instance's own attributes, read at C speed (the planner reads
        # a view's fields tens of thousands of times a plan search); spec fields never start
        # with an underscore, so none is the key's own attribute.
        self.__dict__.update(fields)
        self._fields = fields

    def __getattr__(self, name: str) -> object:
        # Called only for names the instance and its class do not have: every field left out.
        raise UnkeyedRead(name)

    def __eq__(self, other: object) -> bool:
        # Against a view only (the caches' keys); any other comparison reads the batch whole.
        if not isinstance(other, BatchView):
            raise UnkeyedRead("==")
        return self._fields == other._fields

    def __hash__(self) -> int:
        return hash(self._fields)

    def _whole(self, *_: object) -> object:
        """What reads the batch whole (printing it, iterating it) raises UnkeyedRead too."""
        raise UnkeyedRead("the whole batch")

    __repr__ = __str__ = __format__ = __iter__ = __len__ = __getitem__ = __contains__ = _whole


class _StrategyView(BatchView):
    """A strategy's view (batch_keyed's strategy_view), hashed once: it keys every lookup of its
    cache, hit or miss, where a view of the batch or the training is made only on a miss."""

    def __init__(self, fields: tuple[tuple[str, object], ...]) -> None:
        super().__init__(fields)
        self._hash = hash(fields)

    def __hash__(self) -> int:
        return self._hash


class KeptAnswers:
    """Answers by key (specs hash once: zeroplan.specs.base.Frozen), cleared when full."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self.entries: dict[object, object] = {}

    def put(self, key: tuple, answer: object) -> None:
        if len(self.entries) >= self.limit:
            self.entries.clear()
        self.entries[key] = answer

    def clear(self) -> None:
        self.entries.clear()


_MISSING = object()
_READS_MORE = object()
"""Kept under a key whose call read a field the key leaves out: its answers are kept under the
whole request instead."""


class _KeptValues(tuple):
    """A spec's kept values (a tuple, equal to and hashing as the plain one), its hash computed
    once: a training's thirty-odd values, a dozen of them enums whose hash is a Python call, are
    hashed at every cache lookup otherwise."""

    def __hash__(self) -> int:
        return self.hashed


def _kept_values(spec: str, left_out: tuple[str, ...]) -> tuple[tuple[str, ...], Callable[[object], tuple]]:
    """The field names of the request's ``spec`` but ``left_out``, and a reader of their values
    (a tuple, at C speed: operator.attrgetter) that reads a spec and a view of it alike; a spec's
    are kept per spec (specs are immutable) with their hash (_KeptValues)."""
    names = tuple(f for f in PlanRequest.model_fields[spec].annotation.model_fields if f not in left_out)
    getter = operator.attrgetter(*names)
    plain = getter if len(names) > 1 else (lambda spec: (getter(spec),))
    spec_type = PlanRequest.model_fields[spec].annotation
    kept: dict[object, _KeptValues] = {}

    def read(value: object) -> tuple:
        if type(value) is not spec_type:
            return plain(value)  # a view of the spec: its values as they are
        found = kept.get(value)
        if found is None:
            found = _KeptValues(plain(value))
            found.hashed = tuple.__hash__(found)
            if len(kept) >= 1024:
                kept.clear()
            kept[value] = found
        return found

    return names, read


def batch_keyed(*fields: str, limit: int = 1024, training_but: tuple[str, ...] = (), assumptions_but: tuple[str, ...] = (),
                whole_batch: bool = False,
                strategy_view: Callable[[PlanRequest], tuple[tuple[str, object], ...] | None] | None = None,
                ) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Cache ``function(request, *args)`` (args hashable) on the request with its batch reduced
    to ``fields`` (the module's docstring; ``whole_batch``: the batch itself, every field), its
    training less the fields ``training_but`` names and its memory assumptions less those
    ``assumptions_but`` names (each then a view of its other fields, whose reads of those raise
    as the batch's do; the key holds the kept fields' values, so a call on a request that is
    itself such a view keys as the request does). A key whose call read another field is marked,
    and the answers under it are kept by the whole request (hf ZeRO-3's gathers read the
    checkpointing policy that the model states' key leaves out). The wrapper's ``fallbacks``
    counts the calls answered on the whole request, for the tests that keep the caches
    effective. ``strategy_view``, where given, names for a request the only facts of its
    strategy the function reads, as (name, value) pairs (None: the whole strategy keys it): the
    strategy is then a view of those alone, in the key and for the function, whose other reads
    raise as the batch's do."""

    def wrap(function: Callable[..., Result]) -> Callable[..., Result]:
        store = KeptAnswers(limit)
        whole = KeptAnswers(limit)
        # The key's values read at C speed (operator.attrgetter: a tuple of them when more than one).
        batch_values = operator.attrgetter(*fields) if len(fields) > 1 else (
            (lambda batch: (getattr(batch, fields[0]),)) if fields else (lambda batch: ()))
        training_reader = _kept_values("training", training_but) if training_but else None
        assumptions_reader = _kept_values("assumptions", assumptions_but) if assumptions_but else None
        # One view per strategy_view answer, made once: a cache's keys then hold the same view
        # object at every lookup (compared by identity, not by BatchView.__eq__, and not built
        # afresh on a hit), and the view the function is handed is that object too.
        strategy_views: dict[tuple[tuple[str, object], ...], _StrategyView] = {}

        @functools.wraps(function)
        def call(request: PlanRequest, *args: object) -> Result:
            batch = request.batch if whole_batch else batch_values(request.batch)
            trained = training_reader[1](request.training) if training_reader else request.training
            assumed = assumptions_reader[1](request.assumptions) if assumptions_reader else request.assumptions
            viewed_strategy = strategy_view(request) if strategy_view else None
            if viewed_strategy is None:
                strategy = request.strategy
            else:
                strategy = strategy_views.get(viewed_strategy)
                if strategy is None:
                    if len(strategy_views) >= limit:
                        strategy_views.clear()
                    strategy = strategy_views[viewed_strategy] = _StrategyView(viewed_strategy)
            key = (request.model, request.cluster, strategy, request.parallel, request.performance,
                   trained, assumed, batch, args)
            answer = store.entries.get(key, _MISSING)
            if answer is _READS_MORE:
                return _whole_request_answer(request, args)
            if answer is not _MISSING:
                return answer
            update = {} if whole_batch else {"batch": BatchView(tuple(zip(fields, batch)))}
            if training_reader:
                update["training"] = BatchView(tuple(zip(training_reader[0], trained)))
            if assumptions_reader:
                update["assumptions"] = BatchView(tuple(zip(assumptions_reader[0], assumed)))
            if viewed_strategy is not None:
                update["strategy"] = strategy
            viewed = request.model_copy(update=update) if update else request
            try:
                answer = function(viewed, *args)
            except UnkeyedRead:
                answer = _whole_request_answer(request, args)
                store.put(key, _READS_MORE)
                return answer
            store.put(key, answer)
            return answer

        def _whole_request_answer(request: PlanRequest, args: tuple) -> Result:
            # A request that is itself a view raises UnkeyedRead here (hashing or comparing its
            # views), to the cache whose view it is, before anything is kept.
            answer = whole.entries.get((request, args), _MISSING)
            if answer is _MISSING:
                call.fallbacks += 1
                answer = function(request, *args)
                whole.put((request, args), answer)
            return answer

        def cache_clear() -> None:
            store.clear()
            whole.clear()

        call.fallbacks = 0
        call.cache_clear = cache_clear
        call.uncached = function
        return call

    return wrap


def request_keyed(limit: int = 1024) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Cache ``function(request)`` on the whole request (every field keys it)."""

    def wrap(function: Callable[..., Result]) -> Callable[..., Result]:
        store = KeptAnswers(limit)

        @functools.wraps(function)
        def call(request: PlanRequest) -> Result:
            answer = store.entries.get(request, _MISSING)
            if answer is not _MISSING:
                return answer
            answer = function(request)
            store.put(request, answer)
            return answer

        call.cache_clear = store.clear
        call.uncached = function
        return call

    return wrap
