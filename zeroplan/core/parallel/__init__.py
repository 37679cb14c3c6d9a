"""Tensor, sequence, context and pipeline parallelism: each dimension a module of its own that
contributes terms to one rank's breakdown (zeroplan.core.parallel.rank composes them). With
every degree 1 each term is the data-parallel planner's own, unchanged. Nothing here imports
torch."""
