"""The allocator's verdict for one planned request: its step trace (schedule.step_ops)
replayed under the request's PYTORCH_CUDA_ALLOC_CONF (MemoryAssumptions.allocator_conf) on
the GPU's usable memory.

One replay answers: on the usable memory itself, the step either completes, and its reserved
peak is what torch.cuda.max_memory_reserved would report on that GPU (below the device's
memory even where the allocator had to free its cache and retry), or runs out. Only a step that
runs out needs a second replay, without a device limit, for what it would reserve on a GPU
large enough. The OOM capacity (the least memory on which the step completes) is bisected
only on request (MemoryAssumptions.exact_capacity): a dozen replays, the oracle.

A verdict is answered from the replays of the same trace already made where they decide it
exactly, and below the trace's rounded requested peak without one (_outcome); with
MemoryAssumptions.exact_allocator every verdict replays its trace afresh (the oracle that
benchmarks/allocator_fast_sweep.py compares it with)."""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from typing import TYPE_CHECKING

from pydantic import ConfigDict

from zeroplan.allocator.config import LARGE_BUFFER_BYTES, AllocatorConfig, parse_alloc_conf
from zeroplan.allocator.fast_replay import replay_ops
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, Ops, ReplayResult, replay
from zeroplan.allocator.rules import allocation_size, round_size
from zeroplan.allocator.schedule import StepInputs, record_step, step_inputs, step_ops
from zeroplan.core.collector import cyclic_gc_paused
from zeroplan.core.model_states import ModelStateBytes
from zeroplan.core.peak import PeakTerms
from zeroplan.specs.base import Frozen
from zeroplan.specs.request import PlanRequest

# The capacity searches (the OOM capacity's bisection, the band's scan) are imported where they
# run: a default verdict asks neither, and their module's two result models cost about 2.4
# million instructions of each command's start to create (callgrind).
if TYPE_CHECKING:
    from zeroplan.allocator.capacity import BandScan


class PlannedVerdict(Frozen):
    """The allocator's answer for a planned step on a GPU's usable memory."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    fits: bool
    """The replay on the usable memory completes."""
    reserved_peak_bytes: int | None
    """What the step reserves at its peak, the planner's allocated bytes beyond the schedule's
    included: on the usable memory where it completes there (at most the usable memory), else
    without a device limit (more than the usable memory); None where nothing was replayed (the
    allocated peak alone passes the usable memory)."""
    oom_capacity_bytes: int | None = None
    """With MemoryAssumptions.exact_capacity, the bisected OOM capacity on the verdict's side of
    the usable memory (a capacity the step completes on with 2 MiB less failing); else None."""


# The two records below are plain classes, not dataclasses: CPython 3.11's dataclasses compiles
# source text for each method it writes (about 4 million instructions of each command's start for
# these two, callgrind), and nothing compares, prints or copies them.
class _StepReplays:
    """One request's step trace and the replays made of it so far."""

    __slots__ = ("ops", "shortfall_bytes", "config", "results")

    def __init__(self, ops: Ops, shortfall_bytes: int, config: AllocatorConfig) -> None:
        self.ops = ops
        self.shortfall_bytes = shortfall_bytes
        """What the planner's allocated peak counts beyond the schedule's own requested peak (its
        moments count the largest unit for every unit): added to what the allocator needs, never
        taken from it."""
        self.config = config
        self.results: dict[int | None, ReplayResult] = {}
        """Device capacity in bytes (None: no limit) -> the replay on it."""

    def on(self, capacity_bytes: int | None) -> ReplayResult:
        found = self.results.get(capacity_bytes)
        if found is None:
            found = self.results[capacity_bytes] = replay(self.ops, self.config, capacity_bytes)
        return found


