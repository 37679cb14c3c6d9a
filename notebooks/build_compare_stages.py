"""Build notebooks/compare_stages.ipynb from the cells below and execute it in place, so the
committed notebook carries real outputs:

    python notebooks/build_compare_stages.py

To rerun the committed notebook from any directory without rebuilding it (nbclient, a dev
dependency, provides the command): ``.venv/bin/jupyter execute --inplace notebooks/compare_stages.ipynb``.

Every formula is imported from zeroplan; the cells only choose inputs and display results.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from zeroplan.atomic import write_text_atomic

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "compare_stages.ipynb"

CELLS: list[tuple[str, str]] = [
    ("markdown", """# Why ZeRO saves memory, what it costs, and how close the prediction comes

One question, followed in order: Llama-2-13B, 8 x A100-80GB, micro-batch 1 x 4096 tokens, full
activation checkpointing. The planner (`zeroplan.core`, no torch) predicts each strategy's
per-GPU memory, its communication and its step time; the last section puts predictions beside
measurements. Formulas: `docs/memory-model.md` and `docs/communication-time.md`; the figures are
drawn by `zeroplan.report.plots`.

Every GPU of a data-parallel run holds the *model states*, parameters, gradients and the
optimizer's states (for Adam two fp32 moments per parameter, more than parameters and gradients
together), plus the activations of its own micro-batch. The stages differ only in what they
shard across the N GPUs instead of copying:

| strategy | parameters | gradients | optimizer states | what moves |
|---|---|---|---|---|
| DDP | copied | copied | copied | gradients all-reduced |
| ZeRO-1 | copied | copied | 1/N | + parameters all-gathered after the step |
| ZeRO-2, FSDP shard-grad-op | copied | 1/N | 1/N | gradients reduce-scattered |
| ZeRO-3, FSDP full-shard | 1/N | 1/N | 1/N | parameters all-gathered per layer, forward and backward |
| + offload | | | in host memory | optimizer step on the CPU, copies over PCIe |"""),
    ("code", """import pandas as pd
from zeroplan import fit, get_gpu, get_model
from zeroplan.report import plots
from zeroplan.specs import (ActivationCheckpointing, BatchSpec, PlanRequest, StrategyKind,
                            StrategySpec, TrainingSpec, cluster_from_gpus)
from zeroplan.units import GiB

def request_for(model="llama-2-13b", gpus_per_node=8):
    return PlanRequest(
        model=get_model(model),
        training=TrainingSpec(activation_checkpointing=ActivationCheckpointing.full),
        batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        cluster=cluster_from_gpus(get_gpu("a100-80gb"), 8, gpus_per_node=gpus_per_node),
        strategy=StrategySpec(kind=StrategyKind.ddp),
    )

request = request_for()
report = fit(request)
print(report.verdict)"""),
    ("markdown", """## 1. Memory per GPU, stage by stage (GiB)

