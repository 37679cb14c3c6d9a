"""zeroplan's reference ZeRO (Rajbhandari et al. 2020), stages 1, 2 and 3, written to be read.

Layout contract (the planner predicts exactly this; change both or neither):

* Units. Parameters are grouped into units: unit 0 = the embedding module (token table, then
  the learned position table if any); units 1..L = the transformer blocks in order; the last unit
  = the final norm (weight, then bias) then the output projection when untied. With tied
  embeddings the output projection is the token table and adds nothing to the last unit.
* Flat buffers. A unit's parameters are flattened in registration order into one buffer,
  zero-padded at the end to a multiple of the world size N; rank r owns the contiguous shard
  [r * P/N, (r+1) * P/N) of the padded length P.
* Stage 1: full parameters and full gradients on every rank; the fp32 master copy and the
  optimizer's states (AdamW's exp_avg and exp_avg_sq, SGD's momentum buffer) exist only for the
  owned shard.
* Stage 2: as stage 1, but each unit's gradients are reduce-scattered as soon as that unit's
  backward is done (post-accumulate-grad hooks) and the full gradients are freed: only the
  shard's gradient (gradient dtype) is kept.
* Stage 3: only the parameter shard is kept. A unit is all-gathered before its forward and freed
  after it, all-gathered again before its backward and freed after it; its gradients are
  reduce-scattered right after its backward. With tied embeddings unit 0 serves both the
  embedding and the head, so it is gathered once before the forward and kept until its backward
  is done (1 all-gather per micro-batch instead of 2).
* Gradient accumulation (K micro-batches per optimizer step; each backward runs on the
  micro-batch's loss / K). Stage 1 keeps full gradients anyway: they add up in ``p.grad`` and
  are reduce-scattered once, in the step. Stages 2 and 3 by default reduce-scatter each unit's
  gradients after every micro-batch's backward and add the result into the unit's gradient
  shard, as DeepSpeed's stage 2 reduces every micro-batch into its partitioned gradient: the
  full gradients of a unit live only until its backward is done, so the resident gradient
  stays the shard (Psi/N) at the price of K reduce-scatters per step. With
  ``keep_unsharded_grads_on_accum`` (the planner's StrategySpec knob of that name) the full
  gradients add up in ``p.grad`` over the first K-1 micro-batches (a full gradient buffer, Psi,
  for the whole accumulation) and are reduce-scattered once, after the last one's backward.
* Collectives per optimizer step (U units, K micro-batches): stage 1 issues U reduce_scatters
  (P elements each, gradient dtype), stage 2 K*U (U with keep_unsharded_grads_on_accum); both
  then, after the sharded update, U all_gathers (P elements, parameter dtype). Stage 3 issues
  K*(2U) all_gathers (K*(2U-1) with tied embeddings) and K*U reduce_scatters (U with
  keep_unsharded_grads_on_accum). Gradients are summed by reduce_scatter and then divided by N
  (averaged).
* Optimizers: any element-wise one (AdamW, Adam, SGD, SGD with momentum) steps the flat fp32
  shards exactly as it would the whole tensors. Adafactor is refused (engines_table.py): its
  factored statistics and its parameter RMS are per whole matrix, which a flat shard cuts.
* Precision. fp32: parameters, gradients and states fp32; the owned slice of the parameters is
  itself the master (no copy). bf16-mixed: bf16 working parameters and gradients; an fp32 master
  copy and fp32 optimizer states for the owned shard; the shard's gradient is cast to fp32 for
  the update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zeroplan.harness.allocator_trace import free_on_this_thread
from zeroplan.harness.engine import (
    MicroBatch, ModelStateTensors, accumulated_loss, make_optimizer, optimizer_state_tensors,
)
from zeroplan.harness.layout import padded_numel, shard_bounds
from zeroplan.harness.model import Transformer, next_token_loss
from zeroplan.specs import Optimizer


def unit_modules(model: Transformer) -> list[nn.Module]:
    """Unit i's module: the embedding, each block, then the head (final norm + projection)."""
    return [model.embed, *model.blocks, model.head]


