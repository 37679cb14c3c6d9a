"""Hugging Face's naive model parallelism: ``from_pretrained(..., device_map="auto" | "balanced" |
"sequential")`` splits the model's modules over the process's GPUs by accelerate's rule, and one
micro-batch at a time runs through them in turn (accelerate's hooks move the activations from one
GPU to the next; no pipelining, no data parallelism).

The split is accelerate's own greedy walk over the model's modules, replayed here on the module
sizes it computes: accelerate 1.10.1 src/accelerate/utils/modeling.py (the released file's lines),
with the arguments transformers 4.56.2 modeling_utils.py ``_get_device_map`` (:1407-1480) passes.
It is checked against accelerate's own infer_auto_device_map on meta-device models
(benchmarks/device_map_records.py, tests/test_device_map.py).

Sizes are in bytes as accelerate counts them, kept as exact fractions (a 4-bit weight counts half
a byte an element); the few places accelerate truncates, this truncates too.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from zeroplan.core.params import parameter_units
from zeroplan.core.record import frozen
from zeroplan.errors import ZeroplanError
from zeroplan.specs.finetune import BaseDtype, Quantization
from zeroplan.specs.model import ModelSpec, PositionKind
from zeroplan.specs.parallel import DeviceMap
from zeroplan.specs.request import PlanRequest


@frozen
class DeviceShare:
    """What accelerate's split puts on one GPU, in model order."""

    first_block: int
    num_blocks: int
    has_embedding: bool
    """The token embedding (and any position embedding or embedding norm)."""
    has_head: bool
    """The output projection, hence the logits and the loss: the last GPU with an untied head;
    the embedding's GPU with a tied one (accelerate keeps tied parameters on one device)."""
    weight_bytes: int
    """The module bytes accelerate counted on this GPU (its estimate, not the planner's)."""


@frozen
class _Module:
    name: str
    size: Fraction
    children: tuple[_Module, ...] = ()
    no_split: bool = False
    """A decoder block: transformers' _no_split_modules names the block class."""


# transformers 4.56.2 modeling_utils.py _get_device_map: target_dtype is the load dtype, which
# hf_quantizer.adjust_target_dtype replaces (quantizers/quantizer_bnb_4bit.py:126, CustomDtype.INT4,
# half a byte, accelerate utils/modeling.py:168; quantizer_bnb_8bit.py:162 torch.int8, a byte, which
# the records do not cover); special_dtypes
# (get_special_dtypes_update) keeps modules_to_not_convert, the output projection, in the load
# dtype. compute_module_sizes (:668) counts numel x min(target bytes, the tensor's own bytes).
def _element_bytes(request: PlanRequest) -> tuple[Fraction, Fraction]:
    """(bytes of a quantized module's element, bytes of the output projection's element)."""
    finetune = request.training.finetune
    load = Fraction(4 if finetune.base_dtype is BaseDtype.fp32 else 2)
    if finetune.quantize is Quantization.nf4:
        return Fraction(1, 2), load
    if finetune.quantize is Quantization.int8:
        return Fraction(1), load
    return load, load


def _module_of(tensor_name: str) -> str:
    return tensor_name.rsplit(".", 1)[0]


