"""--transformers-version (zeroplan.core.transformers_release): what an older release's causal-LM
forward returns and its loss allocates, read from the releases' own source; the refusals; the
allocator schedule against the planner's peak."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.allocator.schedule import step_trace
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.framework_loss import framework_logits_tensors
from zeroplan.core.frameworks import positions_causal_mask_bytes
from zeroplan.core.kv_cache import kept_outputs_bytes, loss_forward_tensors
from zeroplan.core.plan import memory_breakdown, peak_terms
from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.kv_cache_record import KvCacheRecord
from zeroplan.frameworks.record import load_records
from zeroplan.specs import StrategyKind
from zeroplan.specs.framework import Framework

# fsdp_qlora's benchmarks: Llama-2-7B QLoRA, 2 GPUs, FSDP, pure bf16, 12 x 2048.
FQ = ("llama-2-7b --framework hf --gpus 2 --gpu rtx-4090 --micro-batch 12 --seq-len 2048 --precision bf16-pure "
      "--activation-checkpointing full --lora-rank 64 --quantize nf4")
S, B, V = 2048, 12, 32000


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# llama-recipes' shape of benchmarks/kv-cache-records: Llama-2-7B, micro-batch 4 x 2048, bf16.
COOKBOOK = ("llama-2-7b --framework hf --gpus 8 --gpu a100-80gb --micro-batch 4 --seq-len 2048 "
            "--precision bf16-pure --activation-checkpointing full")


def _request(flags: str):
    base = request_from_args(build_parser().parse_args(["fit", *flags.split()]))
    return base.model_copy(update={"strategy": base.strategy.model_copy(update={"kind": StrategyKind.fsdp_full_shard})})


def test_before_4_46_the_forward_returns_fp32_logits_and_the_loss_copies_the_shifted_ones() -> None:
    sbv, shifted = S * B * V, (S - 1) * B * V
    assert loss_forward_tensors(_request(FQ)) == (2 * sbv, 4 * sbv, 4 * sbv)
    assert loss_forward_tensors(_request(FQ + " --transformers-version 4.38.2")) == (4 * sbv, 4 * shifted, 4 * shifted)
    # 4.46-4.48: compute-dtype logits, the loss's upcast and its copy of the shifted rows.
    assert loss_forward_tensors(_request(FQ + " --transformers-version 4.48")) == (2 * sbv, 4 * sbv, 4 * shifted, 4 * shifted)
    assert loss_forward_tensors(_request(FQ + " --transformers-version 4.49.0")) == (2 * sbv, 4 * sbv, 4 * sbv)
    # An fp32 module's `.float()` returns the logits themselves.
    assert loss_forward_tensors(_request(FQ.replace("bf16-pure", "fp32") + " --transformers-version 4.50")) == (4 * sbv, 4 * sbv)


def test_a_loop_holding_the_output_keeps_fp32_logits_before_4_46() -> None:
    held = _request(FQ + " --keep-outputs")
    old = _request(FQ + " --keep-outputs --transformers-version 4.38.2")
    assert kept_outputs_bytes(held) == 2 * S * B * V
    assert kept_outputs_bytes(old) == 4 * S * B * V == 3_145_728_000  # 2.9 GiB
    # 4.38's LlamaModel also holds its b x 1 x P x P causal mask through backward (tests/test_transformers438_causal_mask.py).
    mask = positions_causal_mask_bytes(old)
    assert mask == 2 * B * 4096 * 4096
    assert peak_terms(old)[1].activations - peak_terms(held)[1].activations == 2 * S * B * V + mask


def test_an_older_release_makes_the_loss_forward_a_moment_and_the_schedule_stays_under_the_peak() -> None:
    request = _request(FQ + " --keep-outputs --transformers-version 4.47")
    forward, backward, slice_backward = framework_logits_tensors(request)
    assert sum(forward) > sum(backward) > sum(slice_backward)
    assert len(framework_logits_tensors(_request(FQ))) == 1
    trace = step_trace(request, *peak_terms(request))
    allocated = memory_breakdown(request)[0].allocated_peak_bytes
    assert 0.9 * allocated <= trace.requested_peak_bytes() <= allocated


def test_before_4_49_the_loss_backward_covers_the_shifted_rows() -> None:
    """The loss runs on b x (s - 1) rows, so its saved log-softmax and both fp32 gradients are of
    those rows; the slice's backward then makes the zeroed gradient of all b x s rows
    (zeroplan.core.transformers_release.slice_backward_tensors). 4.49 on: all rows, no slice."""
    sbv, shifted = S * B * V, (S - 1) * B * V
    for release in ("4.38.2", "4.48"):
        _, backward, slice_backward = framework_logits_tensors(_request(FQ + f" --transformers-version {release}"))
        assert backward[:3] == (4 * shifted,) * 3 and slice_backward[:2] == (4 * shifted, 4 * sbv)
    moments = framework_logits_tensors(_request(FQ + " --transformers-version 4.49.0"))
    assert len(moments) == 2 and moments[1][:3] == (4 * sbv,) * 3


@pytest.mark.parametrize("release", ["4.48"])
def test_the_shifted_backward_takes_no_segment_beside_the_forwards(release: str) -> None:
    """Llama-3-8B at 8 x 2048: a 4 x b x V fp32 row per batch is 3.9 MiB, past the allocator's
    2 MiB rounding, so backward tensors of all b x s rows (as planned before) did not fit the
    forward's freed b x (s - 1)-row blocks and the replay took new segments for them (58.70 GiB
    reserved for 4.48, 11.8 above the allocated peak). Of the shifted rows, they do: the replay
    reserves less than one loss tensor beyond the allocated peak."""
    flags = (f"llama-3-8b --framework hf --transformers-version {release} --gpus 8 --gpu h100-80gb --micro-batch 8 "
             "--seq-len 2048 --precision bf16-pure --activation-checkpointing full --lora-rank 8 --allocator-conf ")
    request = request_from_args(build_parser().parse_args(["fit", *flags.split(), ""]), StrategyKind.ddp)
    breakdown = memory_breakdown(request)[0]
    loss_tensor = 4 * 8 * 2047 * request.model.vocab_size
    assert breakdown.reserved_peak_bytes - breakdown.allocated_peak_bytes < loss_tensor


def test_the_shifted_backward_is_what_torch_allocates_on_the_cpu() -> None:
    """benchmarks/cuda_autocast_loss_tensors.py runs 4.46-4.48's ForCausalLMLoss ops (upcast,
    shifted .contiguous(), view, cross-entropy) and its backward: nll_loss_backward's and
    _log_softmax_backward_data's gradients of the shifted rows, then the slice's zeroed gradient of
    all rows, then the upcast's bf16 cast; at b 1 (where the slice is contiguous, no copy) as at 2.
    The planned tensors made in backward, in fp32 b x s x V blocks, are the first three."""
    pytest.importorskip("torch")
    from tests.scripts import load_script

    script = load_script(BENCHMARKS / "cuda_autocast_loss_tensors.py")
    for b in (1, 2):
        made = [round(size, 3) for size, _ in script.run("transformers < 4.49, b x s x V", b)["made"]]
        request = _request(FQ.replace("--micro-batch 12 --seq-len 2048", f"--micro-batch {b} --seq-len {script.S}")
                           + " --transformers-version 4.48")
        _, backward, slice_backward = framework_logits_tensors(request)
        block = 4 * b * script.S * request.model.vocab_size
        assert made[:3] == [round(size / block, 3) for size in (*backward[1:3], slice_backward[1])] == [0.984, 0.984, 1.0]
        assert made[3] == 0.5


@pytest.mark.parametrize(("value", "message"), [
    ("four", r"^transformers_version: 'four' is not a release number \(allowed: MAJOR.MINOR\[.PATCH\] from 4.31.0 to 4.56.2\)$"),
    ("4.30", r"^transformers_version: 4.30 is not modelled \(allowed: MAJOR.MINOR\[.PATCH\] from 4.31.0 to 4.56.2\)$"),
    ("4.57", r"^transformers_version: 4.57 is not modelled"),
])
def test_malformed_or_unmodelled_versions_are_refused_in_one_line(value: str, message: str) -> None:
    with pytest.raises(ZeroplanError, match=message):
        _request(FQ + f" --transformers-version {value}")


def test_before_4_46_only_the_llama_family_is_planned() -> None:
    """GPT-2-style models computed their own loss in the compute dtype before 4.46 (not planned):
    refused there, accepted from 4.46 when every model goes through ForCausalLMLoss."""
    gpt2 = "gpt2-xl --framework hf --gpus 1 --gpu a100-80gb --seq-len 1024"
    with pytest.raises(ZeroplanError, match=r"^transformers_version: 4.40 is modelled before 4.46 only for the Llama family"):
        _request(gpt2 + " --transformers-version 4.40")
    assert _request(gpt2 + " --transformers-version 4.47").training.transformers_version == "4.47"


def test_the_option_is_refused_outside_hf() -> None:
    with pytest.raises(ZeroplanError, match="^transformers_version: not offered by torchtune"):
        _request("llama-3.1-8b --framework torchtune --gpus 8 --transformers-version 4.38")


@pytest.mark.parametrize("release", ["4.45.2", "4.48.0"])
def test_the_releases_forward_run_on_the_installed_llama_holds_what_is_planned(release: str) -> None:
    # benchmarks/transformers-release-records: each release's LlamaForCausalLM head and loss run on
    # transformers 4.56.2's Llama (zeroplan.frameworks.transformers_release), beside the installed
    # forward's record at the same shape.
    records = {r.replayed_release: r for r in load_records(BENCHMARKS / "transformers-release-records", KvCacheRecord, "kv-cache record")}
    (installed,) = load_records(BENCHMARKS / "kv-cache-records", KvCacheRecord, "kv-cache record")
    record = records[release]
    assert (record.model, record.batch) == (installed.model, installed.batch)
    b, s = record.batch.micro_batch_size, record.batch.seq_len
    old, new = _request(COOKBOOK + f" --transformers-version {release}"), _request(COOKBOOK)
    for use_cache in (False, True):
        run, base = record.run(use_cache, "checkpoint_wrapper"), installed.run(use_cache, "checkpoint_wrapper")
        # The output object's logits: what a loop that holds it keeps.
        assert run.retained_bytes[1] - run.loss_only_bytes[1] == kept_outputs_bytes(_request(COOKBOOK + f" --keep-outputs --transformers-version {release}"))
        # The forward's peak moves by what the loss's forward holds beyond 4.56.2's, less the
        # int64 labels: 4.56.2 pads them to b x (s + 1), the older loss shifts them to b x (s - 1).
        labels = 8 * b * (s - 1) - 8 * b * (s + 1)
        assert run.forward_peak_bytes[1] - base.forward_peak_bytes[1] == sum(loss_forward_tensors(old)) - sum(loss_forward_tensors(new)) + labels


@pytest.mark.slow
def test_a_fresh_run_of_4_45_on_the_installed_llama_holds_fp32_logits() -> None:
    pytest.importorskip("transformers")
    from zeroplan.frameworks.kv_cache import measure_kv_cache

    flags = COOKBOOK.replace("--micro-batch 4 --seq-len 2048", "--micro-batch 1 --seq-len 256") + " --keep-outputs"
    request = _request(flags + " --transformers-version 4.45.2")
    # Two narrow blocks of Llama-2-7B's kind and its vocabulary: the held logits depend on neither
    # the depth nor the width.
    narrow = request.model.model_copy(update={"num_layers": 2, "hidden_size": 1024, "num_heads": 8, "num_kv_heads": 8,
                                               "ffn_hidden_size": 2752})
    request = request.model_copy(update={"model": narrow})
    record = measure_kv_cache(request.model, request.batch, release="4.45.2", checkpointings=("checkpoint_wrapper",))
    run = record.run(False, "checkpoint_wrapper")
    assert run.retained_bytes[1] - run.loss_only_bytes[1] == kept_outputs_bytes(request) == 4 * 256 * request.model.vocab_size


def _ddp_request(flags: str):
    return request_from_args(build_parser().parse_args(["fit", *flags.split(), ""]), StrategyKind.ddp)


LLAMA3_DDP = ("llama-3-8b --framework hf --transformers-version {release} --gpus 8 --gpu h100-80gb --micro-batch {b} "
              "--seq-len 2048 --precision {precision} --activation-checkpointing full --lora-rank 8 --allocator-conf")


def test_before_4_46_the_loss_runs_tensor_by_tensor_in_the_releases_order() -> None:
    """transformers_release.ordered_loss_tensors: the 16-bit logits, their fp32 upcast, the shifted
    copy and the log-softmax; the copy and the upcast go before backward; its two shifted-sized
    gradients, the slice's b x s one, the 16-bit cast. Its largest sets alive are the moments the
    planner sums, so the trace's requested peak is the planner's allocated peak."""
    from zeroplan.allocator.schedule import record_step, step_inputs
    from zeroplan.core.plan import peak_allocated_bytes
    from zeroplan.core.transformers_release import ordered_loss_tensors

    request = _ddp_request(LLAMA3_DDP.format(release="4.45", b=8, precision="bf16-pure"))
    states, terms = peak_terms(request)
    inputs = step_inputs(request, states, terms)
    full, shifted = 8 * 2048 * request.model.vocab_size, 8 * 2047 * request.model.vocab_size
    made = [size for _, size in inputs.loss_order if size]
    assert made == [2 * full, 4 * full, 4 * shifted, 4 * shifted, 4 * shifted, 4 * shifted, 4 * full, 2 * full]
    alive, most = {}, 0
    for tensor, size in inputs.loss_order:
        if size:
            alive[tensor] = size
        else:
            del alive[tensor]
        most = max(most, sum(alive.values()))
    assert most == max(map(sum, inputs.loss_moments))
    assert record_step(inputs).requested_peak_bytes == peak_allocated_bytes(states, terms, 1)[0]
    # Not from 4.46 (the upcast moved into the loss function), nor on fp32 logits, nor outside hf.
    for release, precision in (("4.46", "bf16-pure"), ("4.45", "fp32")):
        other = _ddp_request(LLAMA3_DDP.format(release=release, b=8, precision=precision))
        assert step_inputs(other, *peak_terms(other)).loss_order == ()
    assert ordered_loss_tensors(request.model, request.training.model_copy(update={"framework": Framework.torchtune}),
                                2048, 8) == ()


def test_the_order_caches_the_16_bit_logits_and_a_second_fp32_segment() -> None:
    """In the release's order the 16-bit logits' freed block serves no later fp32 request, and a
    shifted-sized request takes the fp32 logits' freed block before the slice's b x s-row gradient
    asks for one: the replay reserves more than one loss tensor beyond the allocated peak (the
    moments allocated whole, 4.48's, less: the test above), as DeepSpeed 0.14.2's own run does
    (benchmarks/deepspeed_zero3_fp16_streams.py)."""
    request = _ddp_request(LLAMA3_DDP.format(release="4.45", b=8, precision="bf16-pure"))
    breakdown = memory_breakdown(request)[0]
    loss_tensor = 4 * 8 * 2047 * request.model.vocab_size
    assert loss_tensor < breakdown.reserved_peak_bytes - breakdown.allocated_peak_bytes < 2 * loss_tensor


@pytest.mark.parametrize("b", [1, 2])
def test_the_order_is_what_torch_makes_on_the_cpu(b: int) -> None:
    """benchmarks/cuda_autocast_loss_tensors.py ordered_before_446 runs 4.40's head and loss
    (fp16 lm_head, .float(), the shifted .contiguous(), CrossEntropyLoss, the output object
    dropped with the Trainer's compute_loss) and its backward: every allocation and free of a
    logit-sized tensor, in order, is ordered_loss_tensors' (at b 1 no shifted copy)."""
    pytest.importorskip("torch")
    from tests.scripts import load_script
    from zeroplan.core.transformers_release import ordered_loss_tensors

    script = load_script(BENCHMARKS / "cuda_autocast_loss_tensors.py")
    request = _ddp_request(LLAMA3_DDP.format(release="4.40.0", b=b, precision="fp16-mixed"))
    model = request.model.model_copy(update={"vocab_size": script.V})
    planned = ordered_loss_tensors(model, request.training, script.S, b)
    block = 4 * b * script.S * script.V
    renumbered: dict[int, int] = {}
    steps = []
    for tensor, size in planned:
        number = renumbered.setdefault(tensor, len(renumbered)) if size else renumbered.pop(tensor)
        steps.append((number, round(size / block, 3)))
    measured, numbers = [], {}
    for tensor, size in script.ordered_before_446(b):
        number = numbers.setdefault(tensor, len(numbers)) if size else numbers.pop(tensor)
        measured.append((number, size))
    assert measured == steps
