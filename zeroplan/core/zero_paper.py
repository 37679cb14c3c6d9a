"""The ZeRO paper's closed-form equations, in its own symbols (Rajbhandari et al. 2020).

These are kept verbatim so tests can reproduce the paper's Figure 1; the planner's exact,
padded per-unit version lives in zeroplan/core/model_states.py and reduces to these when
nothing needs padding.
"""

from __future__ import annotations


# ZeRO paper sec. 3.1 and Figure 1: mixed-precision Adam holds 2*Psi (fp16 parameters) +
# 2*Psi (fp16 gradients) + K*Psi (fp32 parameters, momentum, variance: K = 12) bytes.
# Sec. 5.1: P_os divides the K*Psi term by N_d; P_os+g also the gradients; P_os+g+p everything.
def zero_model_state_bytes(psi: int, k: int, n_d: int, stage: int) -> float:
    """Per-device model-state bytes for ZeRO stage 0 (DDP) to 3."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / n_d
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n_d
    if stage == 3:
        return (2 + 2 + k) * psi / n_d
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


# ZeRO paper sec. 7.2.1: an all-reduce (reduce-scatter + all-gather) moves 2*Psi elements per
# rank; P_os and P_os+g keep that volume (sec. 7.2.2); P_os+g+p moves 3*Psi (sec. 7.2.3).
def zero_communication_volume(psi: int, stage: int) -> int:
    """Elements communicated per rank per step, as the paper counts them."""
    if stage in (0, 1, 2):
        return 2 * psi
    if stage == 3:
        return 3 * psi
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
