"""Storages saved for backward are told apart by identities a freed storage cannot pass on.

A storage saved into a graph branch that the forward drops is freed while the forward runs;
its StorageImpl's address (``_cdata``, ``storage_key``) can then be given to a storage made
later. A saved-tensor hook that de-duplicates by that address takes the later storage for the
freed one and does not count it (what made benchmarks/expert_records.py's block_saved vary run
to run)."""

from __future__ import annotations

import torch

from zeroplan.simulate import _torch_private as private

BRANCHES = 64


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = h
        for k in range(BRANCHES):
            branch = (h * 2).sin()  # the product is saved by sin ...
            del branch  # ... and freed with the dropped branch
            out = out + (h * (k + 3)).cos()  # a new product, saved by cos and kept
        return out


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_freed_storage_address_passes_to_a_later_storage_with_a_new_identity() -> None:
    identities = private.StorageIdentities()
    with private.fake_tensor_mode():
        first = torch.empty(4)
        kept = identities(first)
        assert identities(first.view(2, 2)) == kept
        addresses, given = {first.untyped_storage()._cdata}, {kept}
        reused = False
        for _ in range(1000):
            tensor = torch.empty(4)
            address = tensor.untyped_storage()._cdata
            reused = reused or address in addresses
            addresses.add(address)
            given.add(identities(tensor))
            del tensor
            if reused:
                break
        assert reused, "no StorageImpl address was given twice in 1000 storages: nothing was tested"
        # Every storage made got its own identity, the reused addresses included, and the live
        # one kept its own.
        assert len(given) == len(addresses) + 1
        assert identities(first) == kept


def test_the_last_block_hook_counts_every_storage_it_sees_saved() -> None:
    from zeroplan.frameworks.tensor_parallel import _SavedInLastBlock

    with torch.device("meta"):
        model = _Model()
    with private.fake_tensor_mode():
        model.to_empty(device="cpu")
        hook = _SavedInLastBlock(model.block, model)
        addresses = []
        pack = hook._pack

        def noted(tensor: torch.Tensor) -> torch.Tensor:
            addresses.append(tensor.untyped_storage()._cdata)
            return pack(tensor)

        hook.hooks = torch.autograd.graph.saved_tensors_hooks(noted, lambda t: t)
        with hook:
            model(torch.empty(4, 8))
        params = {private.storage_key(p) for p in model.parameters()}
        saves = [a for a in addresses if a not in params]
    # The block input, one product per dropped branch and one per kept one: each a new storage.
    assert len(saves) == 1 + 2 * BRANCHES
    assert len(set(saves)) < len(saves), "no address was reused: the test shows nothing"
    assert len(hook.tensors()) == len(saves)


def test_the_harness_counts_a_saved_storage_at_a_freed_ones_address() -> None:
    # Real CPU tensors: the data of a product saved into a dropped branch is freed and the next
    # product of the same size is usually given the same address (data_ptr).
    from zeroplan.harness.engine import ModelStateTensors
    from zeroplan.harness.memory import SavedActivations

    saved = SavedActivations(ModelStateTensors())
    x = torch.ones(256, requires_grad=True)
    addresses = []
    with saved.hooked():
        h = x * 1
        for k in range(BRANCHES):
            branch = (h * 2).sin()
            addresses.append(branch.grad_fn._saved_self.data_ptr())
            del branch
            other = (h * (k + 3)).cos()
            addresses.append(other.grad_fn._saved_self.data_ptr())
    assert len(set(addresses)) < len(addresses), "no address was reused: the test shows nothing"
    # Each of the 2 x BRANCHES products is a storage of its own, 1 KiB each.
    assert saved.num_bytes == 2 * BRANCHES * 256 * 4
