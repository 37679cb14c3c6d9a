"""Plain-text table of a FitReport (no pandas, so the CLI stays fast)."""

from __future__ import annotations

from zeroplan.core.deepspeed_coordinator import holds_recomputed_frozen
from zeroplan.core.params import active_parameters, total_parameters
from zeroplan.answers import FitReport
from zeroplan.core.margin import SPLIT_SEGMENT_NOTE, error_band
from zeroplan.report.fits_cell import fits_cell, fits_cell_notes
from zeroplan.results import StrategyPlan
from zeroplan.specs.finetune import Quantization, lora_adapters
from zeroplan.specs.framework import LAUNCH_ENVIRONMENT, Framework
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.model import ModelSpec
from zeroplan.specs.recipe_defaults import planned_recipe_config, planned_recipe_settings
from zeroplan.specs.training import AttentionKernel
from zeroplan.units import ByteUnit, to_unit

# (name, MemoryBreakdown field or None, value): a field's cell is in ( ) when it is not alive
# at the plan's peak moment, so the cells without ( ) add up to the peak.
_COLUMNS = (
    ("params", "parameter_bytes", lambda p: p.memory.parameter_bytes),
    ("grads", "gradient_bytes", lambda p: p.memory.gradient_bytes),
    ("optim", "optimizer_state_bytes", lambda p: p.memory.optimizer_state_bytes),
    ("activ", "activation_bytes", lambda p: p.memory.activation_bytes),
    ("logits", "logits_bytes", lambda p: p.memory.logits_bytes),
    ("buffers", "peak_buffer_bytes", lambda p: p.memory.peak_buffer_bytes),
    ("step-tmp", "step_temporary_bytes", lambda p: p.memory.step_temporary_bytes),
    ("reserve", "allocator_reserve_bytes", lambda p: p.memory.allocator_reserve_bytes),
    ("peak", None, lambda p: p.memory.peak_bytes),
    ("headroom", None, lambda p: p.headroom_bytes),
)


def _row(plan: StrategyPlan, unit: ByteUnit) -> list[str]:
    cells = [plan.strategy.value, plan.memory.peak_moment.value]
    alive = plan.memory.peak_terms()
    for _, field, get in _COLUMNS:
        # A field alive at the peak shows what of it is alive then (peak_terms), so the cells add up.
        cell = f"{to_unit(alive[field] if field in alive else get(plan), unit):.1f}"
        cells.append(cell if field is None or field in alive else f"({cell})")
    cells.append(fits_cell(plan))
    cells.append(str(plan.max_micro_batch_size))
    cells.append(f"{to_unit(plan.host_bytes_per_node, unit):.0f}" if plan.host_bytes_per_node else "-")
    cells.append(f"{plan.sent_bytes_per_step / 1e9:.1f}")
    return cells


# docs/validation.md, "The caching allocator": the planner's schedule against the frameworks' own
# steps on fake tensors (benchmarks/framework_allocator_accuracy.py), OOM capacity, default
# allocator and expandable segments.
_SCHEDULE_CHECKS = {
    StrategyKind.fsdp_full_shard: "fsdp-full-shard: -7.0 % to +7.6 % and -2.2 % to -0.5 %",
    StrategyKind.fsdp_shard_grad_op: "fsdp-shard-grad-op: -3.2 % to +0.9 % and -1.9 % to +5.3 %",
}


# docs/validation.md, "The caching allocator", "On a GPU": the H200 records
# (benchmarks/gpu-allocator-records/records) are the harness's DDP and its reference ZeRO-1/2/3
# (zeroplan's own engine, not DeepSpeed's); no other strategy ran there.
_H200_CHECKED = (StrategyKind.ddp, StrategyKind.zero1, StrategyKind.zero2, StrategyKind.zero3)


