"""torchtitan 9dec370's whole 2D step (tensor + sequence parallelism under FSDP2) on fake tensors,
its every allocation replayed through the caching-allocator model, beside the planner.

The published 2D rows (benchmarks/published_memory/rows.csv titan-70b-2d*: Llama-3.1-70B, 256
ranks as FSDP 32 x TP 8, local batch 16 x 8192, full recomputation) ran torchtitan 9dec370,
whose model and tensor-parallel plan are not torchtitan 0.3.0's (the installed release): the
model is models/llama/model.py (separate wq/wk/wv, SDPA with repeat_kv, a freqs_cis buffer), the
plan parallelisms/parallelize_llama.py apply_tp. This script imports that model.py from a
checkout of torchtitan at 9dec370 (``--torchtitan-src``; it is not copied into the project) and
applies, on rank 0 of a fake process group of dp x tp ranks:

- apply_tp's plan, stated below as its parallelize_module calls make it (torch's own
  ColwiseParallel/RowwiseParallel/SequenceParallel/PrepareModuleInput), with loss_parallel on
  (9dec370 train.py: enable_loss_parallel = not training.disable_loss_parallel);
- apply_ac (full): checkpoint_wrapper(block, preserve_rng_state=False);
- apply_fsdp: fully_shard per block (the last not resharded after forward), then the root
  (reshard_after_forward None), bf16 parameters, fp32 reduction (config_manager.py defaults);
- train.py's step: pred = model(input_ids); loss_fn = cross_entropy(pred.flatten(0, 1).float(),
  labels.flatten(0, 1)) under loss_parallel(); del pred; loss.backward(); optimizer.step() with
  AdamW(foreach=True) (optimizer.py: foreach = not optimizer.fused) over the local shards; two
  steps, the first creating AdamW's states.

Not run in the step: torch.compile, float8 and AsyncTP (the published rows ran all three but
AsyncTP's). ``--partition`` instead compiles one block as 9dec370 prepares it (``--float8``: with
torchao's float8 linears and tensor-parallel styles) and prints what inductor's partition saves
for backward, under whatever torch runs the script. RMSNorm: 9dec370's own class, taken out of its
norms.py (which imports triton at module level).

    python benchmarks/torchtitan_2d_step.py --torchtitan-src PATH [--layers 80] [--dp 32] [--tp 8]
        [--micro-batch 16] [--seq-len 8192] [--allocator-conf expandable_segments:True] [--local-ops]
    python benchmarks/torchtitan_2d_step.py --torchtitan-src PATH --partition [--float8]

About 40-100 s at 80 blocks on two cores. Measured (torch 2.13, 80 blocks, dp 32 x tp 8, 16 x 8192,
9dec370's own RMSNorm): requested peak 46.16 GiB, at the second step's loss forward (80
sequence-sharded block inputs of 256 MiB, the bf16 local logits, two fp32 local-logit tensors,
the gathered final-norm output and the final norm's fp32 and bf16 tensors); reserved 48.83 GiB
under expandable segments, 56.09 under PyTorch's defaults; published: 71.9. That trace sees
DTensor's operators, not the temporaries of loss_parallel's handlers on the local shard.
``--local-ops`` records DTensor's local operators instead (the trace declines DTensor's, and
leaves out the shape inference DTensor's sharding propagation runs on global-shape fake
tensors): the loss's forward holds 3.5 and its backward 4 fp32 local-logit tensors; requested
peak 57.90 GiB at the second step's loss backward, reserved 64.47 under expandable segments and
71.74 under PyTorch's defaults (about 100 s each). The planner (loss_parallel tensor by tensor,
zeroplan.allocator.fsdp_schedule.run_torchtitan_loss_parallel): allocated 57.84, reserved 63.35
under expandable segments and, with the forward's sequence-parallel collectives
(run_sequence_parallel_forward), 68.99 under the defaults (61.52 without them): the step's forward
leaves its 2 GiB all-gathered block inputs as cached segments the 8 GiB loss tensors cannot use.
The planner column below is the published row's (compiled, float8); for the eager bf16 step's
own flags drop --compile and --float8 from planner(). ``--partition``, with and without ``--float8``, under torch 2.13 +
torchao 0.14.1 and under torch 2.6.0 + torchao 0.8.0 (the releases nearest the runs' torch
1963fc8 and torchao eab345c): the compiled block saves only its 256 MiB input (besides its
parameters and the RoPE table); its backward graph's values peak at 7.0 / 8.0 GiB (torch 2.6,
bf16 / float8) and 9.25 / 9.38 GiB (torch 2.13), unfused.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

# zeroplan's simulation helpers are imported where used: --partition runs under older torch
# releases too (the published runs' torch of December 2024), which they do not support.

GIB = 2**30
LLAMA_31_70B = dict(dim=8192, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                    rope_theta=500000, vocab_size=128256)
"""9dec370 models/llama/__init__.py llama3_configs["70B"] (vocab_size: the tokenizer's 128,256)."""


def load_model_module(src: Path) -> types.ModuleType:
    """9dec370's torchtitan/models/llama/model.py, loaded under its own name so that the
    installed torchtitan is untouched; its one torchtitan import (build_norm) is served by
    9dec370's own RMSNorm class (models/norms.py, norm_type "rmsnorm": config_manager.py's default
    and every train_configs toml's), taken out of norms.py, which imports triton at module level."""
    import ast

    norms_path = src / "torchtitan" / "models" / "norms.py"
    norms_text = norms_path.read_text()
    (node,) = [n for n in ast.parse(norms_text).body if isinstance(n, ast.ClassDef) and n.name == "RMSNorm"]
    norms = types.ModuleType("torchtitan_9dec370_norms")
    norms.__dict__.update(torch=torch, nn=torch.nn)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(norms_path), "exec"), norms.__dict__)  # noqa: S102
    norms.build_norm = lambda norm_type, dim, eps=1e-6: norms.RMSNorm(dim, eps=eps)
    path = src / "torchtitan" / "models" / "llama" / "model.py"
    text = path.read_text().replace("from torchtitan.models.norms import build_norm",
                                    "from torchtitan_9dec370_norms import build_norm")
    sys.modules["torchtitan_9dec370_norms"] = norms
    spec = importlib.util.spec_from_loader("torchtitan_9dec370_model", loader=None)
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks its class's module up in sys.modules.
    sys.modules[spec.name] = module
    exec(compile(text, str(path), "exec"), module.__dict__)  # noqa: S102 (a framework checkout the user names)
    return module


