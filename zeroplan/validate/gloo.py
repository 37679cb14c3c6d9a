"""What a measured run on gloo allocates that the same run on GPUs under NCCL does not, so that
`zeroplan validate` compares a CPU record's allocator peak with the planner's peak for the
backend it ran on. The planner itself predicts NCCL runs and never adds these."""

from __future__ import annotations

from zeroplan.core.buffers import last_reduce_scatter_input_bytes
from zeroplan.core.peak import peak_moments
from zeroplan.core.plan import checked_peak_terms
from zeroplan.results import PeakMoment
from zeroplan.specs.request import PlanRequest


# torch 2.13 ProcessGroupGloo::_reduce_scatter_base (what dist.reduce_scatter_tensor and
# reduce_scatter_single call on gloo) clones the whole input (aten::clone), all-reduces the clone
# and copies this rank's chunk out: measured with torch.profiler(profile_memory=True) on 2 gloo
# ranks, one input-sized allocation per call, freed when the call returns. NCCL's reduce-scatter
# reads the input itself. The copy sits beside the planner's last reduction of backward, whose
# input is modelled tensor by tensor (FSDP2's last unit, DeepSpeed ZeRO-3's epilogue).
def reduce_scatter_copy_bytes(request: PlanRequest) -> int:
    """gloo's working copy of the reduce-scatter that ends backward."""
    return last_reduce_scatter_input_bytes(request)


def gloo_allocated_peak_bytes(request: PlanRequest, allocated_peak_bytes: int) -> int:
    """The planner's allocated peak (``allocated_peak_bytes``, from its breakdown) for a run on
    gloo: the end of backward with gloo's copy, where that moment then is the largest."""
    copy = reduce_scatter_copy_bytes(request)
    if not copy:
        return allocated_peak_bytes
    states, terms = checked_peak_terms(request)
    backward_end = peak_moments(states, terms, request.batch.grad_accum_steps)[PeakMoment.backward_end].total
    return max(allocated_peak_bytes, backward_end + copy)
