"""``--explain STRATEGY``: one strategy's terms, each with its value, what it is made of and the
section of docs/memory-model.md (or docs/communication-time.md) that derives it."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.answers import FitReport
from zeroplan.report.summary import DEFAULT_WIDTH, NARROWEST_WIDTH, wrap
from zeroplan.results import StrategyPlan
from zeroplan.specs.framework import Framework
from zeroplan.specs.strategy import StrategyKind
from zeroplan.units import ByteUnit, to_unit

MEMORY_MODEL = "docs/memory-model.md"


def section(number: int, title: str) -> str:
    """A section of docs/memory-model.md, as its heading reads."""
    return f"{MEMORY_MODEL}, '{number}. {title}'"


@dataclass(frozen=True)
class Term:
    name: str
    value: str
    origin: str
    source: str


def _per_parameter(num_bytes: int, report: FitReport, shards: int) -> str:
    """'2.00 B x Psi / 8 ranks': the bytes per parameter the term holds, when the model is not
    split by tensor or pipeline parallelism (then Psi per rank is not the model's)."""
    plan = report.plans[0]
    if not plan.parallel.is_trivial:
        return "its share of the parameters this rank holds (tp/pp split)"
    per = num_bytes * shards / report.num_parameters
    split = f" / {shards} ranks" if shards > 1 else ""
    return f"{per:.2f} B x Psi ({report.num_parameters:,}){split}"


def _state_terms(report: FitReport, plan: StrategyPlan, unit: ByteUnit) -> list[Term]:
    m, kind, n = plan.memory, plan.strategy, plan.shard_group_size
    states = f"{section(2, 'Model states')}, convention {plan.state_convention.value}"
    if report.training.framework is Framework.megatron:
        # megatron-core keeps its own layout (docs/memory-model.md, "Megatron-LM").
        states = f"{section(2, 'Model states')}, 'Megatron-LM' (its gradient buffer and distributed optimizer)"
    if report.training.framework is Framework.megatron_deepspeed:
        # core/megatron_deepspeed.bf16_optimizer_runs: BF16_Optimizer only with an fp32 grad_accum_dtype.
        states = (f"{section(2, 'Model states')}, 'Megatron-DeepSpeed' (DeepSpeed's ZeRO stage-1 optimizer; "
                  "BF16_Optimizer under bf16 with --deepspeed-grad-accum-dtype fp32)")
    parameter_shards = n if kind.zero_stage >= 3 else 1
    gradient_shards = n if kind.zero_stage >= 2 else 1

    def value(num_bytes: int) -> str:
        return f"{to_unit(num_bytes, unit):.2f} {unit.value}"

    gradients = ("offloaded to host RAM with the optimizer step" if kind.offloads_optimizer and not m.gradient_bytes
                 else _per_parameter(m.gradient_bytes, report, gradient_shards))
    optimizer = ("offloaded to host RAM (0 on the GPU)" if kind.offloads_optimizer and not m.optimizer_state_bytes
                 else _per_parameter(m.optimizer_state_bytes, report, n if kind.zero_stage >= 1 else 1))
    if kind.offloads_optimizer and m.optimizer_state_bytes:
        # ZeRO-Offload++'s ratio (zeroplan.core.deepspeed_partial_offload).
        optimizer = ("fp32 master, fp32 gradient and AdamW states of the sub-groups the offload ratio keeps on the "
                     "GPU; the rest offloaded to host RAM")
    parameters = ("offloaded to host RAM" if kind.offloads_parameters and not m.parameter_bytes
                  else _per_parameter(m.parameter_bytes, report, parameter_shards))
    return [
        Term("params", value(m.parameter_bytes), parameters, states),
        Term("grads", value(m.gradient_bytes), gradients + ("" if m.gradients_at_peak else "; not alive at the peak"), states),
        Term("optim", value(m.optimizer_state_bytes), f"{report.training.optimizer.value}: {optimizer}",
             f"{section(2, 'Model states')}, 'Optimizers'"),
    ]


# zeroplan.core.frameworks.positions_causal_mask_bytes: the term the activations carry.
def _positions_mask_words(report: FitReport) -> str:
    """The clause naming transformers 4.38's causal mask where the activations hold it."""
    from zeroplan.core.transformers_release import builds_positions_mask, positions_mask_side
    from zeroplan.specs.training import ActivationCheckpointing

    model, training, batch = report.model, report.training, report.batch
    if not builds_positions_mask(model, training) or training.activation_checkpointing is ActivationCheckpointing.none:
        return ""
    side = positions_mask_side(model, batch.seq_len)
    return (f", with transformers {training.transformers_version}'s {batch.micro_batch_size} x 1 x {side} x {side} causal mask "
            "held through backward (docs/frameworks.md, 'transformers releases')")


def _step_terms(report: FitReport, plan: StrategyPlan, unit: ByteUnit) -> list[Term]:
    m, b, t = plan.memory, report.batch, report.training
    alive = m.peak_terms()

    def value(num_bytes: int, field: str) -> str:
        shown = f"{to_unit(num_bytes, unit):.2f} {unit.value}"
        return shown if field in alive else f"({shown})"

    model = report.model
    reserve = ("what the caching-allocator model's replay reserves beyond the allocated peak" if m.allocator_modelled
               else "a flat share of the allocated peak (--flat-reserve)")
    return [
        Term("activ", value(alive.get("activation_bytes", m.activation_bytes), "activation_bytes"),
             f"saved for backward by {model.num_layers} blocks at micro-batch {b.micro_batch_size} x seq {b.seq_len}, "
             f"checkpointing {t.activation_checkpointing.value}{_positions_mask_words(report)}", section(3, 'Activations')),
        Term("logits", value(m.logits_bytes, "logits_bytes"),
             f"{b.micro_batch_size} x {b.seq_len} x vocab {model.vocab_size} logits and the loss's fp32 copies",
             section(3, 'Activations')),
        Term("buffers", value(m.peak_buffer_bytes, "peak_buffer_bytes"),
             "communication buckets, gathered units and prefetch, backward workspace alive at the peak"
             + ("; with hpZ's secondary parameter partition (1/H of the parameters, docs/memory-model.md, "
                "'ZeRO++ hpZ and MiCS')" if plan.strategy.uses_hpz else ""),
             section(4, 'Temporary and communication buffers')),
        Term("step-tmp", value(m.step_temporary_bytes, "step_temporary_bytes"),
             "the optimizer step's temporaries (after activations are freed)", section(4, 'Temporary and communication buffers')),
        Term("reserve", value(m.allocator_reserve_bytes, "allocator_reserve_bytes"), reserve,
             section(7, 'The caching allocator')),
    ]


def _total_terms(report: FitReport, plan: StrategyPlan, unit: ByteUnit) -> list[Term]:
    m = plan.memory
    u = unit.value
    return [
        Term("peak", f"{to_unit(m.peak_bytes, unit):.2f} {u}",
             f"the terms alive at {m.peak_moment.value} (the others in parentheses), plus the reserve",
             section(5, 'Peak')),
        Term("headroom", f"{to_unit(plan.headroom_bytes, unit):.2f} {u}",
             f"usable {to_unit(plan.usable_memory_bytes, unit):.2f} {u} (capacity less the CUDA context, "
             f"{to_unit(report.cluster.cuda_context_bytes, unit):.2f} {u}, and the NCCL communicators' buffers, "
             f"{to_unit(report.cluster.usable_memory_bytes - plan.usable_memory_bytes, unit):.2f} {u}) - peak",
             section(5, 'Peak')),
        Term("max-mb", str(plan.max_micro_batch_size), "the largest micro-batch whose peak fits the usable memory",
             section(5, 'Peak')),
        Term("sent", f"{plan.sent_bytes_per_step / 1e9:.2f} GB",
             f"what one GPU sends per step under ring collectives; volume "
             f"{plan.communication_volume_elements / report.num_parameters:.1f} Psi",
             section(6, 'Communication')),
        _step_term(plan),
    ]


def _step_term(plan: StrategyPlan) -> Term:
    if plan.time is None:
        # zeroplan.core.timing.step_time refuses an encoder-decoder; its memory is still planned.
        return Term("step", "-", "not modelled for an encoder-decoder (two stacks)", "docs/memory-model.md")
    return Term("step", f"{plan.time.step_with_overlap_s:.3f} s", _step_parts(plan), "docs/communication-time.md")


def _step_parts(plan: StrategyPlan) -> str:
    """The parts that add up to the step with overlap, those that are not zero after compute."""
    t = plan.time
    parts = [("compute", t.compute_s), ("opt-step", t.optimizer_step_s), ("mp-comm", t.model_parallel_communication_s),
             ("bubble", t.pipeline_bubble_s), ("exposed communication", t.exposed_communication_s),
             ("cpu-step", t.cpu_optimizer_s)]
    return " + ".join(f"{name} {seconds:.3f} s" for i, (name, seconds) in enumerate(parts) if i == 0 or seconds)


def render_explain(report: FitReport, strategy: StrategyKind | str, unit: ByteUnit = ByteUnit.GiB,
                   width: int = DEFAULT_WIDTH) -> str:
    """Each term of ``strategy``'s plan: value, origin, source; wrapped at ``width``."""
    width = max(width, NARROWEST_WIDTH)
    plan = report.plan_for(strategy)
    terms = [*_state_terms(report, plan, unit), *_step_terms(report, plan, unit), *_total_terms(report, plan, unit)]
    name_width = max(len(term.name) for term in terms)
    value_width = max(len(term.value) for term in terms)
    lines = wrap(f"{plan.strategy.value} for {report.model.name} on {report.cluster.world_size} x "
                 f"{report.cluster.gpu.display_name}: each term, what it is made of, and where it is derived. "
                 f"Parenthesised values are not alive at the peak moment ({plan.memory.peak_moment.value}).", width)
    lines.append("")
    indent = " " * (name_width + value_width + 4)
    for term in terms:
        head = f"{term.name.ljust(name_width)}  {term.value.rjust(value_width)}  "
        text = wrap(f"{term.origin}; {term.source}", width - len(indent))
        lines += [head + text[0], *(indent + line for line in text[1:])]
    return "\n".join(lines)
