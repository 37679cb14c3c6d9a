"""What a quantized base leaves on the GPU when FSDP offloads the parameters to the host.

FSDP's CPU offload moves parameters only: FSDP1's CPUOffload(offload_params=True) moves each
unit's FlatParameter (torch 2.13 distributed/fsdp/_init_utils.py:672-673, ``flat_param_to(cpu)``
after flattening; _flat_param.py:1258-1267 pins it as ``_local_shard`` and keeps ``_cpu_grad``
beside it), FSDP2's CPUOffloadPolicy each sharded parameter (_fully_shard/_fsdp_param.py
``_init_sharded_param``, _fsdp_param.py:313: ``padded_sharded_param.cpu()``). bitsandbytes keeps a weight's
quantization constants beside the parameter, not in it: Linear4bit's QuantState (the absmax per
block and, with double quantization, its second-level constants) and Linear8bitLt's SCB are plain
attributes (zeroplan.core.finetune.storage.quantized_layout's second part, which every rank holds
whole). They are made where the weight is quantized, on the GPU (bitsandbytes quantizes only on a
device; Answer.AI's fsdp_qlora train.py, commit 05ed9f2, ``load_and_quantize``: ``type(param)(
value...).cuda(device)`` quantizes, then only ``.data`` goes to the CPU or the meta device, the
QuantState staying where it was made), and neither offload moves them: they stay on the GPU for
the whole run, while the packed codes, the parameter FSDP shards, go to the host.

torchao's NF4Tensor (torchtune) is the parameter itself, constants included, so an offloaded
torchtune base leaves nothing behind.
"""

from __future__ import annotations

from zeroplan.core.finetune.storage import quantized_layout
from zeroplan.core.parallel.units import rank_parameter_units
from zeroplan.core.profiles import profile
from zeroplan.specs.request import PlanRequest


def quant_constants_stay_on_device(request: PlanRequest) -> bool:
    """Whether the request offloads FSDP's parameters over a bitsandbytes-quantized base (nf4 or
    int8), whose constants are attributes the offload does not move."""
    finetune = request.training.finetune
    return (request.training.fsdp_cpu_offload and finetune.quantize.value in ("nf4", "int8")
            and profile(request.training.framework).nf4_library.startswith("bitsandbytes"))


# bitsandbytes 0.43-0.50 nn/modules.py: Params4bit.quant_state and Int8Params.SCB are attributes of
# the parameter (and, from 0.43, of the module: Linear4bit.quant_state,
# fix_4bit_weight_quant_state_from_module), never registered as parameters or buffers, so FSDP
# neither flattens nor offloads them.
def offloaded_quant_constant_bytes(request: PlanRequest) -> int:
    """The bytes of the quantized base's constants one rank keeps on the GPU under FSDP CPU
    offload (0 where nothing stays: no offload, no bitsandbytes base)."""
    if not quant_constants_stay_on_device(request):
        return 0
    return sum(quantized_layout(request, tensor)[1]
               for unit in rank_parameter_units(request) for tensor in unit.tensors
               if tensor.quantized and not tensor.trainable)
