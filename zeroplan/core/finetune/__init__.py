"""Fine-tuning's terms of the per-rank breakdown: which parameters train (LoRA adapters over a
frozen, optionally quantized base; frozen embeddings or blocks), what the frozen ones occupy,
and what adapters keep for backward. Each module contributes its terms; with every parameter
training (the default) none changes anything."""