class _Shape:
    """What is known of one trace under one allocator setting, whichever request built it: the
    least memory any replay of it needs, what it reserves without a device limit once a replay
    has shown it, and each capacity's outcome (completed, reserved peak)."""

    __slots__ = ("floor_bytes", "requested_peak_bytes", "capacity_independent", "largest_request_bytes",
                 "unlimited_peak_bytes", "outcomes", "band_scans")

    def __init__(self, floor_bytes: int, requested_peak_bytes: int, capacity_independent: bool,
                 largest_request_bytes: int) -> None:
        self.floor_bytes = floor_bytes
        """rounded_requested_peak_bytes: on less, no replay completes."""
        self.requested_peak_bytes = requested_peak_bytes
        """The most requested bytes alive at once over the trace."""
        self.capacity_independent = capacity_independent
        """No garbage collection (it acts against the capacity even where nothing is refused)."""
        self.largest_request_bytes = largest_request_bytes
        """The largest request of the trace (0 where it has none): allocator_largest_segment_bytes
        reads it instead of building the trace again."""
        self.unlimited_peak_bytes: int | None = None
        """The reserved peak without a device limit, once a replay has gone without a refusal."""
        self.outcomes: dict[int | None, tuple[bool, int]] = {}
        self.band_scans: dict[tuple[int, int, bool], BandScan] = {}
        """(low, high capacities, the verdict on the usable memory) -> the band scan between them
        for the other outcome (allocator_turns_in_band)."""


# A frozen spec of its string alone; parsing and validating it again cost ~35 us a verdict
# (a default fit asks ~16 verdicts). A string it refuses raises each time (not cached).
@lru_cache(maxsize=64)
def _config(allocator_conf: str) -> AllocatorConfig:
    """parse_alloc_conf(allocator_conf), once per string."""
    return parse_alloc_conf(allocator_conf)


def _step(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int) -> _StepReplays:
    """The step's trace and replays, afresh for every request (the oracle: the exact replay)."""
    config = _config(request.assumptions.allocator_conf or "")
    ops = step_ops(request, states, terms)
    return _StepReplays(ops, max(allocated_peak_bytes - _requested_peak_bytes(ops), 0), config)


TraceKey = tuple[StepInputs, AllocatorConfig]
"""A trace and its allocator setting: the schedules read nothing but their inputs
(schedule.StepInputs), so equal inputs name the same trace, known without building it (fit's
strategies that allocate alike, the same tokens per micro-batch at another sequence length,
the largest-micro-batch search's probes shared between requests, plan() asking twice)."""
_SHAPE_OF: OrderedDict[tuple, tuple[TraceKey, int]] = OrderedDict()
"""(request, allocated peak, allocator setting) -> (its trace's key in _SHAPES, shortfall):
specs are immutable, so a request and its setting name the trace."""
_SHAPES: OrderedDict[TraceKey, _Shape] = OrderedDict()
"""A trace (with the setting) -> what its replays showed."""
_SHAPE_LIMIT = 4096
Recorded = tuple[Ops, list[int]]
"""A trace's ops and its builder's marks."""


def _remember(cache: OrderedDict, key, value, limit: int) -> None:
    cache[key] = value
    if len(cache) > limit:
        cache.popitem(last=False)


def _shape(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
           allocated_peak_bytes: int) -> tuple[TraceKey, _Shape, int, AllocatorConfig, Recorded | None]:
    """The request's trace's key, what is known of it, the shortfall, the setting and, where
    the trace was built for it here, the trace (for _outcome's replay)."""
    config = _config(request.assumptions.allocator_conf or "")
    key = (request, allocated_peak_bytes, config)
    known = _SHAPE_OF.get(key)
    if known is not None and known[0] in _SHAPES:
        _SHAPE_OF.move_to_end(key)
        return known[0], _SHAPES[known[0]], known[1], config, None
    trace = (step_inputs(request, states, terms), config)
    shape = _SHAPES.get(trace)
    recorded = None
    if shape is None:
        builder = record_step(trace[0])
        ops = builder.ops
        # Without roundup_power2_divisions round_size is the builder's rounding to 512 bytes.
        plain = max(config.roundup_power2_divisions) <= 1
        floor = builder.rounded_peak_bytes if plain else _peaks(ops, config)[1]
        shape = _Shape(floor, builder.requested_peak_bytes, config.garbage_collection_threshold == 0.0,
                       builder.largest_request_bytes())
        _remember(_SHAPES, trace, shape, _SHAPE_LIMIT)
        recorded = ops, builder.marks
    else:
        _SHAPES.move_to_end(trace)
    shortfall = max(allocated_peak_bytes - shape.requested_peak_bytes, 0)
    _remember(_SHAPE_OF, key, (trace, shortfall), _SHAPE_LIMIT)
    return trace, shape, shortfall, config, recorded


