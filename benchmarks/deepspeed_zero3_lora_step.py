"""DeepSpeed ZeRO-3's own engine under Hugging Face LoRA as the PEFT docs' Llama-2-70B rows run it
(zero.Init entered by transformers, LoRA on every block linear, non-reentrant gradient
checkpointing, bf16, DeepSpeed's stage-3 settings), on a scaled-down Llama on gloo (2 CPU ranks):
each step's peak of live CPU bytes beside the planner's allocated peak for the same request.

    python benchmarks/deepspeed_zero3_lora_step.py [--deepspeed-src DIR] [--early-2024-recompute]
        [--bf16-adapters] [--breakdown] [--seq-len 512] [--attention sdpa]

From 0.19.2 DeepSpeed's engine casts no zero.Init model to bf16, so peft's fp32 adapters stay
fp32 (zeroplan.core.finetune.activations.adapters_stay_fp32); --bf16-adapters casts them as the
earlier releases' module.bfloat16() did, on the installed release. The planned figure is for the
release the run stands for (--deepspeed-release 0.13.3 for an earlier source or --bf16-adapters),
on a GPU's dispatch path and on the CPU's the run took. --breakdown lists the bytes live at the
run's peak by the op that allocated them.

--deepspeed-src runs another DeepSpeed release from its source tree (e.g. 0.13.3, the release of
the 8 x H100 row's date: `pip download --no-deps --no-binary :all: deepspeed==0.13.3` and unpack).
That release's CPU accelerator imports IPEX and oneCCL and picks the 'ccl' backend, and it reads
two names torch 2.13 and numpy 2 dropped at import; the script stands in for those (gloo's process
group does the collectives), none of which touches ZeRO-3's gathers or its optimizer.
--early-2024-recompute runs torch's non-reentrant recompute as the releases of that date did
(torch/utils/checkpoint.py _recomputation_hook stored x.detach() of every tensor the recompute
saves; torch 2.13 keeps a tensor that needs no gradient as it is, and DeepSpeed before 0.19's
recompute attribution then fails the checkpoint's metadata check on its released frozen weights).

The model keeps the 70B row's proportions where DeepSpeed's settings act on them: a block of
hidden 256, FFN 896 (3.5 x), 8 heads over 1 KV head, 835,584 elements, 1,024 times fewer than
Llama-2-70B's; stage3_prefetch_bucket_size, stage3_max_live_parameters and
stage3_max_reuse_distance are DeepSpeed's defaults (5e7, 1e9, 1e9) over the same 1,024, and
stage3_param_persistence_threshold 4,096 keeps the same tensors whole as 1e5 does on 70B (norms,
the adapters of q, k, v, o and down's B). reduce_bucket_size is 1e5 (planned as given).

Live bytes come from the profiler's allocator events (zeroplan.harness.allocator_trace), whose
blind spot is a free made on a thread the profiler does not cover: the list of what is live at
the run's peak, printed with the step each allocation was made in, shows such tensors (an
earlier step's attention masks, which gc finds gone after the run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from zeroplan.harness.ports import free_local_port, remove_deepspeed_shm_buffers

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB, MICRO_BATCH, STEPS = 256, 896, 4, 8, 1, 512, 2, 3
SCALE = 1024
STAGE3 = {"reduce_bucket_size": 100_000, "stage3_prefetch_bucket_size": 5 * 10**7 // SCALE,
          "stage3_max_live_parameters": 10**9 // SCALE, "stage3_max_reuse_distance": 10**9 // SCALE,
          "stage3_param_persistence_threshold": 4096}


def zero3_config(world: int) -> dict:
    """accelerate's DeepSpeedPlugin config (utils/dataclasses.py, no config file) for ZeRO-3 in
    bf16 with nothing offloaded, at the scaled stage-3 settings."""
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "train_batch_size": MICRO_BATCH * world, "bf16": {"enabled": True}, "steps_per_print": 2**31 - 1,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                                  "stage3_gather_16bit_weights_on_model_save": True, **STAGE3}}


def _detach_every_recomputed_tensor() -> None:
    """torch's _recomputation_hook as in the releases of early 2024: every saved tensor detached."""
    import inspect
    import textwrap

    from torch.utils import checkpoint

    source = textwrap.dedent(inspect.getsource(checkpoint._recomputation_hook))
    kept_as_is = "x = x.detach() if x.requires_grad else x"
    if kept_as_is not in source:
        raise SystemExit("--early-2024-recompute: this torch's _recomputation_hook is not the one it edits")
    # Re-executes torch's own class source with the one line changed, in its own module.
    exec(compile(source.replace(kept_as_is, "x = x.detach()"), checkpoint.__file__, "exec"), checkpoint.__dict__)  # noqa: S102


