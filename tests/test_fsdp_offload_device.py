"""What FSDP's CPU offload leaves on the GPU: a bitsandbytes base's quantization constants
(zeroplan.core.finetune.offload) and, in the allocator's schedule, the device copy of each unit's
host shard before its all-gather (fsdp_schedule.offload_shard_copy_bytes)."""

from __future__ import annotations

from zeroplan.allocator.planner import _requested_peak_bytes
from zeroplan.allocator.replay import ALLOC_OP, FREE_OP
from zeroplan.allocator.schedule import step_ops
from zeroplan.allocator.trace import Stream
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.peak import peak_allocated_bytes
from zeroplan.core.plan import peak_terms
from zeroplan.specs import StrategyKind
from zeroplan.units import ceil_div

# Answer.AI's fsdp_qlora Llama-2-7B runs: r 64 on all seven linears, two GPUs.
QLORA = ("llama-2-7b --framework hf --gpus 2 --gpu rtx-4090 --micro-batch 2 --seq-len 2048 --precision bf16-pure "
         "--activation-checkpointing full --lora-rank 64 --lora-targets q,k,v,o,gate,up,down")


def _request(flags: str):
    return request_from_args(build_parser().parse_args(["fit", *flags.split()]), StrategyKind.fsdp_full_shard)


def _bnb_nf4_constants(shape: tuple[int, int]) -> int:
    # bitsandbytes Linear4bit at block 64 with double quantization: a uint8 absmax per block, an
    # fp32 absmax per 256 of those, and 1,092 bytes of codes and offset per weight.
    scales = ceil_div(shape[0] * shape[1], 64)
    return scales + 4 * ceil_div(scales, 256) + 4 * 16 + 4 * 256 + 4


def test_offload_leaves_bitsandbytes_constants_on_the_gpu_and_moves_the_rest() -> None:
    kept = model_state_bytes(_request(f"{QLORA} --quantize nf4"))
    moved = model_state_bytes(_request(f"{QLORA} --quantize nf4 --fsdp-cpu-offload"))
    h, f = 4096, 11008
    per_block = 4 * _bnb_nf4_constants((h, h)) + 3 * _bnb_nf4_constants((f, h))
    assert moved.parameter_bytes == 32 * per_block  # whole on each rank, not sharded
    assert moved.gradient_bytes == moved.optimizer_state_bytes == 0
    # Nothing lost: what leaves the GPU is on the host.
    assert moved.parameter_bytes + moved.host_bytes == kept.parameter_bytes + kept.gradient_bytes + kept.optimizer_state_bytes


def test_offload_of_an_unquantized_or_torchao_base_leaves_no_parameter_on_the_gpu() -> None:
    assert model_state_bytes(_request(f"{QLORA} --fsdp-cpu-offload")).parameter_bytes == 0
    tune = QLORA.replace("--framework hf", "--framework torchtune")
    assert model_state_bytes(_request(f"{tune} --quantize nf4 --fsdp-cpu-offload")).parameter_bytes == 0


def test_each_gather_under_offload_first_copies_the_units_shard_to_the_device() -> None:
    request = _request(f"{QLORA} --quantize nf4 --fsdp-cpu-offload")
    states, terms = peak_terms(request)
    ops = step_ops(request, states, terms)
    copies = [i for i, (kind, _, _, stream) in enumerate(ops) if kind == ALLOC_OP and stream == Stream.host_copy]
    gathers = [i for i, (kind, _, _, stream) in enumerate(ops) if kind == ALLOC_OP and stream == Stream.all_gather]
    assert len(copies) == len(gathers) > 0
    for copy, gather in zip(copies, gathers):
        # The shard copy comes just before its unit's all-gather output, is half of it on two
        # ranks, and is freed right after it, before the unit's parameters are made.
        assert gather == copy + 1
        assert ops[copy][2] == ceil_div(ops[gather][2], 2)
        assert ops[gather + 1][:2] == (FREE_OP, ops[copy][1])
    # The copies never raise the step above the planner's allocated peak.
    assert _requested_peak_bytes(ops) <= peak_allocated_bytes(states, terms, 1)[0]
    plain = _request(f"{QLORA} --quantize nf4")
    assert not any(stream == Stream.host_copy for _, _, _, stream in step_ops(plain, *peak_terms(plain)))


def test_under_mixed_precision_the_shard_comes_over_in_fp32_then_is_cast() -> None:
    # FSDP1's _use_low_precision_shard and FSDP2's all_gather_inputs: the fp32 shard copied to the
    # device, its bf16 cast beside it, the fp32 one freed, then the unit's all-gather output.
    flags = "gpt2 --framework hf --gpus 2 --micro-batch 1 --seq-len 512 --precision bf16-mixed --fsdp-cpu-offload"
    request = _request(flags)
    states, terms = peak_terms(request)
    ops = step_ops(request, states, terms)
    assert _requested_peak_bytes(ops) <= peak_allocated_bytes(states, terms, 1)[0]
    first = next(i for i, op in enumerate(ops) if op[0] == ALLOC_OP and op[3] == Stream.host_copy)
    fp32, bf16, freed, gathered = ops[first:first + 4]
    assert bf16[0] == ALLOC_OP and bf16[3] == Stream.host_copy and fp32[2] == 2 * bf16[2]
    assert freed[:2] == (FREE_OP, fp32[1])
    assert gathered[0] == ALLOC_OP and gathered[3] == Stream.all_gather and bf16[2] == ceil_div(gathered[2], 2)
