"""When torch itself allocates the gradients and AdamW's states of a plain (non-sharded) training
loop: the order of the tensors its operators make in the first two optimizer steps, on CPU.

A small model (three linear blocks, the middle one under torch.utils.checkpoint, as the
Trainer's gradient checkpointing runs it) trains two optimizer steps of two accumulated
micro-batches each, under torch.optim.AdamW(foreach=True) and zero_grad(set_to_none=True) (torch
2.x's default, HF Trainer's model.zero_grad()). A TorchDispatchMode logs every new storage
an operator returns; each .grad and each state tensor is matched to the operator that made its
storage (the latest one returning that address while the tensor is alive). Printed per phase:
what each allocation became (G: a .grad, S: an optimizer state, T: a foreach temporary, .: an
activation or other temporary).

What it shows (torch 2.13):
- no gradient and no state exists before the first forward;
- each .grad is the tensor the parameter's backward operator returns (AccumulateGrad keeps it,
  torch/csrc/autograd/functions/accumulate_grad.h), made in the first micro-batch's backward
  block by block from the last, between that block's other backward temporaries, before the
  earlier blocks' saved tensors are freed; the second micro-batch adds into them in place;
- AdamW's exp_avg and exp_avg_sq are made at the first optimizer.step() (optim/adamw.py
  _init_group: torch.zeros_like per parameter), then the foreach step's sqrt(exp_avg_sq)
  temporaries (_multi_tensor_adamw: torch._foreach_sqrt) for every parameter at once;
- zero_grad frees the gradients; the second step's backward makes them again, and its
  optimizer step makes only the temporaries.

    python benchmarks/torch_first_step_allocations.py
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

WIDTH, TOKENS, ACCUM, STEPS = 64, 32, 2, 2


class Log(TorchDispatchMode):
    """Every new storage an operator returns: (phase, operator, storage address)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.events: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: not an allocation.
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if (isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes() > 8
                    and tensor.untyped_storage().data_ptr() not in inputs):
                self.events.append((self.phase, str(func), tensor.untyped_storage().data_ptr()))
        return out

    def producer(self, tensor: torch.Tensor) -> int:
        """The index of the latest event whose storage is ``tensor``'s (alive now, so its own)."""
        address = tensor.untyped_storage().data_ptr()
        return max(i for i, event in enumerate(self.events) if event[2] == address)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                                              torch.nn.Linear(4 * WIDTH, WIDTH)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = x + (checkpoint(block, x, use_reentrant=False) if index == 1 else block(x))
        return x


def main() -> int:
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    log = Log()
    kinds: dict[int, str] = {}
    with log:
        print("before the first forward: gradients", sum(p.grad is not None for p in model.parameters()),
              "states", len(optimizer.state))
        for step in range(STEPS):
            for micro in range(ACCUM):
                had = {name for name, p in model.named_parameters() if p.grad is not None}
                log.phase = f"step {step} forward {micro}"
                loss = model(torch.randn(TOKENS, WIDTH)).pow(2).mean()
                log.phase = f"step {step} backward {micro}"
                loss.backward()
                for name, p in model.named_parameters():
                    if name not in had:
                        kinds[log.producer(p.grad)] = "G"
            log.phase = f"step {step} optimizer"
            before = len(log.events)
            fresh = len(optimizer.state) == 0
            optimizer.step()
            if fresh:
                for p in model.parameters():
                    for key in ("exp_avg", "exp_avg_sq"):
                        kinds[log.producer(optimizer.state[p][key])] = "S"
            for i in range(before, len(log.events)):
                if "_foreach_sqrt" in log.events[i][1]:
                    kinds[i] = "T"
            log.phase = f"step {step} zero_grad"
            optimizer.zero_grad(set_to_none=True)
    phases: dict[str, list[str]] = {}
    for i, (phase, _, _) in enumerate(log.events):
        phases.setdefault(phase, []).append(kinds.get(i, "."))
    for phase, marks in phases.items():
        print(f"{phase:22s} {''.join(marks)}")
    print("G: a .grad made (its parameter's first gradient in the step); S: an AdamW state; "
          "T: a foreach temporary; .: any other tensor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