def _schedule_checks(report: FitReport) -> str:
    """What the planner's schedule was measured against, per strategy shown: the frameworks'
    steps on fake tensors, the H200 harness runs, or nothing (under a pipeline, nothing)."""
    kinds = {StrategyKind.fsdp_full_shard if p.strategy is StrategyKind.hsdp else p.strategy for p in report.plans}
    pipeline = any(p.parallel.pp > 1 for p in report.plans)
    checked = [] if pipeline else [text for kind, text in _SCHEDULE_CHECKS.items() if kind in kinds]
    rest = sorted(k.value for k in kinds if k not in _SCHEDULE_CHECKS)
    on_h200 = ", ".join(k for k in rest if StrategyKind(k) in _H200_CHECKED)
    never = ", ".join(k for k in rest if StrategyKind(k) not in _H200_CHECKED)
    parts = ["its OOM capacity (--exact-capacity) against the frameworks' own steps (default allocator, then expandable "
             "segments) " + "; ".join(checked)] if checked else []
    if pipeline:
        parts.append("under a pipeline: a coarser schedule, not yet checked against a measured step")
        return "; ".join(parts)
    if on_h200:
        parts.append(f"{on_h200}: a coarser schedule, checked only on the H200 harness runs (OOM capacity within 2.4 %; "
                     "reserved peak -13.9 % to +13.5 % under the default allocator, -2.4 % to -1.0 % under expandable segments)")
    if never:
        parts.append(f"{never}: a coarser schedule, not checked against any measured step")
    return "; ".join(parts)


def _allocator_cells(plan: StrategyPlan, unit: ByteUnit) -> list[str]:
    """Allocated peak, reserved peak and OOM capacity (the caching-allocator model's columns)."""
    memory = plan.memory
    values = (memory.allocated_peak_bytes, memory.reserved_peak_bytes, memory.oom_capacity_bytes)
    return [f"{to_unit(v, unit):.1f}" if v is not None else "-" for v in values]


def parameter_count_caution(model: ModelSpec) -> list[str]:
    """A one-line caution when the model's parameter count may not be exact, else nothing."""
    if model.parameter_count_exact:
        return []
    return [f"Caution: the parameter count may not be exact ({model.parameter_count_caveat})."]


def left_out_lines(report: FitReport) -> list[str]:
    """One line naming the default strategies that cannot apply to this request, and why."""
    return [f"Left out: {'; '.join(report.left_out)}."] if report.left_out else []


def framework_layout_caution(report: FitReport) -> list[str]:
    """A one-line caution when HF's terms, measured on transformers' Llama, plan another layout."""
    from zeroplan.core.profiles import torchtune_builds

    if report.training.framework is not Framework.hf or report.model.is_moe:
        return []
    if report.model.is_encoder_decoder:
        return [f"Caution: {report.model.name} is an encoder-decoder: its activation terms were measured on transformers' "
                "own T5 (docs/memory-model.md, \"Encoder-decoders\"); seq is the source length, --target-len the target's."]
    reason = torchtune_builds(report.model)
    if reason is None:
        return []
    return [f"Caution: hf's activation terms were measured on transformers' Llama (docs/frameworks.md); "
            f"{report.model.name} has {reason}, planned with them unmeasured."]


# accelerate 1.10.1 utils/dataclasses.py FullyShardedDataParallelPlugin: fsdp_version defaults
# to 1 (FSDP_VERSION unset), which Accelerator.prepare_model wraps in FullyShardedDataParallel;
# fsdp_version 2 is _prepare_fsdp2's fully_shard. hf is planned under the one the request names.
def fsdp_version_lines(report: FitReport) -> list[str]:
    """Under hf with an FSDP strategy planned: which of accelerate's FSDP versions it was."""
    if report.training.framework is not Framework.hf or not any(p.strategy.is_fsdp for p in report.plans):
        return []
    if report.fsdp_version == 1:
        return ["FSDP: accelerate's fsdp_version 1 (FullyShardedDataParallel, accelerate's default), as "
                "--fsdp-version 1 asks (docs/frameworks.md, \"Under FSDP\")."]
    return ["FSDP: accelerate's fsdp_version 2 (fully_shard); accelerate's own default is fsdp_version 1, "
            "planned with --fsdp-version 1 (docs/frameworks.md, \"Under FSDP\")."]


