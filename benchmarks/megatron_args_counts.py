"""Megatron-LM's own parameter count of each Megatron-LM arguments file zeroplan reads
(benchmarks/published_memory/configs/gpt2_755.args, tests/fixtures/megatron/*.args): the file's
arguments parsed and validated by Megatron-LM's own megatron/training/arguments.py
(parse_args, validate_args), the vocabulary padded by its vocab_size_with_padding, and the model
built by its gpt_builders.py gpt_builder on torch's meta device (no GPU, no memory), as one rank
of a fake process group at tensor- and pipeline-parallel size 1 (the whole model).

Usage: ``python benchmarks/megatron_args_counts.py MEGATRON_LM_DIR``, where MEGATRON_LM_DIR holds
Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553's ``megatron/`` and ``gpt_builders.py``
(``git archive d98e8a6 megatron gpt_builders.py | tar -x -C DIR``), run with the repository's
environment (torch, and megatron-core's dependencies); writes
benchmarks/megatron-args-records/records.json, which tests/test_megatron_args.py reads. The same
records hold how Megatron-LM's own parser (add_megatron_arguments) defines every argument the
reader reads or ignores: whether it takes a value, its choices and its default.

Appended to each file's arguments, changing no parameter: --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 (the whole model on one rank); --transformer-impl local (no
Transformer Engine on the CPU: the local spec's norms are modules of their own where Transformer
Engine fuses them into the next linear as layer_norm_weight and layer_norm_bias, the same
elements); --use-cpu-initialization (no CUDA RNG); --no-persist-layer-norm,
--no-gradient-accumulation-fusion and --no-rope-fusion (torch's LayerNorm, no apex or Transformer
Engine kernel); --micro-batch-size 1
where the file gives none (validate_args asserts one). --apply-layernorm-1p is left out (torch's
norms refuse it; Transformer Engine's apply the same weight as 1 + weight, transformer_config.py:206). The vocabulary before padding is the
file's --vocab-size, or GPT-2's 50,257 for the GPT2BPETokenizer (its --vocab-file is not read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks/megatron-args-records/records.json"
FILES = ("benchmarks/published_memory/configs/gpt2_755.args", "tests/fixtures/megatron/gpt3_175b.args",
         "tests/fixtures/megatron/llama3_8b.args", "tests/fixtures/megatron/defaults_mix.args",
         "tests/fixtures/megatron/gpt_biased_gelu.args")
APPENDED = ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--transformer-impl", "local",
            "--use-cpu-initialization", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-rope-fusion")
DROPPED = ("--apply-layernorm-1p",)
GPT2_BPE_VOCAB = 50257


def count(megatron_lm: str, relative: str) -> dict:
    """Megatron-LM's count for one file (in a process of its own: megatron's state is global)."""
    import typing

    # megatron/training/models/hybrid.py imports typing.override (Python 3.12); the decorator
    # only marks a method.
    if not hasattr(typing, "override"):
        typing.override = lambda method: method
    sys.path.insert(0, megatron_lm)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(ROOT))
    from zeroplan.presets.megatron_args import split_arguments

    words = [word for word in split_arguments((ROOT / relative).read_text(encoding="utf-8")) if word not in DROPPED]
    extra = list(APPENDED) + ([] if "--micro-batch-size" in words else ["--micro-batch-size", "1"])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py", *words, *extra]
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args()
    validate_args(args, {})
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    torch.cuda.current_device = lambda: "meta"
    from megatron.core import parallel_state
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    vocab = args.vocab_size or GPT2_BPE_VOCAB
    args.padded_vocab_size = vocab_size_with_padding(vocab, args)
    from gpt_builders import gpt_builder

    with torch.device("meta"):
        model = gpt_builder(args, True, True)
    return {"file": relative, "vocab_size": vocab, "padded_vocab_size": args.padded_vocab_size,
            "parameters": sum(p.numel() for p in model.parameters())}


def _plain(value: object) -> object:
    """A default or choice as JSON holds it: an enum member by its name (AttnBackend.auto: "auto")."""
    import enum

    if isinstance(value, enum.Enum):
        return value.name
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def arguments(megatron_lm: str) -> dict:
    """How Megatron-LM's own parser (add_megatron_arguments) defines each argument zeroplan reads
    or ignores: whether it takes a value, and its default."""
    import argparse
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda method: method
    sys.path.insert(0, megatron_lm)
    sys.path.insert(0, str(ROOT))
    from megatron.training.arguments import add_megatron_arguments

    from zeroplan.presets.megatron_args import IGNORED, READ

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    actions = {option: action for action in parser._actions for option in action.option_strings}
    defined = {}
    for name in sorted(READ | set(IGNORED)):
        action = actions.get(name)
        defined[name] = None if action is None else {
            "takes_value": action.nargs != 0,
            "choices": [_plain(choice) for choice in action.choices] if action.choices else None,
            "default": _plain(action.default),
        }
    return defined


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[2] == "--arguments":
        print(json.dumps(arguments(sys.argv[1])))
        return
    if len(sys.argv) == 3:
        print(json.dumps(count(sys.argv[1], sys.argv[2])))
        return
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    records = []
    for relative in FILES:
        out = subprocess.run([sys.executable, __file__, sys.argv[1], relative], capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"{relative}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        records.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(records[-1])
    out = subprocess.run([sys.executable, __file__, sys.argv[1], "--arguments"], capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"arguments: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    defined = json.loads(out.stdout.strip().splitlines()[-1])
    how = ("Megatron-LM d98e8a6's parse_args, validate_args, vocab_size_with_padding and gpt_builder on the meta device; "
           "its add_megatron_arguments' definition of each argument zeroplan reads or ignores "
           "(benchmarks/megatron_args_counts.py)")
    RECORDS.parent.mkdir(exist_ok=True)
    RECORDS.write_text(json.dumps({"how": how, "records": records, "arguments": defined}, indent=1) + "\n")


if __name__ == "__main__":
    main()
