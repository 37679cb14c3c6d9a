"""Measure what litgpt's whole GPT saves for backward under torch.compile(model), and write the records.

lightning-thunder 3770bf0 thunder/benchmarks/benchmark_litgpt.py (the 'Torch Compile' column of
its issues 1175 and 1176) builds litgpt's GPT (thunder/tests/litgpt_model.py re-exports
litgpt.GPT), casts it to bf16 (init_model: model.to(dtype=torch.bfloat16)) and, for --compile
inductor, compiles the whole module (setup_compile, line 555: ``model = torch.compile(model)``,
dynamo's cache_size_limit 64, no fullgraph, no mode); the loss, F.cross_entropy on the returned
logits, runs outside the compiled module (train(), lines 680-700). Here litgpt's own GPT is
built at the published model's full width on fake tensors with 1, 2 and 3 layers and compiled
the same way through inductor's compile_fx up to code generation
(zeroplan.simulate._torch_private.inductor_without_codegen), recording what the partitioner
(min_cut_rematerialization_partition) saves for the whole graph: the forward graph's outputs
beyond the logits. The per-layer figure is the difference between depths; what does not grow
with depth (the final norm's and the head's saved inputs) is the rest; the first shape is also
measured at the model's own depth (32 layers), which the per-layer figure must reproduce. The
same depths are measured with the graph broken at every block, as FSDP's units break it.

Usage, with a checkout of litgpt at 9a1b82b (the last commit before 2024-09-20, the issues'
date; model.py differs from 00af8b0, the litgpt profile's commit, by a batched-input_pos line):

    python benchmarks/litgpt_compiled_records.py LITGPT_CHECKOUT [OUT_DIR]

litgpt/__init__.py and litgpt/utils.py import lightning; only litgpt/config.py and
litgpt/model.py are loaded, with utils.find_multiple (the one name config.py takes from utils)
given as litgpt 9a1b82b utils.py:57-61 writes it. A few minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import torch

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.compiled import _view_base, partition_saved_values, runtime_saved_bytes
from zeroplan.simulate import _torch_private as private

DEFAULT_OUT = Path(__file__).resolve().parent / "compiled-litgpt-records"
# benchmarks/published_memory/configs/stablecode-completion-alpha-3b.json: the issue-1175 model
# (litgpt config.py "stablecode-completion-alpha-3b": GPT-NeoX defaults, LayerNorm, parallel
# residual, GptNeoxMLP, rotary_percentage 0.25, biases) at two of the published lengths.
RUNS = [("stablecode-completion-alpha-3b", 2048, 1), ("stablecode-completion-alpha-3b", 4096, 1)]
DEPTHS = (1, 2, 3)


# litgpt 9a1b82b utils.py:57-61.
def find_multiple(n: int, k: int) -> int:
    assert k > 0
    if n % k == 0:
        return n
    return n + k - (n % k)


def load_litgpt(checkout: Path) -> types.ModuleType:
    """litgpt.model from ``checkout`` without litgpt/__init__.py (which imports lightning)."""
    package = types.ModuleType("litgpt")
    package.__path__ = [str(checkout / "litgpt")]
    sys.modules["litgpt"] = package
    utils = types.ModuleType("litgpt.utils")
    utils.find_multiple = find_multiple
    sys.modules["litgpt.utils"] = utils
    for name in ("config", "model"):
        spec = importlib.util.spec_from_file_location(f"litgpt.{name}", checkout / "litgpt" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"litgpt.{name}"] = module
        spec.loader.exec_module(module)
        setattr(package, name, module)
    return sys.modules["litgpt.model"]


def saved_tensor_listing(output: torch.Tensor, not_own: set, listed=lambda key: True) -> list[dict]:
    """Each tensor autograd saved in ``output``'s graph with the node that saved it (its shape,
    dtype and storage's bytes), the storages in ``not_own`` (parameters, buffers, token ids) left
    out and only those ``listed`` keeps; each storage named by its index among the listed ones
    (a stable name within the record, where the storages' own keys are addresses)."""
    listing, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
        for attr in sorted(a for a in dir(node) if a.startswith("_saved_")):
            value = getattr(node, attr)
            if (isinstance(value, torch.Tensor) and private.storage_key(value) not in not_own
                    and listed(private.storage_key(value))):
                listing.append({"node": type(node).__name__, "saved": attr[len("_saved_"):],
                                "shape": list(value.shape), "dtype": str(value.dtype),
                                "storage_bytes": value.untyped_storage().nbytes(),
                                "storage": private.storage_key(value)})
    keys = sorted({row["storage"] for row in listing})
    for row in listing:
        row["storage"] = keys.index(row["storage"])
    return listing


def measure(litgpt_model: types.ModuleType, name: str, seq_len: int, micro_batch: int, n_layer: int,
            unit_breaks: bool = False) -> dict:
    """What torch.compile(GPT) saves for backward at ``n_layer`` layers, on fake tensors.

    ``unit_breaks``: each Block and the root carry forward hooks that dynamo does not trace, as
    FSDP2's (torch 2.13 distributed/fsdp/_fully_shard/_fsdp_common.py ``_dynamo_disable`` on
    _fsdp_state.py ``_pre_forward`` / ``_post_forward``; torch 2.5's ``skip_fsdp_hooks``) and
    FSDP1's units (distributed/fsdp/_dynamo_utils.py: dynamo skips the FSDP code, "graph-breaks on
    FSDP module boundaries") put there when fully_shard / auto_wrap_policy={Block} wraps them:
    the graph breaks at every block."""
    torch._dynamo.reset()
    start_s = time.perf_counter()
    config = litgpt_model.Config.from_name(name, n_layer=n_layer, block_size=seq_len)
    with torch.device("meta"):
        model = litgpt_model.GPT(config)
    # benchmark_litgpt.py init_model: model.to(dtype=torch.bfloat16) (the rope cache buffers too).
    model.to(dtype=torch.bfloat16)
    if unit_breaks:
        untraced = torch._dynamo.disable(lambda *args, **kwargs: None, recursive=True)
        for module in (*model.transformer.h, model):
            module.register_forward_pre_hook(untraced)
            module.register_forward_hook(untraced)
    inputs: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        inputs.append(private.dynamo_graph_inputs(gm))
        return private.inductor_without_codegen(gm, example_inputs)

    # Every tensor autograd saves, compiled graphs' and eager ops' alike (a compiled graph's
    # saved values reach save_for_backward, which the hooks see), by storage.
    packed: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed[private.storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with private.fake_tensor_mode(), private.recording_inductor_partitions() as partitions:
        model.to_empty(device="cpu")
        # The rope cache is made at construction on the meta device: rebuilt as GPT.reset_parameters does.
        model.cos, model.sin = (t.to(torch.bfloat16) for t in model.rope_cache(device=torch.device("cpu")))
        compiled = torch.compile(model, backend=backend)
        idx = torch.randint(0, config.padded_vocab_size, (micro_batch, seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = compiled(idx)
        not_own = {private.storage_key(t) for t in (*model.parameters(), *model.buffers(), idx)}
    autograd_saved = sum(n for key, n in packed.items() if key not in not_own)
    record = {
        "model": name, "seq_len": seq_len, "micro_batch_size": micro_batch, "n_layer": n_layer,
        "unit_breaks": unit_breaks,
        "n_embd": config.n_embd, "n_head": config.n_head, "padded_vocab_size": config.padded_vocab_size,
        "intermediate_size": config.intermediate_size, "rope_n_elem": config.rope_n_elem,
        "logits": {"shape": list(logits.shape), "dtype": str(logits.dtype)},
        "dynamo_graphs": len(inputs), "partitions": len(partitions),
        "autograd_saved_bytes": autograd_saved,
    }
    if unit_breaks:
        # GPT.forward's block loop breaks at every block, so dynamo runs that frame eagerly: the
        # embedding, the final norm and the head are eager ops, each block one compiled graph
        # (compiled once, reused by every block).
        record["wall_time_s"] = round(time.perf_counter() - start_s, 1)
        return record
    if len(partitions) != 1 or len(inputs) != 1:
        raise RuntimeError(f"expected one compiled graph (no graph break), got {len(partitions)} partitions "
                           f"of {len(inputs)} dynamo graphs")
    forward, _, user_outputs = partitions[0]
    values = partition_saved_values(forward, user_outputs, inputs[0], hidden=None)
    # A saved view keeps its base's whole storage (the real compiled forward returns a
    # reinterpretation of the base's buffer): each intermediate storage counted once, whole.
    output = forward.graph.find_nodes(op="output")[0]
    saved = [node for node in output.args[0][user_outputs:]
             if isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)]
    bases = {_view_base(node).name: _view_base(node).meta["val"].untyped_storage().nbytes()
             for node, value in zip(saved, values) if value.kind == "intermediate"}
    by_kind: dict[str, int] = {}
    for value in values:
        by_kind[value.kind] = by_kind.get(value.kind, 0) + value.bytes
    record.update({
        "saved_bytes_by_kind": by_kind,
        "intermediate_storage_bytes": sum(bases.values()),
        "runtime_saved_bytes": runtime_saved_bytes(logits.grad_fn, [*model.parameters(), *model.buffers(), idx]),
        "view_bases": {v.name: _view_base(n).name for n, v in zip(saved, values) if _view_base(n) is not n},
        "saved_values": [v.model_dump() for v in values],
        "wall_time_s": round(time.perf_counter() - start_s, 1),
    })
    return record


def main(checkout: Path, out: Path = DEFAULT_OUT) -> None:
    litgpt_model = load_litgpt(checkout)
    out.mkdir(parents=True, exist_ok=True)
    for name, seq_len, micro_batch in RUNS:
        records = [measure(litgpt_model, name, seq_len, micro_batch, n) for n in DEPTHS]
        own = [r["intermediate_storage_bytes"] for r in records]
        per_layer = [b - a for a, b in zip(own, own[1:])]
        full = None
        if (name, seq_len, micro_batch) == RUNS[0]:
            # The model at its own depth, once: the per-layer figure extrapolated must be what the
            # whole graph saves (no choice of the partitioner's changes with depth).
            record = measure(litgpt_model, name, seq_len, micro_batch, litgpt_model.Config.from_name(name).n_layer)
            full = {"n_layer": record["n_layer"], "intermediate_storage_bytes": record["intermediate_storage_bytes"],
                    "runtime_saved_bytes": record["runtime_saved_bytes"], "wall_time_s": record["wall_time_s"]}
        # The graph broken at every block, as FSDP's units break it (fully_shard per Block and
        # the root: benchmark_litgpt.py's fsdp2 branch; Lightning's FSDPStrategy with
        # auto_wrap_policy={Block}).
        broken = [measure(litgpt_model, name, seq_len, micro_batch, n, unit_breaks=True) for n in DEPTHS]
        summary = {
            "source": "torch.compile(litgpt GPT) as lightning-thunder 3770bf0 benchmark_litgpt.py:555 compiles it, "
                      "inductor compile_fx and partition_fn without code generation, fake tensors",
            "litgpt_commit": "9a1b82b", "torch_version": torch.__version__,
            "intermediate_saved_bytes": own, "per_layer_bytes": per_layer,
            "rest_bytes": own[0] - per_layer[0], "full_depth": full, "records": records,
            "unit_breaks_autograd_saved_bytes": [r["autograd_saved_bytes"] for r in broken],
            "unit_breaks_records": broken,
        }
        path = out / f"litgpt_{name}_compile-whole_s{seq_len}_b{micro_batch}.json"
        write_text_atomic(path, json.dumps(summary, indent=2) + "\n")
        print(f"{name} s {seq_len} b {micro_batch}: saved {own} per layer {per_layer} rest {own[0] - per_layer[0]}; "
              f"broken at the blocks {[r['autograd_saved_bytes'] for r in broken]}"
              f"  ({sum(r['wall_time_s'] for r in records):.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT)