def moe_lines(report: FitReport) -> list[str]:
    """For a mixture of experts: its experts and the parameters a token passes through."""
    model = report.model
    if not model.is_moe:
        return []
    dense = model.num_layers - model.moe_layer_count
    shared = f", a shared expert {model.shared_expert_ffn_hidden_size} wide" if model.shared_expert_ffn_hidden_size else ""
    routing = ("dropless" if model.moe_capacity_factor is None else f"capacity factor {model.moe_capacity_factor:g}")
    return [f"Mixture of experts: {model.num_experts} experts ({model.experts_per_token} per token, {routing}{shared}) "
            f"in {model.moe_layer_count} of {model.num_layers} blocks{f' ({dense} dense)' if dense else ''}; "
            f"{active_parameters(model):,} parameters active per token (FLOPs count these)"]


def expert_parallel_line(report: FitReport, dp: int) -> str:
    parallel = report.plans[0].parallel
    region = dp * parallel.cp * parallel.tp
    return (f"Expert parallel: ep {parallel.ep}, {report.model.num_experts // parallel.ep} experts per rank in each MoE "
            f"block, sharded over efsdp = {region // parallel.ep} ranks (the rest over {dp * parallel.cp}); tokens "
            f"all-to-all to their experts' rank and back in every MoE block, forward and backward")


def attention_name(training) -> str:
    """The attention the framework's code runs: torchtitan 0.3.0's Llama-3 runs FlexAttention
    (models/common/attention.py; it saves what a fused kernel saves, plus per-head statistics)."""
    if training.framework is Framework.torchtitan and training.attention_kernel is AttentionKernel.flash:
        return "FlexAttention"
    return f"{training.attention_kernel.value} attention"


def usable_text(report: FitReport, unit: ByteUnit) -> str:
    """The usable memory per GPU in words: one figure, or the range over the plans where their
    NCCL communicators differ (HSDP's replica group, DDP's NVLS buffers)."""
    values = sorted({p.usable_memory_bytes for p in report.plans}) or [report.cluster.usable_memory_bytes]
    low, high = to_unit(values[0], unit), to_unit(values[-1], unit)
    if f"{low:.1f}" == f"{high:.1f}":
        return f"{high:.1f} {unit.value} usable per GPU"
    return f"{low:.1f}-{high:.1f} {unit.value} usable per GPU (by strategy)"


def parallel_lines(report: FitReport) -> list[str]:
    """The model-parallel layout in one line, and a caution when a pipeline gets fewer
    micro-batches than it has ranks (nothing without model parallelism)."""
    parallel = report.plans[0].parallel if report.plans else None
    if parallel is None or (parallel.is_trivial and parallel.ep == 1):
        return []
    dp = report.cluster.world_size // parallel.model_parallel_size
    if parallel.is_trivial:
        return [expert_parallel_line(report, dp)]
    if parallel.device_map is not None:
        return [f"Device map: from_pretrained(device_map={parallel.device_map.value!r}) over {parallel.pp} GPUs of one "
                f"process, the layers split by accelerate's rule, one micro-batch at a time through them "
                f"({report.batch.grad_accum_steps} per step, no data parallelism); figures are the GPU nearest to "
                "running out"]
    parts = [f"tp {parallel.tp}" + (" + sequence parallel" if parallel.sequence_parallel else ""), f"cp {parallel.cp}"]
    if parallel.pp > 1:
        parts.append(f"pp {parallel.pp} ({parallel.pp_schedule.value}, {parallel.virtual_stages} stage(s) per rank, "
                     f"{report.batch.grad_accum_steps} micro-batch(es) per step)")
    lines = [f"Model parallel: {', '.join(parts)} x dp {dp}; the data-parallel strategy runs over dp x cp = "
             f"{dp * parallel.cp} ranks" + ("; memory figures and bytes sent are the pipeline rank's nearest to running out, times the slowest rank's" if parallel.pp > 1 else "")]
    if parallel.ep > 1:
        lines.append(expert_parallel_line(report, dp))
    m = report.batch.grad_accum_steps
    if parallel.pp > 1 and any(p.strategy.is_fsdp for p in report.plans):
        lines.append("FSDP under a pipeline: each stage keeps its units gathered and its gradients unsharded until the "
                     "step's one reduce-scatter (torch's pipelining); torchtitan's default under a pipeline is "
                     "fsdp-shard-grad-op (fsdp_reshard_after_forward 'default').")
    if parallel.pp > 1 and m < parallel.pp:
        lines.append(f"Caution: {m} micro-batch(es) per step through {parallel.pp} pipeline ranks: most of each rank's "
                     f"step is bubble; --grad-accum sets the micro-batches per step (at least {parallel.pp}).")
    return lines


