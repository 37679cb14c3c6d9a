"""Count, on megatron-core's own pipeline schedules, the embedding dropout masks the first
pipeline stage keeps, and write them as a record tests/test_megatron_profile.py compares
zeroplan.core.megatron's count with.

    python benchmarks/megatron_embedding_masks.py

megatron-core 0.16.1 (scripts/setup installs it; zeroplan itself never imports it). Each case
runs in a subprocess of its own (parallel_state is process-global) as pipeline rank 0 of a torch
"fake" process group: a small GPTModel (get_gpt_layer_local_spec, fp32, on the CPU) with
hidden_dropout 0.1 and full recomputation, driven by megatron-core's own
forward_backward_pipelining_without_interleaving or _with_interleaving (the fake group's sends
and receives do nothing, so received gradients are uninitialised: only the bytes matter).
torch.nn.functional.dropout is redirected to torch.native_dropout, the kernel aten's dropout
runs on a CUDA tensor (aten/src/ATen/native/Dropout.cpp is_fused_kernel_acceptable), which saves
a bool mask (the CPU path saves a mask in the input's dtype). A saved-tensor hook wraps every
[s, b, h] bool tensor autograd saves inside model.embedding's forward (the dropout's mask) and
counts the wrappers alive: the most alive at once, and their bytes, are what the record holds,
with the first few tensors the embedding saved.
"""

from __future__ import annotations

from pathlib import Path

from megatron_state_records import cuda_factories_to, run_cases

RECORDS = Path(__file__).resolve().parent / "megatron-embedding-mask-records" / "records.json"

# name, tp, pp, virtual stages, micro-batches, sequence parallel
CASES = [
    ("pp4-m8", 1, 4, 1, 8, False),
    ("pp4-m2", 1, 4, 1, 2, False),
    ("pp2-m4-tp2-sp", 2, 2, 1, 4, True),
    ("pp2-v2-m8", 1, 2, 2, 8, False),
    ("pp4-v2-m8", 1, 4, 2, 8, False),
    ("pp2-v3-m4", 1, 2, 3, 4, False),
]
SEQ, MICRO_BATCH, HIDDEN, VOCAB = 32, 2, 64, 256


def measure(name: str, tp: int, pp: int, v: int, m: int, sp: bool) -> dict:
    import contextlib
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=tp * pp, store=FakeStore())
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self

    cuda_factories_to(torch, "cpu")
    from megatron.core import package_info, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=v if v > 1 else None,
                                             create_gloo_process_groups=False)
    # The recomputation's CUDA RNG bookkeeping (tensor_parallel/random.py) on the CPU generator;
    # the tracker's fork() around the sequence-parallel dropout does nothing here.
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # transformer/torch_norm.py WrappedTorchNorm (the norm without apex or Transformer Engine)
    # refuses sequence parallelism only at construction; the plain torch norm it returns is the
    # same either way (its weight's gradient all-reduce over tp is not what is measured here).
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    norm_new = WrappedTorchNorm.__new__
    WrappedTorchNorm.__new__ = lambda cls, config, *a, **k: norm_new(cls, dataclasses.replace(config, sequence_parallel=False), *a, **k)
    cfg = TransformerConfig(num_layers=2 * pp * v, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=4 * HIDDEN,
                            hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=v if v > 1 else None, sequence_parallel=sp,
                            pipeline_dtype=torch.float32, recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1)
    models = []
    for chunk in range(v):
        models.append(GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                               max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
                               post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
                               vp_stage=chunk if v > 1 else None))
    for model in models:
        model.train()
        model.config.no_sync_func = None

    # aten's dropout on a CUDA tensor: native_dropout, which saves a bool mask.
    def native_dropout(input, p=0.5, training=True, inplace=False):
        return torch.native_dropout(input, p, training)[0] if training and p > 0 else input
    F.dropout = native_dropout

    state = {"inside": 0, "alive": 0, "bytes": 0, "most": 0, "most_bytes": 0, "saved": []}

    class Saved:
        def __init__(self, tensor):
            self.tensor, self.nbytes = tensor, tensor.numel() * tensor.element_size()
            state["alive"] += 1
            state["bytes"] += self.nbytes
            state["most"] = max(state["most"], state["alive"])
            state["most_bytes"] = max(state["most_bytes"], state["bytes"])

        def __del__(self):
            state["alive"] -= 1
            state["bytes"] -= self.nbytes

    def pack(tensor):
        if not state["inside"]:
            return tensor
        if len(state["saved"]) < 4:
            state["saved"].append([str(tensor.dtype), list(tensor.shape)])
        # The dropout's [s, b, h] (or [s/t, b, h]) mask; under tensor parallelism the
        # vocabulary-parallel lookup also saves a [b, s] bool mask of the tokens outside its shard.
        return Saved(tensor) if tensor.dtype is torch.bool and tensor.dim() == 3 else tensor

    def unpack(value):
        return value.tensor if isinstance(value, Saved) else value

    embedding = models[0].embedding
    embedding.register_forward_pre_hook(lambda *a: state.__setitem__("inside", 1))
    embedding.register_forward_hook(lambda *a: state.__setitem__("inside", 0))

    def batches():
        while True:
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ))
            yield dict(tokens=tokens, position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ))

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(batch["tokens"], batch["position_ids"], None)
        return output, lambda out: (out.float().sum(), {})

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        get_forward_backward_func()(forward_step_func=forward_step,
                                    data_iterator=[batches() for _ in range(v)] if v > 1 else batches(),
                                    model=models if v > 1 else models[0], num_microbatches=m, seq_length=SEQ,
                                    micro_batch_size=MICRO_BATCH, forward_only=False)
    return dict(name=name, tp=tp, pp=pp, virtual_stages=v, microbatches=m, sequence_parallel=sp, seq_len=SEQ,
                micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, most_masks_alive=state["most"],
                most_mask_bytes_alive=state["most_bytes"], embedding_saved=state["saved"], alive_after_step=state["alive"],
                megatron_core=package_info.__version__, torch=torch.__version__)


def main() -> None:
    run_cases(__file__, measure, CASES, RECORDS, __doc__)


if __name__ == "__main__":
    main()
