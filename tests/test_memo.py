"""The planner's caches (zeroplan.core.memo) answer what the uncached functions answer: each
keyed on every field its function reads, so two requests differing in one of them get different
answers from a warm cache, and a read of a field a cache does not key on is answered uncached."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from pydantic._internal._model_construction import make_hash_func

from zeroplan.core.algorithms import collective_cost
from zeroplan.core.communication import (
    _data_parallel_collectives, _scheduled_data_parallel_collectives, collectives, data_parallel_collectives,
)
from zeroplan.core.layout import element_bytes
from zeroplan.core.memo import BatchView, UnkeyedRead, batch_keyed, request_keyed
from zeroplan.core.parallel.activations import MicroBatchBytes, _chunk_bytes, _of_sequences, chunk_request, micro_batch_bytes
from zeroplan.core.parallel.collectives import _model_parallel_collectives, model_parallel_collectives
from zeroplan.core.parallel.expert import moe_block_count
from zeroplan.core.parallel.units import _request_units, rank_parameter_units
from zeroplan.core.plan import (
    _accumulation_free_state_terms, _micro_batch_terms, _one_rank_micro_batch_terms, _recent_peak_terms, _state_terms,
    micro_batch_terms, plan, reference_activations,
)
from zeroplan.core.profiles import framework_strategies
from zeroplan.core.roofline.step import _request_memory_seconds
from zeroplan.core.timing import _batch_free_terms
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import (
    BatchSpec, Framework, MemoryAssumptions, Optimizer, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec,
    TrainingSpec, cluster_from_gpus,
)
from zeroplan.specs.parallel import ParallelSpec
from zeroplan.specs.training import ActivationCheckpointing, Precision, StateConvention


def _request(kind: StrategyKind = StrategyKind.zero3, **batch) -> PlanRequest:
    return PlanRequest(model=get_model("llama-2-7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                       strategy=StrategySpec(kind=kind), batch=BatchSpec(**{"seq_len": 2048, **batch}))


def _warm_then_other(function, request: PlanRequest, other: PlanRequest, *args):
    """function's answer for ``request`` (cached first) and then for ``other``, with the uncached
    function's answers for both."""
    first, second = function(request, *args), function(other, *args)
    return (first, second), (function.uncached(request, *args), function.uncached(other, *args))


def test_a_batch_view_gives_only_its_fields() -> None:
    view = BatchView((("grad_accum_steps", 4),))
    assert view.grad_accum_steps == 4
    with pytest.raises(UnkeyedRead):
        view.seq_len  # noqa: B018
    assert view == BatchView((("grad_accum_steps", 4),)) and view != BatchView((("grad_accum_steps", 2),))
    # Reading it whole (a message that prints it, a comparison with a batch) is a read too.
    for whole in (repr, str, dict, lambda v: f"{v}", lambda v: v == BatchSpec(grad_accum_steps=4)):
        with pytest.raises(UnkeyedRead):
            whole(view)


def test_a_function_that_reads_an_unkeyed_field_is_answered_uncached() -> None:
    @batch_keyed("grad_accum_steps")
    def tokens(request: PlanRequest) -> int:
        return request.batch.seq_len * request.batch.grad_accum_steps

    assert tokens(_request(seq_len=1024)) == 1024 and tokens(_request(seq_len=2048)) == 2048
    assert tokens.fallbacks == 2


def test_a_key_whose_call_read_more_keeps_its_answers_by_the_whole_request() -> None:
    calls = []

    @batch_keyed("grad_accum_steps")
    def tokens(request: PlanRequest) -> int:
        calls.append(request.batch.seq_len)
        return request.batch.seq_len * request.batch.grad_accum_steps

    for seq_len in (1024, 2048, 1024, 2048, 1024):
        assert tokens(_request(seq_len=seq_len)) == seq_len
    # One evaluation per whole request (the first through the view, which raised), each kept.
    assert tokens.fallbacks == 2 and calls == [1024, 2048]
    tokens.cache_clear()
    assert tokens(_request(seq_len=1024)) == 1024 and tokens.fallbacks == 3