def finetune_lines(report: FitReport) -> list[str]:
    """What trains under a fine-tune, and how the frozen base is stored (nothing for a full one)."""
    from zeroplan.core.finetune.units import trainable_parameters
    from zeroplan.core.params import parameter_units

    t = report.training
    finetune = t.finetune
    if finetune.trains_everything:
        return []
    total = total_parameters(report.model)
    trainable = trainable_parameters(parameter_units(report.model), finetune, t.framework, report.model)
    if finetune.modules_to_save:
        from zeroplan.core.finetune.modules_to_save import saved_tensors_of

        trainable += sum(x.numel for x in saved_tensors_of(report.model, finetune.modules_to_save))
    share = f"{trainable:,} trainable ({100 * trainable / total:.2f} % of the base)"
    if not finetune.is_lora:
        frozen = ([f"the first {finetune.frozen_blocks} block(s)"] if finetune.frozen_blocks else []) + (
            ["the embeddings"] if finetune.freeze_embeddings else [])
        return [f"Full fine-tune with {' and '.join(frozen)} frozen: {share}."]
    # A fused module's adapter (zeroplan.specs.finetune.fused_modules) shows as its projections joined by +.
    targets = ",".join("+".join(p.value for p in module) for module in lora_adapters(finetune, report.model, t.framework))
    loaded = finetune.base_dtype.value
    if finetune.quantize.is_quantized:
        # peft's prepare_model_for_kbit_training (hf's QLoRA recipe) casts the rest to fp32.
        rest = ("in fp32 (prepare_model_for_kbit_training)" if finetune.hf_casts_rest_to_fp32(t.framework)
                else f"as loaded, in {loaded}")
        if finetune.quantize is Quantization.nf4:
            layout = f"blocks of {finetune.quant_block_size}{', double-quantized scales' if finetune.double_quant else ''}"
            if finetune.bnb_4bit_keeps_input:
                # zeroplan.core.finetune.activations.bnb_4bit_keeps_input (MatMul4Bit before 0.43.2).
                layout += f"; bitsandbytes {finetune.bitsandbytes_version}: each keeps its input for backward"
                if t.checkpoint_reentrant is False and t.activation_checkpointing.value == "full":
                    # zeroplan.core.finetune.activations.checkpoint_escaping_inputs_bytes.
                    layout += ", in every block under the non-reentrant checkpoint"
        elif finetune.quantize is Quantization.gptq_int4:
            # zeroplan.core.finetune.storage.gptq_layout, activations.gptq_saved_weight_bytes.
            layout = (f"auto-gptq QuantLinear: 4-bit codes packed in int32, an fp16 scale and a 4-bit zero point "
                      f"per {finetune.gptq_group_size} input rows; each keeps its dequantized fp16 weight for backward")
            # DeepSpeed's fp16 engine casts the module (GPTQ_STRATEGIES); peft casts nothing of a GPTQ model.
            rest = "in fp16 (DeepSpeed's fp16 engine)"
        else:
            layout = "LLM.int8: an fp32 scale per output row; each keeps its input for backward"
        base = f"base linears frozen in {finetune.quantize.value} ({layout}), the rest frozen {rest}"
    else:
        base = f"base frozen as loaded, in {loaded}"
        if t.framework.value == "hf":
            base += (" (DeepSpeed holds it in bf16, accelerate's FSDP2 in fp32, whatever it was loaded in)"
                     if report.fsdp_version == 2 else " (accelerate's FSDP1 keeps it so: it upcasts only trainable "
                     "flat parameters; DeepSpeed holds it in bf16)")
    dropout = f", dropout {finetune.lora_dropout:g}" if finetune.lora_dropout else ""
    kind = ("DoRA (magnitudes included)" if finetune.dora
            else "VeRA (lambda_b and lambda_d; vera_A and vera_B frozen, shared)" if finetune.vera
            else "LoRA-FA (lora_A frozen)" if finetune.lora_fa else "LoRA")
    lines = [f"{kind} rank {finetune.lora_rank} on {targets}{dropout}: {share}; {base}."]
    if t.framework.value == "hf" and not finetune.quantize.is_quantized:
        # zeroplan.core.finetune.adapter_dtype: the adapters' dtype by peft release.
        from zeroplan.core.finetune.adapter_dtype import training_adapter_element_bytes

        dtype = "fp32" if training_adapter_element_bytes(t) == 4 else loaded
        lines.append(f"peft {finetune.peft_version} leaves the adapters in {dtype} (--peft-version: fp32 before 0.7.0 and "
                     "from 0.12.0, the base's dtype between); under plain DDP their gradients and optimizer states "
                     "are in it too, DeepSpeed and FSDP cast them for compute.")
    if finetune.modules_to_save:
        from zeroplan.core.finetune.modules_to_save import copy_element_bytes_of, saved_tensors_of

        copied = sum(t.numel for t in saved_tensors_of(report.model, finetune.modules_to_save))
        dtype = "fp32" if copy_element_bytes_of(t) == 4 else "bf16"
        names = ",".join(m.value for m in finetune.modules_to_save)
        lines.append(f"PEFT modules_to_save {names}: a trainable copy beside each frozen original, {copied:,} elements "
                     f"in {dtype}, with gradients and {t.optimizer.value} states in {dtype} (in params, grads, optim).")
    if holds_recomputed_frozen(t) and any(p.strategy.zero_stage == 3 and not p.strategy.is_fsdp for p in report.plans):
        lines.append("DeepSpeed ZeRO-3 from 0.19.3 (the release planned): under transformers' reentrant checkpoint each "
                     "recomputed block's frozen weights stay gathered to the end of the backward (--no-checkpoint-reentrant "
                     "for use_reentrant=False; --deepspeed-release 0.13.3 for a release before).")
    return lines


