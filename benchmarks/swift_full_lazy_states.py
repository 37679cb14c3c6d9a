"""ms-swift's December full fine-tune rows (Qwen-7B, one A100 80GB, `swift-dec-qwen-7b-chat-full-*`)
replayed over an epoch of varying-length micro-batches, with the gradients and AdamW states
allocated when HF Trainer's loop allocates them rather than before the first step.

What the run does (ms-swift cfcb672 run_single.py and sft.py; transformers 4.36 Trainer; torch 2.1):
1,000 samples cut to max_length (truncation_left), batch 1, a random order (RandomSampler),
gradient_accumulation_steps 16, adamw_torch, max_grad_norm 0.5, gradient checkpointing.
- Each accumulation window's first backward creates every .grad (AccumulateGrad keeps the
  backward's new tensor); the later backwards add into it (a temporary of the parameter's size).
- `model.zero_grad()` after each optimizer step sets them to None (torch 2.x default), so the
  next window creates them again, wherever the cached segments of that moment put them.
- AdamW's `_init_group` creates exp_avg and exp_avg_sq (zeros_like, per parameter) at the first
  step, after 16 micro-batches of varying length; the foreach step allocates sqrt(exp_avg_sq)
  for every parameter at once (`_multi_tensor_adamw`) and frees it.
The planner's own step instead allocates parameters, states and gradients first (its trace
between steps). Each micro-batch's activations and loss tensors are the planner's own step at
that length (zeroplan.allocator.schedule.step_ops), so the difference is the order alone.

Lengths: the page's statistics (3234.4 +- 2547.5, min 91) as a shifted gamma, cut to
max_length, in seeded random orders. Prints, per row and seed, the reserved peak of the replay
on the usable memory with the states up front and created lazily, and whether it completed.

    python benchmarks/swift_full_lazy_states.py [--seeds 3] [--rows ID ...]   # about two minutes
    python benchmarks/swift_full_lazy_states.py --seeds 1 --fixed 2          # every micro-batch at max_length
    python benchmarks/swift_full_lazy_states.py --seeds 10 --lazy-only --rows swift-dec-qwen-7b-chat-full-4096 --max-length 7168
    python benchmarks/swift_full_lazy_states.py --seeds 10 --lazy-only --segments --rows swift-dec-qwen-7b-chat-full-8192-oom

--segments says, where a replay runs out, what holds each segment of at least half the failed
request: at 8192, AdamW states in two of the three 4.64 GiB loss segments (0.06 and 0.37 GiB,
seed 2), a 64 MiB checkpoint of the 8192 batch in one, the shorter records' segments full of
states (seed 3), states filling all three (seed 5).

With --fixed N, N accumulation windows of max_length micro-batches (the planner's one step, no
epoch of lengths): up front / lazy 72.54 / 72.86 GiB at 2048, 72.22 / 79.07 at 4096, 73.70 /
77.89 at 8192 (completed after one cudaMalloc retry, usable 79.50); one window stays at 72.1-72.9 (the
second step is where the lazy order shows), a third changes nothing. So at one length the lazy order does not run the 8192 row out
of memory: the 3 of 10 OOM orders above need the epoch's varying lengths as well.

The 1.8B rows (measured 19.81, 25.82, 36.65 GiB), seeds 0-2, up front / lazy: 17.76-19.24 /
20.96-21.03 at 2048, 21.46-28.14 / 22.08-22.32 at 4096, 28.84-54.07 / 30.15-45.69 at 8192: the
order of lengths moves the reserve more than when the states are made, and neither order is
closer on every row; --fixed 2: 17.73 / 21.01, 21.44 / 22.09, 28.82 / 32.22.

With --max-length, the 4096 row's run cut at other lengths, lazy order, seeds 0-9 (--lazy-only):
every order completes at 4096 (77.44-79.43 GiB), 5120 (77.51-79.46), 6144 (73.98-79.41) and 7168
(75.07-79.41); at 8192 7 of 10 complete (77.07-79.46) and seeds 2, 3 and 5 run out at a 4.64 GiB
request. zeroplan.allocator.lazy_states calls a fit borderline where the room the planner's step
leaves cannot hold one more segment of its largest request: at 7168 and 8192 (3.58 < 4.06 and
4.34 < 4.64 GiB), not at 4096-6144 (5.86 >= 2.32, 5.12 >= 2.90, 4.44 >= 3.48).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.published_memory_accuracy import argv_of, load_rows, predict  # noqa: E402
from benchmarks.varying_length_rows import without_flag  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.device import DeviceAllocator  # noqa: E402
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP, replay, run_ops  # noqa: E402
from zeroplan.allocator.schedule import step_ops  # noqa: E402
from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core.feasibility import usable_memory_bytes  # noqa: E402
from zeroplan.core.plan import peak_terms  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402

GIB = 2**30
MEAN, SD, MIN, SAMPLES = 3234.4, 2547.5, 91, 1000
ROWS = ("swift-dec-qwen-7b-chat-full-2048", "swift-dec-qwen-7b-chat-full-4096", "swift-dec-qwen-7b-chat-full-8192-oom")
SMALL_ROWS = ("swift-dec-qwen-1_8b-chat-full-2048", "swift-dec-qwen-1_8b-chat-full-4096", "swift-dec-qwen-1_8b-chat-full-8192")
"""The same page's Qwen-1.8B rows (--rows): the same loop on a model whose states leave room."""
BF16 = 2


