"""``zeroplan measure --engine torch --accelerate-config FILE``: check that an accelerate FSDP2
config (the accelerate.yaml of ``zeroplan plan/fit --emit``, or the user's own) describes the
run the harness's FSDP2 engine measures, and record which of its settings the run took.

The settings the FSDP2 engine has are the measure flags' (zeroplan.harness.torch_engines
Fsdp2Engine): ``fsdp_reshard_after_forward`` is the strategy (true fsdp-full-shard, false
fsdp-shard-grad-op), ``mixed_precision`` the precision, ``fsdp_activation_checkpointing`` the
checkpointing, ``num_processes`` the world size. The file is taken where it agrees with them
and refused in one line naming the key where it contradicts them, or where the harness cannot
run it on the CPU (``fsdp_offload_params`` true: the CPU run has no device to offload from;
fp16; a wrap policy other than one unit per block; HSDP's parallelism_config). ``use_cpu``
false, the launch keys and the checkpoint-format keys do not change the measured step: they are
noted as not applied.

The file is read with the small YAML subset accelerate's config files use (``key: value``
lines, nested mappings by indentation, scalars): no YAML library, no planner formula."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zeroplan.errors import ZeroplanError

FLAG = "--accelerate-config"

LAUNCH_KEYS = ("compute_environment", "num_machines", "machine_rank", "main_training_function", "rdzv_backend",
               "same_network", "use_cpu", "main_process_ip", "main_process_port", "debug", "enable_cpu_affinity",
               "gpu_ids", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "downcast_bf16")
"""Top-level keys about where and how accelerate launches: not a setting of the measured step."""

FSDP_NOT_APPLIED = ("fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
                    "fsdp_use_orig_params", "fsdp_transformer_layer_cls_to_wrap", "fsdp_forward_prefetch",
                    "fsdp_backward_prefetch")
"""fsdp_config keys about checkpoints, loading and wrapping by class name (the harness wraps each
block, the unit TRANSFORMER_BASED_WRAP makes), or FSDP1's prefetch: nothing the FSDP2 step holds."""

PRECISIONS = {"no": "fp32", "bf16": "bf16-mixed"}


def _refuse(key: str, message: str) -> ZeroplanError:
    return ZeroplanError(FLAG, f"{key}: {message}")


def _scalar(text: str, where: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "~", ""):
        return None
    try:
        return json.loads(text)  # numbers and double-quoted strings
    except json.JSONDecodeError:
        pass
    if text[0] in "[{&*!|>'":
        raise ZeroplanError(FLAG, f"{where}: {text!r} is beyond the YAML the harness reads (key: value lines)")
    return text  # a plain string