def nvme_lines(report: FitReport, unit: ByteUnit) -> list[str]:
    """Under the NVMe strategies (zero3-nvme, zero3-param-nvme), each one's trade-off per GPU: GPU
    peak, pinned host RAM, NVMe bytes and the step time with its NVMe part (docs/memory-model.md,
    "ZeRO-Infinity on NVMe"); nothing otherwise."""
    shown = [p for p in report.plans if p.strategy.optimizer_on_nvme or p.strategy.offloads_optimizer]
    if not any(p.strategy.optimizer_on_nvme for p in report.plans):
        return []
    lines = [f"Offload trade-off per GPU (NVMe read/write {report.cluster.host.nvme_read_bytes_per_s / 1e9:.1f}/"
             f"{report.cluster.host.nvme_write_bytes_per_s / 1e9:.1f} GB/s per node, --nvme-bandwidth):"]
    for p in shown:
        t = p.time
        lines.append(f"  {p.strategy.value}: GPU peak {to_unit(p.memory.peak_bytes, unit):.1f} {unit.value}, host RAM "
                     f"{to_unit(p.host_bytes_per_rank, unit):.1f} {unit.value}, NVMe {p.nvme_bytes_per_rank / 1e9:.0f} GB; step "
                     f"{t.step_with_overlap_s:.1f} s (compute {t.compute_s:.1f} s, PCIe {t.host_transfer_s:.1f} s, "
                     f"NVMe {t.nvme_transfer_s:.1f} s, CPU step {t.cpu_optimizer_s:.1f} s, exposed {t.exposed_communication_s:.1f} s)")
    return lines


def paged_optimizer_lines(report: FitReport, unit: ByteUnit) -> list[str]:
    """Where a paged optimizer's states are, which the table's columns leave out."""
    if not report.training.paged_optimizer:
        return []
    largest = max((p.memory.paged_optimizer_bytes for p in report.plans), default=0)
    return [f"paged optimizer (bitsandbytes): up to {to_unit(largest, unit):.1f} {unit.value} of optimizer states per GPU in "
            "CUDA managed memory, outside the allocator and the table; the driver pages them to host RAM when the GPU is full."]