def test_hf_zero3_states_with_accumulation_are_kept_across_calls() -> None:
    # DeepSpeed's ZeRO-3 gathers read the checkpointing policy (deepspeed_coordinator.replays_gathers),
    # which the model states' key leaves out: answered on the whole request, then kept.
    request = PlanRequest(model=get_model("llama-2-7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                          strategy=StrategySpec(kind=StrategyKind.zero3), training=TrainingSpec(framework=Framework.hf),
                          batch=BatchSpec(seq_len=2048, grad_accum_steps=4))
    _state_terms.cache_clear()
    before = _state_terms.fallbacks
    first = _state_terms(request)
    fallbacks = _state_terms.fallbacks
    assert fallbacks == before + 1
    assert _state_terms(request) is first and _state_terms.fallbacks == fallbacks
    assert first == _state_terms.uncached(request)


def test_a_training_view_hides_the_fields_left_out_of_the_key() -> None:
    @batch_keyed(training_but=("activation_checkpointing",))
    def policy(request: PlanRequest) -> object:
        return request.training.activation_checkpointing

    @batch_keyed(training_but=("activation_checkpointing",))
    def optimizer(request: PlanRequest) -> object:
        return request.training.optimizer

    full = _request().model_copy(update={"training": TrainingSpec(activation_checkpointing="full")})
    assert policy(_request()) is ActivationCheckpointing.none and policy(full) is ActivationCheckpointing.full
    assert policy.fallbacks == 2
    sgd = _request().model_copy(update={"training": TrainingSpec(optimizer=Optimizer.sgd)})
    assert optimizer(_request()) is Optimizer.adamw and optimizer(sgd) is Optimizer.sgd and optimizer.fallbacks == 0


def test_state_terms_and_data_parallel_collectives_share_across_checkpointing_policies() -> None:
    request = _request(StrategyKind.zero2)
    before = _state_terms.fallbacks
    full = request.model_copy(update={"training": TrainingSpec(activation_checkpointing="full")})
    assert _state_terms(full) is _state_terms(request) and _state_terms.uncached(full) == _state_terms(request)
    assert _state_terms.fallbacks == before
    before = _data_parallel_collectives.fallbacks
    assert _data_parallel_collectives(full) is _data_parallel_collectives(request)
    assert _data_parallel_collectives.uncached(full) == _data_parallel_collectives(request)
    assert _data_parallel_collectives.fallbacks == before


def test_a_request_cache_keys_on_every_spec() -> None:
    @request_keyed()
    def described(request: PlanRequest) -> tuple:
        return request.batch.micro_batch_size, request.strategy.kind, request.training.optimizer

    request = _request()
    assert described(request) == (1, StrategyKind.zero3, Optimizer.adamw)
    assert described(request.with_micro_batch(3))[0] == 3
    assert described(request.with_strategy(StrategySpec(kind=StrategyKind.ddp)))[1] is StrategyKind.ddp
    # A training of the same value but another object (the training is keyed by identity).
    other = request.model_copy(update={"training": TrainingSpec(optimizer=Optimizer.sgd)})
    assert described(other)[2] is Optimizer.sgd


def test_state_terms_key_on_the_accumulation_and_the_strategy() -> None:
    # Unsharded gradients kept across micro-batches are held in backward only when accumulating.
    request = _request().with_strategy(StrategySpec(kind=StrategyKind.zero3, keep_unsharded_grads_on_accum=True))
    cached, uncached = _warm_then_other(_state_terms, request, request.model_copy(
        update={"batch": request.batch.model_copy(update={"grad_accum_steps": 4})}))
    assert cached == uncached and cached[0] != cached[1]
    request = _request(StrategyKind.zero2)
    cached, uncached = _warm_then_other(_state_terms, request, request.with_strategy(StrategySpec(kind=StrategyKind.zero3)))
    assert cached == uncached and cached[0][0] != cached[1][0]
    cached, uncached = _warm_then_other(_state_terms, request, request.model_copy(
        update={"training": TrainingSpec(optimizer=Optimizer.sgd)}))
    assert cached == uncached and cached[0][0] != cached[1][0]


def test_state_terms_share_across_micro_batches_and_sequences() -> None:
    request = _request(StrategyKind.zero2, micro_batch_size=2)
    before = _state_terms.fallbacks
    assert _state_terms(request) == _state_terms(_request(StrategyKind.zero2, micro_batch_size=7, seq_len=4096))
    assert _state_terms.fallbacks == before


def test_the_accumulation_free_state_terms_share_across_accumulations() -> None:
    # ZeRO-2 and FSDP's full sharding at 1 and 4 micro-batches a step: their model states and the
    # buffers no micro-batch leaves to the next are one answer, read without the batch; the
    # state terms at each accumulation differ where the carried gradients do.
    for kind in (StrategyKind.zero2, StrategyKind.fsdp_full_shard):
        request = _request(kind, micro_batch_size=2)
        accumulating = _request(kind, micro_batch_size=2, grad_accum_steps=4)
        before = _accumulation_free_state_terms.fallbacks
        assert _accumulation_free_state_terms(accumulating) is _accumulation_free_state_terms(request)
        assert _accumulation_free_state_terms.uncached(accumulating) == _accumulation_free_state_terms(request)
        assert _accumulation_free_state_terms.fallbacks == before
        for one in (request, accumulating):
            assert _state_terms(one) == _state_terms.uncached(one)


def test_micro_batch_terms_key_on_the_batch() -> None:
    request = _request(micro_batch_size=2)
    for other in (request.with_micro_batch(3), _request(micro_batch_size=2, seq_len=1024)):
        cached, uncached = _warm_then_other(_micro_batch_terms, request, other)
        assert cached == uncached and cached[0] != cached[1]
        assert micro_batch_terms(other) == dict(uncached[1])
    cached, uncached = _warm_then_other(_recent_peak_terms, request, request.with_micro_batch(3))
    assert cached == uncached and cached[0] != cached[1]


def test_the_terms_are_shared_between_allocator_settings() -> None:
    """The model states, buffers and micro-batch terms do not read the allocator setting: a
    request under the flat reserve and under the caching-allocator model (either way round)
    share one answer, the one each computes uncached."""
    caches = (_state_terms, _recent_peak_terms, _micro_batch_terms, _one_rank_micro_batch_terms)
    before = [cache.fallbacks for cache in caches]
    for kind in (StrategyKind.zero3, StrategyKind.fsdp_full_shard, StrategyKind.ddp):
        flat = _request(kind, micro_batch_size=3).with_allocator_conf(None)
        modelled = flat.with_allocator_conf("")
        exact = modelled.model_copy(update={"assumptions": MemoryAssumptions(exact_allocator=True, exact_capacity=True)})
        for cache in caches:
            first = cache(flat)
            assert cache(modelled) is first and cache(exact) is first
            assert cache.uncached(modelled) == cache.uncached(flat) == first
    # A field the terms do read keys them still.
    channels = _request(StrategyKind.zero3).model_copy(update={"assumptions": MemoryAssumptions(nccl_channels=4)})
    assert _recent_peak_terms(channels) == _recent_peak_terms.uncached(channels)
    assert [cache.fallbacks for cache in caches] == before


def test_data_parallel_collectives_key_on_the_accumulation() -> None:
    # ZeRO-3 gathers the parameters again for every micro-batch.
    request = _request(StrategyKind.zero3)
    accumulating = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 4})})
    cached, uncached = _warm_then_other(_data_parallel_collectives, request, accumulating)
    assert cached == uncached and cached[0] != cached[1]
    assert data_parallel_collectives(request) == list(uncached[0])