def _outcome(trace: TraceKey, shape: _Shape, config: AllocatorConfig,
             capacity_bytes: int | None, recorded: Recorded | None = None) -> tuple[bool, int]:
    """(completes, reserved peak) of the trace on ``capacity_bytes`` (None: no limit), from what
    is known where that decides it exactly, else by replaying the whole trace:

    - a replay without a refused device allocation went as it would on any device, so on a
      capacity at least its reserved peak the step completes with that peak (garbage
      collection aside);
    - below rounded_requested_peak_bytes no replay completes, and a step that runs out reserves
      what it would without a limit.

    ``recorded``: the trace, where the caller has it; else it is built again. Traces are not
    kept between verdicts: a later question that needs one replayed again (rare: a capacity
    below the reserved peak of a replay already made) rebuilds it for about a third of the
    replay's cost, where keeping them left thousands of op tuples a verdict for Python's
    cyclic collector to walk (~0.3 ms of a default fit's 11-12 ms)."""
    found = shape.outcomes.get(capacity_bytes)
    if found is not None:
        return found
    unlimited = shape.unlimited_peak_bytes
    if unlimited is not None and shape.capacity_independent and (capacity_bytes is None or capacity_bytes >= unlimited):
        return True, unlimited
    if capacity_bytes is not None and capacity_bytes < shape.floor_bytes:
        return False, _outcome(trace, shape, config, None, recorded)[1]
    if recorded is None:
        builder = record_step(trace[0])
        recorded = builder.ops, builder.marks
    # The oracle's replay, made cheaper where the result is provably the same (fast_replay).
    result = replay_ops(recorded[0], config, capacity_bytes, recorded[1])
    if result.completed and result.device_refusals == 0:
        shape.unlimited_peak_bytes = result.reserved_peak_bytes
    found = (True, result.reserved_peak_bytes) if result.completed else \
        (False, _outcome(trace, shape, config, None, recorded)[1])
    shape.outcomes[capacity_bytes] = found
    return found


def _peaks(ops: Ops, config: AllocatorConfig) -> tuple[int, int]:
    """(the most requested bytes alive at once, the same with every request rounded by
    rules.round_size): every block is at least its rounded request and the allocator never
    holds more than the device gives it, so no replay completes on less than the second."""
    rounded: dict[int, int] = {}
    sizes: dict[int, tuple[int, int]] = {}
    alive = peak = alive_rounded = peak_rounded = 0
    for kind, ident, size, _ in ops:
        if kind == ALLOC_OP:
            block = rounded.get(size)
            if block is None:
                block = rounded[size] = round_size(size, config)
            sizes[ident] = (size, block)
            alive += size
            alive_rounded += block
            if alive > peak:
                peak = alive
            if alive_rounded > peak_rounded:
                peak_rounded = alive_rounded
        elif kind == FREE_OP:
            size, block = sizes.pop(ident)
            alive -= size
            alive_rounded -= block
    return peak, peak_rounded


def _requested_peak_bytes(ops: Ops) -> int:
    """The most requested bytes alive at once over the trace (what a replay's requested peak
    reports, without replaying)."""
    sizes: dict[int, int] = {}
    alive = peak = 0
    for kind, ident, size, _ in ops:
        if kind == ALLOC_OP:
            sizes[ident] = size
            alive += size
            if alive > peak:
                peak = alive
        elif kind == FREE_OP:
            alive -= sizes.pop(ident)
    return peak


def allocator_verdict(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                      allocated_peak_bytes: int, usable_bytes: int) -> PlannedVerdict:
    """Verdict and reserved peak of the request's step on ``usable_bytes`` (the module's
    docstring); where the allocated peak alone passes the usable memory nothing is replayed.
    The same answer as replaying afresh (MemoryAssumptions.exact_allocator), from the replays
    of the same trace already made where they decide it (_outcome)."""
    if allocated_peak_bytes > usable_bytes:
        return PlannedVerdict.trusted(fits=False, reserved_peak_bytes=None)
    assumptions = request.assumptions
    if assumptions.exact_allocator or assumptions.exact_capacity:
        return _exact_verdict(request, states, terms, allocated_peak_bytes, usable_bytes)
    with cyclic_gc_paused():
        trace, shape, shortfall, config, recorded = _shape(request, states, terms, allocated_peak_bytes)
        fits, reserved = _outcome(trace, shape, config, usable_bytes - shortfall, recorded)
        # The trace goes here, while the collector is paused: freed by reference counting.
        del recorded
    return PlannedVerdict.trusted(fits=fits, reserved_peak_bytes=reserved + shortfall)


