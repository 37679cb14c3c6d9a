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

from zeroplan.core.roofline.step import RooflineStep, roofline_step

__all__ = ["RooflineStep", "roofline_step"]
