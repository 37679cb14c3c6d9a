"""``zeroplan measure --engine torch --torchtitan-config FILE``: check that torchtitan command-line
overrides (the torchtitan-overrides.txt of ``zeroplan plan/fit --emit``, or the user's own)
describe the run the harness's torch engines measure, and record which settings the run took.

torchtitan 0.3.0 (config/manager.py ConfigManager: tyro over Trainer.Config) takes
``--section.field value``, booleans as ``--section.field`` / ``--section.no-field``, and the
activation-checkpointing policy as a trailing ``activation_checkpoint:MODE`` subcommand. Its
trainer builds the same parallel step the harness runs on the CPU (torchtitan's
parallelize_llama: fully_shard per block then the root, or replicate; torch's
parallelize_module for TP; torch.distributed.pipelining for PP): the file's settings are the
measure flags', so each is checked against them and refused in one line naming the option
where it contradicts them, or where the CPU run cannot take it (CPU offload: no accelerator to
offload from; compile; context or expert parallelism; selective checkpointing). The launch
options that do not change the measured step (--module/--config, which name the model) are
noted as not applied. No torch, no torchtitan import: the file is read as text."""

from __future__ import annotations

import shlex
from pathlib import Path

from zeroplan.errors import ZeroplanError

FLAG = "--torchtitan-config"

NOT_APPLIED = ("--module", "--config", "--job.config_file", "--job.dump_folder")
"""Options that name the model or where the run writes: the measured model is measure's MODEL."""

DTYPES = {("float32", "float32"): "fp32", ("float32", "bfloat16"): "bf16-mixed"}
"""(training.dtype, training.mixed_precision_param) -> --precision (emit/formats.py torchtitan_overrides)."""


def _refuse(option: str, message: str) -> ZeroplanError:
    return ZeroplanError(FLAG, f"{option}: {message}")


def parse_overrides(text: str) -> dict[str, str | bool]:
    """``--a.b value`` -> {'a.b': 'value'}; ``--a.b`` -> True; ``--a.no-b`` -> {'a.b': False};
    ``activation_checkpoint:MODE`` -> {'activation_checkpoint': MODE}. Lines, or one line."""
    words = shlex.split(text, comments=True)
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("activation_checkpoint:"):
            out["activation_checkpoint"] = word.split(":", 1)[1]
        elif word.startswith("--"):
            key, eq, inline = word[2:].partition("=")
            if eq:
                out[key] = inline
            elif i + 1 < len(words) and not words[i + 1].startswith("--") and ":" not in words[i + 1]:
                out[key] = words[i + 1]
                i += 1
            else:
                section, _, field = key.rpartition(".")
                if field.startswith("no-"):
                    out[f"{section}.{field[3:]}"] = False
                else:
                    out[key] = True
        else:
            raise _refuse(repr(word), "neither an --option nor activation_checkpoint:MODE (allowed: torchtitan's "
                                      "command-line overrides)")
        i += 1
    return out


def read_torchtitan_file(path: str | Path) -> dict[str, str | bool]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ZeroplanError(FLAG, f"cannot read {str(path)!r}: {getattr(error, 'strerror', None) or error}") from None
    try:
        return parse_overrides(text)
    except ValueError as error:  # shlex: an unclosed quote
        raise ZeroplanError(FLAG, f"{str(path)!r} is not a command line: {error}") from None


def _int(options: dict, key: str) -> int:
    value = options[key]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _refuse(f"--{key}", f"{value!r} is not a whole number") from None


def _strategy_of(replicate: int, shard: int, reshard: str) -> str:
    """torchtitan's data-parallel layout as a zeroplan strategy (parallelize_llama: dp_shard > 1
    shards with fully_shard, dp_replicate alone replicates)."""
    if shard > 1 and replicate > 1:
        return "hsdp"
    if shard > 1:
        return "fsdp-shard-grad-op" if reshard == "never" else "fsdp-full-shard"
    return "ddp"


