"""The NCCL release a torch release loads (TrainingSpec.torch_release), and the releases whose
device memory outside the caching allocator differs from the one zeroplan's buffer sizes read
(zeroplan.core.nccl_buffers, v2.28.3-1; docs/memory-model.md, "Memory outside the allocator").
Nothing here imports torch."""

from __future__ import annotations

from zeroplan.core.torch_release import torch_release
from zeroplan.specs.training import TrainingSpec

NCCL_MODELLED = (2, 28, 3)
"""The release zeroplan.core.nccl_buffers reads; planned where the torch release is not given."""

# The NCCL torch's CUDA wheels load, by the first torch minor release that pins it:
# - 2.0: pytorch/pytorch PR 88125 (2022-11) makes the CUDA 11.7 wheels require
#   nvidia-nccl-cu11==2.14.3 (the 1.x wheels bundled releases older still);
# - 2.1: 2.18.1 (.github/scripts/generate_binary_build_matrix.py at v2.1.1, cited in pytorch/pytorch
#   PR 111677: the 2.1 wheels kept 2.18.1);
# - 2.2: 2.19.3 (pytorch/builder PR 1668, 2024-01-08: "update NCCL to 2.19.3");
# - 2.3: 2.20.5 (pytorch/pytorch PR 121635 and pytorch/builder PR 1724, 2024-03-11, before 2.3's
#   branch cut); 2.4 to 2.6 are not read here and are planned as 2.3's;
# - 2.7: 2.26.2 (pytorch/pytorch PR 149546, the cherry-pick to release 2.7), from which the
#   releases connect at run time as v2.28.3-1 does (v2.22.3-1 on), so they are planned as it.
TORCH_NCCL: tuple[tuple[tuple[int, int], tuple[int, int, int]], ...] = (
    ((2, 0), (2, 14, 3)),
    ((2, 1), (2, 18, 1)),
    ((2, 2), (2, 19, 3)),
    ((2, 3), (2, 20, 5)),
    ((2, 7), NCCL_MODELLED),
)

NVLS_FROM = (2, 17, 1)
"""v2.17.1-1 adds NVLS (src/transport/nvls.cc; v2.16.5-1 has none)."""
NVLS_CHUNKED_FROM = (2, 21, 0)
"""v2.21.5-1 src/transport/nvls.cc:310-311 sizes an NVLS buffer NCCL_STEPS x NVLS_CHUNKSIZE
(128 KiB) where earlier releases took the Simple protocol's NCCL_BUFFSIZE (4 MiB)."""
RUNTIME_CONNECT_FROM = (2, 22, 0)
"""v2.22.3-1 src/init.cc:47 NCCL_RUNTIME_CONNECT (default 1) and :1153-1173: rings, trees and the
NVLS buffers are set up when an algorithm first runs (ncclNvlsBufferSetup) instead of at
communicator initialisation; from it NVLS_MEM_ALIGN_SIZE is no longer added to each buffer."""


NCCL_BY_2022_02 = (2, 11, 4)
"""v2.11.4-1 (tagged 2021-09-08), the last NCCL release before 2022-02-17 (v2.12.7-1 followed on
2022-03-02): the newest a stack of that day can have loaded. Planned for
TrainingSpec.deepspeed_release "2022-bigscience" (zeroplan.core.deepspeed_2022), whose runs name
no torch release; any release of the date connects at initialisation and has no NVLS, which is
all that decides its buffers here."""
DEEPSPEED_2022 = "2022-bigscience"


def nccl_release(training: TrainingSpec) -> tuple[int, int, int]:
    """The NCCL release ``training``'s torch loads: NCCL_MODELLED when no torch release is given
    (NCCL_BY_2022_02 under DeepSpeed's February 2022 source)."""
    if training.torch_release is None:
        return NCCL_BY_2022_02 if training.deepspeed_release == DEEPSPEED_2022 else NCCL_MODELLED
    minor = torch_release(training)[:2]
    found = TORCH_NCCL[0][1]
    for first, nccl in TORCH_NCCL:
        if minor >= first:
            found = nccl
    return found


def connects_at_init(nccl: tuple[int, int, int]) -> bool:
    """Whether ``nccl`` sets up a communicator's NVLS buffers at initialisation, used or not."""
    return nccl < RUNTIME_CONNECT_FROM