def test_collective_costs_key_on_the_cluster_and_the_performance_assumptions() -> None:
    # DDP's gradient all-reduce on H100s: NCCL's algorithm and the measured bus bandwidth decide.
    request = _request(StrategyKind.ddp).model_copy(update={"cluster": cluster_from_gpus(get_gpu("h100-80gb"), 8)})
    (collective, *_) = data_parallel_collectives(request)
    for other in (request.model_copy(update={"cluster": cluster_from_gpus(get_gpu("a100-80gb"), 8)}),
                  request.model_copy(update={"performance": PerformanceAssumptions(algorithm="ring")}),
                  request.model_copy(update={"performance": PerformanceAssumptions(bandwidth="nominal")})):
        cached, uncached = _warm_then_other(collective_cost, request, other, collective)
        assert cached == uncached and cached[0].seconds != cached[1].seconds


def test_the_planner_reads_no_batch_field_its_caches_leave_out() -> None:
    """The caches hold for the planner's own requests (none falls back to the uncached
    function): every strategy of three frameworks' stacks, planned."""
    caches = (_state_terms, _accumulation_free_state_terms, _data_parallel_collectives, collective_cost, _chunk_bytes,
              _of_sequences, _recent_peak_terms, _micro_batch_terms, _request_memory_seconds,
              _scheduled_data_parallel_collectives, _batch_free_terms, _one_rank_micro_batch_terms)
    before = [cache.fallbacks for cache in caches]
    for framework in (Framework.zeroplan, Framework.megatron, Framework.torchtitan):
        request = PlanRequest(model=get_model("llama-3.1-8b"), training=TrainingSpec(framework=framework),
                              cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8), strategy=StrategySpec(kind="ddp"),
                              assumptions=MemoryAssumptions(allocator_conf=None))
        for kind in framework_strategies(framework, 8):
            plan(request.with_strategy(StrategySpec(kind=kind)), largest_micro_batch=False)
    # A layout's chunks (tensor, sequence and pipeline parallel).
    layout = _request(StrategyKind.zero1, grad_accum_steps=4).with_parallel(ParallelSpec(tp=2, sequence_parallel=True, pp=2))
    plan(layout, largest_micro_batch=False)
    assert [cache.fallbacks for cache in caches] == before