def qwen1_parameters(model) -> tuple[list[int], list[list[int]], list[int]]:
    """Bytes of each bf16 parameter in model.parameters() order, grouped: (wte), per block
    (ln_1, c_attn weight and bias, c_proj, ln_2, w1, w2, mlp c_proj: modeling_qwen.py QWenBlock),
    (ln_f, lm_head)."""
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    block = [h, 3 * h * h, 3 * h, h * h, h, f * h, f * h, h * f]
    return [v * h * BF16], [[n * BF16 for n in block] for _ in range(model.num_layers)], [h * BF16, v * h * BF16]


def lengths_of(seq_len: int, seed: int) -> list[int]:
    shape, scale = ((MEAN - MIN) / SD) ** 2, SD**2 / (MEAN - MIN)
    rng = random.Random(seed)
    return [min(seq_len, int(MIN + rng.gammavariate(shape, scale))) for _ in range(SAMPLES)]


class Steps:
    """The planner's step at each length, split into the micro-batch's own ops (activations,
    loss, recompute) and the points where the backward reaches the head and each block."""

    def __init__(self, flags: list[str]):
        self.flags, self.cache = flags, {}

    def at(self, tokens: int):
        if tokens not in self.cache:
            args = build_parser().parse_args([*self.flags, "--seq-len", str(tokens)])
            request = request_from_args(args, StrategyKind.ddp)
            ops = step_ops(request, *peak_terms(request))
            freed = {ident for kind, ident, _, _ in ops if kind == FREE_OP}
            end = len(ops)
            while ops[end - 1][0] == FREE_OP:
                end -= 1
            start = end
            while ops[start - 1][0] == ALLOC_OP:
                start -= 1
            # Up to the optimizer's temporaries: the micro-batch; model states (never freed) and
            # the gradients (freed after the temporaries) are left to the caller.
            late = {ident for _, ident, _, _ in ops[end:]}
            temporaries = {ident for _, ident, _, _ in ops[start:end]}
            body = [op for op in ops[:start] if op[1] in freed and op[1] not in late - temporaries]
            allocs = [op for op in body if op[0] == ALLOC_OP]
            largest = max(size for _, _, size, _ in allocs)
            loss_ids = {ident for _, ident, size, _ in allocs if size >= 0.99 * largest}
            first_loss = next(i for i, op in enumerate(body) if op[1] in loss_ids)
            checkpoints = [op[1] for op in body[:first_loss] if op[0] == ALLOC_OP]
            head = max(i for i, op in enumerate(body) if op[0] == FREE_OP and op[1] in loss_ids)
            block_done = {op[1]: i for i, op in enumerate(body) if op[0] == FREE_OP and op[1] in checkpoints}
            # The last checkpoint freed first: the backward runs the blocks from the last.
            points = [block_done[ident] for ident in checkpoints]
            self.cache[tokens] = (body, head, points)
        return self.cache[tokens]


