"""VeRA and LoRA-FA (FineTuneSpec.vera, FineTuneSpec.lora_fa), measured on peft's own code on the
CPU: a tiny bf16 Llama under get_peft_model (VeraConfig, or LoraConfig and
create_lorafa_optimizer), its trainable elements, its frozen adapter tensors (dtype, sharing),
what its adapters save for backward and what LoraFAOptimizer's step allocates, against the
planner's parameter units, activation terms and step temporary for the spec read from the same
config. The installed peft (0.17.1) has the same VeRA forward and LoRA-FA optimizer as the
51c2ff6 the MetaMathQA method comparison ran (tuners/vera/layer.py forward and
optimizers/lorafa.py differ only in imports, type hints and the quantization hook)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zeroplan.core.buffers import optimizer_step_temporary_bytes
from zeroplan.core.finetune.activations import INPUT_GROUPS, _group_input_bytes, variant_kept_bytes
from zeroplan.core.finetune.storage import frozen_tensor_bytes
from zeroplan.core.finetune.units import finetune_units, trainable_parameters
from zeroplan.core.model_states import model_state_bytes
from zeroplan.core.params import parameter_units
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.hf_config import parse_hf_config
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, FineTuneSpec, Framework, PlanRequest, StrategySpec, TrainingSpec, cluster_from_gpus
from zeroplan.specs.finetune import LoraTarget, lora_adapters
from zeroplan.specs.training import Kernels, OptimizerLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from peft_adapter_dtype_records import adapter_saved_bytes  # noqa: E402

RANK = 8
SEQ, BATCH = 16, 2
TARGETS = (LoraTarget.q, LoraTarget.v)
CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=128, max_position_embeddings=64)


def _config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(**CONFIG)


def _spec():
    return parse_hf_config(_config().to_dict(), "llama")


def _finetune(variant: str) -> FineTuneSpec:
    return FineTuneSpec(lora_rank=RANK, lora_targets=TARGETS, **{variant: True})


def _request(finetune: FineTuneSpec, precision: str = "bf16-pure", **training) -> PlanRequest:
    loop = OptimizerLoop.for_loop if finetune.lora_fa else None
    return PlanRequest(model=_spec(), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1), strategy=StrategySpec(kind="ddp"),
                       batch=BatchSpec(seq_len=SEQ, micro_batch_size=BATCH),
                       training=TrainingSpec(framework="hf", precision=precision, kernels=Kernels.cpu, finetune=finetune,
                                             optimizer_loop=loop, **training))


def _peft_model(variant: str):
    """The tiny Llama loaded in bf16 (the harness's dtype) under peft, as the run builds it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)
    targets = ["q_proj", "v_proj"]
    if variant == "vera":
        return peft.get_peft_model(model, peft.VeraConfig(r=RANK, target_modules=targets)), None
    from peft.optimizers import create_lorafa_optimizer

    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets))
    return model, create_lorafa_optimizer(model, r=RANK, lora_alpha=2 * RANK, lr=1e-4, weight_decay=0.1)


@pytest.mark.parametrize("variant", ["vera", "lora_fa"])
def test_trainable_elements_equal_peft(variant: str) -> None:
    spec = _spec()
    planned = trainable_parameters(parameter_units(spec), _finetune(variant), Framework.hf, spec)
    model, _ = _peft_model(variant)
    assert planned == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # VeRA: lambda_b (out) and lambda_d (r) per wrapped linear; LoRA-FA: B alone.
    per_block = (spec.q_size + spec.kv_size + 2 * RANK) if variant == "vera" else RANK * (spec.q_size + spec.kv_size)
    assert planned == spec.num_layers * per_block


