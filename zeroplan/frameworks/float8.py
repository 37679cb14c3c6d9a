"""float8 training as torchao's Float8Linear does it, on torchtitan's Llama block, measured on
fake tensors: what a block saves for backward (eager and compiled, through
zeroplan.frameworks.compiled) and what one block's FSDP2 all-gather moves with torchao's float8
all-gather versus bf16.

torchtitan 0.3.0 components/quantization/float8.py ``Float8LinearConverter`` swaps every
``Linear.Config`` that ``module_filter_fn`` (components/quantization/utils.py: both dims
divisible by 16, fqn not in ``filter_fqns``, default none) admits, the output projection
included, for its ``Float8Linear`` (a subclass of torchao's, same forward), configured with
``Float8LinearConfig.from_recipe_name(recipe_name)`` ("rowwise" default, or
"rowwise_with_gw_hp"; no tensorwise, no float8 all-gather option). Its constructor refuses a
machine without SM89 (or ``emulate`` without compile), and importing
``torchtitan.components.quantization`` fails with torchao 0.14.1 here (its mx module imports
torchao prototype Triton kernels that the installed triton rejects), so the same swap is made
with torchao's ``convert_to_float8_training`` on the built module, with torchtitan's own
``module_filter_fn`` loaded from its file. Tensorwise (torchao's default Float8LinearConfig, what
``enable_fsdp_float8_all_gather`` needs) is measured with the same swap.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.build import build
from zeroplan.frameworks.compiled import measure_compiled_block
from zeroplan.frameworks.compiled_record import CompiledBlockRecord
from zeroplan.frameworks.float8_record import AllGatherCall, Float8AllGatherRecord
from zeroplan.simulate import _torch_private as private
from zeroplan.specs import ActivationCheckpointing, BatchSpec, ModelSpec
from zeroplan.specs.framework import Framework

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao 0.14.1 float8/config.py Float8LinearRecipeName values."""


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ZeroplanError("float8_recipe", f"{recipe!r} is not a torchao float8 recipe (allowed: {', '.join(RECIPES)})")


def float8_config(recipe: str, fsdp_all_gather: bool = False) -> object:
    """torchao's Float8LinearConfig for ``recipe``; ``fsdp_all_gather``: tensorwise's
    ``enable_fsdp_float8_all_gather``."""
    from torchao.float8 import Float8LinearConfig

    check_recipe(recipe)
    if fsdp_all_gather and recipe != "tensorwise":
        # torchao 0.14.1 float8/config.py Float8LinearConfig.__post_init__ allows the float8
        # all-gather only with tensorwise scaling of the weight.
        raise ZeroplanError("float8_recipe", f"{recipe!r}: torchao's float8 all-gather needs tensorwise scaling (allowed: tensorwise)")
    # torchao 0.14.1 float8/config.py: Float8LinearConfig.from_recipe_name(name); "tensorwise"
    # is the default Float8LinearConfig().
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return config


