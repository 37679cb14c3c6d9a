"""Step time operation by operation: every kernel of a training step timed as a roofline,
max(FLOPs / achievable matrix rate, bytes / achievable memory bandwidth), with the ceilings
each GPU reaches in published (or this project's own) measurements. docs/communication-time.md,
"Compute, operation by operation", derives each term; the H200 step profiles in
benchmarks/gpu-step-profile-records check them (benchmarks/step_profile_accuracy.py).

ceilings.py   the achievable rates per GPU, each with its source
operations.py the step's operations (matrix products by shape, attention, memory-bound passes)
optimizer.py  the optimizer step's memory traffic
step.py       the times, by phase, as PerformanceAssumptions.compute_model "roofline" uses them
"""

__all__ = ["RooflineStep", "roofline_step"]


def __getattr__(name: str) -> object:
    # The step's modules are imported when first asked for: the planner imports this package
    # for the optimizer's constants (zeroplan.core.timing), and a command under the default
    # compute model ('hfu') never times a kernel.
    if name in __all__:
        from zeroplan.core.roofline import step

        return getattr(step, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
