"""A torch-free model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp)
and the step's allocation trace that drives it. docs/memory-model.md, "The caching allocator",
lists every rule with its source."""