def _torchtitan_filter() -> object:
    """torchtitan 0.3.0 components/quantization/utils.py ``module_filter_fn``, loaded from its
    file: importing the package runs its __init__, which fails here (module docstring)."""
    import torchtitan

    path = Path(torchtitan.__file__).parent / "components" / "quantization" / "utils.py"
    spec = importlib.util.spec_from_file_location("zeroplan_torchtitan_quantization_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.module_filter_fn


def converter(recipe: str, fsdp_all_gather: bool = False) -> object:
    """A function that swaps a built torchtitan model's linears for Float8Linear as torchtitan's
    Float8LinearConverter would, returning a one-line note of what it did."""
    config = float8_config(recipe, fsdp_all_gather)
    module_filter_fn = _torchtitan_filter()

    def convert(module: torch.nn.Module) -> str:
        from torchao.float8 import convert_to_float8_training

        # torchtitan's filter reads in_features / out_features of the Linear.Config; the built
        # nn.Linear has the same attributes. No fqn is filtered out (0.3.0's default: filter_fqns empty).
        convert_to_float8_training(module, config=config,
                                   module_filter_fn=lambda linear, fqn: module_filter_fn(linear, fqn, []))
        swapped = sorted(name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear")
        dtypes = sorted({str(p.dtype) for p in module.parameters()})
        return (f"torchao convert_to_float8_training(Float8LinearConfig recipe {recipe}"
                f"{', enable_fsdp_float8_all_gather' if fsdp_all_gather else ''}) with torchtitan's module_filter_fn: "
                f"{len(swapped)} Float8Linear ({', '.join(swapped)}); parameter dtypes after the swap {dtypes}")

    return convert


def measure_float8_block(model: ModelSpec, policy: ActivationCheckpointing, batch: BatchSpec, recipe: str) -> CompiledBlockRecord:
    """One torchtitan Llama block with its linears swapped for Float8Linear, eager and compiled."""
    check_recipe(recipe)
    with _rowwise_inductor_config(recipe):
        return measure_compiled_block(Framework.torchtitan, model, policy, batch, convert=converter(recipe),
                                      float8_recipe=recipe)


class _rowwise_inductor_config:
    """torchtitan 0.3.0 Float8LinearConverter.__init__: with recipe "rowwise",
    ``torch._inductor.config.emulate_precision_casts = True``."""

    def __init__(self, recipe: str) -> None:
        self.patch = torch._inductor.config.patch(emulate_precision_casts=True) if recipe == "rowwise" else None

    def __enter__(self) -> None:
        if self.patch is not None:
            self.patch.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.patch is not None:
            self.patch.__exit__(*exc)


def measure_all_gather(model: ModelSpec, world_size: int, float8: bool, seq_len: int = 4096) -> Float8AllGatherRecord:
    """The all-gathers one torchtitan block's FSDP2 unit issues in a forward, on rank 0 of a
    fake ``world_size``-rank group: torchtitan's apply_fsdp_to_decoder (fp32 sharded
    parameters, bf16 param_dtype), with ``float8`` torchao's tensorwise Float8Linear with
    ``enable_fsdp_float8_all_gather`` and ``precompute_float8_dynamic_scale_for_fsdp``."""
    from zeroplan.simulate.collectives import CollectiveRecorder
    from zeroplan.simulate.fake_world import device_mesh, fake_process_group

    if world_size < 2:
        raise ZeroplanError("world_size", f"an all-gather needs at least 2 ranks, got {world_size}")
    start_s = time.perf_counter()
    notes = []
    # The fp32 module torchtitan's FSDP2 shards (zeroplan.frameworks.step STEP_PRECISION).
    built = build(Framework.torchtitan, model, 1, ActivationCheckpointing.none, torch.float32, seq_len)
    if float8:
        notes.append(converter("tensorwise", fsdp_all_gather=True)(built.module))
    block = built.blocks[0]
    with fake_process_group(world_size, 0):
        mesh = device_mesh(world_size)
        notes.append(built.shard(mesh, True))
        with private.fake_tensor_mode():
            built.module.to_empty(device="cpu")
            if float8:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                # torchao 0.14.1 float8/fsdp_utils.py, what a training loop calls after each
                # optimizer step with the float8 all-gather (one all-reduce of all the amaxes).
                precompute_float8_dynamic_scale_for_fsdp(built.module)
            # FlexAttention's higher-order op passes through the recorder like any operator.
            recorder = private.passing_higher_order_ops(CollectiveRecorder())
            marks: list[int] = []

            class Stop(Exception):
                pass

            def after(*_: object) -> None:
                marks.append(len(recorder.records))
                raise Stop

            # Prepended: runs before FSDP2's own pre-forward hook, which issues the all-gather.
            block.register_forward_pre_hook(lambda *_: marks.append(len(recorder.records)), prepend=True)
            block.register_forward_hook(after)
            tokens = torch.randint(0, model.vocab_size, (1, seq_len))
            with recorder:
                try:
                    built.forward(tokens)
                except Stop:
                    pass
    gathers = [r for r in recorder.records[marks[0]:marks[1]] if r.kind.value == "all_gather"]
    if not gathers:
        raise RuntimeError("the block's FSDP2 unit issued no all-gather in its forward")
    return Float8AllGatherRecord(
        framework_version=built.version, torch_version=torch.__version__, model=model, world_size=world_size,
        float8_all_gather=float8, parameter_elements=sum(p.numel() for p in block.parameters()),
        collectives=[AllGatherCall(op=r.op, dtype=r.dtype, element_bytes=r.element_bytes, input_elements=r.input_elements,
                                   output_elements=r.output_elements) for r in gathers],
        wall_time_s=time.perf_counter() - start_s, notes=notes,
    )