Each stage removes a term from every GPU: ZeRO-1 the optimizer states, ZeRO-2 the gradients,
ZeRO-3 the parameters; offload moves what is left of the optimizer to the host. The bars stack
the terms alive at each plan's peak moment; the dashed line is the memory the allocator can use."""),
    ("code", """frame = report.to_dataframe()
memory_columns = [c for c in frame.columns if c.endswith("_bytes") and c not in ("sent_bytes_per_step",)]
memory_gib = (frame[memory_columns] / GiB).round(1)
memory_gib.columns = [c.removesuffix("_bytes") + "_gib" for c in memory_columns]
memory_gib.join(frame[["fits", "max_micro_batch_size"]])"""),
    ("code", """plots.memory_stack_figure(report);"""),
    ("markdown", """## 2. What it costs in communication

`volume` counts what each engine sends as the ZeRO paper does (2Ψ for DDP, 3Ψ for ZeRO-3 and for
DeepSpeed's ZeRO-1/2, which all-reduce their gradients where the paper reduce-scatters); `sent` the
bytes each GPU puts on the wire under ring collectives; times from the alpha-beta model."""),
    ("code", """pd.DataFrame({
    "volume (x Psi)": frame.communication_volume_elements / report.num_parameters,
    "sent GB": frame.sent_bytes_per_step / 1e9,
    "comm s": frame.communication_s,
    "exposed s": frame.exposed_communication_s,
    "step s (overlap)": frame.step_with_overlap_s,
    "step s (no overlap)": frame.step_without_overlap_s,
}).round(3)"""),
    ("markdown", """The bytes are the same on any network; their time is not. The same 8 GPUs in one node
(NVLink, 300 GB/s per GPU) and in 8 nodes of one GPU (InfiniBand HDR, 25 GB/s per GPU): light
bars are all collectives of a step, dark the part that compute does not hide."""),
    ("code", """networks = {"1 node x 8 GPUs (NVLink)": report, "8 nodes x 1 GPU (InfiniBand)": fit(request_for(gpus_per_node=1))}
plots.network_communication_figure(networks);"""),
    ("markdown", """## 3. When it slows training

Sharding slows a step only by what its collectives leave exposed, and offload by the CPU's
optimizer step and the PCIe copies. Each bar is a step with overlap, split into its parts."""),
    ("code", """plots.step_time_figure(report);"""),
    ("markdown", """These step times are the planner's default, not calibrated: the matrix products' and
attention's executed FLOPs at the HFU fitted on published runs of the same GPU generation and
attention kernel (the line below names it and the error band measured for it on sources left out
of the fit), the memory-bound kernels and the optimizer step at the GPU's copy bandwidth. `compare` and `plan` print the
same line under their tables; with `--efficiency FILE`
(written by `zeroplan calibrate step` from one measured step of the same GPU and stack) it says
*calibrated* and quotes the band measured for one-row calibrations on the published rows
(docs/validation.md, "Step time")."""),
    ("code", """from zeroplan.calibrate.basis import time_basis_line
print(time_basis_line(request_for(), None, None, hfu_given=False))"""),
    ("markdown", """The trade-off in one picture: peak memory against step time, on both networks. On NVLink
ZeRO-3 costs next to nothing and DeepSpeed's ZeRO-1/2, which reduce their gradients outside the
backward by default (overlap_comm off below stage 3), 0.27 s; on InfiniBand DDP and HSDP leave
1.7-2.0 s of each step waiting on the network, ZeRO-1/2 2.7 s, ZeRO-3 and FSDP 0.2-1.1 s. Offload is slower in the single node because
its 8 GPUs share one host's CPUs for the optimizer step (1.5 s against 0.2 s with a host per GPU)."""),
    ("code", """plots.tradeoff_figure(networks);"""),
    ("markdown", """The same plans with compute timed kernel by kernel (`compute_model="roofline"`: matrix
products, attention and memory-bound kernels at the GPU's measured ceilings, and the optimizer
step on the GPU), a lower bound on compute (docs/validation.md, "Step time, kernel by kernel")."""),
    ("code", """from zeroplan.specs import PerformanceAssumptions

roofline = fit(request.model_copy(update={"performance": PerformanceAssumptions(compute_model="roofline")}))
steps = pd.DataFrame({p.strategy.value: plots.step_parts_s(p.time) for p in roofline.plans}).T
steps["step s"] = [p.time.step_with_overlap_s for p in roofline.plans]
display(steps.loc[:, (steps != 0).any()].round(3))
plots.step_time_figure(roofline);"""),
    ("markdown", """## Will Llama-2-70B train on 8 x A100-80GB?"""),
    ("code", """answer = fit(request_for("llama-2-70b"))
print(answer.verdict)
zero3 = answer.plan_for("zero3").memory
print(f"ZeRO-3 model states per GPU: {(zero3.parameter_bytes + zero3.gradient_bytes + zero3.optimizer_state_bytes) / GiB:.1f} GiB")
offload = answer.plan_for("zero3-offload")
print(f"ZeRO-3 + optimizer offload: peak {offload.memory.peak_bytes / GiB:.1f} GiB per GPU, "
      f"host RAM {offload.host_bytes_per_node / GiB:.0f} GiB per node")"""),
    ("markdown", """## The rest of the ZeRO family

Llama-2-70B on 16 A100s in two nodes of 8. ZeRO++'s hpZ keeps a second copy of the parameters
split over a node, so the backward's gathers stay on NVLink; the full ZeRO++ (`zero3-zeropp`)
adds int8 weight gathers (qwZ) and int4 gradient all-to-alls (qgZ); MiCS shards every state
within a node and replicates it across nodes. Each buys traffic off the inter-node links with
memory (docs/memory-model.md and docs/communication-time.md derive every term; MiCS is measured
against DeepSpeed's own engine in `benchmarks/mics-records/`). None is in the default list: they
are named."""),
    ("code", """two_nodes = request_for("llama-2-70b").model_copy(
    update={"cluster": cluster_from_gpus(get_gpu("a100-80gb"), 16, gpus_per_node=8)})
family = fit(two_nodes, ["zero3", "zero3-hpz", "zero3-zeropp", "zero3-mics"])
pd.DataFrame({p.strategy.value: {
    "peak GiB": p.memory.peak_bytes / GiB,
    "sent GB": p.sent_bytes_per_step / 1e9,
    "sent over groups spanning nodes GB": sum(c.sent_bytes_per_step for c in p.collectives if c.spans_nodes) / 1e9,
    "comm s": p.time.communication_s,
    "step s": p.time.step_with_overlap_s,
} for p in family.plans}).T.round(2)"""),
    ("markdown", """ZeRO-Infinity goes the other way: one GPU, the optimizer's states (and with
`zero3-param-nvme` the parameters) on an NVMe drive instead of host RAM. The GPU peak is the CPU
offload's; host RAM shrinks to the swappers' pinned buffers; the step waits on the drive (one
PCIe 4.0 drive, 6.5 / 3.5 GB/s). DeepSpeed's pipelined swapper (`nvme_pipeline_read/write`)
overlaps each sub-group's reads and writes with the CPU step, for three times the swap buffers."""),
    ("code", """one_gpu = request_for("llama-2-70b").model_copy(update={"cluster": cluster_from_gpus(get_gpu("a100-80gb"), 1)})
pipelined = one_gpu.with_strategy(one_gpu.strategy.model_copy(
    update={"nvme_pipeline_read": True, "nvme_pipeline_write": True}))
rows = {}
for label, base, kinds in [("", one_gpu, ["zero3-param-offload", "zero3-param-nvme"]),
                           (", pipelined", pipelined, ["zero3-param-nvme"])]:
    for p in fit(base, kinds).plans:
        rows[p.strategy.value + label] = {"GPU peak GiB": p.memory.peak_bytes / GiB,
                                          "host RAM GiB": p.host_bytes_per_rank / GiB,
                                          "NVMe GB": p.nvme_bytes_per_rank / 1e9,
                                          "step s": p.time.step_with_overlap_s}
pd.DataFrame(rows).T.round(1)"""),
    ("markdown", """## 4. Validation against measurements

Records committed under `benchmarks/records/` come from real runs of the harness (CPU, gloo,
small models; see `benchmarks/records/README.md` for the commands). Each row is one quantity
of one run: the planner's prediction for the same request, the measurement, and their ratio."""),
    ("code", """from pathlib import Path
import zeroplan
from zeroplan.validate.compare import compare_record
from zeroplan.validate.load import load_records
from zeroplan.validate.report import comparison_frame

# Found from the package, so that the notebook runs from any directory.
records_dir = Path(zeroplan.__file__).resolve().parents[1] / "benchmarks" / "records"
records = [r for r in load_records([str(records_dir)]) if r.rank == 0]
rows = [row for record in records for row in compare_record(record)]
table = comparison_frame(rows)[["model", "strategy", "engine", "world_size", "quantity", "predicted_bytes", "measured_bytes", "ratio"]]
with pd.option_context("display.max_rows", None):  # every row, not pandas' first and last 5
    display(table.round(4))"""),
    ("markdown", """Measured / predicted for every row above. The grey band is how far real peaks fall from
the prediction on published GPU runs (the middle half, `zeroplan.core.margin.PEAK_ERROR_BAND`,
docs/validation.md). Most quantities of the harness's CPU runs match within 1 %; the peaks of
tracked tensors of three runs (torch's DDP and ZeRO-1, ZeRO-3 in bf16) were measured at 0.76-0.90 x
the prediction, at or below the band's low end: buffers the tracker cannot see (DDP's bucket
copies, ZeroRedundancyOptimizer's buckets, ZeRO-3's refilled storages; docs/validation.md), which
the CPU allocator's peak of the same runs counts."""),
    ("code", """plots.validation_figure(rows);"""),
    ("markdown", """## 5. From plan to running job, and back

The loop a user runs, on a model small enough for the CPU: **plan** the job and **emit** the files
that run it (`zeroplan fit --emit`: here a DeepSpeed config for ZeRO-3 on 2 GPUs), **run** them
(`zeroplan measure` takes the emitted file and runs DeepSpeed itself, 2 ranks on gloo), and
**validate** the run against the plan. On a GPU cluster the run is `launch.sh` from the same
folder, and `zeroplan validate --from-log` reads the peak-memory lines the stack prints (the
emitted README gives the command)."""),
    ("code", """import json, os, tempfile
from zeroplan.cli.main import main as zeroplan_cli
from zeroplan.harness.presets import HARNESS_PRESETS

os.chdir(tempfile.mkdtemp())  # the emitted files and any run go to a scratch folder
spec = HARNESS_PRESETS["tiny-llama"]  # written as the Hugging Face config.json `zeroplan fit` reads
Path("tiny-llama.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
    "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
    "num_key_value_heads": spec.num_kv_heads, "intermediate_size": spec.ffn_hidden_size,
    "max_position_embeddings": spec.max_positions, "tie_word_embeddings": False, "hidden_act": "silu"}))
plan = ["fit", "tiny-llama.json", "--gpus", "2", "--gpu", "a100-80gb", "--strategies", "zero3", "--precision", "fp32",
        "--micro-batch", "2", "--seq-len", "64", "--emit", "plan-zero3"]
zeroplan_cli(plan)
print(json.dumps(json.loads(Path("plan-zero3/deepspeed.json").read_text())["zero_optimization"], indent=1))"""),
    ("markdown", """The run. `RUN = True` launches it here (torchrun, 2 ranks on the CPU, about a minute; needs
DeepSpeed); otherwise the records of the same command, made by `benchmarks/emitted_records.py`
and committed with the file they ran, are read, after checking that file is the one just emitted."""),
    ("code", """RUN = False
measure = ["measure", "tiny-llama", "--strategy", "zero3", "--engine", "deepspeed", "--nproc", "2", "--backend", "gloo",
           "--steps", "3", "--precision", "fp32", "--micro-batch", "2", "--seq-len", "64",
           "--deepspeed-config", "plan-zero3/deepspeed.json", "--out", "runs/plan-zero3"]
print("zeroplan " + " ".join(measure))
if RUN:
    assert zeroplan_cli(measure) == 0
    run_dir = Path("runs/plan-zero3")
else:
    run_dir = records_dir.parent / "emitted-records" / "tiny-llama-zero3-deepspeed-n2"
    assert json.loads((run_dir / "deepspeed.json").read_text()) == json.loads(Path("plan-zero3/deepspeed.json").read_text())
    print(f"read: benchmarks/emitted-records/{run_dir.name}")"""),
    ("code", """emitted_rows = [row for record in load_records([str(run_dir)]) if record.rank == 0 for row in compare_record(record)]
comparison_frame(emitted_rows)[["quantity", "predicted_bytes", "measured_bytes", "ratio"]].round(4)"""),
    ("markdown", """Parameters, gradients, optimizer states, the kept buffers and every collective match the plan
to the byte. Gradients are one thing on both sides: the fp32 partition AdamW steps from;
DeepSpeed's reduce bucket and gradient partition buffer are buffers (`buffers (kept)`), in the
record as in the planner (docs/harness.md, "What counts as gradients"). The all-gather is the
planner's under the deepspeed convention: DeepSpeed's prefetch keeps the forward's last modules
gathered for their backward, as many as `stage3_max_live_parameters` holds (here the head, the
last block and most of the one before), and the backward gathers only the rest
(`zeroplan/core/deepspeed_coordinator.py`).

Each emitted run (the DeepSpeed file above, and the accelerate and torchtitan files of
`fsdp-full-shard`, `benchmarks/emitted-records/`) against the harness's tolerance, the bounds of
`zeroplan validate --check` (`zeroplan/validate/tolerance.py`: model states and collectives 0.1 %,
saved activations 2 %, the allocator's peak 5 %):"""),
    ("code", """from zeroplan.validate.tolerance import tolerance_of, within

emitted_runs = sorted(p for p in (records_dir.parent / "emitted-records").iterdir() if p.is_dir())
checked = [row for run in emitted_runs for record in load_records([str(run)]) if record.rank == 0
           for row in compare_record(record)]
frame = comparison_frame(checked)[["run_id", "quantity", "ratio"]].round(4)
frame["run_id"] = [row.run_id.removeprefix("tiny-llama-").removesuffix("-n2") for row in checked]
frame["bound"] = [tolerance_of(row.quantity) for row in checked]
frame["within"] = [within(row) if tolerance_of(row.quantity) is not None else "not checked" for row in checked]
frame"""),
    ("markdown", """Every row is inside its bound, the allocator's peaks included. Each run peaks at the last
reduction of backward, which the planner models tensor by tensor: DeepSpeed's epilogue copies the
reduce bucket into one flat buffer for its reduce-scatter beside the embedding, still gathered;
FSDP2's root unit reduce-scatters its gradients after resharding, beside the head's unsharded
gradient. On gloo the reduce-scatter also copies its input, which `zeroplan validate` adds for a
gloo record only (`zeroplan/validate/gloo.py`; NCCL makes no such copy); docs/harness.md
("Running an emitted config") traces each to the source."""),
]


def build() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in CELLS:
        cell = nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
        notebook.cells.append(cell)
    return notebook


def execute(notebook: nbformat.NotebookNode, timeout_s: int = 300) -> nbformat.NotebookNode:
    NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return notebook


if __name__ == "__main__":
    write_text_atomic(NOTEBOOK, nbformat.writes(execute(build())) + "\n")
    print(f"wrote {NOTEBOOK}")