def check_torchtitan_file(options: dict[str, str | bool], *, strategy: str, precision: str, activation_checkpointing: str,
                          micro_batch: int, grad_accum: int, seq_len: int, tp: int, pp: int, sequence_parallel: bool,
                          world_size: int | None) -> list[str]:
    """The record's notes, or a one-line refusal naming the option (see the module docstring)."""
    options = dict(options)
    taken, not_applied = [], []
    replicate = _int(options, "parallelism.data_parallel_replicate_degree") \
        if "parallelism.data_parallel_replicate_degree" in options else 1
    shard = _int(options, "parallelism.data_parallel_shard_degree") \
        if "parallelism.data_parallel_shard_degree" in options else -1
    file_tp = _int(options, "parallelism.tensor_parallel_degree") if "parallelism.tensor_parallel_degree" in options else 1
    file_pp = _int(options, "parallelism.pipeline_parallel_degree") if "parallelism.pipeline_parallel_degree" in options else 1
    if file_tp != tp:
        raise _refuse("--parallelism.tensor_parallel_degree", f"{file_tp} contradicts --tp {tp} (allowed: {tp})")
    if file_pp != pp:
        raise _refuse("--parallelism.pipeline_parallel_degree", f"{file_pp} contradicts --pp {pp} (allowed: {pp})")
    if shard == -1:  # torchtitan's default: every rank not used by the other degrees
        if world_size is None:
            raise _refuse("--parallelism.data_parallel_shard_degree", "-1 needs the run's world size")
        shard = world_size // (replicate * tp * pp)
    if world_size is not None and replicate * shard * tp * pp != world_size:
        raise _refuse("--parallelism.data_parallel_shard_degree",
                      f"replicate {replicate} x shard {shard} x tp {tp} x pp {pp} is not the run's {world_size} ranks")
    reshard = str(options.get("parallelism.fsdp_reshard_after_forward", "default"))
    if reshard not in ("default", "always", "never"):
        raise _refuse("--parallelism.fsdp_reshard_after_forward", f"{reshard!r} (allowed: default, always, never)")
    wanted = _strategy_of(replicate, shard, reshard)
    if wanted != strategy:
        raise _refuse("--parallelism.data_parallel_shard_degree",
                      f"replicate {replicate}, shard {shard}, reshard {reshard} runs {wanted}, not --strategy {strategy} "
                      f"(allowed: --strategy {wanted})")
    taken.append(f"data parallel replicate {replicate} x shard {shard} (reshard_after_forward {reshard}): {wanted}")
    for key in ("parallelism.context_parallel_degree", "parallelism.expert_parallel_degree"):
        if key in options and _int(options, key) != 1:
            raise _refuse(f"--{key}", f"{options[key]}: the harness has no context or expert parallelism (allowed: 1)")
    if "parallelism.enable_sequence_parallel" in options and tp > 1:
        if bool(options["parallelism.enable_sequence_parallel"]) is not sequence_parallel:
            raise _refuse("--parallelism.enable_sequence_parallel", f"{options['parallelism.enable_sequence_parallel']} "
                                                                    f"contradicts --sequence-parallel {sequence_parallel}")
    local = _int(options, "training.local_batch_size") if "training.local_batch_size" in options else micro_batch
    expected_local = micro_batch * grad_accum if pp > 1 else micro_batch
    if local != expected_local:
        raise _refuse("--training.local_batch_size", f"{local} contradicts --micro-batch {micro_batch}"
                                                     f"{f' x --grad-accum {grad_accum} (a pipeline takes them all)' if pp > 1 else ''} "
                                                     f"(allowed: {expected_local})")
    if "training.global_batch_size" in options:
        dp = replicate * shard
        expected = local * dp * (1 if pp > 1 else grad_accum)
        if _int(options, "training.global_batch_size") != expected:
            raise _refuse("--training.global_batch_size", f"{options['training.global_batch_size']} is not local batch "
                                                          f"{local} x {dp} data-parallel ranks x --grad-accum "
                                                          f"{grad_accum} (allowed: {expected})")
    if "training.seq_len" in options and _int(options, "training.seq_len") != seq_len:
        raise _refuse("--training.seq_len", f"{options['training.seq_len']} contradicts --seq-len {seq_len}")
    taken.append(f"local batch {local}, seq_len {seq_len}")
    dtypes = (str(options.get("training.dtype", "float32")), str(options.get("training.mixed_precision_param", "bfloat16")))
    file_precision = DTYPES.get(dtypes)
    if file_precision is None:
        raise _refuse("--training.mixed_precision_param", f"training.dtype {dtypes[0]} with mixed_precision_param "
                                                          f"{dtypes[1]} is no precision the harness measures "
                                                          "(allowed: float32/float32 fp32, float32/bfloat16 bf16-mixed)")
    if file_precision != precision:
        raise _refuse("--training.mixed_precision_param", f"{dtypes[1]} contradicts --precision {precision} "
                                                          f"(allowed: --precision {file_precision})")
    taken.append(f"dtype {dtypes[0]}, mixed_precision_param {dtypes[1]}")
    if options.get("training.enable_cpu_offload") is True:
        raise _refuse("--training.enable_cpu_offload", "offloads parameters from the accelerator to the host; the CPU "
                                                       "run has no accelerator (allowed: --training.no-enable_cpu_offload)")
    if options.get("compile.enable") is True:
        raise _refuse("--compile.enable", "the harness measures the eager step (allowed: --compile.no-enable)")
    if options.get("compile.enable_async_tensor_parallel") is True:
        # torchtitan's async TP is an inductor pass over the compiled step (distributed/compile.py).
        raise _refuse("--compile.enable_async_tensor_parallel", "is a pass of the compiled step; the harness measures the "
                                                                "eager step (allowed: --compile.no-enable_async_tensor_parallel)")
    mode = str(options.get("activation_checkpoint", "none"))
    if mode not in ("none", "full"):
        raise _refuse(f"activation_checkpoint:{mode}", "the harness checkpoints whole blocks or nothing (allowed: none, full)")
    if mode != activation_checkpointing:
        raise _refuse(f"activation_checkpoint:{mode}", f"contradicts --activation-checkpointing {activation_checkpointing} "
                                                       f"(allowed: --activation-checkpointing {mode})")
    taken.append(f"activation_checkpoint:{mode}")
    known = {"parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
             "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
             "parallelism.pipeline_parallel_degree", "parallelism.context_parallel_degree",
             "parallelism.expert_parallel_degree", "parallelism.enable_sequence_parallel", "training.local_batch_size",
             "training.global_batch_size", "training.seq_len", "training.dtype", "training.mixed_precision_param",
             "training.enable_cpu_offload", "compile.enable", "compile.enable_async_tensor_parallel", "activation_checkpoint"}
    pipeline = {"parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
                "parallelism.pipeline_parallel_layers_per_stage"}
    for key in options:
        if key in known or (key in pipeline and pp > 1):
            continue
        if f"--{key}" in NOT_APPLIED:
            not_applied.append(f"--{key}")
        else:
            raise _refuse(f"--{key}", "the harness does not take this option")
    if pp > 1 and "parallelism.pipeline_parallel_microbatch_size" in options:
        if _int(options, "parallelism.pipeline_parallel_microbatch_size") != micro_batch:
            raise _refuse("--parallelism.pipeline_parallel_microbatch_size",
                          f"{options['parallelism.pipeline_parallel_microbatch_size']} contradicts --micro-batch {micro_batch}")
    notes = ["from the torchtitan overrides: " + "; ".join(taken)]
    if not_applied:
        notes.append("not applied to the measured step (the model and output are measure's): " + ", ".join(not_applied))
    return notes