def test_a_layouts_chunk_activations_key_on_the_sequences_and_serve_every_rank_and_accumulation() -> None:
    request = _request(StrategyKind.zero1, micro_batch_size=2, grad_accum_steps=4).with_parallel(
        ParallelSpec(tp=2, sequence_parallel=True, pp=2))

    def uncached(r: PlanRequest) -> MicroBatchBytes:
        p = r.parallel
        return _chunk_bytes.uncached(chunk_request(r, split_heads=True), reference_activations, p.tp, p.sequence_parallel, p.cp)

    cached = micro_batch_bytes(request, reference_activations)
    assert cached == uncached(request)
    other_rank = request.at_pipeline_rank(1).model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 8})})
    assert micro_batch_bytes(other_rank, reference_activations) is cached and uncached(other_rank) == cached
    for other in (request.with_micro_batch(3), _request(StrategyKind.zero1, micro_batch_size=2, seq_len=1024, grad_accum_steps=4).with_parallel(request.parallel),
                  request.with_parallel(ParallelSpec(tp=4, sequence_parallel=True, pp=2))):
        assert micro_batch_bytes(other, reference_activations) == uncached(other) != cached
    whole = _request(micro_batch_size=2)
    accumulating = whole.model_copy(update={"batch": whole.batch.model_copy(update={"grad_accum_steps": 4})})
    assert _of_sequences(whole, reference_activations) == reference_activations(accumulating)
    assert _of_sequences(whole.with_micro_batch(3), reference_activations) == reference_activations(whole.with_micro_batch(3))


def test_a_spec_copy_is_pydantics() -> None:
    """Frozen.model_copy (the planner's fast copy) gives what pydantic's BaseModel.model_copy gives."""
    request = _request(micro_batch_size=2)
    for update in (None, {"batch": BatchSpec(micro_batch_size=5)}, {"strategy": StrategySpec(kind=StrategyKind.ddp)}):
        ours, theirs = request.model_copy(update=update), BaseModel.model_copy(request, update=update)
        assert ours == theirs and ours.__dict__ == theirs.__dict__ and ours is not request
        assert ours.model_fields_set == theirs.model_fields_set and hash(ours) == hash(theirs)
        assert ours.model_dump() == theirs.model_dump()
    assert request.model_copy(deep=True) == request


def test_model_parallel_collectives_key_on_the_batch_and_the_layout() -> None:
    # Tensor parallelism's activation collectives grow with the micro-batch.
    request = _request(micro_batch_size=2).with_parallel(ParallelSpec(tp=2))
    for other in (request.with_micro_batch(3), _request(micro_batch_size=2).with_parallel(ParallelSpec(tp=4))):
        cached, uncached = _warm_then_other(_model_parallel_collectives, request, other)
        assert cached == uncached and cached[0] != cached[1]
    assert model_parallel_collectives(request) == list(_model_parallel_collectives.uncached(request))


def test_a_spec_keeps_the_hash_pydantic_gives_it_and_a_copy_hashes_afresh() -> None:
    request = _request(micro_batch_size=2)
    assert hash(request) == make_hash_func(PlanRequest)(request)
    for spec in (request.model, request.training, request.cluster, request.cluster.gpu, request.batch):
        assert hash(spec) == make_hash_func(type(spec))(spec)
    changed = request.with_micro_batch(3)
    assert hash(changed) == make_hash_func(PlanRequest)(changed) != hash(request)
    assert hash(changed.batch) == hash(BatchSpec(seq_len=2048, micro_batch_size=3))
    assert hash(request.model_copy()) == hash(request) and request.model_copy() == request


