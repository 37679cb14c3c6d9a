"""Where the allocator model's rules were read (docs/memory-model.md, "The caching allocator")."""

from __future__ import annotations

ALLOCATOR_SOURCE = "pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp @ 001074d25084fdb87a799823e395a50f5ec044d3"
"""The stored revision of the allocator whose rules this package models. It is of the
AcceleratorAllocatorConfig era (2.8 and later); that it matches the 2.13 release line rule for
rule is an assumption (docs/memory-model.md)."""

CONFIG_SOURCE = "pytorch/pytorch c10/core/AllocatorConfig.cpp @ 065861fba7598880aa3216822742a1172d0a197c"
"""The stored revision of the PYTORCH_CUDA_ALLOC_CONF parser whose keys and checks config.py follows."""
