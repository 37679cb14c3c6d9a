"""One collective of a step, the bytes each rank sends under a ring, and how it is built: the
type every collective-producing module shares (zeroplan.core.communication for data
parallelism, zeroplan.core.parallel.collectives for tensor, context and pipeline parallelism).
"""

from collections import Counter
from enum import Enum

from pydantic import ConfigDict

from zeroplan.specs.base import Frozen
from zeroplan.units import ceil_div


class CollectiveOp(str, Enum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    broadcast = "broadcast"
    send = "send"
    """A point-to-point send to one peer (pipeline stages): NCCL runs ncclSend/ncclRecv on the
    same channels as a two-rank ring, so it is timed as one (zeroplan.core.algorithms)."""
    all_to_all = "all_to_all"
    """Each rank sends a different 1/N of its buffer to each other rank (expert parallelism's
    token dispatch). NCCL has no all-to-all algorithm: torch's all_to_all_single issues N - 1
    grouped ncclSend/ncclRecv pairs, moving (N - 1)/N of the buffer, the bytes of a ring
    all-gather of the same buffer, so it is timed as one on the ring (zeroplan.core.algorithms)."""


class Phase(str, Enum):
    forward = "forward"
    backward = "backward"
    step = "step"


class Collective(Frozen):
    """One kind of collective in a step, summed over the units or buckets it runs on."""

    # The planner builds it unvalidated (Frozen.trusted), so its validator is built on first use
    # (a caller's validation, a JSON dump), not at each command's start.
    model_config = ConfigDict(defer_build=True)

    op: CollectiveOp
    """The collective."""
    phase: Phase
    """When it runs."""
    what: str
    """Which tensors it moves, e.g. 'gradients' or 'parameters'."""
    group_size: int
    """Ranks taking part."""
    element_bytes: int
    """Bytes of one element on the wire (the dtype)."""
    buffer_bytes: int
    """S summed over the calls of one occurrence: the unsharded buffer (all-gather output,
    reduce-scatter input, all-reduce buffer)."""
    calls: int
    """Separate calls in one occurrence (units or buckets), for the latency term."""
    occurrences_per_step: int
    """Times it happens per optimizer step (grad_accum_steps for per-micro-batch ones)."""
    spans_nodes: bool
    """Whether the group crosses a node boundary (inter-node links then bound the ring)."""
    sent_bytes_per_call_sum: int
    """Bytes one rank sends in one occurrence under a ring, summed over its calls."""
    ranks_per_node: int | None = None
    """Members of the group on each node it spans (NICs it can use); None: consecutive ranks,
    min(group_size, GPUs per node)."""
    blocking: bool = False
    """Compute waits for it: tensor- and context-parallel collectives inside a block and the
    sends between pipeline stages sit on the critical path, where the data-parallel ones run
    beside the compute (zeroplan.core.timing)."""
    packed_elements: int | None = None
    """Elements carried per occurrence where the wire dtype packs several in a byte (qgZ's int4,
    element_bytes 1); None: buffer_bytes / element_bytes."""
    kernel_bytes: int = 0
    """HBM bytes read and written, per occurrence, by the kernels that (de)quantize what it
    carries (ZeRO++'s qwZ and qgZ, zeroplan.core.zeropp); 0 for an unquantized collective. Timed
    with it, on its stream, as a memory-bound pass (zeroplan.core.algorithms.collective_cost)."""
    call_sizes: tuple[tuple[int, int], ...] = ()
    """(S bytes, number of calls of that size) for each distinct call size of one occurrence, in
    the order they first run; NCCL picks an algorithm per call from its size
    (zeroplan/core/algorithms.py)."""

    @property
    def volume_elements_per_step(self) -> int:
        """The ZeRO paper's volume (sec. 7.2.1): an all-reduce counts twice its buffer."""
        factor = 2 if self.op is CollectiveOp.all_reduce else 1
        if self.packed_elements is not None:
            return factor * self.packed_elements * self.occurrences_per_step
        return factor * self.buffer_bytes_per_step // self.element_bytes

    @property
    def buffer_bytes_per_step(self) -> int:
        return self.buffer_bytes * self.occurrences_per_step

    @property
    def sent_bytes_per_step(self) -> int:
        return self.sent_bytes_per_call_sum * self.occurrences_per_step


# Ring all-gather / reduce-scatter: N-1 rounds, each sending one 1/N chunk of the S-byte buffer.
# A pipelined ring broadcast forwards the whole buffer once along the chain: every rank but the
# last sends S, and S / B bounds its time (NCCL tests doc/PERFORMANCE.md: broadcast busbw = algbw).
def ring_sent_bytes(op: CollectiveOp, buffer_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for one collective of an S-byte buffer over a ring of N ranks."""
    if op in (CollectiveOp.broadcast, CollectiveOp.send):
        return buffer_bytes if group_size > 1 else 0
    return _chunks_sent(op, group_size) * ceil_div(buffer_bytes, group_size)


def _chunks_sent(op: CollectiveOp, group_size: int) -> int:
    """Chunks of 1/N of the buffer one rank sends in a ring collective: a round each, twice over
    for an all-reduce (a reduce-scatter then an all-gather)."""
    rounds = group_size - 1
    return 2 * rounds if op is CollectiveOp.all_reduce else rounds


def ring_sent_bytes_sum(op: CollectiveOp, sizes: dict[int, int], group_size: int) -> int:
    """ring_sent_bytes summed over calls of the sizes ``sizes`` counts (size: calls), the same
    integers: one rank's chunk per round is the only term that changes with the size, so the
    rounds multiply the chunks' sum (a collective of a DeepSpeed bucket per ~500 M elements has
    hundreds of distinct sizes)."""
    if op in (CollectiveOp.broadcast, CollectiveOp.send):
        return sum(size * calls for size, calls in sizes.items()) if group_size > 1 else 0
    return _chunks_sent(op, group_size) * sum(calls * ceil_div(size, group_size) for size, calls in sizes.items())


def make_collective(
    op: CollectiveOp, phase: Phase, what: str, buffers: list[int], group_size: int,
    occurrences: int, spans_nodes: bool, element_bytes: int, ranks_per_node: int | None = None, blocking: bool = False,
) -> Collective:
    # Many calls share a size (one per block): each distinct size is computed once.
    return collective_of_sizes(op, phase, what, Counter(buffers), group_size, occurrences, spans_nodes,
                               element_bytes, ranks_per_node, blocking)


def collective_of_sizes(
    op: CollectiveOp, phase: Phase, what: str, sizes: dict[int, int], group_size: int,
    occurrences: int, spans_nodes: bool, element_bytes: int, ranks_per_node: int | None = None, blocking: bool = False,
) -> Collective:
    """make_collective of the calls ``sizes`` counts (each distinct size and its calls, in the
    order the calls first meet it: Counter's of the calls), for a caller that knows the counts
    without listing every call (DDP's tens of thousands of equal buckets)."""
    # Built unvalidated (Frozen.trusted): every value is already of its field's type (ints,
    # bools, the enums, a tuple of int pairs), as validating it gives; the plan search builds
    # thousands of collectives, ~4 us of pydantic's validation each.
    return Collective.trusted(
        op=op, phase=phase, what=what, group_size=group_size, element_bytes=element_bytes,
        buffer_bytes=sum(size * calls for size, calls in sizes.items()),
        calls=sum(sizes.values()), occurrences_per_step=occurrences, spans_nodes=spans_nodes,
        sent_bytes_per_call_sum=ring_sent_bytes_sum(op, sizes, group_size),
        ranks_per_node=ranks_per_node, call_sizes=tuple(sizes.items()), blocking=blocking,
    )
