"""The fairseq profile (zeroplan.core.fairseq, docs/frameworks.md "fairseq"): fairseq c6006678's
transformer_lm on torch 1.8 under fairscale's FSDP. Its byte terms against the sources' shapes,
fairseq's GELU measured with saved-tensor hooks, the README's 13B run planned as it ran, and the
one-line refusals of what the profile does not plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zeroplan.cli.fit import check_options_apply, request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.activations import layer_terms
from zeroplan.core.fairseq import (
    fairseq_layer_delta_bytes,
    fairseq_logits_parts,
    gelu_upcast_bytes,
    held_layer_gradient_bytes,
    kept_scores_bytes,
    softmax_backward_extra_bytes,
    softmax_backward_temporary_bytes,
)
from zeroplan.core.feasibility import usable_memory_bytes
from zeroplan.core.plan import pipeline_rank_breakdowns
from zeroplan.errors import ZeroplanError
from zeroplan.specs.strategy import StrategyKind
from zeroplan.specs.training import AttentionKernel

ROOT = Path(__file__).resolve().parents[1]
GPT3_13B = str(ROOT / "benchmarks" / "published_memory" / "configs" / "fairseq-transformer-lm-gpt3-13.json")
SMALL = ["gpt2", "--gpus", "2", "--micro-batch", "2", "--seq-len", "64", "--framework", "fairseq",
         "--activation-checkpointing", "full"]


def _request(*flags: str, strategy: StrategyKind = StrategyKind.fsdp_full_shard):
    args = build_parser().parse_args(["fit", *flags])
    check_options_apply(args)
    return request_from_args(args, strategy)


def test_defaults_are_the_readme_runs():
    """--fp16 and eager attention (torch 1.8's multi_head_attention_forward) by default, no unit
    gathered ahead (fairscale 05ce7971 gathers each unit's own parameters only)."""
    request = _request(*SMALL)
    assert request.training.precision.value == "fp16-mixed"
    assert request.training.attention_kernel is AttentionKernel.eager
    assert request.strategy.prefetch_units == 0


@pytest.mark.parametrize("strategy", [StrategyKind.fsdp_full_shard, StrategyKind.fsdp_shard_grad_op])
def test_one_gpu_accumulates_into_the_fp32_shard(strategy):
    """trainer.py maybe_no_sync enters no_sync() only where data_parallel_world_size > 1: on one
    GPU each micro-batch reduces into the fp32 shard, which stays alive through the next, so a
    step of two micro-batches allocates no less than a step of one (it held the fp16 unsharded
    gradients instead, half the fp32 shard's bytes on one GPU, and planned less)."""
    one_gpu = [flag if flag != "2" or SMALL[i - 1] != "--gpus" else "1" for i, flag in enumerate(SMALL)]
    accumulating = _request(*one_gpu, "--grad-accum", "2", strategy=strategy)
    assert not accumulating.strategy.keep_unsharded_grads_on_accum
    assert _request(*SMALL, "--grad-accum", "2", strategy=strategy).strategy.keep_unsharded_grads_on_accum
    single = _request(*one_gpu, strategy=strategy)
    allocated = [max(b.allocated_peak_bytes for b, _ in pipeline_rank_breakdowns(r)) for r in (single, accumulating)]
    assert allocated[1] >= allocated[0]


def test_layer_delta_is_the_kept_scores_and_the_fp32_gelu_input():
    request = _request(*SMALL)
    s, b, h, a, f = 64, 2, 768, 12, 3072
    assert kept_scores_bytes(request) == 2 * a * s * s * b
    assert gelu_upcast_bytes(request) == (4 - 2) * s * b * f
    assert fairseq_layer_delta_bytes(request) == 2 * a * s * s * b + 2 * s * b * f
    # In fp32 .float() returns the tensor itself: only the kept scores remain.
    fp32 = _request(*SMALL, "--precision", "fp32")
    assert gelu_upcast_bytes(fp32) == 0
    assert fairseq_layer_delta_bytes(fp32) == 4 * a * s * s * b
    del h


def test_fairseq_gelu_keeps_its_fp32_input():
    """fairseq/modules/gelu.py gelu(x) = F.gelu(x.float()).type_as(x) keeps 4 + e bytes per inner
    element (GELU's fp32 input, fc2's cast-back input) where F.gelu on the compute dtype keeps 2e:
    gelu_upcast_bytes' 4 - e, measured on the CPU with saved-tensor hooks (bf16, e = 2)."""
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(activation) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.nn.Parameter) and t is not w:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = x @ w  # fc1's output (its input x is not counted: the same in both)
            (activation(hidden) @ w).sum()
        return sum(seen.values()) - x.untyped_storage().nbytes()

    fairseq = saved_bytes(lambda t: F.gelu(t.float()).type_as(t))
    reference = saved_bytes(F.gelu)
    assert fairseq - reference == (4 - 2) * 8 * 16


def test_loss_keeps_fp16_logits_and_fp32_log_probabilities():
    request = _request(*SMALL)
    sbv = 64 * 2 * request.model.vocab_size
    assert fairseq_logits_parts(request) == (2 * sbv, 4 * sbv, 4 * sbv, 2 * sbv)


def test_softmax_backward_moment():
    """The scores' and probabilities' gradients, torch 1.8's CUDA `grad * output` product, and
    under FSDP the layer's flat-parameter views' gradients computed so far, less what the block
    saved after its attention core (freed by the softmax's backward)."""
    request = _request(*SMALL)
    s, b, h, a, f = 64, 2, 768, 12, 3072
    terms = layer_terms(request.model, request.training, s, b)
    freed = (2 * s * b * h) * 3 + terms["mlp_inner"] + 2 * s * b * f + terms["hidden_dropout_masks"]
    assert softmax_backward_temporary_bytes(request) == 2 * a * s * s * b
    # out_proj (weight, bias), the second LayerNorm (weight, bias), fc1 and fc2 (weights, biases), fp16.
    held = 2 * (h * h + h + 2 * h + 2 * h * f + f + h)
    assert held_layer_gradient_bytes(request) == held
    assert softmax_backward_extra_bytes(request) == max(0, 3 * 2 * a * s * s * b + held - freed)
    # DDP: each gradient goes to its AccumulateGrad (the model states' gradients), none held.
    assert held_layer_gradient_bytes(_request(*SMALL, strategy=StrategyKind.ddp)) == 0
    # Long sequences: the quadratic gradients win.
    long = _request("gpt2", "--gpus", "2", "--micro-batch", "1", "--seq-len", "1024", "--framework", "fairseq")
    assert softmax_backward_extra_bytes(long) > 0


@pytest.mark.slow  # replays the caching allocator over a 13B step
def test_readme_13b_offload_run_fits_one_v100():
    """examples/fully_sharded_data_parallel/README.md @c6006678: the 13B run completed on one
    32 GB V100 (gb_free 9.3); the plan must not call it out of memory."""
    request = _request(GPT3_13B, "--gpus", "1", "--gpu", "v100-32gb", "--micro-batch", "8", "--seq-len", "2048",
                       "--framework", "fairseq", "--activation-checkpointing", "full", "--fsdp-cpu-offload")
    breakdown = max((b for b, _ in pipeline_rank_breakdowns(request)), key=lambda b: b.peak_bytes)
    assert breakdown.peak_bytes <= usable_memory_bytes(request)
    assert breakdown.parameter_bytes == breakdown.optimizer_state_bytes == 0  # fp32 shard and Adam on the host


@pytest.mark.slow  # replays the caching allocator over a 13B step
@pytest.mark.parametrize(("micro_batch", "fits"), [(1, True), (2, False)])
def test_readme_13b_without_offload_fits_batch_1_only(micro_batch, fits):
    """The same README, '13B params on 8 V100 GPUs': without CPU offloading only a batch size of
    1 per GPU fits. What grows with the batch at the first layer's backward, where nearly every
    gradient shard is allocated: the scores, the probabilities, their gradients and torch 1.8's
    `grad * output` product in the recomputed layer's softmax backward."""
    request = _request(GPT3_13B, "--gpus", "8", "--gpus-per-node", "8", "--gpu", "v100-32gb", "--micro-batch",
                       str(micro_batch), "--seq-len", "2048", "--framework", "fairseq", "--activation-checkpointing", "full",
                       "--optimizer", "adam")
    breakdown = max((b for b, _ in pipeline_rank_breakdowns(request)), key=lambda b: b.peak_bytes)
    assert (breakdown.peak_bytes <= usable_memory_bytes(request)) is fits


@pytest.mark.parametrize(("flags", "field"), [
    (("--attention", "flash"), "attention_kernel"),
    (("--precision", "fp32", "--fsdp-cpu-offload"), "fsdp_cpu_offload"),
    (("--precision", "bf16-mixed"), "precision"),
])
def test_refusals_name_the_field(flags, field):
    with pytest.raises(ZeroplanError) as refused:
        _request(*SMALL, *flags)
    message = str(refused.value)
    assert field in message and "allowed" in message and "\n" not in message


def test_refuses_models_and_strategies_it_does_not_build():
    with pytest.raises(ZeroplanError) as refused:
        _request("llama-2-7b", "--gpus", "2", "--framework", "fairseq")
    assert "transformer_lm" in str(refused.value) and "allowed" in str(refused.value)
    from zeroplan.core.profiles import check_framework_strategies
    from zeroplan.specs.framework import Framework

    with pytest.raises(ZeroplanError) as refused:
        check_framework_strategies(Framework.fairseq, (StrategyKind.zero2,), 2)
    assert "fsdp-full-shard" in str(refused.value) and "ddp" in str(refused.value)


def test_ddp_runs_fp16_optimizer():
    """--ddp-backend c10d with --fp16: the model is fp16 itself (no autocast), FP16Optimizer keeps
    a flat fp32 master and a flat fp32 gradient beside Adam's fp32 states, and torch 1.8 DDP's
    buckets copy the fp16 gradients: 2 + 2 + 16 bytes a parameter and 2 of buckets."""
    from zeroplan.core.buffers import resident_buffer_bytes
    from zeroplan.core.model_states import model_state_bytes

    request = _request(*SMALL, strategy=StrategyKind.ddp)
    states = model_state_bytes(request)
    n = states.parameter_elements
    assert not request.runs_under_autocast
    assert states.parameter_bytes == states.gradient_bytes == 2 * n
    assert states.optimizer_state_bytes - states.step_counter_bytes == (4 + 4 + 8) * n
    assert resident_buffer_bytes(request) == 2 * n
    fp32 = model_state_bytes(_request(*SMALL, "--precision", "fp32", strategy=StrategyKind.ddp))
    assert fp32.parameter_bytes == fp32.gradient_bytes == 4 * n


@pytest.mark.slow
@pytest.mark.parametrize("flat", [False, True], ids=["ddp", "fairscale-flat-param"])
def test_layer_and_softmax_backward_measured_on_the_cpu(tmp_path, flat):
    """A fairseq pre-norm decoder layer written as its ops run (torch 1.8 nn/functional.py
    multi_head_attention_forward: q*scaling, bmm, the float mask added in place, softmax, bmm,
    out_proj; fairseq's fp32 GELU), fp32 on the CPU, live storages counted per op
    (tests/live_storages.py). Under DDP the backward asks for the input's gradient only, so no
    weight gradient (the planner's gradients, not its workspace) is made; under fairscale's FSDP
    the weights are views of one flat parameter made at the forward
    (flatten_params_wrapper.py _unflatten_params_as_views) and the backward asks for its gradient
    too, which autograd's split backward makes only once every view's gradient has arrived
    (held_layer_gradient_bytes; the planner's biases and norm weights, which this layer lacks, are
    within the tolerance). The softmax is torch 1.8's on CUDA, which this CPU torch does
    not run: it keeps its input beside its output (derivatives.yaml) and its backward
    materialises `grad * output` before writing the scores' gradient (cuda/SoftMax.cu
    softmax_backward_cuda). Saved after the forward: the planner's layer (framework_layer_bytes);
    the most alive in its backward beyond that: the residual workspace and
    softmax_backward_extra_bytes, to within one residual-stream tensor."""
    import json

    from tests.live_storages import live_storage_tracker
    from zeroplan.core.activations import backward_workspace_bytes
    from zeroplan.core.frameworks import framework_layer_bytes

    s, b, h, a, f = 128, 1, 64, 4, 256
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512, "n_embd": h, "n_layer": 2, "n_head": a,
                                  "n_inner": f, "n_positions": s, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                  "attn_pdrop": 0.0, "tie_word_embeddings": False}))
    request = _request(str(config), "--gpus", "2", "--micro-batch", str(b), "--seq-len", str(s), "--framework", "fairseq",
                       "--precision", "fp32", "--activation-checkpointing", "none",
                       strategy=StrategyKind.fsdp_full_shard if flat else StrategyKind.ddp)
    torch.manual_seed(0)
    d = h // a
    shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "fc1": (f, h), "fc2": (h, f)}
    flat_param = (torch.randn(sum(m * n for m, n in shapes.values())) * 0.1).requires_grad_()
    # Under FSDP the layer's forward makes the views; separate weights otherwise.
    w = {} if flat else {name: (torch.randn(shape) * 0.1).requires_grad_() for name, shape in shapes.items()}
    mask = torch.triu(torch.full((s, s), float("-inf")), 1)

    class Torch18CudaSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scores):
            probs = torch.softmax(scores, dim=-1)
            ctx.save_for_backward(scores, probs)  # _softmax_backward_data(grad, result, dim, self)
            return probs

        @staticmethod
        def backward(ctx, grad):
            _, probs = ctx.saved_tensors
            tmp = grad * probs  # softmax_backward_cuda: Tensor tmp = grad * output;
            grad_input = torch.empty_like(tmp)  # host_softmax_backward's gI, written from tmp
            torch.mul(probs, tmp.sum(-1, keepdim=True), out=grad_input)
            return torch.sub(tmp, grad_input, out=grad_input)

    def layer(x):
        if flat:
            views = flat_param.split([m * n for m, n in shapes.values()])
            w.update({name: t.view(shape) for (name, shape), t in zip(shapes.items(), views)})
        y = F.layer_norm(x, (h,))
        q = F.linear(y, w["q"]) * d ** -0.5
        k, v = F.linear(y, w["k"]), F.linear(y, w["v"])
        q, k, v = (t.contiguous().view(s, b * a, d).transpose(0, 1) for t in (q, k, v))
        scores = torch.bmm(q, k.transpose(1, 2))
        scores += mask
        out = torch.bmm(Torch18CudaSoftmax.apply(scores), v).transpose(0, 1).contiguous().view(s, b, h)
        x = x + F.linear(out, w["o"])
        y = F.layer_norm(x, (h,))
        return x + F.linear(F.gelu(F.linear(y, w["fc1"]).float()).type_as(y), w["fc2"])

    skipped = {t.untyped_storage().data_ptr() for t in (*w.values(), mask, flat_param)}
    x = torch.randn(s, b, h, requires_grad=True)
    skipped.add(x.untyped_storage().data_ptr())
    tracker = live_storage_tracker(skipped)
    with tracker:
        out = layer(x)
        output_bytes = out.untyped_storage().nbytes()
        saved = sum(tracker.live.values()) - output_bytes
        grad = torch.ones_like(out)
        start = sum(tracker.live.values())
        most = [start]
        tracker.probe = lambda: most.append(sum(tracker.live.values()))
        torch.autograd.grad(out, (x, flat_param) if flat else x, grad)
    # The planner's block also counts its input (the first norm's), which the measurement skips,
    # and ignores the norms' per-token statistics (mean and rstd, fp32), which it counts.
    statistics = 2 * 2 * 4 * s * b
    assert saved - (framework_layer_bytes(request) - 4 * s * b * h) == statistics
    planned = backward_workspace_bytes(request.model, request.training, s, b) + softmax_backward_extra_bytes(request)
    assert softmax_backward_extra_bytes(request) > 0
    assert abs((max(most) - start + output_bytes) - planned) <= 4 * s * b * h