def _exact_verdict(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                   allocated_peak_bytes: int, usable_bytes: int) -> PlannedVerdict:
    """allocator_verdict by replaying the request's whole trace afresh: on the usable memory,
    and without a limit where it runs out (the oracle; with exact_capacity, the bisection)."""
    # The trace's tens of thousands of events and the allocator's linked blocks would set off
    # full collections that cost as much as the replay itself (70B FSDP2: compile_trace 19 ms
    # with the collector, 4 ms without).
    with cyclic_gc_paused():
        step = _step(request, states, terms, allocated_peak_bytes)
        capacity = usable_bytes - step.shortfall_bytes
        on_gpu = step.on(capacity)
        # Where the step completes, the replay never failed a request: a step that runs out
        # reserved more than the usable memory without a limit (it completes identically on any
        # capacity at least its unlimited reserved peak).
        reserved = on_gpu if on_gpu.completed else step.on(None)
        oom_capacity = None
        if request.assumptions.exact_capacity:
            from zeroplan.allocator.capacity import CAPACITY_STEP_BYTES, bisect_capacity

            unlimited = step.on(None)
            oom_capacity = bisect_capacity(step.ops, step.config, unlimited, capacity // CAPACITY_STEP_BYTES,
                                           on_gpu.completed) + step.shortfall_bytes
    return PlannedVerdict.trusted(fits=on_gpu.completed, reserved_peak_bytes=reserved.reserved_peak_bytes + step.shortfall_bytes,
                          oom_capacity_bytes=oom_capacity)


def allocator_fits(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms, allocated_peak_bytes: int,
                   usable_bytes: int) -> bool:
    """allocator_verdict(...).fits, without the reserved peak of a step that runs out (the
    largest-micro-batch search asks only this)."""
    if allocated_peak_bytes > usable_bytes:
        return False
    with cyclic_gc_paused():
        if request.assumptions.exact_allocator:
            step = _step(request, states, terms, allocated_peak_bytes)
            return step.on(usable_bytes - step.shortfall_bytes).completed
        trace, shape, shortfall, config, recorded = _shape(request, states, terms, allocated_peak_bytes)
        capacity = usable_bytes - shortfall
        fits = capacity >= shape.floor_bytes and _outcome(trace, shape, config, capacity, recorded)[0]
        del recorded
    return fits


def allocator_fits_unrefused(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                             allocated_peak_bytes: int, usable_bytes: int) -> bool:
    """Whether the step completes on ``usable_bytes`` without the allocator ever being refused a
    device allocation: what it reserves without a device limit is within the usable memory (and,
    under garbage collection, which acts against the capacity, its replay there completes). A
    step that completes only by freeing its cache and retrying is not counted: how tightly it
    then packs depends on when in the step the first refusal comes, which need not move one way
    with the micro-batch."""
    if allocated_peak_bytes > usable_bytes:
        return False
    with cyclic_gc_paused():
        if request.assumptions.exact_allocator:
            step = _step(request, states, terms, allocated_peak_bytes)
            capacity = usable_bytes - step.shortfall_bytes
            return step.on(None).reserved_peak_bytes <= capacity and step.on(capacity).completed
        trace, shape, shortfall, config, recorded = _shape(request, states, terms, allocated_peak_bytes)
        capacity = usable_bytes - shortfall
        unrefused = capacity >= shape.floor_bytes and _outcome(trace, shape, config, None, recorded)[1] <= capacity
        if unrefused and not shape.capacity_independent:
            unrefused = _outcome(trace, shape, config, capacity, recorded)[0]
        del recorded
    return unrefused


def allocator_unlimited_reserved_bytes(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                                       allocated_peak_bytes: int) -> int:
    """What the step reserves without a device limit (the shortfall added): on at least this
    much the allocator is never refused (garbage collection aside)."""
    with cyclic_gc_paused():
        if request.assumptions.exact_allocator:
            step = _step(request, states, terms, allocated_peak_bytes)
            return step.on(None).reserved_peak_bytes + step.shortfall_bytes
        trace, shape, shortfall, config, recorded = _shape(request, states, terms, allocated_peak_bytes)
        reserved = _outcome(trace, shape, config, None, recorded)[1]
        del recorded
    return reserved + shortfall