@pytest.mark.parametrize("variant", ["vera", "lora_fa"])
def test_frozen_adapter_tensors_are_fp32_and_veras_pair_is_shared(variant: str) -> None:
    torch = pytest.importorskip("torch")
    model, _ = _peft_model(variant)
    request = _request(_finetune(variant))
    units = finetune_units(parameter_units(request.model), request.training.finetune, Framework.hf, request.model)
    planned = sum(frozen_tensor_bytes(request, t) for unit in units for t in unit.tensors
                  if not t.trainable and (t.name.startswith("vera_") or ".lora_a." in t.name))
    if variant == "vera":
        layers = [m for m in model.modules() if hasattr(m, "vera_lambda_d")]
        pairs = {(id(m.vera_A["default"]), id(m.vera_B["default"])) for m in layers}
        assert len(layers) == 2 * CONFIG["num_hidden_layers"] and len(pairs) == 1  # one pair for every layer
        a, b = layers[0].vera_A["default"], layers[0].vera_B["default"]
        assert a.dtype == b.dtype == torch.float32  # the base is bf16
        assert (tuple(a.shape), tuple(b.shape)) == ((RANK, CONFIG["hidden_size"]), (CONFIG["hidden_size"], RANK))
        measured = a.numel() * a.element_size() + b.numel() * b.element_size()
    else:
        frozen_a = [p for n, p in model.named_parameters() if "lora_A" in n]
        assert all(not p.requires_grad and p.dtype == torch.float32 for p in frozen_a)
        measured = sum(p.numel() * p.element_size() for p in frozen_a)
    assert planned == measured


@pytest.mark.parametrize("block", [0, 1])
@pytest.mark.parametrize("variant", ["vera", "lora_fa"])
def test_adapter_saved_activations_equal_peft(variant: str, block: int) -> None:
    request = _request(_finetune(variant))
    planned = sum(_group_input_bytes(request, group, kind, kept_anyway) for group, kind, kept_anyway in INPUT_GROUPS
                  if any(t in group for t in TARGETS))
    planned += sum(variant_kept_bytes(request, module)
                   for module in lora_adapters(request.training.finetune, request.model, Framework.hf))
    model, _ = _peft_model(variant)
    # The first block too: its input (the frozen embedding's) needs no gradient, and neither
    # adapter kept it anyway.
    model.train()
    assert planned == adapter_saved_bytes(model, block)
    tokens = SEQ * BATCH
    width = {"vera": 2 * RANK + request.model.q_size + request.model.kv_size, "lora_fa": 2 * RANK}[variant]
    assert planned == 4 * tokens * width


def test_lorafa_step_allocates_two_copies_of_the_largest_b() -> None:
    # LoraFAOptimizer.step (optimizers/lorafa.py:137-175) per pair: A A^T, its pseudo-inverse
    # (r x r), the projected gradient under bf16 autocast cast back to B's dtype, and the square
    # root of exp_avg_sq_B: two B-sized fp32 temporaries at once, as torch's for-loop AdamW holds.
    # The planner's for-loop temporary for the same adapters in fp32 against the measured peak of
    # the second step (the first also makes the states), the r x r scratch apart.
    torch = pytest.importorskip("torch")
    from tests.live_storages import live_storage_tracker

    model, optimizer = _peft_model("lora_fa")
    model.float()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    peak = [0]
    for _ in range(2):
        model(input_ids=ids).logits.sum().backward()
        held = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
        held += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        tracker = live_storage_tracker({t.untyped_storage().data_ptr() for t in held})
        peak[0] = 0
        tracker.probe = lambda: peak.__setitem__(0, max(peak[0], sum(tracker.live.values())))
        with tracker:
            optimizer.step()
        optimizer.zero_grad()
    request = _request(_finetune("lora_fa"), precision="fp32")
    planned = optimizer_step_temporary_bytes(request, model_state_bytes(request).optimizer_elements)
    largest_b = max(p.numel() for n, p in model.named_parameters() if "lora_B" in n)
    assert planned == 2 * 4 * largest_b
    assert planned <= peak[0] < planned + 16 * 4 * RANK * RANK


@pytest.mark.parametrize("variant, change, field", [
    ("vera", dict(framework="zeroplan"), "finetune.vera"),
    ("vera", dict(precision="bf16-mixed"), "precision"),
    ("vera", dict(activation_checkpointing="full"), "activation_checkpointing"),
    ("lora_fa", dict(optimizer_loop=OptimizerLoop.foreach), "optimizer_loop"),
    ("lora_fa", dict(optimizer="adam"), "optimizer"),
    ("vera", dict(objective="dpo"), "objective"),
])
def test_refused_outside_what_was_measured(variant: str, change: dict, field: str) -> None:
    training = dict(framework="hf", precision="bf16-pure", finetune=_finetune(variant),
                    optimizer_loop=OptimizerLoop.for_loop if variant == "lora_fa" else None)
    training.update(change)
    with pytest.raises(ZeroplanError) as error:
        PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 1),
                    strategy=StrategySpec(kind="ddp"), batch=BatchSpec(seq_len=512, micro_batch_size=1),
                    training=TrainingSpec(**training))
    assert error.value.field == field and "\n" not in str(error.value)