MODEL_STATE_IDS = 10**12
"""Ids of the parameters, states, gradients and step temporaries start here, past every
micro-batch's own ids (shifted by (n + 1) x 10**7: 10**10 after 1,000 micro-batches)."""


def epoch_ops(steps: Steps, lengths: list[int], model, accum: int, lazy: bool,
              kinds: dict[int, str] | None = None) -> list[tuple[int, int, int, int]]:
    """The epoch's ops; ``kinds``, where given, is filled with what each id is: parameter, state,
    gradient, temporary (accumulation and foreach), or the micro-batch's own (its loss's largest
    tensors 'loss', the rest 'activation')."""
    wte, blocks, tail = qwen1_parameters(model)
    sizes = wte + [s for b in blocks for s in b] + tail
    next_id = [MODEL_STATE_IDS]
    kinds = {} if kinds is None else kinds

    def new(size: int, kind: str = "temporary") -> tuple[int, int, int, int]:
        next_id[0] += 1
        kinds[next_id[0]] = kind
        return (ALLOC_OP, next_id[0], size, 0)

    ops = [new(s, "parameter") for s in sizes]
    states = [new(s, "state") for s in sizes for _ in range(2)]
    grads_up_front = [new(s, "gradient") for s in sizes]
    if not lazy:
        ops += states + grads_up_front
    states_made = not lazy
    grads: list[tuple[int, int, int, int]] = []
    for n, tokens in enumerate(lengths):
        body, head, points = steps.at(tokens)
        shift = (n + 1) * 10**7
        body = [(kind, ident + shift, size, stream) for kind, ident, size, stream in body]
        largest = max(size for _, _, size, _ in body)
        kinds.update((ident, "loss" if size >= 0.99 * largest else "activation")
                     for kind, ident, size, _ in body if kind == ALLOC_OP)
        first = n % accum == 0
        inserts: dict[int, list] = {}
        if lazy:
            # AccumulateGrad: the first backward's tensor becomes .grad; later ones add into it.
            def made(group: list[int], first: bool = first, grads: list = grads) -> list:
                if first:
                    out = [new(s, "gradient") for s in group]
                    grads.extend(out)
                    return out
                out = [new(s) for s in group]
                return out + [(FREE_OP, op[1], 0, 0) for op in out]

            inserts[head] = made(tail[::-1])
            for j, point in enumerate(points):
                inserts[point] = made(blocks[len(blocks) - 1 - j][::-1])
            inserts[points[-1]] = inserts[points[-1]] + made(wte)
        for i, op in enumerate(body):
            ops.append(op)
            ops += inserts.get(i, [])
        if (n + 1) % accum == 0 or n == len(lengths) - 1:
            if not states_made:
                ops += states
                states_made = True
            temporaries = [new(s) for s in sizes]  # foreach sqrt(exp_avg_sq)
            ops += temporaries + [(FREE_OP, op[1], 0, 0) for op in temporaries]
            if lazy:
                ops += [(FREE_OP, op[1], 0, 0) for op in grads]  # zero_grad(set_to_none=True)
                grads = []
    return ops