def allocator_lines(report: FitReport) -> list[str]:
    """The allocator setting the verdict is judged under, where it is not PyTorch's default or
    where PyTorch's default is a multi-node launcher's choice over its single-node one's."""
    if not report.allocator_conf:
        if report.allocator_conf_is_launch_default and report.allocator_conf is not None:
            return [f"allocator: PyTorch's defaults ({report.training.framework.value}'s multi-node launch default; "
                    "--allocator-conf expandable_segments:True for its single-node one)"]
        return []
    origin = (f"{report.training.framework.value}'s launch default; --allocator-conf \"\" for PyTorch's defaults"
              if report.allocator_conf_is_launch_default else "--allocator-conf")
    return [f"allocator: PYTORCH_CUDA_ALLOC_CONF={report.allocator_conf} ({origin})"]


def launch_lines(report: FitReport) -> list[str]:
    """The environment the framework's own launch scripts set (LAUNCH_ENVIRONMENT), where any."""
    launch = LAUNCH_ENVIRONMENT.get(report.training.framework)
    if launch is None:
        return []
    return [f"launch: {launch} ({report.training.framework.value}'s launch scripts; no allocator setting)"]


def host_extra(report: FitReport) -> str:
    """The legend's words for the host column's checkpointed block inputs, where DeepSpeed's
    cpu_checkpointing keeps them there (zeroplan.core.deepspeed_checkpointing), and for the
    whole models the ranks hold at load where that is the larger (zeroplan.core.model_load)."""
    words = "and host-kept checkpoints " if report.training.cpu_checkpointing else ""
    if any(p.load_sets_host_peak for p in report.plans):
        words += "or, where more, the whole model each rank holds at load "
    return words


def checkpointing_words(report: FitReport) -> str:
    """The activation checkpointing planned, and whose default it is where it is the framework's
    own configuration's for the model, with the launch settings planned at that configuration's
    values (compile, float8, async tensor parallelism, optimizer in backward:
    zeroplan.specs.recipe_defaults)."""
    training = report.training
    framework = training.framework.value
    words = f"activation checkpointing {training.activation_checkpointing.value}"
    config = planned_recipe_config(report.model.name, training, report.cluster.world_size)
    parallel = report.plans[0].parallel if report.plans else None
    launch, settings = planned_recipe_settings(report.model.name, training, parallel, report.cluster.world_size)
    if config is not None and settings:
        return f"{words} ({framework}'s {config} config, as are its {', '.join(settings)})"
    if config is not None:
        return f"{words} ({framework}'s {config} config)"
    if settings:
        return f"{words} ({', '.join(settings)}: {framework}'s {launch} config)"
    return words


