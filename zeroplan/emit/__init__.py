"""From a plan to the files that run it: ``zeroplan plan --emit DIR`` and ``zeroplan fit
--strategies S --emit DIR`` write the configurations of the run they show (zeroplan.emit.formats),
a torchrun launch script and a Slurm batch script with the allocator setting the plan assumed,
and a README that says what was predicted and how to check it (``zeroplan validate --from-log``).

Only the formats that can express the planned run are written; the others are named, each with
the reason, in one line. Everything is written atomically (zeroplan.atomic). Nothing here imports
torch or a framework."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import ActivationCheckpointing
from zeroplan.emit import formats
from zeroplan.specs.request import PlanRequest
from zeroplan.units import GiB


@dataclass(frozen=True)
class PlannedRun:
    """One configuration the planner showed, with what it predicted for it."""

    request: PlanRequest
    """The whole request of the configuration (strategy, batch split, layout, checkpointing)."""
    command: str
    """The zeroplan command line that planned it, as the user typed it."""
    peak_bytes: int
    """The per-GPU peak the planner showed (what the verdict was judged on)."""
    allocated_peak_bytes: int
    """The planner's peak of allocated bytes (torch.cuda.max_memory_allocated)."""
    reserved_peak_bytes: int | None
    """The caching-allocator model's reserved peak (max_memory_reserved); None under the flat reserve."""
    step_time_s: float
    """Predicted seconds per optimizer step."""
    fit_flags: tuple[str, ...]
    """The `zeroplan fit` arguments (model first) that plan this configuration alone: what
    `zeroplan validate --from-log LOG` takes to predict the same run."""


@dataclass
class Emitted:
    """What emit wrote and what it passed over."""

    directory: Path
    files: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """Two lines for the command line: the files written, and the formats skipped with why."""
        lines = [f"zeroplan: wrote {', '.join(self.files)} to {self.directory}"]
        if self.skipped:
            lines.append("zeroplan: skipped " + "; ".join(f"{name} ({why})" for name, why in self.skipped.items()))
        return "\n".join(lines)


FORMATS = (
    ("deepspeed.json", formats.deepspeed_json),
    ("accelerate.yaml", formats.accelerate_yaml),
    ("torchtitan-overrides.txt", formats.torchtitan_text),
    ("torchtune-overrides.txt", formats.torchtune_text),
)
"""Every configuration file emit can write, in the order the README lists them."""


def render(planned: PlannedRun) -> tuple[dict[str, str], dict[str, str]]:
    """(file name -> content, skipped file name -> reason) for the planned run, nothing written."""
    if planned.request.training.framework.megatron_layout:
        # Megatron-LM and Megatron-DeepSpeed are launched through their own pretrain_gpt.py
        # arguments, which no format here writes; a launch.sh of another stack's would be wrong.
        raise ZeroplanError("--emit", "Megatron-LM and Megatron-DeepSpeed run files are not written (allowed: "
                            "--framework zeroplan, hf, torchtitan or torchtune)")
    if planned.request.training.float8 is not None and planned.request.training.float8.value == "te-delayed":
        # TransformerEngine's float8 is llm-foundry's (fc_type te under Composer's amp_fp8): no
        # file here runs it, and a launch without it would train bf16.
        raise ZeroplanError("--emit", "te-delayed float8 runs are not written: it is llm-foundry's amp_fp8, timed only "
                            "(allowed: without --float8 te-delayed)")
    written: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, build in FORMATS:
        try:
            written[name] = build(planned.request)
        except formats.NotApplicable as reason:
            skipped[name] = str(reason)
    tags = {"torchtitan": "torchtitan-overrides.txt" in written}
    written["launch.sh"] = formats.launch_script(planned.request, {k: "" for k, v in tags.items() if v})
    written["job.sbatch"] = formats.sbatch_script(planned.request)
    written["README.md"] = readme(planned, written, skipped)
    return written, skipped


def emit(planned: PlannedRun, directory: str | Path) -> Emitted:
    """Write the planned run's files into ``directory`` (made if missing); special files and
    a directory that is a file are refused in one line before anything is written."""
    from zeroplan.atomic import writable_directory, writable_file, write_text_atomic

    contents, skipped = render(planned)
    folder = writable_directory(directory, "--emit", create=False)
    for name in contents:
        writable_file(folder / name, "--emit")  # refuse a device or FIFO under a file's name first
    folder = writable_directory(directory, "--emit")
    result = Emitted(directory=Path(directory), skipped=skipped)
    for name, text in contents.items():
        write_text_atomic(folder / name, text, "--emit")
        result.files.append(name)
    return result


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


FILE_ROLES = {
    "deepspeed.json": "DeepSpeed config (ZeRO stage, offload, buckets, batch split, precision)",
    "accelerate.yaml": "accelerate config (`accelerate launch --config_file accelerate.yaml ...`)",
    "torchtitan-overrides.txt": "torchtitan 0.3.0 command-line overrides (it reads no TOML: `--module/--config` pick a config function)",
    "torchtune-overrides.txt": "torchtune `tune run` key=value overrides",
    "launch.sh": "torchrun launch line for each node, with the allocator setting the plan assumed",
    "job.sbatch": "Slurm batch script running launch.sh on every node",
}


