"""DeepSpeed 0.14.2's ZeRO-3 coordinator step by step, on deepspeed_zero3_fp16_streams.py's run
(8 gloo ranks, Llama-3-8B 16 times narrower, fp16, checkpointed, the stage-3 defaults over 256):
which parameters each step gathers together, which are still gathered after each backward and
after each optimizer step, and the coordinator's counter of available elements
(__n_available_params) at each step's first fetch, at its first block's and around the optimizer
step.

Measured with --layers 32 (micro-batch 13): the embedding is still gathered after every backward
(its module's input takes no gradient, so no post-backward release); reset_step zeroes the
counter at the backward's end (stage3.py:2215) and the optimizer step's release_and_reset_all
(stage3.py:2021, coordinator :407-421, :478-483) then subtracts it: step 1 starts at -2,052,096
(the embedding's 8,016 x 256), step 2 at -2,068,736 (the 65 persistent norms' 16,640 too:
_post_step gathers them outside the coordinator after step 1's, stage3.py:1986). At 8 blocks
steps 1 and 2 gather and release the same parameters in the same order.

At --layers 2 --world 2 (5 norms, 1,280 elements): --tied starts step 2 at -2,053,376 as the
untied model does (at --layers 8, past the reuse distance, it gathers the weight three times a step,
for the embedding, the head and at the backward's end, and starts at -2,056,448); --frozen-embedding gathers the embedding in each forward only (its output takes
no gradient, so no pre-backward fetch) and starts at -1,280; --frozen-embedding
--input-require-grads (transformers' enable_input_require_grads, as peft calls it under the
reentrant checkpoint) gathers it again at the backward's end, keeps it, and starts at -2,053,376.
With --accumulation 2 the micro-batch after an optimizer step starts at -2,053,376 and the one after
a micro-batch with no step at 0 with the embedding still gathered (its fetch adds nothing, its
release after the forward subtracts it: -2,052,096 in effect).
Without --deepspeed-src the installed DeepSpeed runs (0.19.8): the embedding is released at each
backward's end (backward_epilogue's release_backward_leftovers) and the counter is zeroed at every
forward's start, so each step's first fetch sees 0, every micro-batch's under --accumulation 2 too
(zeroplan.core.deepspeed_coordinator.initial_counter).
Usage:

    python benchmarks/deepspeed_zero3_coordinator_counter.py [--deepspeed-src DIR] [--layers 32]
        [--world 8] [--tied] [--frozen-embedding] [--input-require-grads] [--accumulation N]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import deepspeed_zero3_fp16_streams as m  # noqa: E402

def _rank(rank, world, o):
    from deepspeed_zero3_lora_step import _import_old_deepspeed, start_rank
    start_rank(rank, world, o)
    import torch, torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    if o.deepspeed_src:
        deepspeed = _import_old_deepspeed(o.deepspeed_src)
    else:  # the installed release
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        get_accelerator()._communication_backend_name = "gloo"
    from deepspeed.accelerator import get_accelerator
    type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    log = []
    name = {}
    f = C._PartitionedParameterCoordinator__all_gather_params_
    def g(self, params, forward, quantize=False):
        todo = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if todo:
            log.append(("gather", tuple(sorted(name.get(id(p), "?") for p in todo))))
        return f(self, params, forward, quantize)
    C._PartitionedParameterCoordinator__all_gather_params_ = g
    r = C._PartitionedParameterCoordinator__release_param
    def rr(self, param, *args, **kwargs):
        was = param.ds_status
        out = r(self, param, *args, **kwargs)
        if was != param.ds_status:
            log.append(("release", name.get(id(param), "?")))
        return out
    C._PartitionedParameterCoordinator__release_param = rr
    fs = C.fetch_sub_module
    first_block = [True]
    def ff(self, m, forward):
        if self._PartitionedParameterCoordinator__step_id == 0:
            log.append(("counter at first fetch", self._PartitionedParameterCoordinator__n_available_params, str(self._PartitionedParameterCoordinator__trace_mode)))
        if forward and first_block[0] and type(m).__name__.endswith("DecoderLayer"):
            # After the embedding's forward and its release: 0.19.8 zeroes the counter at the
            # forward's start (parameter_offload.py:299-306), so its offset shows only here.
            first_block[0] = False
            log.append(("counter at first block", self._PartitionedParameterCoordinator__n_available_params))
        return fs(self, m, forward)
    C.fetch_sub_module = ff
    mb = o.micro_batch
    config = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": o.accumulation,
              "train_batch_size": mb * world * o.accumulation,
              "fp16": {"enabled": True, "initial_scale_power": 8}, "steps_per_print": 2**31 - 1,
              "zero_optimization": {"stage": 3, **m.STAGE3}}
    mc = LlamaConfig(vocab_size=m.VOCAB, hidden_size=m.HIDDEN, intermediate_size=m.FFN, num_hidden_layers=o.layers,
                     num_attention_heads=m.HEADS, num_key_value_heads=m.KV, attn_implementation="sdpa", use_cache=False,
                     tie_word_embeddings=o.tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(mc)
    if o.frozen_embedding:
        model.get_input_embeddings().weight.requires_grad_(False)
    if o.input_require_grads:
        # What peft and transformers register under gradient checkpointing with a frozen
        # embedding (modeling_utils.py enable_input_require_grads): its output requires grad.
        model.enable_input_require_grads()
    model.gradient_checkpointing_enable()
    model.train()
    for n, p in model.named_parameters():
        name[id(p)] = n.replace("model.layers.", "L").replace(".self_attn", "").replace(".mlp", "").replace(".weight", "")
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    tokens = torch.randint(0, m.VOCAB, (mb, m.SEQ), generator=torch.Generator().manual_seed(rank))
    def coordinator():
        try:
            return engine.optimizer._get_param_coordinator(training=True)
        except TypeError:  # one coordinator from 0.15.4 on
            return engine.optimizer._get_param_coordinator()
    def avail():
        return sorted(name[id(p)] for p in model.parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)
    for step in range(3 * o.accumulation):
        first_block[0] = True
        log.append(("start", step, avail()))
        logits = engine(input_ids=tokens).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[..., :-1, :].contiguous().view(-1, m.VOCAB), tokens[..., 1:].contiguous().view(-1))
        engine.backward(loss); del loss
        log.append(("after backward", step, avail()))
        log.append(("counter after backward", coordinator()._PartitionedParameterCoordinator__n_available_params))
        engine.step()
        log.append(("after step", step, avail()))
        log.append(("counter after step", coordinator()._PartitionedParameterCoordinator__n_available_params))
    if rank == 0:
        for x in log:
            print(*x, flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed-src", default="", help="an earlier release's source tree (DeepSpeed 0.14.2's); "
                   "the installed release where left out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=13)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--port", type=int, default=29633)
    p.add_argument("--early-2024-recompute", action="store_true")
    p.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps (3 optimizer steps are run)")
    p.add_argument("--tied", action="store_true", help="tie lm_head to the embedding (tie_word_embeddings)")
    p.add_argument("--frozen-embedding", action="store_true", help="the embedding's weight takes no gradient")
    p.add_argument("--input-require-grads", action="store_true",
                   help="make the embedding's output require grad (enable_input_require_grads)")
    o = p.parse_args()
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(o.world, o), nprocs=o.world)
