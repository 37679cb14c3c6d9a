"""The plan search's pruning (zeroplan.core.search.cannot_fit): the groups its memory bound rules
out change nothing the search answers."""

from __future__ import annotations

import numpy as np
import pytest

from zeroplan.core.search import (
    LayoutSpace, _at, _schedulable, _searched_groups, _splits, evaluate, memory_lower_bound, scalar_evaluate, search,
)
from zeroplan.specs import Framework, PlanRequest

from search_requests import base_request


def _base(model: str, gpus: int, gpu: str = "h100-80gb", seq_len: int = 2048, framework: Framework = Framework.zeroplan,
          host_memory_bytes: int | None = None) -> PlanRequest:
    return base_request(model, gpus, gpu, seq_len, framework, host_memory_bytes)


# (model, GPUs, GPU, seq, framework, host bytes, global batch, layouts): each has groups the bound
# rules out and groups that fit.
REQUESTS = [
    ("llama-2-13b", 8, "h100-80gb", 2048, Framework.zeroplan, None, 64, LayoutSpace(max_tp=4)),
    ("llama-3.1-8b", 16, "a100-40gb", 4096, Framework.torchtitan, None, 64, LayoutSpace(max_tp=2)),
    ("llama-2-7b", 8, "a100-40gb", 2048, Framework.hf, 2**38, 32, None),
    ("llama-2-13b", 8, "a100-40gb", 4096, Framework.torchtune, None, 16, None),
]
IDS = [f"{m}-{g}-{f.value}" for m, g, _, _, f, _, _, _ in REQUESTS]


@pytest.mark.parametrize("model,gpus,gpu,seq,framework,host,batch,space", REQUESTS, ids=IDS)
def test_the_pruned_search_answers_as_the_unpruned_one(model, gpus, gpu, seq, framework, host, batch, space) -> None:
    base = _base(model, gpus, gpu, seq, framework, host)
    pruned = search(base, batch, space=space)
    unpruned = search(base, batch, space=space, prune=False)
    assert pruned.best == unpruned.best
    assert pruned.ranked == unpruned.ranked
    assert pruned.pareto == unpruned.pareto
    assert pruned == unpruned  # the counts and the explanation too
    assert pruned.ranked and len(pruned.pareto) > 1


@pytest.mark.parametrize("model,gpus,gpu,seq,framework,host,batch,space", REQUESTS, ids=IDS)
def test_the_memory_bound_is_below_every_peak_of_its_group(model, gpus, gpu, seq, framework, host, batch, space) -> None:
    base = _base(model, gpus, gpu, seq, framework, host)
    all_groups, _ = _searched_groups(base, batch, None, space)
    all_groups, splits = _schedulable(all_groups, _splits(all_groups, batch), batch)
    ruled_out = 0
    for group, (micro, accum) in zip(all_groups, splits):
        bound = memory_lower_bound(group, accum)
        peak, fits, _ = evaluate(group, micro, accum)
        assert bound is None or bound <= int(peak.min()), group.request.strategy.kind
        # And below the scalar planner's peak (every pipeline rank) at the group's smallest split.
        k = int(np.argmin(peak))
        assert bound is None or bound <= scalar_evaluate(_at(group.request, int(micro[k]), int(accum[k])))[0]
        if bound is not None and bound > group.usable_bytes:
            assert not fits.any()
            ruled_out += 1
    assert 0 < ruled_out < len(all_groups)