def test_the_last_requests_units_and_their_expert_count_follow_the_request() -> None:
    request = _request()
    split = request.with_parallel(ParallelSpec(tp=2))
    whole = rank_parameter_units(request)
    assert rank_parameter_units(split) != whole and rank_parameter_units(request) is whole
    assert rank_parameter_units(split) == _request_units(split)
    moe = PlanRequest(model=get_model("mixtral-8x7b"), cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8),
                      strategy=StrategySpec(kind=StrategyKind.zero3))
    assert moe_block_count(rank_parameter_units(request)) == 0
    assert moe_block_count(rank_parameter_units(moe)) == moe.model.num_layers


def test_element_bytes_follow_the_convention() -> None:
    assert element_bytes(Precision.bf16_mixed, StateConvention.deepspeed).gradient == 4
    assert element_bytes(Precision.bf16_mixed, StateConvention.zero).gradient == 2


def test_a_strategy_view_keys_on_its_facts_alone() -> None:
    @batch_keyed(strategy_view=lambda request: (("runs_under_autocast", request.runs_under_autocast),))
    def autocast(request: PlanRequest) -> bool:
        return request.runs_under_autocast

    @batch_keyed(strategy_view=lambda request: (("runs_under_autocast", request.runs_under_autocast),))
    def kind(request: PlanRequest) -> StrategyKind:
        return request.strategy.kind

    assert autocast(_request(StrategyKind.zero3)) is autocast(_request(StrategyKind.zero2)) is False
    assert autocast.fallbacks == 0
    assert kind(_request(StrategyKind.zero3)) is StrategyKind.zero3 and kind(_request(StrategyKind.zero2)) is StrategyKind.zero2
    assert kind.fallbacks == 2


def test_the_reference_models_micro_batch_terms_are_shared_by_strategies_of_one_engine() -> None:
    """The reference model's terms read of the strategy only whether it runs under autocast and
    whether FSDP1's root stays gathered: fit's strategies share them, each the answer it computes
    uncached; FSDP1's gathered root keys them on the whole strategy."""
    before = _micro_batch_terms.fallbacks
    request = _request(micro_batch_size=3).model_copy(update={"training": TrainingSpec(precision=Precision.bf16_mixed,
                                                                                       state_convention=StateConvention.fsdp2)})
    answers = {}
    for kind in framework_strategies(Framework.zeroplan, 8):
        strategy_request = request.with_strategy(StrategySpec(kind=kind))
        answer = _micro_batch_terms(strategy_request)
        assert answer == _micro_batch_terms.uncached(strategy_request)
        answers.setdefault(strategy_request.runs_under_autocast, answer)
        assert answers[strategy_request.runs_under_autocast] is answer
    assert set(answers) == {False, True} and answers[False] != answers[True]
    root = request.with_strategy(StrategySpec(kind=StrategyKind.fsdp_full_shard, fsdp1_root_stays_gathered=True))
    assert _micro_batch_terms(root) == _micro_batch_terms.uncached(root) != answers[False]
    assert _micro_batch_terms.fallbacks == before


def test_a_requests_own_memory_passes_share_across_micro_batches_and_key_on_the_accumulation() -> None:
    request = _request(StrategyKind.fsdp_full_shard, micro_batch_size=2)
    before = _request_memory_seconds.fallbacks
    assert _request_memory_seconds(request) is _request_memory_seconds(_request(StrategyKind.fsdp_full_shard, micro_batch_size=5,
                                                                                seq_len=4096))
    accumulating = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 4})})
    cached, uncached = _warm_then_other(_request_memory_seconds, request, accumulating)
    assert cached == uncached and cached[0] != cached[1]
    assert _request_memory_seconds.fallbacks == before


def test_a_steps_batch_free_terms_share_across_micro_batches_and_key_on_the_accumulation() -> None:
    """The step's collectives in their phases and its terms that do not change with the batch's
    shape (collective prices, host copies, the CPU step, the pipeline bubble, the HFU): one
    answer for a strategy's micro-batches and sequences, another with another accumulation."""
    befores = (_scheduled_data_parallel_collectives.fallbacks, _batch_free_terms.fallbacks)
    request = _request(StrategyKind.zero2_offload, micro_batch_size=2)
    other_shape = _request(StrategyKind.zero2_offload, micro_batch_size=5, seq_len=4096)
    assert _scheduled_data_parallel_collectives(request) is _scheduled_data_parallel_collectives(other_shape)
    step_collectives = tuple(collectives(request))
    assert _batch_free_terms(request, step_collectives) is _batch_free_terms(other_shape, step_collectives)
    accumulating = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 4})})
    cached, uncached = _warm_then_other(_scheduled_data_parallel_collectives, request, accumulating)
    assert cached == uncached
    cached, uncached = _warm_then_other(_batch_free_terms, request, accumulating, step_collectives)
    assert cached == uncached and cached[0] != cached[1]
    assert (_scheduled_data_parallel_collectives.fallbacks, _batch_free_terms.fallbacks) == befores