def block_plan(float8: bool) -> dict:
    """9dec370 apply_tp's plan for one block; with float8, torchao's Float8ColwiseParallel,
    Float8RowwiseParallel and PrepareFloat8ModuleInput in place of torch's, as apply_tp swaps them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as ColwiseParallel,
        )
        from torchao.float8.float8_tensor_parallel import (
            Float8RowwiseParallel as RowwiseParallel,
        )
        from torchao.float8.float8_tensor_parallel import (
            PrepareFloat8ModuleInput as PrepareModuleInput,
        )
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_9dec370(model: torch.nn.Module, mesh) -> None:
    """parallelisms/parallelize_llama.py at 9dec370: apply_tp (loss_parallel, no float8), apply_ac
    (full), apply_fsdp (no PP, no CPU offload)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp, block_plan(False))
    for name, block in model.layers.named_children():
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    last = len(model.layers) - 1
    for name, block in model.layers.items():
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=int(name) < last)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=None)


def _pause_during_sharding_propagation(recorder) -> None:
    """Leave DTensor's shape inference (torch/distributed/tensor/_sharding_prop.py
    _propagate_tensor_meta_non_cached: the operator run on fake tensors of the global shape)
    out of the trace."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def paused(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        recorder.paused = True
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.paused = False

    ShardingPropagator._propagate_tensor_meta_non_cached = paused


def run(options: argparse.Namespace):
    """Two training steps; the trace of every storage and the event index of each phase's end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from zeroplan.simulate import _torch_private as private
    from zeroplan.simulate.alloc_trace import (
        HOPPER_CUBLAS_WORKSPACE_BYTES,
        recording_storages,
    )
    from zeroplan.simulate.fake_world import fake_process_group

    module = load_model_module(Path(options.torchtitan_src))
    args = module.ModelArgs(n_layers=options.layers, max_seq_len=options.seq_len, **LLAMA_31_70B)
    marks: list[tuple[str, int]] = []
    with fake_process_group(options.dp * options.tp, 0):
        mesh = init_device_mesh("cpu", (options.dp, options.tp), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = module.Transformer(args)
        apply_9dec370(model, mesh)
        with private.fake_tensor_mode(), recording_storages(HOPPER_CUBLAS_WORKSPACE_BYTES) as recorder:
            if options.local_ops:
                recorder.declines = DTensor
                _pause_during_sharding_propagation(recorder)
            model.to_empty(device="cpu")
            params = list(model.parameters())
            shards = [private.dtensor_local_storage(p) for p in params]
            optimizer = torch.optim.AdamW(shards, lr=1.5e-4, foreach=True)
            tokens = torch.randint(0, args.vocab_size, (options.micro_batch, options.seq_len))
            for step in (1, 2):
                with loss_parallel():
                    pred = model(tokens)
                    marks.append((f"step {step} forward", len(recorder.events)))
                    loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), tokens.flatten(0, 1))
                    marks.append((f"step {step} loss forward", len(recorder.events)))
                    del pred
                    loss.backward()
                marks.append((f"step {step} backward", len(recorder.events)))
                for param, shard in zip(params, shards):
                    shard.grad = None if param.grad is None else private.dtensor_local_storage(param.grad)
                optimizer.step()
                marks.append((f"step {step} optimizer", len(recorder.events)))
                model.zero_grad(set_to_none=True)
                optimizer.zero_grad(set_to_none=True)
                del loss
        trace = recorder.trace("fake tensors: torchtitan 9dec370 2D step")
    return trace, marks


