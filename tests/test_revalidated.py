"""zeroplan.specs.request.revalidated (with_strategy, with_parallel) against PlanRequest's own
validation of the same fields: the same request (every field the same object, the same fields
set) or the same refusal, for requests whose before-validators change nothing, change something,
and whose specs were built without validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, MemoryAssumptions, PlanRequest, StrategySpec, cluster_from_gpus
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.request import revalidated
from zeroplan.specs.strategy import StrategyKind, ZeroGradientReduce
from zeroplan.specs.training import TrainingSpec


def _full(request: PlanRequest, **update) -> PlanRequest:
    return type(request)(**{**dict(request), **update})


def _outcome(build):
    try:
        return build()
    except (ZeroplanError, ValidationError) as error:
        return type(error), str(error)


def _assert_same(request: PlanRequest, **update) -> None:
    fast, full = _outcome(lambda: revalidated(request, **update)), _outcome(lambda: _full(request, **update))
    if isinstance(full, tuple):
        assert fast == full
        return
    assert fast == full and hash(fast) == hash(full)
    assert fast.model_fields_set == full.model_fields_set
    given = {**dict(request), **update}
    for name in PlanRequest.model_fields:
        # The objects given, where validation keeps them (it copies what a before-validator changes).
        assert (getattr(fast, name) is given[name]) == (getattr(full, name) is given[name]), name


def _base(framework: Framework = Framework.zeroplan, **fields) -> PlanRequest:
    return PlanRequest(model=get_model("llama-2-7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                       strategy=StrategySpec(kind="zero3"), training=TrainingSpec(framework=framework), **fields)


@pytest.mark.parametrize("kind", list(StrategyKind))
def test_every_strategy_as_validation_answers(kind: StrategyKind) -> None:
    base = _base()
    _assert_same(base, strategy=base.strategy.model_copy(update={"kind": kind}))


def test_refusals_are_validation_s() -> None:
    base = _base()
    # An HSDP group that does not divide the ranks: _check_groups refuses.
    _assert_same(base, strategy=StrategySpec(kind="hsdp", shard_group_size=3))
    # A strategy built without validation that its own validator refuses.
    _assert_same(base, strategy=base.strategy.model_copy(update={"kind": StrategyKind.zero3,
                                                                  "zero_gradient_reduce": ZeroGradientReduce.per_unit}))
    _assert_same(base, strategy=StrategySpec(kind="zero2", zero_gradient_reduce="per-unit"))
    # A model built without validation whose shapes its validator refuses, met once and again.
    bad_model = base.model.model_copy(update={"num_kv_heads": 7})
    broken = base.model_copy(update={"model": bad_model})
    for _ in range(2):
        _assert_same(broken, strategy=StrategySpec(kind="zero2"))


def test_parallel_layouts() -> None:
    base = _base()
    for parallel in (ParallelSpec(tp=2), ParallelSpec(pp=2), ParallelSpec(tp=3), ParallelSpec(tp=2, sequence_parallel=True)):
        _assert_same(base, parallel=parallel)
    _assert_same(base, parallel=ParallelSpec().model_copy(update={"sequence_parallel": True}))


def test_where_a_before_validator_changes_the_data() -> None:
    # fairseq plans no prefetched unit unless the strategy names one: a strategy without it set
    # is changed by the validation (the full validation answers).
    fairseq = _base(Framework.fairseq)
    _assert_same(fairseq, strategy=StrategySpec(kind="fsdp-full-shard"))
    _assert_same(fairseq, strategy=StrategySpec(kind="fsdp-full-shard", prefetch_units=1))
    # torchtitan's launcher's allocator setting, where the assumptions were copied in unvalidated.
    titan = _base(Framework.torchtitan).model_copy(update={"assumptions": MemoryAssumptions(exact_allocator=True)})
    _assert_same(titan, strategy=StrategySpec(kind="fsdp-full-shard"))
    # A batch whose seq_len was not given, copied in unvalidated.
    unset = _base().model_copy(update={"batch": BatchSpec(micro_batch_size=2)})
    _assert_same(unset, strategy=StrategySpec(kind="zero2"))


def test_the_fast_path_is_taken(monkeypatch) -> None:
    """A request validated once answers a strategy without PlanRequest's whole validation (the
    point of revalidated), and a first sight of a spec validates it."""
    base = _base()
    calls = []
    original = PlanRequest.__init__

    def counting(self, **data):
        calls.append(1)
        original(self, **data)

    monkeypatch.setattr(PlanRequest, "__init__", counting)
    assert base.with_strategy(StrategySpec(kind="zero1")).strategy.kind is StrategyKind.zero1
    assert not calls


def test_kept_copy_is_model_copy_made_once() -> None:
    """kept_copy: model_copy's result (values and fields set), one object for equal specs with
    the same fields set and update, another where the fields set differ (PlanRequest's
    before-validators read them)."""
    from zeroplan.specs.base import kept_copy

    first, second = StrategySpec(kind="zero3"), StrategySpec(kind="zero3")
    copy = kept_copy(first, kind=StrategyKind.zero1)
    made = first.model_copy(update={"kind": StrategyKind.zero1})
    assert copy == made and copy.model_fields_set == made.model_fields_set
    assert kept_copy(second, kind=StrategyKind.zero1) is copy
    assert kept_copy(first, kind=StrategyKind.zero2) is not copy
    unset = StrategySpec.model_validate({"kind": "zero3"}).model_copy()
    object.__setattr__(unset, "__pydantic_fields_set__", set())
    assert unset == first and kept_copy(unset, kind=StrategyKind.zero1) is not copy
    assert kept_copy(unset, kind=StrategyKind.zero1).model_fields_set == {"kind"}


def test_spec_validators_read_values_alone() -> None:
    """What revalidated's table of passed specs rests on: every validator of a request's field
    specs runs after validation, on the spec's values (never on the fields set, which equality
    leaves out)."""
    import inspect

    from zeroplan.specs.request import _FIELD_TYPES

    for field_type in _FIELD_TYPES.values():
        for decorator in field_type.__pydantic_decorators__.model_validators.values():
            assert decorator.info.mode == "after", (field_type.__name__, decorator.cls_var_name)
            assert "fields_set" not in inspect.getsource(decorator.func), (field_type.__name__, decorator.cls_var_name)
        assert not field_type.__pydantic_decorators__.field_validators, field_type.__name__


def test_requests_that_differ_in_the_micro_batch_alone() -> None:
    """_check_groups' outcome is kept per view of what it reads (_groups_view): the micro-batch is
    read only by the gptq-int4 check (seq_len x micro_batch_size of GPTQ_CUDA_KERNEL_TOKENS or
    more), so a request that passed at one micro-batch and one refused at another answer alike."""
    from zeroplan.specs import FineTuneSpec
    from zeroplan.specs.finetune import GPTQ_CUDA_KERNEL_TOKENS

    seq = GPTQ_CUDA_KERNEL_TOKENS // 2
    gptq = PlanRequest(model=get_model("qwen-7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 1),
                       strategy=StrategySpec(kind="zero2"), batch=BatchSpec(seq_len=seq, micro_batch_size=2),
                       training=TrainingSpec(framework="hf", precision="fp16-mixed",
                                             finetune=FineTuneSpec(lora_rank=64, quantize="gptq-int4")))
    for micro in (2, 1, 3, 1):
        _assert_same(gptq.with_micro_batch(micro), strategy=StrategySpec(kind="zero1"))
    assert isinstance(_outcome(lambda: revalidated(gptq.with_micro_batch(1), strategy=StrategySpec(kind="zero1"))), tuple)
    # The sequence length and the accumulation are read: a view that passed does not answer for another.
    base = _base()
    for seq_len, accum in ((4096, 1), (4095, 1), (4097, 1), (4096, 3), (4096, 4)):
        request = base.model_copy(update={"batch": BatchSpec(seq_len=seq_len, grad_accum_steps=accum)})
        for micro in (1, 2):
            _assert_same(request.with_micro_batch(micro), strategy=StrategySpec(kind="zero2"))
            _assert_same(request.with_micro_batch(micro), parallel=ParallelSpec(tp=2, sequence_parallel=True))
            _assert_same(request.with_micro_batch(micro), strategy=StrategySpec(kind="ddp"),
                         parallel=ParallelSpec(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2))
    # megatron's interleaved schedule reads the accumulation (a multiple of pp).
    megatron = _base(Framework.megatron)
    for accum in (2, 3, 2, 3):
        request = megatron.model_copy(update={"batch": BatchSpec(seq_len=4096, grad_accum_steps=accum)})
        for micro in (1, 2):
            _assert_same(request.with_micro_batch(micro), strategy=StrategySpec(kind="zero1"),
                         parallel=ParallelSpec(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2))
