"""PYTORCH_CUDA_ALLOC_CONF as a typed, frozen config (source.CONFIG_SOURCE, AllocatorConfig::parseArgs)."""

from __future__ import annotations

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen
from zeroplan.units import MiB

LARGE_BUFFER_BYTES = 20 * MiB
"""kLargeBuffer: the segment a 1-10 MiB request gets, and the smallest max_split_size_mb."""

ROUNDUP_INTERVALS = 16
"""kRoundUpPowerOfTwoIntervals: one divisions entry per power of two from 1 MiB to 64 GiB."""

UNLIMITED = 2**64 - 1
"""std::numeric_limits<size_t>::max(): max_split_size's default (no limit)."""

_KEYS = (
    "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
    "garbage_collection_threshold", "expandable_segments", "backend", "release_lock_on_cudamalloc",
)
_IGNORED = {"release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
            "pinned_use_background_threads", "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse"}
"""Keys the allocator accepts that change nothing this model replays (locking, pinned host memory)."""


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class AllocatorConfig(Frozen):
    """The native caching allocator's settings that shape which blocks it reserves."""

    max_split_size_bytes: int = Field(default=UNLIMITED, ge=LARGE_BUFFER_BYTES)
    """max_split_size_mb in bytes: cached blocks this large or larger are never split."""
    max_non_split_rounding_bytes: int = Field(default=LARGE_BUFFER_BYTES, ge=LARGE_BUFFER_BYTES)
    """max_non_split_rounding_mb in bytes: how much larger than a request (itself at least
    max_split_size) an unsplittable cached block may be and still serve it."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Divisions per power-of-two interval, index 0 for sizes below 2 MiB up to index 15 for
    32 GiB and above (AllocatorConfig::roundup_power2_divisions(size)); 0 or 1: no rounding."""
    garbage_collection_threshold: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of the allowed memory above which cached, unsplit large blocks are freed
    before a cudaMalloc; 0 turns it off."""
    expandable_segments: bool = False
    """Map 2 MiB (small pool) or 20 MiB (large pool) pages into one growing segment per stream
    and pool instead of cudaMalloc-ing a segment per block."""

    @model_validator(mode="after")
    def _check(self) -> "AllocatorConfig":
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise ZeroplanError("roundup_power2_divisions", f"needs {ROUNDUP_INTERVALS} entries (allowed: 1 MiB to 64 GiB intervals)")
        for value in self.roundup_power2_divisions:
            if value != 0 and not _is_power_of_two(value):
                raise ZeroplanError("roundup_power2_divisions", f"{value} is not a power of two (allowed: 0 or 1, 2, 4, 8, ...)")
        return self


def _tokens(text: str) -> list[str]:
    # AllocatorConfig::lexArgs: ',', ':', '[' and ']' are tokens of their own, spaces vanish.
    out: list[str] = []
    word = ""
    for char in text:
        if char in ",:[]":
            if word:
                out.append(word)
                word = ""
            out.append(char)
        elif char != " ":
            word += char
    if word:
        out.append(word)
    return out


def _int(key: str, token: str, allowed: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise ZeroplanError(key, f"{token!r} is not an integer (allowed: {allowed})") from None


def _megabytes(key: str, token: str) -> int:
    # parseMaxSplitSize / parseMaxNonSplitRoundingSize: at least kLargeBuffer / kMB = 20.
    allowed = "an integer number of MiB >= 20"
    value = _int(key, token, allowed)
    if value < LARGE_BUFFER_BYTES // MiB:
        raise ZeroplanError(key, f"{value} is too small (allowed: {allowed})")
    return value * MiB


def _threshold(key: str, token: str) -> float:
    # parseGarbageCollectionThreshold: strictly between 0 and 1.
    try:
        value = float(token)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise ZeroplanError(key, f"{token!r} is not allowed (allowed: a number in (0.0, 1.0))")
    return value


def _divisions(key: str, tokens: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """parseRoundUpPower2Divisions: one power of two for every interval, or a list
    [MB:divisions, ..., >:divisions] whose first entry also fills the intervals below it."""
    allowed = "a power of two, or [size_mb:divisions,...,>:divisions] with powers of two"
    divisions = [0] * ROUNDUP_INTERVALS
    if i >= len(tokens):
        raise ZeroplanError(key, f"missing value (allowed: {allowed})")
    if tokens[i] != "[":
        value = _int(key, tokens[i], allowed)
        if not _is_power_of_two(value):
            raise ZeroplanError(key, f"{value} is not a power of two (allowed: {allowed})")
        return (value,) * ROUNDUP_INTERVALS, i
    first, last_index = True, 0
    i += 1
    while i < len(tokens) and tokens[i] != "]":
        interval = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ZeroplanError(key, f"expected ':' after {interval!r} (allowed: {allowed})")
        value = _int(key, tokens[i + 2], allowed)
        if value != 0 and not _is_power_of_two(value):
            raise ZeroplanError(key, f"{value} is not a power of two or 0 (allowed: {allowed})")
        if interval == ">":
            divisions[last_index:] = [value] * (ROUNDUP_INTERVALS - last_index)
        else:
            size_mb = _int(key, interval, allowed)
            if not _is_power_of_two(size_mb):
                raise ZeroplanError(key, f"interval {size_mb} is not a power of two (allowed: {allowed})")
            index = min(size_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise ZeroplanError(key, f"missing ']' (allowed: {allowed})")
    return tuple(divisions), i


def _boolean(key: str, token: str | None) -> bool:
    if token not in ("True", "False"):
        raise ZeroplanError(key, f"{token!r} is not allowed (allowed: True, False)")
    return token == "True"


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """A PYTORCH_CUDA_ALLOC_CONF string ("" for the defaults) as an AllocatorConfig; a bad
    key or value is refused in one line naming it and what is allowed."""
    tokens = _tokens(text)
    values: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key not in _KEYS and key not in _IGNORED:
            raise ZeroplanError("allocator_conf", f"unknown key {key!r} (allowed: {', '.join(_KEYS)})")
        if i + 1 >= len(tokens) or tokens[i + 1] != ":":
            raise ZeroplanError(key, "expected ':' and a value (allowed: key:value[,key:value...])")
        i += 2
        token = tokens[i] if i < len(tokens) else None
        if key == "max_split_size_mb":
            values["max_split_size_bytes"] = _megabytes(key, token or "")
        elif key == "max_non_split_rounding_mb":
            values["max_non_split_rounding_bytes"] = _megabytes(key, token or "")
        elif key == "garbage_collection_threshold":
            values["garbage_collection_threshold"] = _threshold(key, token or "")
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"], i = _divisions(key, tokens, i)
        elif key == "expandable_segments":
            values["expandable_segments"] = _boolean(key, token)
        elif key == "backend":
            if token != "native":
                # cudaMallocAsync hands memory to the driver's pool: nothing here models it.
                raise ZeroplanError(key, f"{token!r} is not modelled (allowed: native)")
        elif key in _IGNORED or key == "release_lock_on_cudamalloc":
            if token is None:
                raise ZeroplanError(key, "missing value (allowed: key:value)")
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise ZeroplanError("allocator_conf", f"expected ',' after {key}'s value, got {tokens[i]!r} (allowed: key:value[,key:value...])")
            i += 1
    return AllocatorConfig(**values)