def compiled_partition(options: argparse.Namespace) -> int:
    """One block as 9dec370 prepares it (apply_tp's block plan, float8 with ``--float8``,
    checkpoint_wrapper) on rank 0 of a fake tp group, compiled as apply_compile compiles it
    (fullgraph) but through AOTAutograd with inductor's decompositions and functorch's
    min_cut_rematerialization_partition(compiler="inductor"), the partition inductor makes, under
    the running torch (no code generation: the partition is read and the run stopped). Prints what
    the forward graph saves for backward and the largest bytes the backward graph's own values
    hold at once in its node order (unfused: an upper bound on what inductor's kernels hold)."""

    import torch.distributed as dist
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    # torch's fake process group (torch.testing._internal.distributed.fake_pg registers "fake").
    from torch.testing._internal.distributed.fake_pg import FakeStore

    module = load_model_module(Path(options.torchtitan_src))
    args = module.ModelArgs(n_layers=options.layers, max_seq_len=options.seq_len, **LLAMA_31_70B)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=options.tp)
    try:
        mesh = init_device_mesh("cpu", (options.tp,), mesh_dim_names=("tp",))
        torch.set_default_dtype(torch.bfloat16)  # what FSDP2's MixedPrecisionPolicy hands the block
        block = module.TransformerBlock(0, args)
        if options.float8:
            # 9dec370 float8.py convert_to_float8_training: tensorwise dynamic scaling (the default config).
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(block, config=Float8LinearConfig())
        parallelize_module(block, mesh, block_plan(options.float8))
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        seen: dict[str, object] = {}

        class Partitioned(Exception):
            pass

        def partition(joint, inputs, **kwargs):
            forward, backward = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kwargs)
            seen["forward"], seen["backward"] = forward, backward
            raise Partitioned()

        def backend(graph, example_inputs):
            return aot_module_simplified(graph, example_inputs, fw_compiler=lambda g, _: g, partition_fn=partition,
                                         decompositions=select_decomp_table())

        hidden = torch.randn(options.micro_batch, options.seq_len // options.tp, args.dim, requires_grad=True)
        freqs_cis = module.precompute_freqs_cis(args.dim // args.n_heads, options.seq_len, args.rope_theta)
        try:
            torch.compile(block, backend=backend, fullgraph=True)(hidden, freqs_cis)
        except Exception as error:  # dynamo wraps the backend's exception
            if "forward" not in seen:
                raise error
    finally:
        torch.set_default_dtype(torch.float32)
        dist.destroy_process_group()
    output = next(n for n in seen["forward"].graph.nodes if n.op == "output")
    print(f"torch {torch.__version__}: the compiled block's forward graph returns (its output first, then what it saves):")
    for node in output.args[0]:
        value = getattr(node, "meta", {}).get("val")
        if isinstance(value, torch.Tensor):
            print(f"    {node.name:24s} {tuple(value.shape)} {value.dtype} {_nbytes(value) / 2**20:.1f} MiB")
    print(f"  backward graph: its values' largest live bytes in node order (unfused) {_graph_live_peak(seen['backward']) / GIB:.2f} GiB")
    return 0


def _graph_live_peak(graph_module) -> int:
    """Largest sum of the bytes of a graph's computed values alive at once, each freed after its
    last use; views and getitem are not counted (they hold no storage of their own)."""
    nodes = list(graph_module.graph.nodes)
    last = {inp: i for i, node in enumerate(nodes) for inp in node.all_input_nodes}
    live: dict[object, int] = {}
    now = peak = 0
    for i, node in enumerate(nodes):
        value = node.meta.get("val")
        if node.op == "call_function" and isinstance(value, torch.Tensor) and value._base is None \
                and not _is_view(node):
            live[node] = _nbytes(value)
            now += live[node]
            peak = max(peak, now)
        for inp in node.all_input_nodes:
            if last.get(inp) == i and inp in live:
                now -= live.pop(inp)
    return peak


def _nbytes(value: torch.Tensor) -> int:
    """A graph value's bytes; 0 for one of symbolic size (a scalar dynamo made symbolic)."""
    numel = value.numel()
    return numel * value.element_size() if isinstance(numel, int) else 0


def _is_view(node) -> bool:
    """Whether an aten node returns a view of its input (its schema's alias annotation)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def phase_peaks(trace, marks: list[tuple[str, int]]) -> list[tuple[str, int, dict[int, int]]]:
    """Each phase's requested peak and the sizes alive at it."""
    from zeroplan.allocator.trace import AllocEvent, FreeEvent

    live: dict[int, int] = {}
    now, start, out = 0, 0, []
    for name, end in marks:
        peak, snapshot = 0, {}
        for event in trace.events[start:end]:
            if isinstance(event, AllocEvent):
                live[event.id] = event.size_bytes
                now += event.size_bytes
                if now > peak:
                    peak, snapshot = now, dict(live)
            elif isinstance(event, FreeEvent):
                now -= live.pop(event.id)
        out.append((name, peak, snapshot))
        start = end
    return out


def planner(options: argparse.Namespace) -> tuple[float, float]:
    """The planner's allocated and reserved peaks for the published row's flags."""
    from zeroplan.cli.fit import check_options_apply, request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.plan import memory_breakdown
    from zeroplan.specs.strategy import StrategyKind

    args = build_parser().parse_args([
        "fit", "llama-3.1-70b", "--gpus", str(options.dp * options.tp), "--gpu", "h100-80gb", "--gpu-memory-gib", "95.5",
        "--micro-batch", str(options.micro_batch), "--seq-len", str(options.seq_len), "--activation-checkpointing",
        "full", "--framework", "torchtitan", "--tp", str(options.tp), "--compile", "--float8", "tensorwise",
        "--unchunked-loss", "--torchtitan-release", "9dec370", "--allocator-conf", options.allocator_conf])
    check_options_apply(args)
    breakdown = memory_breakdown(request_from_args(args, StrategyKind.fsdp_full_shard))[0]
    return breakdown.allocated_peak_bytes / GIB, breakdown.reserved_peak_bytes / GIB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchtitan-src", required=True, help="a checkout of torchtitan at 9dec370")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--dp", type=int, default=32)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--allocator-conf", default="expandable_segments:True")
    parser.add_argument("--partition", action="store_true", help="one compiled block's partition instead of the step")
    parser.add_argument("--float8", action="store_true", help="with --partition: torchao's float8 tensorwise linears")
    parser.add_argument("--local-ops", action="store_true",
                        help="record DTensor's local operators (loss_parallel's handlers' temporaries included) "
                             "instead of DTensor's own")
    options = parser.parse_args(argv)
    if options.partition:
        return compiled_partition(options)
    from zeroplan.allocator.capacity import oom_capacity
    from zeroplan.allocator.config import parse_alloc_conf

    start_s = time.perf_counter()
    trace, marks = run(options)
    print(f"{len(trace.events)} events in {time.perf_counter() - start_s:.0f} s")
    for name, peak, snapshot in phase_peaks(trace, marks):
        print(f"  {name:24s} requested peak {peak / GIB:7.2f} GiB")
        if name in ("step 2 forward", "step 2 loss forward", "step 2 backward"):
            for size, count in sorted(collections.Counter(snapshot.values()).items(), key=lambda kv: -kv[0] * kv[1])[:5]:
                print(f"      {count:4d} x {size / 2**20:9.2f} MiB")
    verdict = oom_capacity(trace, parse_alloc_conf(options.allocator_conf))
    allocated, reserved = planner(options) if options.layers == 80 else (float("nan"), float("nan"))
    print(f"replayed under {options.allocator_conf!r}: requested {verdict.unlimited.requested_peak_bytes / GIB:.2f} GiB, "
          f"reserved {verdict.unlimited.reserved_peak_bytes / GIB:.2f} GiB | planner (row flags): allocated "
          f"{allocated:.2f}, reserved {reserved:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