class FlatUnit:
    """One unit's parameters as views into one zero-padded flat buffer, plus this rank's shard."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, stage: int) -> None:
        self.params = params
        self.world_size, rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in params)
        self.padded_numel = padded_numel(self.numel, self.world_size)
        self.start, self.end = shard_bounds(self.numel, self.world_size, rank)
        self.flat = torch.zeros(self.padded_numel, dtype=dtype)
        offset = 0
        for p in params:
            self.flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        own = self.flat[self.start : self.end]
        # Stage 3 keeps the shard in its own storage so the full buffer can be freed.
        self.param_shard = own.clone() if stage == 3 else own
        # fp32: the owned slice is the master (an alias, no copy); mixed: an fp32 copy.
        self.master = nn.Parameter(
            self.param_shard if dtype == torch.float32 else self.param_shard.float()
        )
        self.master_is_shard = dtype == torch.float32
        """fp32: the master is the working shard itself (no copy back after the step)."""
        self.grad_shard: torch.Tensor | None = None
        self.gathered = True
        self.pending_grads = len(params)

    def gather(self) -> None:
        """All-gather the full parameters into the flat buffer (stage 3)."""
        if self.gathered:
            return
        self.flat.untyped_storage().resize_(self.padded_numel * self.flat.element_size())
        # Autograd saved these parameters (views of flat) in the forward; refilling their
        # storage is not a modification it must reject, so keep the version counter.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat):
            dist.all_gather_into_tensor(self.flat, self.param_shard)
        self.gathered = True

    def free(self) -> None:
        """Drop the full parameters, keeping only the shard (stage 3)."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_scatter_grads(self, free_full: bool) -> None:
        """Flatten the gradients, reduce-scatter them, average, and add the result to this
        rank's gradient shard (micro-batches accumulate there)."""
        # Factories name the device: from stage 2 on this runs in a gradient hook, on autograd's
        # device thread, where the caller's torch.device context does not reach.
        flat_grad = torch.zeros(self.padded_numel, dtype=self.params[0].grad.dtype, device=self.flat.device)
        offset = 0
        for p in self.params:
            flat_grad[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
            if free_full:
                p.grad = None
        shard = torch.empty(self.end - self.start, dtype=flat_grad.dtype, device=flat_grad.device)
        dist.reduce_scatter_tensor(shard, flat_grad)
        free_on_this_thread(flat_grad)
        del flat_grad
        shard.div_(self.world_size)
        if self.grad_shard is None:
            self.grad_shard = shard
        else:
            self.grad_shard.add_(shard)

    @torch.no_grad()
    def update_params_from_master(self, keep_full: bool) -> None:
        """Copy the updated master into the working shard and, for stages 1-2, all-gather it."""
        if not self.master_is_shard:
            self.param_shard.copy_(self.master)
        if keep_full:
            # all_gather_into_tensor wants an input that does not alias its output.
            send = self.param_shard.clone()
            dist.all_gather_into_tensor(self.flat, send)
            free_on_this_thread(send)
            del send


class ReferenceZero:
    """ZeRO stage 1, 2 or 3 over ``model`` on the default process group (see module docstring)."""

    def __init__(
        self, model: Transformer, stage: int, dtype: torch.dtype, optimizer: Optimizer = Optimizer.adamw,
        keep_unsharded_grads_on_accum: bool = False,
    ) -> None:
        assert stage in (1, 2, 3)
        self.module, self.stage = model, stage
        self.keep_unsharded = keep_unsharded_grads_on_accum
        self.micro = MicroBatch()
        self.units: list[FlatUnit] = []
        for module in unit_modules(model):
            params = list(module.parameters())
            self.units.append(FlatUnit(params, dtype, stage))
        self.optimizer = make_optimizer(optimizer, [unit.master for unit in self.units])
        self.tied = model.head.proj is None
        if stage >= 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda _p, u=unit: self._on_grad(u))
        if stage == 3:
            for index, (unit, module) in enumerate(zip(self.units, unit_modules(model))):
                module.register_forward_pre_hook(lambda _m, _a, u=unit: u.gather())
                module.register_forward_hook(lambda _m, _a, out, i=index: self._after_forward(i, out))
                unit.free()

    def _after_forward(self, index: int, output: torch.Tensor) -> None:
        unit = self.units[index]
        if output.requires_grad:
            output.register_hook(lambda _grad: unit.gather())
        if not (index == 0 and self.tied):
            unit.free()

    def _on_grad(self, unit: FlatUnit) -> None:
        unit.pending_grads -= 1
        if unit.pending_grads == 0:  # the unit's backward is done
            unit.pending_grads = len(unit.params)
            if self.micro.is_last or not self.keep_unsharded:
                unit.reduce_scatter_grads(free_full=True)
            if self.stage == 3:
                unit.free()

    def forward_backward(
        self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, micro: MicroBatch = MicroBatch()
    ) -> torch.Tensor:
        self.micro = micro
        if self.stage == 3 and self.tied:
            self.units[0].gather()
        loss = next_token_loss(self.module(tokens_BS), targets_BS)
        accumulated_loss(loss, micro).backward()
        return loss.detach()

    def step(self) -> None:
        for unit in self.units:
            if self.stage == 1:
                unit.reduce_scatter_grads(free_full=False)
            unit.master.grad = unit.grad_shard.to(torch.float32)
        self.optimizer.step()
        for unit in self.units:
            unit.update_params_from_master(keep_full=self.stage < 3)
            # The fp32 gradient (a copy under bf16-mixed) and, at stage 1, the reduced shard are
            # inputs of this update only; what stays is the contract's gradient state (full
            # gradients at stage 1, the shard's gradient from stage 2 on).
            unit.master.grad = None
            if self.stage == 1:
                unit.grad_shard = None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for unit in self.units:
            unit.grad_shard = None
            for p in unit.params:
                p.grad = None

    def model_state_tensors(self) -> ModelStateTensors:
        params = [u.param_shard if self.stage == 3 else u.flat for u in self.units]
        grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        grads += [u.grad_shard for u in self.units if u.grad_shard is not None]
        grads += [u.master.grad for u in self.units if u.master.grad is not None]
        # The fp32 master belongs to the optimizer states (the ZeRO paper's K); under fp32 it
        # is the parameter shard itself and is counted once, as a parameter.
        masters = [u.master for u in self.units]
        return ModelStateTensors(params, grads, masters + optimizer_state_tensors(self.optimizer))

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        names = {id(p): name for name, p in self.module.named_parameters()}
        full: dict[str, torch.Tensor] = {}
        for unit in self.units:
            flat = torch.empty(unit.padded_numel, dtype=unit.flat.dtype, device=unit.flat.device)
            dist.all_gather_into_tensor(flat, unit.param_shard.clone())
            offset = 0
            for p in unit.params:
                full[names[id(p)]] = flat[offset : offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return full