def parse_yaml_subset(text: str) -> dict[str, Any]:
    """``key: value`` lines with mappings nested by indentation; comments and blank lines skipped."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() or line.strip() == "---":
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, sep, value = line.strip().partition(":")
        if not sep or line.lstrip().startswith("- "):
            raise ZeroplanError(FLAG, f"line {number}: {line.strip()!r} is beyond the YAML the harness reads "
                                      "(key: value lines)")
        while indent <= stack[-1][0]:
            stack.pop()
        parent = stack[-1][1]
        value = value.strip()
        if value:
            parent[key] = _scalar(value, f"line {number}")
        else:
            parent[key] = {}
            stack.append((indent, parent[key]))
    return root


def read_accelerate_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ZeroplanError(FLAG, f"cannot read {str(path)!r} ({type(error).__name__}: {error})") from None
    return parse_yaml_subset(text)


def check_accelerate_file(config: dict[str, Any], strategy: str, precision: str, activation_checkpointing: str,
                          world_size: int | None) -> list[str]:
    """Refuse a file that contradicts the run or that the CPU run cannot take (one line naming
    the key); return the record's notes: what the run took from the file, what it did not apply."""
    taken: list[str] = []
    not_applied: list[str] = []
    kind = config.get("distributed_type")
    if kind != "FSDP":
        raise _refuse("distributed_type", f"{kind!r}: the harness's torch engine takes an FSDP config "
                                          "(allowed: FSDP; a DeepSpeed run takes --deepspeed-config)")
    fsdp = config.get("fsdp_config")
    if not isinstance(fsdp, dict):
        raise _refuse("fsdp_config", "missing: the file must hold the FSDP settings")
    if "parallelism_config" in config:
        raise _refuse("parallelism_config", "HSDP's replicate/shard sizes: the harness's FSDP2 engine shards over "
                                            "all ranks (allowed: absent)")
    # accelerate's defaults where the file is silent (commands/config/config_args.py, FSDP2).
    config = {"mixed_precision": "no", **config}
    fsdp = {"fsdp_reshard_after_forward": True, "fsdp_activation_checkpointing": False, **fsdp}
    for key, value in config.items():
        if key in ("distributed_type", "fsdp_config"):
            continue
        if key == "mixed_precision":
            if value not in PRECISIONS:
                raise _refuse(key, f"{value!r}: the harness measures fp32 and bf16-mixed only (allowed: no, bf16)")
            if PRECISIONS[value] != precision:
                raise _refuse(key, f"{value!r} contradicts --precision {precision} "
                                   f"(allowed: {next(k for k, v in PRECISIONS.items() if v == precision)!r})")
            taken.append(f"mixed_precision {value}")
        elif key == "num_processes":
            if world_size is not None and value != world_size:
                raise _refuse(key, f"{value} contradicts the run's {world_size} ranks (allowed: {world_size})")
            taken.append(f"num_processes {value}")
        elif key in LAUNCH_KEYS:
            not_applied.append(key)
        else:
            raise _refuse(key, "the harness does not take this key")
    if fsdp.get("fsdp_version", 1) != 2:
        raise _refuse("fsdp_config.fsdp_version", f"{fsdp.get('fsdp_version', 1)!r}: the harness's torch engine "
                                                  "runs FSDP2 (allowed: 2)")
    for key, value in fsdp.items():
        name = f"fsdp_config.{key}"
        if key == "fsdp_version":
            taken.append("fsdp_version 2")
        elif key == "fsdp_reshard_after_forward":
            reshard = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}.get(value, value) if isinstance(value, str) else value
            if not isinstance(reshard, bool):
                raise _refuse(name, f"{value!r}: the harness runs FULL_SHARD or SHARD_GRAD_OP (allowed: true, false)")
            wanted = "fsdp-full-shard" if reshard else "fsdp-shard-grad-op"
            if strategy != wanted:
                raise _refuse(name, f"{str(value).lower()} contradicts --strategy {strategy} (allowed: --strategy {wanted})")
            taken.append(f"fsdp_reshard_after_forward {str(reshard).lower()}")
        elif key == "fsdp_offload_params":
            if value:
                raise _refuse(name, "true offloads parameters from the accelerator to the host; the CPU run has "
                                    "no accelerator (allowed: false)")
            taken.append("fsdp_offload_params false")
        elif key == "fsdp_activation_checkpointing":
            wanted = "full" if value else "none"
            if activation_checkpointing != wanted:
                raise _refuse(name, f"{str(value).lower()} contradicts --activation-checkpointing "
                                    f"{activation_checkpointing} (allowed: --activation-checkpointing {wanted})")
            taken.append(f"fsdp_activation_checkpointing {str(value).lower()}")
        elif key == "fsdp_auto_wrap_policy":
            if value != "TRANSFORMER_BASED_WRAP":
                raise _refuse(name, f"{value!r}: the harness shards each transformer block, then the root "
                                    "(allowed: TRANSFORMER_BASED_WRAP)")
            taken.append("fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP")
        elif key in FSDP_NOT_APPLIED:
            not_applied.append(name)
        else:
            raise _refuse(name, "the harness does not take this key")
    notes = ["from the accelerate config file: " + ", ".join(taken)]
    if not_applied:
        notes.append("not applied to the measured step (launch, checkpoint or loading settings): "
                     + ", ".join(not_applied))
    notes.append("kept the harness's (not in accelerate's config): MixedPrecisionPolicy reduce_dtype float32, "
                 "the --optimizer's torch optimizer")
    return notes
