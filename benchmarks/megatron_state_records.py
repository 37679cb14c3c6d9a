"""Measure one rank's model-state bytes from megatron-core's own DistributedDataParallel and
DistributedOptimizer, at full size on torch's meta device (no GPU, no memory), and write them
as a record that tests/test_megatron_profile.py compares zeroplan's megatron profile with.

    python benchmarks/megatron_state_records.py

megatron-core 0.16.1 is installed by scripts/setup (pyproject.toml extra `megatron`); zeroplan
itself never imports it, and tests/test_megatron_profile.py reads only the committed records.
Each case runs in a subprocess of its own (parallel_state is process-global), as one rank of a
torch "fake" process group of the case's world size, so megatron builds that rank's
tensor-parallel shards and pipeline stage and its data-parallel group has the case's size.
megatron's GPU-only calls are redirected to the meta device: torch.cuda.current_device
returns "meta", explicit device="cuda" tensor factories make meta tensors, and Tensor.type()
reports meta tensors as torch.cuda.* (the distributed optimizer checks that string). The
model is GPTModel with get_gpt_layer_local_spec (no Transformer Engine or apex), wrapped in
Float16Module as Megatron-LM's training loop wraps it. Optimizer states are created by one
step of the inner optimizer on zero gradients; without apex or Transformer Engine that is
torch's AdamW, whose 0-dim step counters are left out (the fused Adams megatron uses on a GPU
keep the step per parameter group).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic

RECORDS = Path(__file__).resolve().parent / "megatron-state-records" / "records.json"

# name, zeroplan preset, world, tp, pp, rank, distributed optimizer, precision
CASES = [
    ("gpt2-medium-tp2-dp4-distopt", "gpt2-medium", 8, 2, 1, 0, True, "bf16-mixed"),
    ("gpt2-medium-tp2-dp4-ddp", "gpt2-medium", 8, 2, 1, 0, False, "bf16-mixed"),
    ("llama-2-7b-tp4-pp2-dp2-first-distopt", "llama-2-7b", 16, 4, 2, 0, True, "bf16-mixed"),
    ("llama-2-7b-tp4-pp2-dp2-last-distopt", "llama-2-7b", 16, 4, 2, 15, True, "bf16-mixed"),
    ("llama-2-7b-tp8-dp3-distopt", "llama-2-7b", 24, 8, 1, 0, True, "bf16-mixed"),
    ("llama-2-7b-tp4-pp2-dp2-first-fp32-distopt", "llama-2-7b", 16, 4, 2, 0, True, "fp32"),
    ("gpt2-medium-tp2-pp2-dp3-first-distopt", "gpt2-medium", 12, 2, 2, 0, True, "bf16-mixed"),
    # Rank 8 is dp rank 1 of the last stage: the shard without bucket padding, whose fp32 main
    # parameters are the most any rank of the stage holds (ceil(buffer / dp), as planned).
    ("gpt2-medium-tp2-pp2-dp3-last-distopt", "gpt2-medium", 12, 2, 2, 8, True, "bf16-mixed"),
    # Rank 11 (dp rank 2) holds the buffer's end padding in its shard: 384 fewer main elements.
    ("gpt2-medium-tp2-pp2-dp3-last-padded-shard-distopt", "gpt2-medium", 12, 2, 2, 11, True, "bf16-mixed"),
    ("gpt2-medium-tp2-pp2-dp3-last-ddp", "gpt2-medium", 12, 2, 2, 11, False, "bf16-mixed"),
]

# The architectures as megatron-core's TransformerConfig spells them (Megatron-LM's
# --use-mcore-models flags for GPT-2 and Llama-2: examples/gpt3, examples/llama).
ARCHITECTURES = {
    "gpt2-medium": dict(config=dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                                    add_bias_linear=True, normalization="LayerNorm"),
                        vocab=50257, max_seq=1024, position="learned_absolute", tied=True),
    "llama-2-7b": dict(config=dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                                   add_bias_linear=False, normalization="RMSNorm", gated_linear_unit=True,
                                   activation_func="silu"),
                       vocab=32000, max_seq=4096, position="rope", tied=False),
}


def cuda_factories_to(torch, device: str) -> None:
    """Make torch's tensor factories called with an explicit device="cuda..." make ``device``
    tensors (megatron's GPU-only calls). Shared with megatron_embedding_masks.py."""
    def redirected(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = device
            return fn(*args, **kwargs)
        return wrapped

    for factory in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, factory, redirected(getattr(torch, factory)))


def run_cases(script: str, measure, cases: list[tuple], records: Path, doc: str) -> None:
    """``script``'s command line: with a case (JSON) as its argument, that case measured and
    printed as JSON; without, every case in a subprocess of its own (parallel_state is
    process-global), each record printed, then all written to ``records``. Shared with
    megatron_embedding_masks.py."""
    if len(sys.argv) > 1:
        print(json.dumps(measure(*json.loads(sys.argv[1]))))
        return
    results = []
    for case in cases:
        out = subprocess.run([sys.executable, script, json.dumps(case)], capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"{case[0]}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1])
    how = f"{doc.strip().splitlines()[0]} (benchmarks/{Path(script).name})"
    write_text_atomic(records, json.dumps({"how": how, "records": results}, indent=1) + "\n")


def measure(name: str, preset: str, world: int, tp: int, pp: int, rank: int, distopt: bool, precision: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    torch.cuda.current_device = lambda: "meta"
    # language_module.py moves a tied embedding's copy with .cuda() before its all-reduce.
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import package_info, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    arch = ARCHITECTURES[preset]
    config = dict(arch["config"])
    if config.get("activation_func") == "silu":
        config["activation_func"] = F.silu
    bf16 = precision == "bf16-mixed"
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(**config, bf16=bf16, params_dtype=dtype, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            pipeline_dtype=dtype if pp > 1 else None)
    # Megatron-LM pads the tokenizer's vocabulary to a multiple of 128 x tp (vocab_size_with_padding).
    vocab = -(-arch["vocab"] // (128 * tp)) * 128 * tp
    with torch.device("meta"):
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config["normalization"]),
                         vocab_size=vocab, max_sequence_length=arch["max_seq"],
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage(),
                         share_embeddings_and_output_weights=arch["tied"], position_embedding_type=arch["position"])
        if bf16:
            model = Float16Module(cfg, model)
    parameter_elements = sum(p.numel() for p in model.parameters())

    cuda_factories_to(torch, "meta")
    tensor_type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (tensor_type(self, *a, **k).replace("torch.meta.", "torch.cuda.")
                                               if not a and not k else tensor_type(self, *a, **k))

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(cfg, ddp_config, model)
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    param_buffer = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers if b.param_data is not None)
    grad_buffer = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    # Without the distributed optimizer the parameters stay the module's own tensors.
    module_parameters = 0 if distopt else sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", bf16=bf16, use_distributed_optimizer=distopt,
                                                       lr=1e-4), [ddp], use_gloo_process_groups=False)
    inners = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    main = [p for inner in inners for g in inner.param_groups for p in g["params"]]
    # fp32 training steps the parameters themselves (views into the buffer), not copies.
    main_copies = sum(p.numel() * p.element_size() for p in main) if bf16 else 0
    for p in main:
        p.grad = torch.zeros_like(p)
    for inner in inners:
        inner.step()
    states = sum(t.numel() * t.element_size() for inner in inners for st in inner.state.values()
                 for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    return dict(
        name=name, preset=preset, data_parallel_rank=parallel_state.get_data_parallel_rank(), world=world, tp=tp, pp=pp, rank=rank, distributed_optimizer=distopt,
        precision=precision, padded_vocab=vocab, data_parallel_size=parallel_state.get_data_parallel_world_size(),
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(), megatron_core=package_info.__version__,
        torch=torch.__version__, rank_parameter_elements=parameter_elements,
        buffer_elements=sum(b.numel for b in buffers), buffer_elements_unpadded=sum(b.numel_unpadded for b in buffers),
        parameter_bytes=param_buffer + module_parameters, gradient_bytes=grad_buffer,
        main_parameter_bytes=main_copies, optimizer_state_bytes=states,
    )


def main() -> None:
    run_cases(__file__, measure, CASES, RECORDS, __doc__)


if __name__ == "__main__":
    main()
