"""DeepSpeed ZeRO-3's optimizer replayed from its build through its first step, which makes the
optimizer's states, and a second (zeroplan.allocator.deepspeed_first_step): where it applies,
what the build allocates at each release, that the trace's requested peak is the one-step
trace's, and that the planner's fast answers are the oracle's on it."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zeroplan.allocator.deepspeed_first_step import first_step
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP
from zeroplan.allocator.schedule import record_step, step_inputs
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core import nvme
from zeroplan.core.plan import checked_peak_terms, replayed
from zeroplan.specs import StrategyKind
from zeroplan.units import FP32_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from allocator_fast_sweep import compare  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[1] / "benchmarks" / "published_memory" / "configs" / "qwen1.5-0.5b.json")
FLAGS = ("--gpus 1 --gpu rtx-4090 --seq-len 2048 --precision fp16-mixed --framework hf --transformers-version 4.40.0 "
         "--torch-release 2.2 --deepspeed-release 0.14.2 --model-load full-per-rank --padded-batches yes")
# A 6.86B model over 4 ranks: a 1.71e9-element partition, two sub-groups of DeepSpeed's 1e9.
WIDE = '{"model_type": "gpt2", "vocab_size": 50000, "n_embd": 4096, "n_layer": 32, "n_head": 32, ' \
       '"n_inner": 16384, "n_positions": 512, "tie_word_embeddings": false}'


def _request(extra: str = "", model: str = CONFIG, kind: StrategyKind = StrategyKind.zero3):
    args = build_parser().parse_args(["fit", model, *FLAGS.split(), *extra.split()])
    return request_from_args(args, kind)


def _wide(tmp_path, extra: str, kind: StrategyKind = StrategyKind.zero3):
    path = tmp_path / "config.json"
    path.write_text(WIDE)
    argv = ["fit", str(path), "--gpus", "4", "--gpu", "a100-80gb", "--micro-batch", "1", "--seq-len", "512",
            "--activation-checkpointing", "full", "--framework", "hf", *extra.split()]
    return request_from_args(build_parser().parse_args(argv), kind)


def _made(request):
    states, terms = replayed(*checked_peak_terms(request))
    return first_step(request, states, terms)


def _trace(request):
    states, terms = replayed(*checked_peak_terms(request))
    return states, terms, record_step(step_inputs(request, states, terms))


@pytest.mark.parametrize("release", ["0.13.3", "0.14.2", "0.19.8"])
@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_it_applies_at_every_release_over_16_bit_models(release: str, precision: str) -> None:
    assert _made(_request(f"--micro-batch 1 --deepspeed-release {release} --precision {precision}")) is not None


@pytest.mark.parametrize(("extra", "kind"), [("--micro-batch 1", StrategyKind.zero2),
                                             ("--micro-batch 1", StrategyKind.zero3_offload),
                                             ("--micro-batch 1 --precision fp32", StrategyKind.zero3)])
def test_other_steps_start_from_the_states_whole(extra: str, kind: StrategyKind) -> None:
    assert _made(_request(extra, kind=kind)) is None


@pytest.mark.parametrize(("release", "transient", "to_next"), [("0.13.3", 2, False), ("0.14.2", 2, False),
                                                               ("0.19.8", FP32_BYTES, True)])
def test_each_sub_group_makes_a_transient_and_its_fp32_master(tmp_path, release: str, transient: int,
                                                              to_next: bool) -> None:
    request = _wide(tmp_path, f"--precision bf16-mixed --deepspeed-release {release}")
    groups = nvme.sub_group_partition_elements(request)
    assert len(groups) == 2
    made = _made(request)
    assert made.sub_groups == tuple((n * transient, n * FP32_BYTES) for n in groups)
    assert made.transient_to_next is to_next
    assert made.init_gradient_buffer == max(groups) * FP32_BYTES
    assert made.lazy_states == tuple((n * FP32_BYTES, n * FP32_BYTES) for n in groups)


def test_the_build_in_its_order(tmp_path) -> None:
    # 0.19.8: the first transient is freed only once the second is made; the gradient buffer
    # made and freed; the ipg bucket and the gradient partitions after it.
    request = _wide(tmp_path, "--precision bf16-mixed")
    states, terms, builder = _trace(request)
    made = first_step(request, states, terms)
    (t1, m1), (t2, m2) = made.sub_groups
    ops = builder.ops[:12]
    freed_size = {ident: size for kind, ident, size, _ in ops if kind == ALLOC_OP}
    order = [(kind, size if kind == ALLOC_OP else freed_size[ident]) for kind, ident, size, _ in ops]
    expected = [(ALLOC_OP, states.parameter_bytes), (ALLOC_OP, t1), (ALLOC_OP, m1), (ALLOC_OP, t2), (FREE_OP, t1),
                (ALLOC_OP, m2), (FREE_OP, t2)]
    assert made.module_buffers == 0
    assert order[:len(expected)] == expected
    assert sum(made.resident_parts) + made.module_buffers == terms.resident_buffers


def test_the_states_add_up_to_the_planners_and_the_optimizers_are_made_in_the_first_step() -> None:
    request = _request("--micro-batch 2 --activation-checkpointing full")
    states, terms, builder = _trace(request)
    made = first_step(request, states, terms)
    assert made.flat_parameters == states.parameter_bytes
    lazy = [size for group in made.lazy_states for size in group]
    assert sum(made.sub_group_masters) + made.master_rest + sum(lazy) == states.optimizer_state_bytes
    assert made.module_buffers + sum(made.resident_parts) == terms.resident_buffers
    ops = builder.ops
    sizes = [size for kind, _, size, _ in ops if kind == ALLOC_OP]
    # transformers 4.40's Qwen2 rotary caches (the module's buffers), then the flat parameters
    # and, per sub-group, the 16-bit clone and the master.
    assert made.module_buffers > 0
    assert sizes[:2 + 2 * len(made.sub_groups)] == [made.module_buffers, states.parameter_bytes,
                                                    *(size for group in made.sub_groups for size in group)]
    freed = {ident for kind, ident, _, _ in ops if kind == FREE_OP}
    kept = [i for i, (kind, ident, _, _) in enumerate(ops) if kind == ALLOC_OP and ident not in freed]
    # Never freed: the constructed states, then the optimizer's, made after the first step's
    # backward has freed its blocks' activations and before the second step's first allocation.
    adams = kept[-len(lazy):]
    assert [ops[i][2] for i in adams] == lazy
    backward_frees = sum(1 for kind, *_ in ops[:adams[0]] if kind == FREE_OP)
    assert backward_frees > request.model.num_layers
    resident = [part for part in made.resident_parts if part]
    assert len(kept) == 2 + len(made.sub_groups) + (made.master_rest > 0) + len(resident) + len(lazy)


@pytest.mark.parametrize("micro_batch", [1, 3])
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_traces_requested_peak_is_the_one_step_traces(micro_batch: int, conf: str) -> None:
    # Only where the bytes lie moves: the second step holds what the one step held.
    request = _request(f"--micro-batch {micro_batch} --activation-checkpointing full --allocator-conf={conf}")
    states, terms, builder = _trace(request)
    one_step = record_step(replace(step_inputs(request, states, terms), deepspeed_first_step=None))
    assert builder.requested_peak_bytes == one_step.requested_peak_bytes
    # The states in fewer tensors (one flat buffer, a master per sub-group) round up less.
    assert builder.requested_peak_bytes <= builder.rounded_peak_bytes <= one_step.rounded_peak_bytes


@pytest.mark.parametrize("extra", ["--micro-batch 4 --activation-checkpointing full --allocator-conf=",
                                   "--micro-batch 4 --activation-checkpointing full --allocator-conf=expandable_segments:True",
                                   "--micro-batch 2 --allocator-conf=",
                                   "--micro-batch 3 --activation-checkpointing full --allocator-conf=max_split_size_mb:128",
                                   "--micro-batch 3 --activation-checkpointing full --precision bf16-mixed --deepspeed-release 0.13.3",
                                   "--micro-batch 2 --precision bf16-mixed --deepspeed-release 0.19.8 --allocator-conf="])
def test_the_fast_answers_are_the_oracles(extra: str) -> None:
    answers = compare(_request(extra))
    assert any(replayed for _, _, replayed in answers)
    assert all(same and difference == 0 for same, difference, _ in answers)
