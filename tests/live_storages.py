"""A dispatch mode counting, by storage, the tensors made inside it that are still alive: the
measurement tests/test_head_gradients.py and tests/test_offload_stash.py read (live bytes at a
moment of torchtune's own code on the CPU)."""

from __future__ import annotations

import weakref


def live_storage_tracker(skipped: set[int]):  # type: ignore[no-untyped-def]
    """A TorchDispatchMode whose ``live`` maps each storage made inside it and still alive to its
    bytes (``skipped``: storage pointers not to count, e.g. the parameters', which views such as
    aten.t return); ``probe``, when set, is called after every op."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.probe = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    key = storage.data_ptr()
                    if key and key not in self.live and key not in skipped:
                        self.live[key] = storage.nbytes()
                        weakref.finalize(storage, self.live.pop, key)
            if self.probe is not None:
                self.probe()
            return out

    return Live()