def test_refused_under_zero_and_beside_dora_alpha_or_each_other() -> None:
    with pytest.raises(ZeroplanError, match="strategy"):
        PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 2),
                    strategy=StrategySpec(kind="zero2"), batch=BatchSpec(seq_len=512, micro_batch_size=1),
                    training=TrainingSpec(framework="hf", precision="bf16-pure", finetune=_finetune("vera")))
    for fields in (dict(vera=True, dora=True), dict(vera=True, lora_alpha=16.0), dict(vera=True, lora_fa=True),
                   dict(lora_fa=True, lora_dropout=0.1), dict(vera=True, quantize="nf4")):
        with pytest.raises(ZeroplanError) as error:
            FineTuneSpec(lora_rank=RANK, **fields)
        assert error.value.field in ("finetune.vera", "finetune.lora_fa")
    with pytest.raises(ZeroplanError, match="lora_rank"):
        FineTuneSpec(vera=True)


def test_flags_plan_the_method_comparisons_runs(zeroplan_cli) -> None:
    common = ["fit", "llama-3.1-8b", "--gpu", "h100-80gb", "--micro-batch", "4", "--seq-len", "768", "--precision",
              "bf16-pure", "--framework", "hf", "--strategies", "ddp", "--lora-targets", "q,v"]
    code, out, err = zeroplan_cli(*common, "--lora-rank", "256", "--vera")
    assert code == 0, err
    code, out, err = zeroplan_cli(*common, "--lora-rank", "32", "--lora-fa", "--optimizer-loop", "for-loop")
    assert code == 0, err
    code, out, err = zeroplan_cli(*common, "--lora-rank", "32", "--lora-fa", "--optimizer-loop", "foreach")
    assert code != 0 and "--optimizer-loop" in err and len(err.strip().splitlines()) == 1


def _wider_config(hidden: int, layers: int):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(**{**CONFIG, "hidden_size": hidden, "num_hidden_layers": layers,
                                       "intermediate_size": 2 * hidden})


def _live_bytes_at_the_loss(variant: str, config) -> int:
    """Bytes made by one training forward of peft's model and alive when its loss is taken
    (parameters and buffers left out), on a tiny bf16 Llama of ``config``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.live_storages import live_storage_tracker

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    targets = ["q_proj", "v_proj"]
    if variant == "vera":
        model = peft.get_peft_model(model, peft.VeraConfig(r=RANK, target_modules=targets))
    else:
        from peft.optimizers import create_lorafa_optimizer

        model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets))
        if variant == "lora_fa":
            create_lorafa_optimizer(model, r=RANK, lora_alpha=2 * RANK, lr=1e-4)
    tracker = live_storage_tracker({t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]})
    with tracker:
        loss = model(input_ids=torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))).logits.float().sum()
        live = sum(tracker.live.values())
    del loss
    return live


def test_the_whole_forward_differs_by_the_planned_block_terms_alone() -> None:
    # Everything else a step keeps (the base's activations, the loss) is the same under both, so
    # what peft's whole model holds at the loss differs by the planner's block terms, every block.
    from zeroplan.core.finetune.activations import lora_layer_delta_bytes

    layers = 3
    config = _wider_config(128, layers)
    spec = parse_hf_config(config.to_dict(), "llama")

    def planned(variant: str) -> int:
        request = _request(_finetune(variant)).model_copy(update={"model": spec})
        return layers * lora_layer_delta_bytes(request)

    measured = _live_bytes_at_the_loss("vera", config) - _live_bytes_at_the_loss("lora_fa", config)
    assert measured == planned("vera") - planned("lora_fa") > 0


def test_lorafa_drops_each_adapters_fp32_copy_of_its_input() -> None:
    # peft's LoRA (the same model, lora_A trainable) holds, every block, the fp32 copy of the
    # input each adapter casts and lora_A keeps; LoRA-FA's frozen lora_A keeps none (what the
    # MetaMathQA LoRA-FA run's peak, 50 MiB under its LoRA's, does not show: docs/memory-model.md).
    layers, hidden = 3, 128
    config = _wider_config(hidden, layers)
    dropped = _live_bytes_at_the_loss("lora", config) - _live_bytes_at_the_loss("lora_fa", config)
    assert dropped == layers * 2 * 4 * SEQ * BATCH * hidden
