"""DeepSpeed ZeRO-3's optimizer build (zeroplan.core.deepspeed_stage3_setup): after defragment's
empty_cache, each sub-group's transient (a clone in the model dtype through 0.14.2, an fp32 copy
in 0.19.8) and fp32 master, then the fp32 gradient buffer of the largest sub-group made and freed,
then the resident buffers and the other optimizer states; the replay starts from that build."""

from __future__ import annotations

import pytest

from zeroplan.allocator.schedule import step_trace
from zeroplan.allocator.trace import AllocEvent, FreeEvent
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core import deepspeed_stage3_setup, nvme
from zeroplan.core.plan import peak_terms
from zeroplan.specs import StrategyKind
from zeroplan.units import FP32_BYTES

# A 6.86B model over 4 ranks: a 1.71e9-element partition, two sub-groups of DeepSpeed's 1e9.
CONFIG = '{"model_type": "gpt2", "vocab_size": 50000, "n_embd": 4096, "n_layer": 32, "n_head": 32, ' \
         '"n_inner": 16384, "n_positions": 512, "tie_word_embeddings": false}'


def _request(tmp_path, *flags: str, kind: StrategyKind = StrategyKind.zero3, precision: str = "bf16-mixed"):
    path = tmp_path / "config.json"
    path.write_text(CONFIG)
    argv = ["fit", str(path), "--gpus", "4", "--gpu", "a100-80gb", "--micro-batch", "1", "--seq-len", "512",
            "--precision", precision, "--activation-checkpointing", "full", "--framework", "hf", *flags]
    return request_from_args(build_parser().parse_args(argv), kind)


@pytest.mark.parametrize(("release", "transient"), [("0.13.3", 2), ("0.14.2", 2), ("0.19.8", FP32_BYTES)])
def test_each_sub_group_makes_a_transient_and_its_fp32_master(tmp_path, release: str, transient: int) -> None:
    request = _request(tmp_path, "--deepspeed-release", release)
    groups = nvme.sub_group_partition_elements(request)
    assert len(groups) == 2
    assert deepspeed_stage3_setup.setup_sub_groups(request) == tuple((n * transient, n * FP32_BYTES) for n in groups)
    assert deepspeed_stage3_setup.init_gradient_buffer_bytes(request) == max(groups) * FP32_BYTES


@pytest.mark.parametrize("kind", [StrategyKind.zero2, StrategyKind.zero3_offload])
def test_other_strategies_start_from_the_states(tmp_path, kind: StrategyKind) -> None:
    request = _request(tmp_path, kind=kind)
    assert deepspeed_stage3_setup.setup_sub_groups(request) == ()
    assert deepspeed_stage3_setup.init_gradient_buffer_bytes(request) == 0


def test_an_fp32_model_clones_its_master_without_a_transient(tmp_path) -> None:
    assert deepspeed_stage3_setup.setup_sub_groups(_request(tmp_path, precision="fp32")) == ()


def test_the_replay_starts_with_the_build_in_its_order(tmp_path) -> None:
    request = _request(tmp_path, "--deepspeed-release", "0.13.3")
    states, terms = peak_terms(request)
    events = step_trace(request, states, terms).events
    groups = nvme.sub_group_partition_elements(request)
    sizes = {e.id: e.size_bytes for e in events if isinstance(e, AllocEvent)}
    head = [("free", sizes[e.id]) if isinstance(e, FreeEvent) else ("alloc", e.size_bytes) for e in events[:12]]
    clone0, clone1 = groups[0] * 2, groups[1] * 2
    assert head[:10] == [
        ("alloc", states.parameter_bytes),
        ("alloc", clone0), ("alloc", groups[0] * FP32_BYTES), ("free", clone0),
        ("alloc", clone1), ("alloc", groups[1] * FP32_BYTES), ("free", clone1),
        ("alloc", max(groups) * FP32_BYTES), ("free", max(groups) * FP32_BYTES),
        ("alloc", terms.resident_buffers)]
    # Adam's two states per sub-group follow, each its master's size, then what remains of the
    # optimizer states (its scalars): the states built add up to the planner's.
    adam = [("alloc", groups[0] * FP32_BYTES)] * 2 + [("alloc", groups[1] * FP32_BYTES)] * 2
    built = [("alloc", e.size_bytes) for e in events[10:15] if isinstance(e, AllocEvent)]
    assert built[:4] == adam
    assert sum(size for _, size in built) == states.optimizer_state_bytes - sum(groups) * FP32_BYTES