# DeviceCachingAllocator::malloc: a request no cached block of its stream serves gets a new
# segment of its own allocation size (alloc_block); a request that a cached block served at one
# micro-batch need not find one at a smaller (the cached blocks shrink with it and are split
# differently), so each such miss reserves at most one segment of the largest request's size more.
def allocator_largest_segment_bytes(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                                    allocated_peak_bytes: int | None = None) -> int:
    """The largest segment a request of the step's trace would get of its own (alloc_block's
    allocation_size of its rounded size). ``allocated_peak_bytes``: where ``states`` and
    ``terms`` are the ones the verdicts replay, the planner's allocated peak, so what is known
    of the trace (_Shape) is read where that decides it (the trace the max-mb walk has just
    replayed at this micro-batch is not built again); None: the trace is built afresh (other
    terms must not take the verdicts' place in the kept shapes, which the request names)."""
    config = _config(request.assumptions.allocator_conf or "")
    with cyclic_gc_paused():
        if allocated_peak_bytes is None:
            return _largest_segment_of(step_ops(request, states, terms), config)
        trace, shape, _, config, recorded = _shape(request, states, terms, allocated_peak_bytes)
        # round_size never falls as the size grows (its divisions are powers of two:
        # AllocatorConfig), and allocation_size gives a request of at most 10 MiB a segment of
        # at most 20 MiB and a larger one its size rounded up to 2 MiB: where the largest
        # request's segment is at least 20 MiB, no other request's is larger.
        largest = allocation_size(round_size(max(shape.largest_request_bytes, 1), config))
        if largest < LARGE_BUFFER_BYTES:
            largest = _largest_segment_of(recorded[0] if recorded is not None else record_step(trace[0]).ops, config)
        del recorded
    return largest


def _largest_segment_of(ops: Ops, config: AllocatorConfig) -> int:
    """The largest allocation_size of any request's rounded size in ``ops``."""
    sizes = {size for kind, _, size, _ in ops if kind == ALLOC_OP}
    return max((allocation_size(round_size(size, config)) for size in sizes), default=0)


def allocator_turns_in_band(request: PlanRequest, states: ModelStateBytes, terms: PeakTerms,
                            allocated_peak_bytes: int, low_bytes: int, high_bytes: int, fits: bool) -> int | None:
    """The least memory in [low_bytes, high_bytes] on which the step goes the other way than on
    the usable memory, whose verdict is ``fits`` (the shortfall added), by replaying its trace
    path by path (capacity.scan_band, the oracle's replay); None where it goes the same way on
    all of them, or where that is not settled: garbage collection (it acts against the capacity,
    so no path holds over a range of them) or more paths than a scan makes
    (capacity.MAX_BAND_REPLAYS). A step that fits without a refused device allocation goes the
    same way on every larger memory, and from its unlimited reserved peak down to the band's
    low end the margin (core.margin.is_borderline) has answered already: it is not scanned."""
    config = _config(request.assumptions.allocator_conf or "")
    if config.garbage_collection_threshold > 0.0:
        return None
    with cyclic_gc_paused():
        trace, shape, shortfall, config, recorded = _shape(request, states, terms, allocated_peak_bytes)
        low, high = low_bytes - shortfall, high_bytes - shortfall
        if not fits:
            # Below the rounded requested peak no replay completes (_Shape.floor_bytes).
            low = max(low, shape.floor_bytes)
        elif _outcome(trace, shape, config, None, recorded)[1] <= low:
            low = high + 1  # completes unrefused on all of them
        scan = None
        if low <= high:
            scan = shape.band_scans.get((low, high, fits))
            if scan is None:
                from zeroplan.allocator.capacity import scan_band

                ops = recorded[0] if recorded is not None else record_step(trace[0]).ops
                scan = shape.band_scans[low, high, fits] = scan_band(ops, config, low, high, completes=not fits)
                del ops
        del recorded
    if scan is None or not scan.settled or scan.found_bytes is None:
        return None
    return scan.found_bytes + shortfall


def forget_replays() -> None:
    """Drop every kept trace and replay outcome (a benchmark timing cold answers, a test
    counting replays)."""
    _SHAPE_OF.clear()
    _SHAPES.clear()