def segments_at_oom(ops, kinds: dict[int, str], capacity_bytes: int) -> list[str]:
    """Replays ``ops`` to where they run out and says, of each segment at least half the request
    that failed, what holds it (by ``kinds``) and what it has free: which tensors split the
    segments the failed request could have used."""
    device = DeviceAllocator(parse_alloc_conf(""), capacity_bytes)
    live: dict[int, object] = {}
    index = run_ops(device, ops, 0, live)
    if index is None:
        return []
    request = ops[index][2]
    holder = {id(block): kinds.get(ident, "?") for ident, block in live.items()}
    firsts = {}
    for block in [*live.values(), *device.large_pool.by_key.values()]:
        while block.prev is not None:
            block = block.prev
        firsts[block.ptr] = block
    lines = []
    for first in sorted(firsts.values(), key=lambda b: b.ptr):
        held: dict[str, int] = {}
        size = free = largest = 0
        block = first
        while block is not None:
            size += block.size
            if block.allocated:
                held[holder.get(id(block), "?")] = held.get(holder.get(id(block), "?"), 0) + block.size
            else:
                free += block.size
                largest = max(largest, block.size)
            block = block.next
        if first.small or size < request // 2:
            continue
        holders = ", ".join(f"{kind} {n / GIB:.2f}" for kind, n in sorted(held.items()))
        lines.append(f"    segment {size / GIB:.2f} GiB: free {free / GIB:.2f} (largest {largest / GIB:.2f}); {holders or 'nothing'}")
    return [f"  at the failed {request / GIB:.2f} GiB request ({device.reserved / GIB:.2f} GiB reserved), "
            f"the segments of at least half its size:"] + lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS + SMALL_ROWS)
    parser.add_argument("--fixed", type=int, default=0, metavar="WINDOWS",
                        help="replay WINDOWS accumulation windows of max_length micro-batches instead of the epoch")
    parser.add_argument("--max-length", type=int, metavar="TOKENS",
                        help="cut the samples at TOKENS instead of the row's max_length (the same run at another length)")
    parser.add_argument("--lazy-only", action="store_true", help="replay the lazy order alone (half the time)")
    parser.add_argument("--segments", action="store_true",
                        help="where a replay runs out, say what holds each segment the failed request could have used")
    options = parser.parse_args(argv)
    rows = {row["id"]: row for row in load_rows()}
    for rid in options.rows:
        # The one step at max_length: the epoch's lengths are replayed here, not taken as a term.
        row = {**rows[rid], "extra_flags": without_flag(rows[rid]["extra_flags"])}
        seq_len = options.max_length or int(row["seq_len"])
        at = "" if seq_len == int(row["seq_len"]) else f" at max_length {row['seq_len']}"
        row["seq_len"] = str(seq_len)
        flags = argv_of(row)
        flags = [f for i, f in enumerate(flags) if f != "--seq-len" and (i == 0 or flags[i - 1] != "--seq-len")]
        request = request_from_args(build_parser().parse_args([*flags, "--seq-len", str(seq_len)]), StrategyKind.ddp)
        usable = usable_memory_bytes(request)
        measured = f"{float(row['measured_value']) * int(row['unit_bytes']) / GIB:.2f} GiB" if row["measured_value"] else "OOM"
        print(f"{rid}: measured {measured}{at}; planned step {predict(row)['predicted'] / GIB:.2f} GiB; usable {usable / GIB:.2f}")
        steps = Steps(flags)
        for seed in range(options.seeds):
            lengths = [seq_len] * (options.fixed * int(row["grad_accum"])) if options.fixed else lengths_of(seq_len, seed)
            line = []
            held = []
            for lazy in (True,) if options.lazy_only else (False, True):
                kinds: dict[int, str] = {}
                ops = epoch_ops(steps, lengths, request.model, int(row["grad_accum"]), lazy, kinds)
                result = replay(ops, parse_alloc_conf(""), usable)
                state = "completed" if result.completed else f"OOM ({result.oom_request_bytes / GIB:.2f} GiB request)"
                line.append(f"{'lazy' if lazy else 'up front'} {result.reserved_peak_bytes / GIB:.2f} GiB {state}, "
                            f"{result.alloc_retries} retries")
                if options.segments and not result.completed:
                    held += segments_at_oom(ops, kinds, usable)
            print(f"  seed {seed}: " + "; ".join(line))
            for text in held:
                print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