def _import_old_deepspeed(source: str):
    """DeepSpeed from a source tree of an earlier release, with the stand-ins the docstring names."""
    import logging

    import numpy
    import torch.distributed.elastic.agent.server.api as elastic_api

    sys.path.insert(0, source)
    # DeepSpeed builds its CPU ops (deepspeed_shm_comm) on first use into torch's extension cache,
    # one directory per op name whatever the release: an earlier release's build there is loaded
    # by the installed DeepSpeed's next launch, which then fails (its shm_comm lacks
    # vector_kernel_level). Each source tree builds into a cache of its own.
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(cache / "torch_extensions" / f"deepspeed-src-{Path(source).resolve().name}")
    elastic_api.log = logging.getLogger("elastic")  # read at import by elasticity/elastic_agent.py
    if not hasattr(elastic_api, "_get_socket_with_port"):
        elastic_api._get_socket_with_port = lambda: None
    numpy.BUFSIZE = 8192  # numpy 1's constant, read at import by autotuning/scheduler.py
    for name in ("intel_extension_for_pytorch", "oneccl_bindings_for_pytorch"):
        sys.modules[name] = types.ModuleType(name)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator()._communication_backend_name = "gloo"
    return deepspeed


def mark_empty_cache(accelerator) -> None:  # type: ignore[no-untyped-def]
    """Wrap the accelerator's empty_cache in a "zs:empty_cache" profiler range, so a trace shows
    where DeepSpeed flushed the cache (ZeRO-3's defragment before the optimizer's build)."""
    from torch.profiler import record_function

    empty = accelerator.empty_cache

    def marked_empty_cache():  # type: ignore[no-untyped-def]
        with record_function("zs:empty_cache"):
            return empty()

    accelerator.empty_cache = marked_empty_cache


def mark_calls(cls, name: str, label: str) -> None:  # type: ignore[no-untyped-def]
    """Wrap ``cls.name`` in a profiler range ``label``, so a trace shows which of DeepSpeed's
    calls (and so which of its streams on a GPU) made each allocation."""
    from torch.profiler import record_function

    call = getattr(cls, name)

    def marked(*args, **kwargs):  # type: ignore[no-untyped-def]
        with record_function(label):
            return call(*args, **kwargs)

    setattr(cls, name, marked)


def recorded_events(options: argparse.Namespace, parser: argparse.ArgumentParser, run) -> dict:  # type: ignore[no-untyped-def]
    """A ZeRO-3 trace script's record: read back from --events, or made by ``run(out)`` (which
    writes it as JSON to ``out``) and kept in --save-events where asked. The shared-memory
    buffers DeepSpeed's CPU all-reduce named after the run's port are removed after it."""
    if options.events:
        return json.loads(options.events.read_text())
    if not options.deepspeed_src:
        parser.error("--deepspeed-src is required unless --events is given")
    import tempfile

    out = str(Path(tempfile.mkdtemp()) / "events.json")
    try:
        run(out)
    finally:
        remove_deepspeed_shm_buffers(options.port)
    data = json.loads(Path(out).read_text())
    if options.save_events:
        options.save_events.write_text(json.dumps(data))
    return data


