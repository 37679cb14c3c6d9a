"""``zeroplan measure --engine deepspeed --deepspeed-config FILE``: run DeepSpeed with the ZeRO
settings of a DeepSpeed config JSON (the one ``zeroplan plan/fit --emit`` writes, or the user's
own) instead of the harness's.

The file is read with ``json`` only: the harness is an independent check of the planner, so
nothing here imports its formulas (nor torch: the launcher checks the file before torchrun
starts, every rank merges it again). What the file sets, DeepSpeed gets; what it leaves out,
the harness sets as it always does (zeroplan.harness.deepspeed_engine), and the record's
``description.notes`` name both.

Refused in one line naming the key: a setting that contradicts the measure flags (ZeRO stage
vs --strategy, offload vs a -offload strategy, micro-batch, accumulation, batch size,
precision, optimizer), and one the harness cannot run or explain on the CPU: fp16 (the harness
measures fp32 and bf16-mixed), ``overlap_comm`` true (DeepSpeed's CPU accelerator has no side
stream to overlap on; the recorded buffers would not be the run's), pinned or NVMe offload,
parameter offload, and any key the harness does not know."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zeroplan.errors import ZeroplanError
from zeroplan.specs.deepspeed_config import read_deepspeed_json

FLAG = "--deepspeed-config"

TOP_LEVEL = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "optimizer", "bf16", "fp16", "zero_optimization", "steps_per_print",
             "wall_clock_breakdown")
"""Top-level keys the harness takes (any other is refused: it cannot tell whether it runs on the CPU)."""

ZERO_KEYS = ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
             "reduce_scatter", "use_multi_rank_bucket_allreduce", "round_robin_gradients",
             "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
             "stage3_max_live_parameters", "sub_group_size", "offload_optimizer", "offload_param")
"""zero_optimization keys the harness takes."""

ADAM_TYPES = ("adam", "adamw")
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")
"""optimizer.params taken from the file; the harness always adds torch_adam true and foreach
false (torch.optim.AdamW, no compiled op: what the record's optimizer-state bytes count)."""


def _refuse(key: str, message: str) -> ZeroplanError:
    return ZeroplanError(FLAG, f"{key}: {message}")


def read_deepspeed_file(path: str | Path) -> dict[str, Any]:
    """The file's JSON object; a missing, unreadable or non-object file is refused in one line
    (the same reader the planner's --deepspeed-config uses: zeroplan.specs.deepspeed_config)."""
    return read_deepspeed_json(path)


def _enabled(config: dict[str, Any], key: str) -> bool:
    block = config.get(key, {})
    if not isinstance(block, dict) or not isinstance(block.get("enabled", False), bool):
        raise _refuse(f"{key}.enabled", "must be true or false")
    return block.get("enabled", False)


def _offload_device(zero: dict[str, Any], key: str) -> str | None:
    """'cpu' or None (absent or device 'none'); anything else is refused."""
    block = zero.get(key)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise _refuse(f"zero_optimization.{key}", "must be an object")
    device = block.get("device", "none")
    if device == "none":
        return None
    if device != "cpu":
        raise _refuse(f"zero_optimization.{key}.device", f"{device!r}: the harness offloads to the CPU only (allowed: cpu, none)")
    if block.get("pin_memory", False):
        raise _refuse(f"zero_optimization.{key}.pin_memory", "true pins host memory for CUDA copies; the CPU run "
                                                            "has none (allowed: false)")
    unknown = sorted(set(block) - {"device", "pin_memory"})
    if unknown:
        raise _refuse(f"zero_optimization.{key}.{unknown[0]}", "the harness does not take it (allowed: device, pin_memory)")
    return device


def _positive_int(config: dict[str, Any], key: str, name: str) -> int | None:
    value = config.get(key)
    if value is None or value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(name, f"{value!r} is not a positive integer")
    return value


def check_deepspeed_file(config: dict[str, Any], stage: int, offloads_optimizer: bool, micro_batch_size: int,
                         grad_accum_steps: int, bf16: bool, world_size: int | None) -> None:
    """Refuse, in one line naming the key, a file that contradicts the measure flags or that the
    harness cannot run on the CPU (see the module docstring); ``world_size`` None skips the
    train_batch_size check (not known yet)."""
    unknown = [key for key in config if key not in TOP_LEVEL]
    if unknown:
        raise _refuse(unknown[0], f"the harness does not take this key (allowed: {', '.join(TOP_LEVEL)})")
    for key, flag, wanted in (("train_micro_batch_size_per_gpu", "--micro-batch", micro_batch_size),
                              ("gradient_accumulation_steps", "--grad-accum", grad_accum_steps)):
        value = _positive_int(config, key, key)
        if value is not None and value != wanted:
            raise _refuse(key, f"{value} contradicts {flag} {wanted} (allowed: the same value in both)")
    batch = _positive_int(config, "train_batch_size", "train_batch_size")
    if batch is not None and world_size is not None and batch != micro_batch_size * grad_accum_steps * world_size:
        raise _refuse("train_batch_size", f"{batch} is not --micro-batch {micro_batch_size} x --grad-accum "
                                          f"{grad_accum_steps} x {world_size} ranks")
    if _enabled(config, "fp16"):
        raise _refuse("fp16.enabled", "true: the harness measures fp32 and bf16-mixed only (allowed: false)")
    if _enabled(config, "bf16") != bf16:
        precision = "bf16-mixed" if bf16 else "fp32"
        raise _refuse("bf16.enabled", f"{str(not bf16).lower()} contradicts --precision {precision} "
                                      f"(allowed: {str(bf16).lower()})")
    optimizer = config.get("optimizer")
    if optimizer is not None:
        if not isinstance(optimizer, dict):
            raise _refuse("optimizer", "must be an object")
        kind = str(optimizer.get("type", "")).lower()
        if kind not in ADAM_TYPES:
            raise _refuse("optimizer.type", f"{optimizer.get('type')!r} contradicts --optimizer adamw (allowed: Adam, AdamW)")
        params = optimizer.get("params", {})
        unknown = sorted(set(params) - set(OPTIMIZER_PARAMS)) if isinstance(params, dict) else ["params"]
        if unknown:
            raise _refuse(f"optimizer.params.{unknown[0]}", f"the harness does not take it (allowed: {', '.join(OPTIMIZER_PARAMS)})")
    clipping = config.get("gradient_clipping", 0.0)
    if not isinstance(clipping, (int, float)) or isinstance(clipping, bool) or clipping < 0:
        raise _refuse("gradient_clipping", f"{clipping!r} is not a non-negative number")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        raise _refuse("zero_optimization", "missing: the file must say the ZeRO stage (zero_optimization.stage)")
    unknown = [key for key in zero if key not in ZERO_KEYS]
    if unknown:
        raise _refuse(f"zero_optimization.{unknown[0]}", "the harness does not take this key")
    if zero.get("stage") != stage:
        raise _refuse("zero_optimization.stage", f"{zero.get('stage')!r} contradicts --strategy's ZeRO stage {stage}")
    if zero.get("overlap_comm", False):
        raise _refuse("zero_optimization.overlap_comm", "true overlaps on a CUDA side stream, which DeepSpeed's CPU "
                                                        "accelerator does not have (allowed: false)")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters", "sub_group_size", "stage3_param_persistence_threshold",
                "stage3_max_reuse_distance"):
        value = zero.get(key, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise _refuse(f"zero_optimization.{key}", f"{value!r} is not a non-negative number")
    if _offload_device(zero, "offload_param") is not None:
        raise _refuse("zero_optimization.offload_param", "the harness's DeepSpeed engine does not offload parameters "
                                                         "(allowed: absent, or device none)")
    offloads = _offload_device(zero, "offload_optimizer") is not None
    if offloads != offloads_optimizer:
        raise _refuse("zero_optimization.offload_optimizer",
                      "offloads the optimizer but --strategy does not (allowed: a -offload strategy)" if offloads else
                      "is missing but --strategy offloads the optimizer (allowed: device cpu)")


def merge_deepspeed_file(harness: dict[str, Any], file: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The configuration DeepSpeed gets: the harness's own (``harness``, as
    deepspeed_engine.deepspeed_config builds it) with every checked setting of the file over it,
    and the notes that say which settings came from where."""
    merged = json.loads(json.dumps(harness))
    taken: list[str] = []
    kept: list[str] = []
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
                "steps_per_print", "wall_clock_breakdown"):
        if key in file and file[key] != "auto":
            merged[key] = file[key]
            taken.append(key)
        elif key in merged:
            kept.append(f"{key} {json.dumps(merged[key])}")
    if "train_batch_size" in file and file["train_batch_size"] != "auto":
        merged["train_batch_size"] = file["train_batch_size"]
        taken.append("train_batch_size")
    for key in ("bf16", "fp16"):
        if key in file:
            merged[key] = file[key]
            taken.append(f"{key}.enabled")
    params = dict(merged["optimizer"]["params"])
    if "optimizer" in file:
        taken.append("optimizer.type")
        given = file["optimizer"].get("params", {})
        params.update(given)
        taken += [f"optimizer.params.{key}" for key in given]
    merged["optimizer"] = {"type": "AdamW", "params": params}
    kept.append("optimizer torch.optim.AdamW (torch_adam true, foreach false)"
                + ("" if "optimizer" in file and file["optimizer"].get("params") else " with the harness's lr, betas, eps, weight_decay"))
    zero = merged["zero_optimization"]
    for key, value in file["zero_optimization"].items():
        if key in ("offload_optimizer", "offload_param") and value.get("device", "none") == "none":
            zero.pop(key, None)
        else:
            zero[key] = value
        taken.append(f"zero_optimization.{key}")
    kept += [f"zero_optimization.{key} {json.dumps(value)}" for key, value in zero.items()
             if key not in file["zero_optimization"]]
    notes = ["from the DeepSpeed config file: " + ", ".join(taken),
             "kept the harness's (not set in the file): " + "; ".join(kept)]
    return merged, notes
