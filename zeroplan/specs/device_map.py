"""What Hugging Face's naive model parallelism (``from_pretrained(device_map=...)``, the layers
split over one process's GPUs: zeroplan.core.parallel.device_map) combines with, the rest refused
in one line naming the field."""

from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import Quantization
from zeroplan.specs.framework import Framework
from zeroplan.specs.parallel import ParallelSpec


def check_device_map(parallel: ParallelSpec, model, cluster, strategy_kind, training) -> None:
    """Refuse a device map the planner does not model. One process drives every GPU: no data
    parallelism (transformers 4.56.2 trainer.py sets is_model_parallel for a model whose
    hf_device_map spans several GPUs and then wraps it in neither DataParallel nor DDP), so
    the strategy is the plain one ('ddp' over one replica) and pp is the GPU count."""
    if parallel.device_map is None:
        return
    if training.framework is not Framework.hf:
        raise ZeroplanError("parallel.device_map", f"is transformers' from_pretrained device map, not "
                            f"{training.framework.value}'s (allowed: framework hf)")
    # accelerate 1.10.1 utils/modeling.py:761 get_max_memory lists the devices torch.cuda.device_count()
    # sees, the GPUs of the process's own node: a split cannot reach another node's.
    if cluster.num_nodes > 1:
        raise ZeroplanError("parallel.device_map", f"splits the layers over the GPUs one process sees, on one node, not "
                            f"{cluster.num_nodes} nodes (allowed: nodes 1, at most {cluster.gpus_per_node} GPUs)")
    if parallel.pp != cluster.world_size:
        raise ZeroplanError("parallel.pp", f"{parallel.pp}: a device map splits the layers over all "
                            f"{cluster.world_size} GPUs, one pipeline rank each (allowed: pp {cluster.world_size})")
    if strategy_kind.value != "ddp":
        raise ZeroplanError("strategy", f"{strategy_kind.value!r} does not run under a device map: one process "
                            "drives every GPU, without data parallelism, FSDP or ZeRO (allowed: ddp, one replica)")
    if model.is_encoder_decoder:
        raise ZeroplanError("parallel.device_map", "is modelled for decoder-only models (allowed: a decoder-only model)")
    finetune = training.finetune
    if not finetune.is_lora:
        raise ZeroplanError("parallel.device_map", "is modelled for LoRA and QLoRA fine-tunes (allowed: with a LoRA rank)")
    if finetune.quantize not in (Quantization.none, Quantization.nf4, Quantization.int8):
        raise ZeroplanError("finetune.quantize", f"{finetune.quantize.value} under a device map: accelerate's sizes "
                            "are read for bitsandbytes only (allowed: none, nf4, int8)")
    for field, used in (("training.compile", training.compile),
                        ("training.activation_offloading", training.activation_offloading),
                        ("training.optimizer_in_backward", training.optimizer_in_backward),
                        ("training.fsdp_cpu_offload", training.fsdp_cpu_offload)):
        if used:
            raise ZeroplanError(field, "is not modelled under a device map (allowed: off with parallel.device_map)")
