"""The litgpt profile's terms (torch-free, cheap): each against the byte count its source gives
(zeroplan.core.profiles, litgpt 0.4.13.dev1 at commit 00af8b0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.core.activations import norm_bytes, rms_norm_operand_bytes
from zeroplan.core.buffers import block_backward_transient_bytes, transient_buffer_bytes
from zeroplan.core.framework_loss import LITGPT_LOSS_CHUNK_TOKENS, fsdp_head_gathered_bytes, framework_logits_pieces
from zeroplan.core.frameworks import expanded_kv_extra_bytes, hf_bf16_norm_savings_bytes
from zeroplan.core.params import total_parameters
from zeroplan.core.profiles import check_framework_request, check_framework_strategies, framework_strategies
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, Framework, PlanRequest, Precision, StrategyKind, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import FineTuneSpec, LoraTarget, default_lora_targets

S, B = 512, 2
FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _request(model="llama-3-8b", kind=StrategyKind.ddp, gpus=1, lora_rank=0, framework=Framework.litgpt) -> PlanRequest:
    return PlanRequest(
        model=get_model(model), batch=BatchSpec(seq_len=S, micro_batch_size=B),
        training=TrainingSpec(framework=framework, precision=Precision.bf16_pure,
                              finetune=FineTuneSpec(lora_rank=lora_rank)),
        cluster=cluster_from_gpus(get_gpu("a10g"), gpus), strategy=StrategySpec(kind=kind),
    )


def test_a_tied_model_is_planned_with_litgpts_own_head() -> None:
    tied = get_model("falcon-7b")
    assert tied.tied_embeddings
    request = _request("falcon-7b")
    assert not request.model.tied_embeddings
    assert total_parameters(request.model) == total_parameters(tied) + tied.vocab_size * tied.hidden_size
    assert _request("falcon-7b", framework=Framework.hf).model.tied_embeddings


def test_kv_heads_are_expanded_to_every_query_head() -> None:
    request = _request("falcon-7b")
    model = request.model
    assert model.kv_size == 64 and model.q_size == 4544
    assert expanded_kv_extra_bytes(model, request.training, S, B) == 2 * 2 * S * B * (4544 - 64)


def test_rms_norm_saves_its_fp32_input_and_fp32_product() -> None:
    # litgpt's RMSNorm multiplies by weight.float() before casting back (benchmarks/eager-litgpt-records).
    request = _request("llama-3-8b")
    sbh = S * B * request.model.hidden_size
    assert rms_norm_operand_bytes(request.training, autocast=False) is None
    saved = norm_bytes(request.model, request.training, S, B) - hf_bf16_norm_savings_bytes(request)
    assert saved == 4 * sbh + 4 * sbh


def test_lora_loss_is_fp32_head_chunks_and_their_log_softmax() -> None:
    # lightning's convert_output hands the bf16 chunks back as fp32 copies (LITGPT_LOGITS_BYTES);
    # the model's forward end holds the bf16 chunks, their copies and the previous step's copies.
    request = _request("llama-3-8b", lora_rank=32)
    sbv, chunk = S * B * 128256, 4 * B * LITGPT_LOSS_CHUNK_TOKENS * 128256
    assert framework_logits_pieces(request) == (2 * sbv + 4 * sbv + 4 * sbv, 2 * 4 * sbv + chunk, 2 * 4 * sbv + 2 * chunk)


def test_full_loss_is_three_fp32_logit_tensors() -> None:
    request = _request("llama-3-8b")
    sbv = S * B * 128256
    assert framework_logits_pieces(request) == (2 * sbv + 4 * sbv + 4 * sbv, 3 * 4 * sbv, 3 * 4 * sbv)


def test_a_4bit_head_adds_its_dequantized_weight_and_the_previous_steps_matmul_inputs() -> None:
    from zeroplan.core.finetune.activations import previous_step_matmul_inputs_bytes

    def qlora(version: str) -> PlanRequest:
        return _request("llama-3-8b").model_copy(update={"training": TrainingSpec(
            framework=Framework.litgpt, precision=Precision.bf16_pure,
            finetune=FineTuneSpec(lora_rank=32, quantize="nf4", bitsandbytes_version=version))})

    old, new = qlora("0.42.0"), qlora("0.43.2")
    tokens, sbv, chunk = S * B, S * B * 128256, B * LITGPT_LOSS_CHUNK_TOKENS * 128256
    # Llama-3-8B, 32 blocks: q/k/v read the attention norm's output (4096), o the attention's
    # (4096), gate/up the MLP norm's (4096), down the product (14336); the head the final norm's
    # (4096); not the first block's q/k/v, whose input (the frozen embedding's) needs no gradient.
    assert previous_step_matmul_inputs_bytes(old) == 2 * tokens * (32 * (3 * 4096 + 14336) - 4096 + 4096)
    assert previous_step_matmul_inputs_bytes(new) == 0
    head = (2 + 2) * 128256 * 4096  # fp16 dequantized, then its bf16 copy
    last_chunk = 2 * (sbv - chunk) + head + 4 * sbv
    assert framework_logits_pieces(new)[:2] == (last_chunk, 2 * sbv + 4 * sbv + 4 * sbv)
    extra = previous_step_matmul_inputs_bytes(old)
    assert framework_logits_pieces(old)[:2] == (last_chunk + extra, 2 * sbv + 4 * sbv + 4 * sbv + extra)


def test_fsdp1_root_unit_stays_gathered_to_the_loss_backward() -> None:
    request = _request("llama-3-8b", kind=StrategyKind.fsdp_full_shard, gpus=4)
    gathered = fsdp_head_gathered_bytes(request)
    assert gathered >= 2 * 2 * 128256 * 4096  # bf16 embedding and head, unsharded
    assert framework_logits_pieces(request)[1] == 3 * 4 * S * B * 128256 + gathered


def test_the_fsdp1_root_is_held_beside_every_blocks_units() -> None:
    """FSDP1 reshards the root only at its own post-backward, after every block's: a block's
    backward holds the root (embedding and head, the head's gradient) and its own units, which
    the largest unit (the root) does not bound; hf's and torchtune's FSDP2 roots are bounded."""
    request = _request("llama-2-7b", kind=StrategyKind.fsdp_full_shard, gpus=4)
    root = 2 * 2 * 32000 * 4096 + 2 * 4096  # bf16 embedding, head and final norm, unsharded
    head_gradient = 2 * 32000 * 4096
    # One Llama-2-7B block in bf16 (q, k, v, o 4096^2, the MLP 3 x 4096 x 11008, two norms): two
    # gathered (the block's and the one prefetched) and its unsharded gradient.
    block = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)
    held = block_backward_transient_bytes(request)
    assert held > transient_buffer_bytes(request)  # the root alone, with its gradient
    assert root + head_gradient + 3 * block <= held < root + head_gradient + 3 * block + 2**20  # shard padding
    # hf's FSDP2 root is resharded after its forward but gathered again at the loss's backward and
    # resharded only by its post-backward, after every block's (record_fsdp_step gathers it for the
    # whole backward): the same units beside a block's, not bounded by the largest unit either.
    hf = _request("llama-2-7b", kind=StrategyKind.fsdp_full_shard, gpus=4, framework=Framework.hf)
    assert block_backward_transient_bytes(hf) == held > transient_buffer_bytes(hf)


def test_strategies_defaults_and_refusals() -> None:
    assert framework_strategies(Framework.litgpt, 1) == (StrategyKind.ddp, StrategyKind.fsdp_full_shard)
    assert framework_strategies(Framework.litgpt, 4) == (StrategyKind.fsdp_full_shard,)
    with pytest.raises(ZeroplanError, match="strategies.*zero3.*allowed: fsdp-full-shard"):
        check_framework_strategies(Framework.litgpt, (StrategyKind.zero3,), 4)
    assert default_lora_targets(Framework.litgpt) == (LoraTarget.q, LoraTarget.v)


@pytest.mark.parametrize("model", ["gpt2", str(FIXTURES / "bert-base-uncased.json"), str(FIXTURES / "bloom-560m.json")])
def test_models_litgpt_has_no_config_for_are_refused_in_one_line(model: str) -> None:
    with pytest.raises(ZeroplanError, match="^model: .*litgpt") as error:
        check_framework_request(TrainingSpec(framework=Framework.litgpt), get_model(model))
    assert "\n" not in str(error.value)


def _lora(targets, quantize="none", kind=StrategyKind.ddp, gpus=1, checkpointing="none") -> PlanRequest:
    from zeroplan.specs.finetune import Quantization

    return PlanRequest(
        model=get_model("llama-3-8b"), batch=BatchSpec(seq_len=S, micro_batch_size=B, grad_accum_steps=4),
        training=TrainingSpec(framework=Framework.litgpt, precision=Precision.bf16_pure, activation_checkpointing=checkpointing,
                              finetune=FineTuneSpec(lora_rank=16, lora_targets=targets, lora_dropout=0.05,
                                                    **({"quantize": Quantization.nf4, "double_quant": False}
                                                       if quantize == "nf4" else {}))),
        cluster=cluster_from_gpus(get_gpu("a10g"), gpus), strategy=StrategySpec(kind=kind),
    )


def test_emitted_litgpt_command_names_its_own_switches() -> None:
    from zeroplan.emit.formats import litgpt_command

    t = LoraTarget
    command = litgpt_command(_lora((t.q, t.v, t.gate, t.up, t.down, t.output), quantize="nf4"))
    assert command.startswith("litgpt finetune_lora checkpoints/YOUR_MODEL --devices 1 --num_nodes 1 --precision bf16-true")
    assert "--train.micro_batch_size 2 --train.global_batch_size 8 --train.max_seq_length 512" in command
    assert ("--lora_r 16 --lora_alpha 32 --lora_dropout 0.05 --lora_query true --lora_key false --lora_value true "
            "--lora_projection false --lora_mlp true --lora_head true --quantize bnb.nf4") in command


@pytest.mark.parametrize("targets,kind,gpus,checkpointing,reason", [
    ((LoraTarget.q, LoraTarget.gate), StrategyKind.ddp, 1, "none", "lora_mlp wraps every MLP linear"),
    ((LoraTarget.q,), StrategyKind.fsdp_full_shard, 4, "none", "checkpoints every block under FSDP"),
    ((LoraTarget.q,), StrategyKind.ddp, 1, "full", "checkpoints every block under FSDP"),
])
def test_a_plan_litgpt_cannot_run_is_not_emitted(targets, kind, gpus, checkpointing, reason) -> None:
    from zeroplan.emit.formats import NotApplicable, litgpt_command

    with pytest.raises(NotApplicable, match=reason):
        litgpt_command(_lora(targets, kind=kind, gpus=gpus, checkpointing=checkpointing))


def test_bf16_mixed_runs_an_fp32_module_under_autocast_with_an_fp32_cross_entropy() -> None:
    from zeroplan.core.frameworks import autocast_caches_weights
    from zeroplan.specs.finetune import BaseDtype

    request = PlanRequest(
        model=get_model("llama-2-7b"), batch=BatchSpec(seq_len=S, micro_batch_size=1),
        training=TrainingSpec(framework=Framework.litgpt, precision=Precision.bf16_mixed,
                              finetune=FineTuneSpec(lora_rank=8, base_dtype=BaseDtype.fp32)),
        cluster=cluster_from_gpus(get_gpu("a100-40gb"), 1), strategy=StrategySpec(kind=StrategyKind.ddp),
    )
    assert request.runs_under_autocast and autocast_caches_weights(request)
    sbv, rows = S * 32000, LITGPT_LOSS_CHUNK_TOKENS * 32000
    # The frozen fp32 head cast to bf16 afresh for each of the 512 / 128 = 4 slices, each copy
    # saved until its slice's head backward (framework_loss.litgpt_autocast_head_copies).
    copies = 4 * 2 * 32000 * 4096
    # autocast's bf16 logits and lightning's fp32 copies (and the previous step's); fp32 logits,
    # log-softmax, the last chunk's reshape copy and two gradients.
    assert framework_logits_pieces(request) == (2 * sbv + 4 * sbv + 4 * sbv + copies, 2 * 4 * sbv + 4 * rows + copies,
                                                2 * 4 * sbv + 2 * 4 * rows + copies)


def test_a_bf16_head_is_not_copied_per_slice() -> None:
    from zeroplan.core.framework_loss import litgpt_autocast_head_copies

    assert litgpt_autocast_head_copies(_request(lora_rank=8)) == ()


def test_a_quantized_base_on_several_gpus_is_refused_as_litgpt_refuses_it() -> None:
    with pytest.raises(ZeroplanError, match="^finetune.quantize: litgpt quantizes a base on one GPU only"):
        _lora((LoraTarget.q,), quantize="nf4", kind=StrategyKind.fsdp_full_shard, gpus=4, checkpointing="full")


def test_qlora_head_is_4bit_and_dequantizes_through_fp16() -> None:
    from zeroplan.core.finetune.activations import dequantized_weight_bytes
    from zeroplan.core.parallel.units import rank_parameter_units

    request = _lora((LoraTarget.q, LoraTarget.v), quantize="nf4")
    head = next(t for unit in rank_parameter_units(request) for t in unit.tensors if t.name == "lm_head.weight")
    assert head.quantized and not head.trainable
    # The head is the largest 4-bit weight: dequantized to fp16 (lightning quantized it from
    # fp16), then cast to bf16 beside it.
    assert dequantized_weight_bytes(request) == 128256 * 4096 * (2 + 2)


def test_lora_mlp_on_a_gpt_mlp_wraps_fc_and_proj_as_up_and_down() -> None:
    from zeroplan.core.finetune.units import trainable_parameters
    from zeroplan.core.params import parameter_units
    from zeroplan.emit.formats import litgpt_command
    from zeroplan.specs.finetune import check_finetune

    phi2 = get_model(str(FIXTURES / "phi-2.json"))
    t = LoraTarget
    finetune = FineTuneSpec(lora_rank=8, lora_targets=(t.q, t.k, t.v, t.o, t.up, t.down, t.output))
    check_finetune(finetune, phi2, Framework.litgpt, 1)
    # litgpt/lora.py at 00af8b0: per block the fused qkv adapter (A 3r x h, B 3h x r), proj's
    # (r x h, h x r), GptNeoxMLP fc's (r x h, f x r) and proj's (r x f, h x r); the head's (r x h, V x r).
    h, f, r, v = 2560, 10240, 8, 51200
    per_block = 2 * 3 * r * h + 2 * r * h + (r * h + f * r) + (r * f + h * r)
    assert trainable_parameters(parameter_units(phi2), finetune, Framework.litgpt, phi2) == 32 * per_block + r * h + v * r
    request = PlanRequest(model=phi2, batch=BatchSpec(seq_len=S, micro_batch_size=B),
                          training=TrainingSpec(framework=Framework.litgpt, precision=Precision.bf16_pure, finetune=finetune),
                          cluster=cluster_from_gpus(get_gpu("a10g"), 1), strategy=StrategySpec(kind=StrategyKind.ddp))
    assert "--lora_mlp true" in litgpt_command(request)
    with pytest.raises(ZeroplanError, match="'up': phi-2 has no such layer"):
        check_finetune(finetune, phi2, Framework.hf, 1)
    with pytest.raises(ZeroplanError, match="'gate': phi-2 has no such layer"):
        check_finetune(FineTuneSpec(lora_rank=8, lora_targets=(t.q, t.gate)), phi2, Framework.litgpt, 1)


def test_litgpt_accumulates_unsharded_gradients_under_no_sync_by_default() -> None:
    """finetune/full.py fit() runs the accumulating micro-batches under fabric.no_backward_sync,
    FSDP1's no_sync(): the command line plans litgpt with keep_unsharded_grads_on_accum."""
    from zeroplan.cli.fit import request_from_args
    from zeroplan.cli.main import build_parser
    from zeroplan.core.buffers import backward_held_buffer_bytes
    from zeroplan.core.plan import memory_breakdown

    argv = ["fit", "llama-2-7b", "--gpus", "4", "--gpu", "a10g", "--micro-batch", "4", "--seq-len", "512", "--grad-accum", "4",
            "--activation-checkpointing", "full", "--precision", "bf16-pure"]
    litgpt = request_from_args(build_parser().parse_args([*argv, "--framework", "litgpt"]), StrategyKind.fsdp_full_shard)
    plain = request_from_args(build_parser().parse_args(argv), StrategyKind.fsdp_full_shard)
    assert litgpt.strategy.keep_unsharded_grads_on_accum and not plain.strategy.keep_unsharded_grads_on_accum
    syncing = litgpt.with_strategy(litgpt.strategy.model_copy(update={"keep_unsharded_grads_on_accum": False}))
    assert backward_held_buffer_bytes(litgpt) == 2 * total_parameters(litgpt.model)  # bf16, the whole model
    # The published 4xA10G run of this config ran out of memory (config_hub/finetune/README.md).
    assert memory_breakdown(litgpt)[0].allocated_peak_bytes > get_gpu("a10g").memory_bytes
    assert memory_breakdown(syncing)[0].allocated_peak_bytes < get_gpu("a10g").memory_bytes