# transformers 4.56.2: LlamaConfig (and most causal LMs' configs) default use_cache=True, and only
# transformers' own gradient checkpointing turns it off in training (utils/generic.py, the
# use_cache override under self.gradient_checkpointing); the checkpoint wrapper accelerate's
# fsdp_activation_checkpointing applies does not, so the forward builds a cache of every layer's K
# and V (zeroplan.core.kv_cache) unless the script loads the model with use_cache=False.
def _use_cache_note(planned_with_cache: bool) -> str:
    """The README's line on transformers' KV cache under accelerate's FSDP checkpointing."""
    if planned_with_cache:
        return ("KV cache: planned with --use-cache (every layer's K and V kept through the step), as transformers "
                "does under fsdp_activation_checkpointing when the model keeps its config's use_cache=True.")
    return ("KV cache: the plan assumes none. Under fsdp_activation_checkpointing transformers keeps its config's "
            "use_cache=True and builds a cache of every layer's K and V in training: load the model with "
            "`from_pretrained(..., use_cache=False)` (or set `model.config.use_cache = False`), or plan with --use-cache.")


def readme(planned: PlannedRun, written: dict[str, str], skipped: dict[str, str]) -> str:
    r = planned.request
    b = r.batch
    conf = formats.allocator_conf(r)
    layout = formats.model_parallel(r) or "data parallel only"
    reserved = (f"; max_memory_reserved {_gib(planned.reserved_peak_bytes)}"
                if planned.reserved_peak_bytes is not None else "")
    global_batch = b.micro_batch_size * b.grad_accum_steps * r.data_parallel_size
    lines = [
        f"# Planned run: {r.model.name} on {r.cluster.world_size} x {r.cluster.gpu.name}",
        "",
        "Planned with:",
        "",
        "```",
        planned.command,
        "```",
        "",
        f"- framework {r.training.framework.value}, strategy {r.strategy.kind.value}"
        + (f" (shard group {r.shard_group_size})" if r.strategy.kind.value == "hsdp" else "")
        + f", layout {layout}",
        f"- micro-batch {b.micro_batch_size} x accumulation {b.grad_accum_steps} x {r.data_parallel_size} data-parallel "
        f"ranks = global batch {global_batch} sequences of {b.seq_len} tokens",
        f"- precision {r.training.precision.value}, optimizer {r.training.optimizer.value}, activation checkpointing "
        f"{r.training.activation_checkpointing.value}" + (", compiled" if r.training.compile else "")
        + (f", float8 {r.training.float8.value}" if r.training.float8 else ""),
        f"- PYTORCH_CUDA_ALLOC_CONF={conf or '(unset: PyTorch defaults)'}",
        "",
        f"Predicted per-GPU peak, as `zeroplan fit` judges it: **{_gib(planned.peak_bytes)}** (max_memory_allocated "
        f"{_gib(planned.allocated_peak_bytes)}{reserved}); predicted step time **{planned.step_time_s:.3f} s**.",
        "",
        "## Files",
        "",
    ]
    lines += [f"- `{name}`: {FILE_ROLES[name]}" for name in written if name in FILE_ROLES]
    if skipped:
        lines.append("- not written: " + "; ".join(f"`{name}` ({why})" for name, why in skipped.items()))
    if r.strategy.kind.optimizer_on_nvme and "deepspeed.json" in written:
        from zeroplan.core.nvme import host_pinned_bytes, nvme_bytes

        per_node = r.cluster.gpus_per_node
        lines += ["", f"NVMe: deepspeed.json swaps to nvme_path {formats.NVME_PATH} (DeepSpeed's tutorial's); point both "
                  f"nvme_path entries at a directory on the node's NVMe drive, with {nvme_bytes(r) * per_node / 1e9:.0f} GB "
                  f"free per node ({nvme_bytes(r) / 1e9:.0f} GB per rank), and allow {_gib(host_pinned_bytes(r) * per_node)} "
                  "of pinned host memory per node (`ulimit -l`). The step time assumed the drive's "
                  f"{r.cluster.host.nvme_read_bytes_per_s / 1e9:.1f}/{r.cluster.host.nvme_write_bytes_per_s / 1e9:.1f} GB/s "
                  "read/write (--nvme-bandwidth)."]
    if "accelerate.yaml" in written and r.training.framework is Framework.hf and r.strategy.kind.is_fsdp \
            and r.training.activation_checkpointing is ActivationCheckpointing.full:
        lines += ["", _use_cache_note(r.training.use_cache)]
    if r.training.float8 is not None:
        lines += ["", "float8: torchtitan 0.3.0 sets it in the config function (model_spec converters "
                  "Float8LinearConverter, as llama3_debugmodel_float8 does), not on the command line."]
    lines += [
        "",
        "## Run",
        "",
        "```",
        "bash launch.sh        # on each node, with NODE_RANK and MASTER_ADDR set",
        "sbatch job.sbatch     # or under Slurm",
        "```",
        "",
        "Where a line names YOUR_TRAIN_SCRIPT.py, YOUR_CONFIG, YOUR_CONFIG_FUNCTION or checkpoints/YOUR_MODEL (litgpt's "
        "checkpoint directory), put your own.",
        "",
        "## Validate",
        "",
        "Save rank 0's log and compare its peak-memory lines with the prediction:",
        "",
        "```",
        "zeroplan validate --from-log train.log " + shlex.join(planned.fit_flags),
        "```",
        "",
        "It reads torchtitan's step lines, torchtune's peak_memory_* metrics (log_peak_memory_stats=True), "
        "the HF Trainer's train metrics (skip_memory_metrics=False) or DeepSpeed's see_memory_usage lines, "
        "says which figure it read, and compares it with this prediction.",
    ]
    return "\n".join(lines) + "\n"
