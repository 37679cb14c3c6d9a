"""What the caching allocator reserves on a Megatron-DeepSpeed pipeline stage when the step is
replayed tensor by tensor (zeroplan.allocator's replay), against published per-rank figures.

The planner's allocator replay for a pipeline rank is coarse (zeroplan/allocator/schedule.py:
each block's activations as a few parts, one forward and one backward). Here the first stage's
step is written out tensor by tensor as the stack runs it, to see where the caching allocator's
reserve on the BigScience tr11 rows comes from: replayed without the optimizer step
(--without-step), the pipeline's interleaving alone reserves 2.2 GiB beyond the allocated peak
at dp 4 x pp 10 (1.5-3.4 GiB over the rows at dp 2 or more); with it, 5.2 GiB, the step's single large tensors (the gradient norm's fp64 copy, the flat fp32
gradient partition) taking segments of their own. The planner models those two since
(zeroplan.core.deepspeed_step); the interleaving's share it does not. The trace:

- Init (bigscience-workshop/Megatron-DeepSpeed @541b967f megatron/mpu/layers.py: parameters
  made on the GPU in fp16; DeepSpeed @2151c787a, 2022-02-18, runtime/zero/stage_1_and_2.py
  __init__: move_to_cpu, each group flattened on the CPU and moved back, the fp32 partition a
  clone().float() of its slice, initialize_optimizer_states' zero gradient and Adam's states).
- DeepSpeed's TrainSchedule on the first stage (runtime/pipe/schedule.py): min(pp, micro-batches)
  forwards, then a backward and a forward in turn, then the last backwards. Each forward runs
  every block under DeepSpeed's checkpointing (runtime/activation_checkpointing/checkpointing.py
  CheckpointFunction: no_grad, the block's input kept), keeps the embedding's dropout mask and
  this rank's 1/t of the stage output (runtime/pipe/engine.py _exec_forward_pass,
  pipe_partitioned). Each backward gathers the output and its gradient (PartitionedTensor.full)
  and, block by block, recomputes the block with grad and runs its backward.
- One block, tensor by tensor (the fork's megatron/model/transformer.py ParallelAttention and
  ParallelMLP: baddbmm into a new [b*np, s, s] tensor, the fused masked softmax keeping its
  output, dropout's mask and output, the context's permute().contiguous() copy, bias-dropout-add
  keeping its mask, bias-GeLU keeping its input, the linears their inputs), and in backward each
  op's input gradient and weight gradient; a weight gradient is the parameter's .grad at the
  step's first micro-batch and added into it (then freed) at the others (AccumulateGrad).
- The reduce and step of DeepSpeed's ZeRO stage 1 of 2022 (stage_1_and_2.py: contiguous_gradients
  off at stage 1, engine.py _configure_zero_optimizer): buffered_reduce_fallback flattens buckets
  of up to reduce_bucket_size elements; the epilogue keeps the gradients overlapping this rank's
  partition; step's check_overflow copies each to fp32 (_has_inf_or_nan) and get_grad_norm_direct
  each to fp64 (g.data.double()), one at a time; each group's flat fp16 partition is made and
  cast to fp32; the fused Adam steps in place.

Two steps are replayed (the first step's step temporaries are in the cache at the second). The
block's tensors are the fork's legacy GPT block (MHA, GeLU, eager attention, no sequence
parallelism, full recomputation), which is what the rows ran; it is not the planner's trace.

Checked against the one published log of this stack that states both peaks per rank:
bigscience-workshop/bigscience experiments/gpt2-meg-ds-3d/meg_ds_3d_gpt2_perf_n16-ds-on.out
@57f4e9b (GPT 64 x 8192, tp 4 x pp 16, micro-batch 4, 256 micro-batches, V100 32GB, DeepSpeed
0.4.0's pipeline engine; its "(after 1 iterations) memory (MB)" lines). That run's ZeRO stage 0
optimizer is DeepSpeed 0.4.0's FP16_Optimizer, not the stage-1 step written here, so its step
is an approximation. Usage:

    python benchmarks/megatron_deepspeed_stage_replay.py [--without-step]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroplan.allocator.builder import TraceBuilder  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.replay import ReplayResult, replay  # noqa: E402

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Stage:
    """The first pipeline stage of a Megatron-DeepSpeed GPT run, per tensor-parallel rank."""

    hidden: int
    ffn: int
    heads: int
    seq_len: int
    micro_batch: int
    tp: int
    blocks: int
    """Blocks on this stage."""
    pp: int
    micro_batches: int
    """Micro-batches a step runs through the pipeline (grad-accum)."""
    vocab: int
    """Padded vocabulary (the word embedding's rows over all tp ranks)."""
    dp: int
    groups: int
    """Parameter groups DeepSpeed flattens apart (the fork's get_param_groups)."""
    positions: int = 0
    """Rows of a learned position table on this stage (0 under ALiBi)."""
    overflow_copy_bytes: int = 4
    """Bytes per element of check_overflow's copy (x.float(), fp16 runs)."""
    reduce_bucket: int = 500_000_000
    element_bytes: int = 2
    steps: int = 2

    @property
    def in_flight(self) -> int:
        return min(self.pp, self.micro_batches)

    def parameters(self) -> list[int]:
        """This rank's parameter tensors in registration order: the word embedding (and
        positions), then per block LN1 weight and bias, QKV weight and bias, the attention's
        output weight and bias, LN2 weight and bias, the MLP's two weights and biases."""
        h, hp, fp = self.hidden, self.hidden // self.tp, self.ffn // self.tp
        block = [h, h, 3 * hp * h, 3 * hp, h * hp, h, h, h, fp * h, fp, h * fp, h]
        head = [self.vocab // self.tp * h] + ([self.positions * h] if self.positions else [])
        return head + block * self.blocks

    @property
    def head_tensors(self) -> int:
        return 2 if self.positions else 1


class StageTrace:
    """Builds the stage's allocations (see the module docstring) with a TraceBuilder."""

    def __init__(self, stage: Stage) -> None:
        self.st = stage
        self.b = TraceBuilder()
        e, s, b = stage.element_bytes, stage.seq_len, stage.micro_batch
        tokens = s * b
        self.hidden = tokens * stage.hidden * e
        self.hidden_part = tokens * (stage.hidden // stage.tp) * e
        self.ffn = tokens * (stage.ffn // stage.tp) * e
        self.scores = b * (stage.heads // stage.tp) * s * s * e
        self.params = stage.parameters()
        self.grads: dict[int, int] = {}
        self.in_flight: dict[int, tuple[list[int], list[list[int]], list[int]]] = {}

    def alloc(self, size: int) -> list[int]:
        return self.b.alloc(size)

    def free(self, *groups: list[int]) -> None:
        for ids in groups:
            self.b.free(ids)

    def init(self) -> None:
        st, e = self.st, self.st.element_bytes
        original = [self.alloc(n * e) for n in self.params]
        self.free(*original)
        total = sum(self.params)
        self.group_elements = [total // st.groups] * st.groups
        self.group_elements[0] += total - sum(self.group_elements)
        for n in self.group_elements:
            self.alloc(n * e)  # the flat fp16 group, kept
        self.partitions = [n // st.dp for n in self.group_elements]
        for p in self.partitions:
            half = self.alloc(p * e)
            self.alloc(p * 4)  # fp32 master partition, kept
            self.free(half)
        zero = [self.alloc(p * 4) for p in self.partitions]
        for p in self.partitions:
            self.alloc(p * 4)
            self.alloc(p * 4)  # Adam's exp_avg and exp_avg_sq, kept
        self.free(*zero)

    def weight_grad(self, index: int) -> None:
        new = self.alloc(self.params[index] * self.st.element_bytes)
        if index in self.grads:
            self.free(new)
        else:
            self.grads[index] = new[0]

    def block_forward(self) -> tuple[dict[str, list[int]], list[int]]:
        """The block run with grad: what it saves, and its output."""
        H, HP, F, SC = self.hidden, self.hidden_part, self.ffn, self.scores
        saved = {"ln1": self.alloc(H), "qkv": self.alloc(3 * HP)}
        scores = self.alloc(SC)
        saved["probs"] = self.alloc(SC)
        self.free(scores)
        saved["attention_mask"] = self.alloc(SC // self.st.element_bytes)
        saved["attention_dropout"] = self.alloc(SC)
        context = self.alloc(HP)
        saved["context"] = self.alloc(HP)
        self.free(context)
        dense = self.alloc(H)
        saved["mask1"] = self.alloc(H // self.st.element_bytes)
        saved["residual"] = self.alloc(H)
        self.free(dense)
        saved["ln2"] = self.alloc(H)
        saved["fc1"] = self.alloc(F)
        saved["gelu"] = self.alloc(F)
        fc2 = self.alloc(H)
        saved["mask2"] = self.alloc(H // self.st.element_bytes)
        output = self.alloc(H)
        self.free(fc2)
        return saved, output

    def block_backward(self, block: int, saved: dict[str, list[int]], output: list[int], grad: list[int]) -> list[int]:
        H, HP, F, SC = self.hidden, self.hidden_part, self.ffn, self.scores
        first = self.st.head_tensors + 12 * block
        self.free(output)
        g = self.alloc(H)
        self.free(saved["mask2"])
        g_fc2 = self.alloc(F)
        self.weight_grad(first + 10)
        self.free(saved["gelu"], g)
        g_gelu = self.alloc(F)
        self.free(saved["fc1"], g_fc2)
        self.weight_grad(first + 8)
        g_fc1 = self.alloc(H)
        self.free(saved["ln2"], g_gelu)
        g_ln2 = self.alloc(H)
        self.free(g_fc1)
        residual = self.alloc(H)
        self.free(g_ln2, grad, saved["residual"])
        g_add = self.alloc(H)
        self.free(saved["mask1"])
        g_dense = self.alloc(HP)
        self.weight_grad(first + 4)
        self.free(saved["context"], g_add)
        g_probs = self.alloc(SC)
        g_value = self.alloc(HP)
        self.free(saved["attention_dropout"], g_dense)
        g_dropout = self.alloc(SC)
        self.free(saved["attention_mask"], g_probs)
        g_softmax = self.alloc(SC)
        self.free(saved["probs"], g_dropout)
        g_query, g_key = self.alloc(HP), self.alloc(HP)
        self.free(g_softmax)
        g_qkv = self.alloc(3 * HP)
        self.free(g_query, g_key, g_value, saved["qkv"])
        self.weight_grad(first + 2)
        g_input = self.alloc(H)
        self.free(g_qkv, saved["ln1"])
        g_ln1 = self.alloc(H)
        self.free(g_input)
        g_x = self.alloc(H)
        self.free(g_ln1, residual)
        return g_x

    def forward(self, micro_batch: int) -> None:
        H, e = self.hidden, self.st.element_bytes
        embedded = self.alloc(H)
        mask = self.alloc(H // e)
        dropped = self.alloc(H)
        self.free(embedded)
        x = self.alloc(H)  # transpose(0, 1).contiguous(): the first block's input
        self.free(dropped)
        inputs = []
        for _ in range(self.st.blocks):
            inputs.append(x)
            saved, x = self.block_forward()
            self.free(*saved.values())
        part = self.alloc(H // self.st.tp)
        self.free(x)
        self.in_flight[micro_batch] = (mask, inputs, part)

    def backward(self, micro_batch: int) -> None:
        mask, inputs, part = self.in_flight.pop(micro_batch)
        full = self.alloc(self.hidden)
        grad = self.alloc(self.hidden)
        self.free(part)
        for block in reversed(range(self.st.blocks)):
            saved, output = self.block_forward()
            grad = self.block_backward(block, saved, output, grad)
            self.free(inputs[block])
        self.free(full)
        for index in range(self.st.head_tensors):
            self.weight_grad(index)
        self.free(mask, grad)

    def reduce_and_step(self) -> None:
        st, e = self.st, self.st.element_bytes
        bucket = 0
        for i, n in enumerate(self.params):
            bucket += n
            if bucket > st.reduce_bucket or i == len(self.params) - 1:
                self.free(self.alloc(bucket * e))
                bucket = 0
        # Rank 0's partition: the first 1/dp of each group.
        bounds, offset = [], 0
        for n in self.group_elements:
            bounds.append((offset, offset + n // st.dp))
            offset += n
        overlap, position = {}, 0
        for i, n in enumerate(self.params):
            overlap[i] = sum(max(0, min(position + n, hi) - max(position, lo)) for lo, hi in bounds)
            position += n
        for i in [i for i in self.grads if not overlap[i]]:
            self.free([self.grads.pop(i)])
        for i in list(self.grads):
            if st.overflow_copy_bytes:
                self.free(self.alloc(overlap[i] * st.overflow_copy_bytes))
            self.free(self.alloc(overlap[i] * 8))
        fp32 = []
        for p in self.partitions:
            flat = self.alloc(p * e)
            fp32.append(self.alloc(p * 4))
            self.free(flat)
        self.free([self.grads.pop(i) for i in list(self.grads)])
        self.free(*fp32)

    def drop_gradients(self) -> None:
        """--without-step: the gradients go at the step's end with no reduce or step."""
        self.free([self.grads.pop(i) for i in list(self.grads)])

    def build(self, with_step: bool = True) -> TraceBuilder:
        self.init()
        for _ in range(self.st.steps):
            forwards = backwards = 0
            for _ in range(self.st.in_flight):
                self.forward(forwards)
                forwards += 1
            while backwards < self.st.micro_batches:
                self.backward(backwards)
                backwards += 1
                if forwards < self.st.micro_batches:
                    self.forward(forwards)
                    forwards += 1
            if with_step:
                self.reduce_and_step()
            else:
                self.drop_gradients()
        return self.b


def replay_stage(stage: Stage, with_step: bool = True) -> ReplayResult:
    return replay(StageTrace(stage).build(with_step).ops, parse_alloc_conf(""), None)


# experiments/gpt2-meg-ds-3d/meg_ds_3d_gpt2_perf_n16-ds-on.out @57f4e9b: ranks 0-3 (stage 0),
# "(after 1 iterations) memory (MB)": max allocated 19961.07, max reserved 22892-23288.
LOG_2021 = Stage(hidden=8192, ffn=32768, heads=32, seq_len=1024, micro_batch=4, tp=4, blocks=4, pp=16,
                 micro_batches=256, vocab=50688, dp=1, groups=2, positions=1024, steps=1)
LOG_2021_MEASURED_MIB = (19961.07, 22892.0, 23288.0)

BIGSCIENCE_ROWS = ("bigsci-tr11-200b-dp12-pp4-tp8", "bigsci-tr11-200b-dp9-pp5-tp8", "bigsci-tr11-200b-dp6-pp8-tp8",
                   "bigsci-tr11-200b-dp4-pp10-tp8", "bigsci-tr11-200b-dp4-pp10-mbs2-tp8",
                   "bigsci-tr11-200b-dp4-pp10-mbs4-tp8", "bigsci-tr11-200b-dp4-pp10-mbs8-tp8",
                   "bigsci-tr11-200b-tp8-pp10-fp16", "bigsci-tr11-200b-dp2-tp8-pp10-fp16")


def bigscience_stage(row: dict[str, str]) -> Stage:
    """The first stage of a BigScience tr11 row (the 200B: 80 blocks of 14400, 96 heads, ALiBi;
    three parameter groups, the fork's FusedAdam workaround of 2022-02-17, megatron/optimizer/
    __init__.py @541b967f)."""
    pp, tp = int(row["pp"]), int(row["tp"])
    return Stage(hidden=14400, ffn=4 * 14400, heads=96, seq_len=int(row["seq_len"]), micro_batch=int(row["micro_batch"]),
                 tp=tp, blocks=80 // pp, pp=pp, micro_batches=int(row["grad_accum"]), vocab=250880,
                 dp=int(row["num_gpus"]) // (tp * pp), groups=3)


def planner_outside_allocator_bytes(row: dict[str, str]) -> int:
    """The planner's CUDA context and NCCL buffers for the row (what it adds to the reserved peak
    for an nvidia-smi figure)."""
    from benchmarks.published_memory_accuracy import argv_of
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.feasibility import usable_memory_bytes
    from zeroplan.specs.strategy import StrategyKind

    request = request_from_args(build_parser().parse_args(shlex.split(shlex.join(argv_of(row)))), StrategyKind(row["strategy"]))
    return request.cluster.gpu.memory_bytes - usable_memory_bytes(request)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without-step", action="store_true",
                        help="replay without the reduce and the optimizer step (the pipeline's interleaving alone)")
    with_step = not parser.parse_args(argv).without_step
    from benchmarks.published_memory_accuracy import load_rows, predict

    result = replay_stage(LOG_2021, with_step)
    allocated, low, high = (v * MIB / GIB for v in LOG_2021_MEASURED_MIB)
    print("2021 log, GPT 64 x 8192, tp 4 x pp 16, stage 0, after one step (GiB):")
    print(f"  replay: allocated {result.requested_peak_bytes / GIB:.2f}, reserved {result.reserved_peak_bytes / GIB:.2f}")
    print(f"  log:    allocated {allocated:.2f}, reserved {low:.2f}-{high:.2f}")
    print("\nBigScience tr11 first stages, two steps (GiB; nvidia-smi = reserved + the planner's context and NCCL buffers):")
    print(f"  {'row':38s} {'alloc':>6s} {'reserved':>8s} {'reserve':>7s} {'smi':>6s} {'measured':>8s} {'err %':>6s} {'planner':>7s} {'err %':>6s}")
    for row in load_rows():
        if row["id"] not in BIGSCIENCE_ROWS:
            continue
        result = replay_stage(bigscience_stage(row), with_step)
        outside = planner_outside_allocator_bytes(row)
        smi = (result.reserved_peak_bytes + outside) / GIB
        measured = float(row["measured_value"]) * float(row["unit_bytes"]) / GIB
        planner = predict(row)["predicted"] / GIB
        print(f"  {row['id']:38s} {result.requested_peak_bytes / GIB:6.2f} {result.reserved_peak_bytes / GIB:8.2f} "
              f"{(result.reserved_peak_bytes - result.requested_peak_bytes) / GIB:7.2f} {smi:6.2f} {measured:8.2f} "
              f"{100 * (smi - measured) / measured:+6.1f} {planner:7.2f} {100 * (planner - measured) / measured:+6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