def test_one_ranks_micro_batch_terms_share_across_accumulation_counts_and_key_on_the_sequences() -> None:
    """Without model parallelism the micro-batch terms are the sequences' own: one answer for
    every accumulation count, the whole-batch cache's and the uncached function's; another micro-batch
    or sequence length keys another."""
    before = _one_rank_micro_batch_terms.fallbacks
    for framework in (Framework.zeroplan, Framework.hf, Framework.torchtitan):
        request = _request(micro_batch_size=2).model_copy(update={"training": TrainingSpec(framework=framework)})
        accumulating = request.model_copy(update={"batch": request.batch.model_copy(update={"grad_accum_steps": 4})})
        assert _one_rank_micro_batch_terms(request) is _one_rank_micro_batch_terms(accumulating)
        assert micro_batch_terms(accumulating) == dict(_micro_batch_terms(accumulating)) == dict(_micro_batch_terms.uncached(request))
        for other in (request.with_micro_batch(3), request.model_copy(
                update={"batch": request.batch.model_copy(update={"seq_len": 1024})})):
            cached, uncached = _warm_then_other(_one_rank_micro_batch_terms, request, other)
            assert cached == uncached and cached[0] != cached[1]
    assert _one_rank_micro_batch_terms.fallbacks == before


def test_the_reference_engine_kept_per_training_and_strategy_is_the_requests_own() -> None:
    """reference_engine keeps its answer per (training, strategy): for every strategy, precision
    and state convention (autocast or not, FSDP1's root or not) it is what the request gives."""
    from zeroplan.core.plan import _reference_engine, reference_engine

    base = _request()
    for training in (TrainingSpec(), TrainingSpec(precision=Precision.bf16_mixed, state_convention=StateConvention.fsdp2),
                     TrainingSpec(framework=Framework.hf), TrainingSpec(precision=Precision.bf16_pure)):
        for kind in framework_strategies(Framework.zeroplan, 8):
            for strategy in (StrategySpec(kind=kind), StrategySpec(kind=kind, fsdp1_root_stays_gathered=True)):
                request = base.model_copy(update={"training": training, "strategy": strategy})
                assert reference_engine(request) == _reference_engine(request)
                assert reference_engine(request) == _reference_engine(request)  # kept, the same


def test_peak_terms_of_is_the_records_own_construction() -> None:
    """peak.peak_terms_of builds what PeakTerms(**micro_batch, **states) builds, and refuses what
    it refuses (a field named twice)."""
    from zeroplan.core.peak import PeakTerms, peak_terms_of

    micro = micro_batch_terms(_request(StrategyKind.fsdp_full_shard, micro_batch_size=2))
    states = dict(_state_terms(_request(StrategyKind.fsdp_full_shard))[1])
    built = peak_terms_of(micro, states)
    assert built == PeakTerms(**micro, **states) and hash(built) == hash(PeakTerms(**micro, **states))
    assert repr(built) == repr(PeakTerms(**micro, **states))
    # Fewer fields: PeakTerms' defaults; a field twice: its own TypeError.
    fewer = {name: value for name, value in states.items() if name != "draining_held_buffers"}
    assert peak_terms_of(micro, fewer) == PeakTerms(**micro, **fewer)
    with pytest.raises(TypeError):
        peak_terms_of(micro, {**states, "workspace": 0})


def test_a_specs_kept_values_are_its_values_and_hash_as_them() -> None:
    """The values a cache keeps of a spec less some fields (its training, its assumptions) are
    the plain tuple of them, equal and hashing alike, the same object for the same spec, and a
    view's are read as they are."""
    from zeroplan.core.memo import _kept_values

    names, read = _kept_values("training", ("activation_checkpointing",))
    training = TrainingSpec(optimizer=Optimizer.sgd)
    plain = tuple(getattr(training, name) for name in names)
    kept = read(training)
    assert kept == plain and hash(kept) == hash(plain) and read(training) is kept
    assert read(TrainingSpec(optimizer=Optimizer.sgd)) == kept
    view = BatchView(tuple(zip(names, plain)))
    assert read(view) == plain
