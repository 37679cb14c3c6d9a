"""Measurements of the training frameworks' own model code (torchtitan, Hugging Face
Transformers, torchtune) under fake tensors: what one block keeps for backward, at full width and
full sequence length, on a CPU.

``record`` is torch-free (the planner's tests read the committed records); ``build`` and
``measure`` need torch and the framework itself (``scripts/install-frameworks``).
"""