def start_rank(rank: int, world: int, options: argparse.Namespace) -> None:
    """A CPU rank's environment and gloo group (the recompute patch first, where asked)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(options.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    import torch.distributed as dist

    if options.early_2024_recompute:
        _detach_every_recomputed_tensor()
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _rank(rank: int, world: int, options: argparse.Namespace, out: str) -> None:
    start_rank(rank, world, options)
    import torch
    import torch.distributed as dist

    from zeroplan.harness.allocator_trace import (
        STEP_RANGE_PREFIX,
        AllocatorTrace,
        _replay,
    )

    with AllocatorTrace() as trace:
        # transformers probes for IPEX at import: imported before the stand-ins.
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed = _import_old_deepspeed(options.deepspeed_src) if options.deepspeed_src else __import__("deepspeed")
        deepspeed.init_distributed(dist_backend="gloo")
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        config = zero3_config(world)
        ds_config = HfDeepSpeedConfig(config)  # noqa: F841  (kept alive: transformers reads it through a weakref)
        model_config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, attention_dropout=0.0,
                                   attn_implementation=options.attention, use_cache=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(model_config)  # under zero.Init (is_deepspeed_zero3_enabled)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        if options.bf16_adapters:
            # What DeepSpeed before 0.19.2 did to them: _configure_distributed_model's module.bfloat16().
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.to(torch.bfloat16)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
        adapter_dtypes = sorted({str(p.dtype) for n, p in model.named_parameters() if "lora_" in n})

        gathered: list[tuple[str, int]] = []

        def note_gathered(name: str) -> None:
            gathered.append((name, sum(p.numel() * p.element_size() for p in model.parameters()
                                       if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE and not p.ds_persist)))

        last = f"layers.{LAYERS - 1}."
        for name, module in model.named_modules():
            if name.endswith("base_layer") and last in name:
                module.register_full_backward_pre_hook(lambda m, g, name=name: note_gathered(name.split(last)[1]))
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, options.seq_len), generator=torch.Generator().manual_seed(rank))
        for step in range(STEPS):
            with trace.step(step):
                engine.backward(engine(input_ids=tokens, labels=tokens).loss)
                engine.step()
    if rank == 0:
        peaks = trace.peaks()
        events = trace.events()
        best, live, peak_ns = -1, [], 0
        for event, (alive, total) in zip(events, _replay(events)):
            if total > best:
                best, live, peak_ns = total, [(a.size_bytes, a.operator, a.time_ns) for a in alive.values()], event.time_ns
        starts = sorted(e.start_time_ns for e in trace._profile.profiler.kineto_results.experimental_event_tree()
                        if e.name.startswith(STEP_RANGE_PREFIX))

        def step_of(time_ns: int) -> int:
            return sum(time_ns >= s for s in starts) - 1

        result = {"deepspeed": deepspeed.__version__, "adapter_dtypes": adapter_dtypes,
                  "step_peaks": {k: v.peak_bytes for k, v in peaks.items()},
                  "gathered_at_last_block_backward": gathered[-7:], "peak_step": step_of(peak_ns),
                  "live_at_peak": [(size, op, step_of(t)) for size, op, t in sorted(live, reverse=True)]}
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def planned_bytes(options: argparse.Namespace, release: str, kernels: str = "cuda") -> int:
    """The planner's allocated peak for the same request (zero3, --framework hf, 2 ranks) under
    DeepSpeed ``release`` (--deepspeed-release), on a GPU's dispatch path or (kernels "cpu") the
    CPU's the run took (Kernels: dropout keeps a noise tensor of its input's dtype, not a bool mask)."""
    import tempfile

    from transformers import LlamaConfig

    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.plan import memory_breakdown
    from zeroplan.specs.strategy import StrategyKind
    from zeroplan.specs.training import Kernels

    path = Path(tempfile.mkdtemp()) / "config.json"
    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096).to_json_file(path)
    attention = "flash" if options.attention == "sdpa" else "eager"  # SDPA's CPU kernel saves what FA2 does
    flags = (f"--gpus 2 --gpu h100-80gb --micro-batch {MICRO_BATCH} --seq-len {options.seq_len} --precision bf16-mixed "
             "--framework hf --lora-rank 8 --lora-targets q,k,v,o,gate,up,down --lora-alpha 16 --lora-dropout 0.1 "
             f"--activation-checkpointing full --attention {attention} --deepspeed-release {release}").split()
    request = request_from_args(build_parser().parse_args(["fit", str(path), *flags]), StrategyKind.zero3)
    request = request.model_copy(update={"strategy": request.strategy.model_copy(
        update={"zero_bucket_elements": STAGE3["reduce_bucket_size"]}),
        "training": request.training.model_copy(update={"kernels": Kernels(kernels)})})
    return memory_breakdown(request)[0].allocated_peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-src", help="a DeepSpeed source tree to run instead of the installed release")
    parser.add_argument("--early-2024-recompute", action="store_true",
                        help="torch's non-reentrant recompute detaching every saved tensor, as early-2024 releases did")
    parser.add_argument("--bf16-adapters", action="store_true",
                        help="cast peft's fp32 adapters to bf16 before deepspeed.initialize, as DeepSpeed before 0.19.2's "
                             "module.bfloat16() did")
    parser.add_argument("--breakdown", action="store_true", help="the bytes live at the run's peak by the op that made them")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--port", type=int, default=None,
                        help="the ranks' rendezvous port on 127.0.0.1 (default: a free one)")
    options = parser.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    out = str(Path(tempfile.mkdtemp()) / "result.json")
    if options.port is None:
        options.port = free_local_port()
    mp.spawn(_rank, args=(2, options, out), nprocs=2)
    remove_deepspeed_shm_buffers(options.port)
    result = json.loads(Path(out).read_text())
    mib = 2**20
    # DeepSpeed before 0.19.2 casts the adapters to bf16 with the module (engine.py
    # _configure_distributed_model), as --bf16-adapters does: the planner's release 0.13.3.
    ds_version = tuple(int(part) for part in result["deepspeed"].split("+")[0].split(".")[:3])
    release = "0.13.3" if options.bf16_adapters or ds_version < (0, 19, 2) else "0.19.8"
    planned = planned_bytes(options, release)
    planned_cpu = planned_bytes(options, release, "cpu")
    print(f"DeepSpeed {result['deepspeed']}, LoRA adapters in {', '.join(result['adapter_dtypes'])}; micro-batch "
          f"{MICRO_BATCH} x seq {options.seq_len}, {options.attention}; torch recompute: "
          f"{'early-2024 (every saved tensor detached)' if options.early_2024_recompute else 'as installed'}")
    for step, peak in sorted(result["step_peaks"].items(), key=lambda kv: int(kv[0])):
        print(f"  step {step}: peak of live CPU bytes {peak / mib:8.2f} MiB")
    print(f"  planned allocated peak (zeroplan, same request, --deepspeed-release {release}): {planned / mib:8.2f} MiB; "
          f"on the CPU's dispatch path the run took: {planned_cpu / mib:8.2f} MiB")
    print("  gathered (non-persistent) parameters at each base linear's backward, last block: "
          + ", ".join(f"{name.split('.')[-2]} {size / mib:.2f}" for name, size in result["gathered_at_last_block_backward"]))
    # transformers' SDPA path builds a boolean causal mask (masking_utils: comparisons and an and) that every
    # checkpointed layer takes as an input; flash-attention 2, which the planner's --attention flash is, builds
    # none. Earlier steps' masks still count at the peak: their frees are the profiler's blind spot (gc finds no
    # mask alive after the run).
    mask_ops = ("aten::le", "aten::eq", "aten::bitwise_and")
    masks = sum(size for size, op, step in result["live_at_peak"] if step >= 0 and op in mask_ops)
    earlier = sum(size for size, op, step in result["live_at_peak"]
                  if 0 <= step < result["peak_step"] and op not in mask_ops)
    peak = result["step_peaks"][str(result["peak_step"])]
    print(f"  at the run's peak (step {result['peak_step']}): {masks / mib:.2f} MiB made by the ops the SDPA mask is "
          f"built with (every step's), {earlier / mib:.2f} MiB else made in earlier steps (optimizer states among "
          f"them); without the masks {(peak - masks) / mib:.2f} MiB")
    if options.breakdown:
        by_op: dict[tuple[str, int, int], int] = {}
        for size, op, step in result["live_at_peak"]:
            by_op[(op, size, step)] = by_op.get((op, size, step), 0) + 1
        for (op, size, step), count in sorted(by_op.items(), key=lambda kv: -kv[0][1] * kv[1]):
            print(f"    {op:32s} step {step:2d} {count:4d} x {size:9d} B = {count * size / mib:7.3f} MiB")


if __name__ == "__main__":
    main()
