"""The DeepSpeed settings Hugging Face fills into a config whose entries say "auto": what an
API caller sets on StrategySpec to plan a Trainer run with such a config (the command line
plans DeepSpeed's own defaults, what accelerate's DeepSpeedPlugin without a config file runs).
Measured: benchmarks/hf_deepspeed_buckets.py. Nothing here imports torch.
"""

from __future__ import annotations

from zeroplan.specs.model import ModelSpec
from zeroplan.specs.strategy import StrategySpec


# transformers 4.56.2 integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize
# (accelerate 1.10.1 accelerator.py _prepare_deepspeed fills the same): reduce_bucket_size
# hidden_size^2; at stage 3 stage3_prefetch_bucket_size int(0.9 * hidden_size^2) and
# stage3_param_persistence_threshold 10 * hidden_size.
def hf_auto_strategy(strategy: StrategySpec, model: ModelSpec) -> StrategySpec:
    """``strategy`` with the bucket sizes a Hugging Face "auto" DeepSpeed config resolves to."""
    h = model.hidden_size
    update: dict[str, int] = {"zero_bucket_elements": h * h}
    if strategy.kind.zero_stage == 3 and not strategy.kind.is_fsdp:
        update |= {"deepspeed_prefetch_bucket_elements": int(0.9 * h * h), "deepspeed_param_persistence_threshold": 10 * h}
    return strategy.model_copy(update=update)