def render_table(report: FitReport, unit: ByteUnit = ByteUnit.GiB) -> str:
    c = report.cluster
    t, b = report.training, report.batch
    header_lines = [
        f"{report.model.name}: {total_parameters(report.model):,} parameters on "
        f"{c.world_size} x {c.gpu.display_name} ({c.num_nodes} node(s) x {c.gpus_per_node}), "
        f"{usable_text(report, unit)}",
        f"{t.precision.value}, {t.optimizer.value}, micro-batch {b.micro_batch_size} x seq {b.seq_len}, "
        f"grad-accum {b.grad_accum_steps}, {checkpointing_words(report)}, "
        f"{attention_name(t)}"
        + ("" if report.model.causal else " (bidirectional: an encoder with a masked-LM head)")
        + (", fused linear cross-entropy (liger)" if t.fused_linear_cross_entropy else "")
        + (", fused cross-entropy (flash-attn)" if t.fused_cross_entropy else "")
        + (", torch's nn.MultiheadAttention" if t.torch_multihead_attention else "")
        + (", torch's own F.linear under DeepSpeed's ZeRO-3" if t.deepspeed_torch_linear else "")
        + (", DeepSpeed's bf16 master weights under torch_autocast" if t.deepspeed_bf16_autocast else "")
        + (", unchunked loss" if t.unchunked_loss else "")
        + (f", torchtitan {t.torchtitan_release}" if t.torchtitan_release else "")
        + (f", deepspeed {t.deepspeed_release}" if t.deepspeed_release else "")
        + (", KV cache kept (use_cache)" if t.use_cache else "")
        + (", outputs held through backward" if t.keep_outputs else "")
        + (f", transformers {t.transformers_version}" if t.transformers_version else "")
        + (f", torch {t.torch_release}" if t.torch_release else "")
        + (", optimizer in backward" if t.optimizer_in_backward else "")
        + (", FSDP CPU offload (sharded states in host RAM)" if t.fsdp_cpu_offload else "")
        + (", torch.compile" if t.compile else "")
        + (f", float8 {t.float8.value} (the linears' products at the fp8 peak where the catalog has one"
           + ("; memory as bf16's: TransformerEngine's float8 weight copies not modelled)" if t.float8.value == "te-delayed" else ")")
           if t.float8 else "")
        + (", float8 all-gather" if t.float8_all_gather else "") + (", output projection in bf16" if t.float8_skips_output else ""),
        *allocator_lines(report),
        *launch_lines(report),
        *paged_optimizer_lines(report, unit),
        *nvme_lines(report, unit),
        *finetune_lines(report),
        *moe_lines(report),
        *parallel_lines(report),
        f"Per-GPU memory in {unit.value}; host = offloaded states {host_extra(report)}per node ({unit.value}); "
        f"sent = GB each GPU sends per step (ring).",
        "",
    ]
    names = ["strategy", "peak at", *(name for name, _, _ in _COLUMNS), "fits", "max-mb", "host", "sent"]
    rows = [_row(p, unit) for p in report.plans]
    allocator = any(p.memory.allocator_modelled for p in report.plans)
    if allocator:
        names += ["alloc", "reserved", "oom-at"]
        rows = [row + _allocator_cells(p, unit) for row, p in zip(rows, report.plans)]
    widths = [max(len(names[i]), *(len(r[i]) for r in rows)) for i in range(len(names))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(cell.rjust(w) for cell, w in zip(cells[1:], widths[1:]))])

    body = [line(names), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    notes = [
        "",
        "peak at = the moment of the step that sets the peak; its columns add up to peak (to rounding);",
        "( ) = not alive at that moment: gradients fill in as activations free (docs/memory-model.md, \"Peak\").",
    ]
    if allocator:
        notes.append("alloc = allocated peak; reserved = what the caching-allocator model's replay reserves on the usable "
                     "memory, or with no limit where the step runs out (peak = reserved; - = not replayed where alloc alone "
                     "passes the usable memory, peak = alloc); oom-at = the least memory the step completes on, bisected "
                     "with --exact-capacity (docs/memory-model.md, \"The caching allocator\").")
        notes.append(f"caution: the replay follows the planner's own schedule; {_schedule_checks(report)} (docs/validation.md); "
                     "`zeroplan simulate MODEL --framework F --whole-step --allocator-conf CONF` replays the framework's "
                     "own allocations.")
    notes += [f"{p.strategy.value}: peak on {p.peak_rank_reason}." for p in report.plans if p.peak_rank_reason]
    band = error_band(report.batch.varying_lengths is not None)
    if any(p.borderline_by_band(band) for p in report.plans):
        notes.append(f"* = borderline: the middle half of published runs peaked at {100 * band.low:.0f}-{100 * band.high:.0f} % of their "
                     "prediction, and the usable memory lies in that range, or the caching-allocator model's step goes the "
                     "other way on a memory a run with that error stands on as on the usable one (docs/validation.md, "
                     "\"Published peaks\"; docs/memory-model.md, \"The caching allocator\").")
    if any(p.borderline_by_split_segment for p in report.plans):
        notes.append(f"* = borderline: {SPLIT_SEGMENT_NOTE}.")
    notes += fits_cell_notes(report)
    notes += parameter_count_caution(report.model)
    notes += framework_layout_caution(report)
    notes += fsdp_version_lines(report)
    notes += left_out_lines(report)
    notes.append(f"Verdict: {report.verdict}")
    return "\n".join(header_lines + body + notes)