# The module tree of transformers' decoder-only causal LM (LlamaForCausalLM, Qwen2ForCausalLM and
# the like; Qwen-1's remote QWenLMHeadModel has the same shape): the top-level "model" holds the
# embeddings, the blocks (a ModuleList, each block a _no_split_modules class), the final norm and
# the rotary embedding, whose inv_freq buffer (head_size / 2 fp32 elements) compute_module_sizes
# counts too; "lm_head" is the other top-level child. A tied output projection is the embedding's
# own parameter, counted once (named_parameters drops the duplicate), so lm_head counts nothing.
def _module_tree(model: ModelSpec, element: Fraction, head_element: Fraction) -> _Module:
    units = parameter_units(model)
    embedding, blocks, head = units[0], units[1:-1], units[-1]
    inside: list[_Module] = []
    by_module: dict[str, Fraction] = {}
    for tensor in embedding.tensors:
        by_module[_module_of(tensor.name)] = by_module.get(_module_of(tensor.name), 0) + tensor.numel * element
    inside += [_Module(name=f"model.{name}", size=size) for name, size in by_module.items()]
    layers = tuple(_block_module(i, unit.tensors, element) for i, unit in enumerate(blocks))
    inside.append(_Module(name="model.layers", size=sum((b.size for b in layers), Fraction(0)), children=layers))
    lm_head = Fraction(0)
    rest: dict[str, Fraction] = {}
    for tensor in head.tensors:
        if tensor.name.startswith("lm_head."):
            lm_head += tensor.numel * head_element
        else:
            rest[_module_of(tensor.name)] = rest.get(_module_of(tensor.name), 0) + tensor.numel * element
    inside += [_Module(name=f"model.{name}", size=size) for name, size in rest.items()]
    if model.position is PositionKind.rope:
        inside.append(_Module(name="model.rotary_emb", size=(model.head_size // 2) * min(element, Fraction(4))))
    top = [_Module(name="model", size=sum((m.size for m in inside), Fraction(0)), children=tuple(inside))]
    top.append(_Module(name="lm_head", size=lm_head))
    return _Module(name="", size=sum((m.size for m in top), Fraction(0)), children=tuple(top))


def _block_module(index: int, tensors, element: Fraction) -> _Module:
    leaves: dict[str, Fraction] = {}
    for tensor in tensors:
        name = f"model.layers.{index}.{_module_of(tensor.name)}"
        leaves[name] = leaves.get(name, 0) + tensor.numel * element
    children = tuple(_Module(name=name, size=size) for name, size in leaves.items())
    return _Module(name=f"model.layers.{index}", size=sum(leaves.values(), Fraction(0)), children=children,
                   no_split=True)


def _leaf_modules(module: _Module) -> list[_Module]:
    if not module.children:
        return [module]
    return [leaf for child in module.children for leaf in _leaf_modules(child)]


# accelerate 1.10.1 utils/modeling.py:935 get_balanced_memory: per_gpu = total // n plus a buffer
# of 1.25 x max(the first no-split block's size, the mean size of the leaf modules) (:1011-1048);
# every GPU but the last is capped at per_gpu, the last keeps all its free memory (:1057-1059).
def balanced_max_memory(tree: _Module, gpus: int, free_bytes: int) -> list[Fraction]:
    """max_memory per GPU under "auto"/"balanced" (accelerate's get_balanced_memory)."""
    per_gpu = tree.size // gpus
    blocks = tree.children[0].children
    layers = next(m for m in blocks if m.name == "model.layers").children
    no_split = layers[0].size if layers else Fraction(0)
    # The modules owning tensors (:1043-1046); a tied lm_head owns none (its weight is counted
    # once, under the embedding) and is no leaf.
    leaves = [leaf for leaf in _leaf_modules(tree) if leaf.size]
    mean_leaves = int(sum((leaf.size for leaf in leaves), Fraction(0)) / max(len(leaves), 1))
    buffer = int(Fraction(5, 4) * max(no_split, mean_leaves))
    capped = per_gpu + buffer
    return [Fraction(min(capped, free_bytes)) for _ in range(gpus - 1)] + [Fraction(free_bytes)]


# accelerate 1.10.1 utils/modeling.py:722 get_max_layer_size: the largest module that is not
# split further (a leaf or a no-split block) among ``modules``, and every module of that size.
def _max_layer(modules: list[_Module]) -> tuple[Fraction, list[str]]:
    largest, names = Fraction(0), []
    pending = list(modules)
    while pending:
        module = pending.pop(0)
        if not module.children or module.no_split:
            if module.size > largest:
                largest, names = module.size, [module.name]
            elif module.size == largest:
                names.append(module.name)
        else:
            pending = list(module.children) + pending
    return largest, names


def _contains(outer: str, name: str) -> bool:
    return name == outer or name.startswith(outer + ".")


# accelerate 1.10.1 utils/modeling.py:1294 infer_auto_device_map, its GPU part: modules in order,
# each put on the current GPU if it fits under that GPU's max_memory (GPU 0, a "main device",
# less the largest layer still to place, :1409-1412), else split into its children if it has any
# and is no block (:1505-1533), else the next GPU (:1558-1561). The largest layer is recomputed
# when every module that realised it has been taken (:1372-1379) and after each split. A tied
# group (the embedding and a tied lm_head) goes where its first member goes (:1389-1455).
def _walk(tree: _Module, max_memory: list[Fraction], tied: bool) -> dict[str, int]:
    embedding = tree.children[0].children[0].name
    placed: dict[str, int] = {}
    used = [Fraction(0)] * len(max_memory)
    pending = list(tree.children)
    device = 0
    largest, largest_names = _max_layer(pending)
    while pending:
        module = pending.pop(0)
        largest_names = [n for n in largest_names if not _contains(module.name, n)]
        if not largest_names:
            largest, largest_names = _max_layer(pending)
        if device >= len(max_memory):
            raise ZeroplanError("parallel.device_map", "the model's weights do not fit the GPUs under accelerate's split "
                                "(it would offload the rest to the CPU; allowed: more or larger GPUs)")
        limit = max_memory[device] - (largest if device == 0 else 0)
        ties = tied and module.name in ("model", embedding)
        if used[device] + module.size <= limit:
            used[device] += module.size
            placed[module.name] = device
            if ties:
                placed["lm_head"] = device
                pending = [m for m in pending if m.name != "lm_head"]
            continue
        if used[device] + module.size >= limit and module.children and not module.no_split:
            pending = list(module.children) + pending
            largest, largest_names = _max_layer(pending)
            continue
        device += 1
        pending.insert(0, module)
    return placed


@lru_cache(maxsize=64)
def _split(model: ModelSpec, mode: DeviceMap, gpus: int, free_bytes: int, element: Fraction, head_element: Fraction,
           quantized: bool) -> tuple[DeviceShare, ...]:
    tree = _module_tree(model, element, head_element)
    if mode is DeviceMap.sequential:
        # transformers' _get_device_map: get_max_memory(None), each GPU's free memory (:761).
        max_memory = [Fraction(free_bytes)] * gpus
    else:
        max_memory = balanced_max_memory(tree, gpus, free_bytes)
    if quantized:
        # transformers 4.56.2 quantizers/quantizer_bnb_4bit.py:255 (quantizer_bnb_8bit.py:131)
        # adjust_max_memory: 90 % of each.
        max_memory = [m * Fraction(9, 10) for m in max_memory]
    placed = _walk(tree, max_memory, model.tied_embeddings)
    return _shares(tree, placed, gpus, model.num_layers)


def _device_of(name: str, placed: dict[str, int]) -> int:
    """The GPU of module ``name``: its own entry or its nearest placed ancestor's."""
    while name not in placed:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        if name == "":
            raise AssertionError("every module is placed")
    return placed[name]


def _shares(tree: _Module, placed: dict[str, int], gpus: int, num_layers: int) -> tuple[DeviceShare, ...]:
    block_device = [_device_of(f"model.layers.{i}", placed) for i in range(num_layers)]
    embedding = _device_of(tree.children[0].children[0].name, placed)
    head = _device_of("lm_head", placed)
    weights = [Fraction(0)] * gpus
    for leaf in _leaf_modules(tree):
        weights[_device_of(leaf.name, placed)] += leaf.size
    shares, first = [], 0
    for device in range(gpus):
        count = block_device.count(device)
        shares.append(DeviceShare(first_block=first, num_blocks=count, has_embedding=device == embedding,
                                  has_head=device == head, weight_bytes=int(weights[device])))
        first += count
    return tuple(shares)


def device_shares(request: PlanRequest) -> tuple[DeviceShare, ...]:
    """accelerate's split of the request's model over its GPUs, GPU 0 first."""
    element, head_element = _element_bytes(request)
    return _split(request.model, request.parallel.device_map, request.cluster.world_size,
                  request.cluster.usable_memory_bytes, element, head_element,
                  request.training.finetune.quantize.is_quantized)
