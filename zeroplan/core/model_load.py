"""What a rank holds while the model is loaded, before its first step (TrainingSpec.model_load):
on the host, the model from_pretrained builds; on the GPU, the module DeepSpeed's engine moves
there before ZeRO-3 partitions it. Planned under hf's DeepSpeed ZeRO-3 strategies, where the two
loads differ; elsewhere the load is not planned (docs/memory-model.md, "Host memory")."""

from zeroplan.core.params import total_parameters
from zeroplan.specs.finetune import BaseDtype
from zeroplan.specs.request import PlanRequest
from zeroplan.specs.training import ModelLoad, Precision

FP32_BYTES = 4
HALF_BYTES = 2


# transformers 4.26.0 training_args.py __post_init__ (lines 1303-1312) builds the
# HfTrainerDeepSpeedConfig whose weakref is_deepspeed_zero3_enabled reads (deepspeed.py
# set_hf_deepspeed_config), and modeling_utils.py from_pretrained (lines 2351-2357) enters
# deepspeed.zero.Init only when that answers True: a Trainer user who builds TrainingArguments
# before loading the model gets the sharded load, the profile's default.
def model_load(request: PlanRequest) -> ModelLoad:
    """The load planned: the request's, else hf's default (sharded)."""
    return request.training.model_load or ModelLoad.sharded


def loads_whole_model(request: PlanRequest) -> bool:
    """Whether the request's load materialises the whole model on every rank and the engine
    moves it onto every GPU: full-per-rank under a DeepSpeed ZeRO-3 strategy."""
    kind = request.strategy.kind
    return model_load(request) is ModelLoad.full_per_rank and kind.zero_stage == 3 and not kind.is_fsdp


# transformers 4.26.0 modeling_utils.py from_pretrained: without zero.Init (and without
# low_cpu_mem_usage) the model is built whole on the CPU (lines 2351-2361, cls(config) under
# no_init_weights only) in torch's default float32 unless torch_dtype is given, then each
# checkpoint shard's state dict is copied in and freed (lines 2778-2818). Every rank runs this.
# The shard read beside the model is not counted: its size is the checkpoint's, not an input.
def load_host_bytes(request: PlanRequest) -> int:
    """Host bytes one rank holds at load: the whole model in its load dtype under full-per-rank
    (ZeRO-3), 0 under the sharded load."""
    if not loads_whole_model(request):
        return 0
    return total_parameters(request.model) * load_element_bytes(request)


def load_element_bytes(request: PlanRequest) -> int:
    """Bytes of one parameter as from_pretrained builds it: bf16 where the run passes
    torch_dtype=torch.bfloat16 (a LoRA base loaded in bf16, pure bf16 training), else float32."""
    finetune = request.training.finetune
    if (finetune.is_lora and finetune.base_dtype is BaseDtype.bf16) or request.training.precision is Precision.bf16_pure:
        return HALF_BYTES
    return FP32_BYTES


# DeepSpeed v0.8.0 runtime/engine.py _configure_distributed_model (lines 1124-1151) and v0.13.3
# (lines 1094-1112): the engine casts the module to its fp16/bf16 dtype (module.half(),
# module.bfloat16()), then, unless its parameters came from zero.Init (0.13.3's
# is_zero_init_model: any parameter with a ds_id), calls self.module.to(self.device). Only
# afterwards does the ZeRO-3 optimizer partition it (zero/parameter_offload.py
# _convert_to_zero_parameters -> Init(module=...)), so the whole module sits on every GPU first.
def load_gpu_bytes(request: PlanRequest) -> int:
    """GPU bytes one rank holds when DeepSpeed's engine has moved the whole module there (0
    under the sharded load)."""
    if not loads_whole_model(request):
        return 0
    element = HALF_BYTES if request.training.precision is not Precision.fp32 else load_element_bytes(request)
    return total_parameters(request.model) * element


def load_fits_gpu(request: PlanRequest, usable_bytes: int) -> bool:
    """Whether the module the engine moves onto the GPU at load fits its usable memory."""
    return load_gpu_bytes(request) <= usable_bytes
