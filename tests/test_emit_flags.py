"""--emit rebuilds fit's command line from the parsed arguments (zeroplan.cli.emit.flags_of): the
README's planning command and its `zeroplan validate --from-log` line. Every flag fit accepts
must come back as typed: parse -> flags_of -> parse gives the same namespace, for every option
of the parser (a flag added later without a sample here fails the coverage test), every choice
of an enum flag and both forms of a boolean one. argparse only: no planning, no torch."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from zeroplan.cli.emit import SKIPPED_DESTS, _fit_parser, flags_of

PARSER = _fit_parser()
MODEL = "llama-3.1-8b"

TEXT_SAMPLES: dict[str, list[str]] = {
    # Options whose text is free (no choices, no numeric type): values a user types.
    "gpu": ["h100-80gb", "gpus/my gpu.json"],
    "host": ["dgx-a100"],
    "nvme_bandwidth": ["4x-pm1743", "6.5,3.2"],
    "efficiency": ["efficiency.json"],
    "deepspeed_config": ["ds_config.json", "configs/my ds.json"],
    "strategies": ["zero3", "zero2,fsdp-full-shard"],
    "bitsandbytes_version": ["0.43.1"],
    "peft_version": ["0.11.1"],
    "transformers_version": ["4.38.2", "4.45"],
    "accelerate_version": ["0.28.0", "1.10"],
    "torch_release": ["1.13", "2.0.1"],
    "allocator_conf": ["expandable_segments:True,max_split_size_mb:128"],
    "lora_targets": ["q,v", "q,k,v,o,gate,up,down,output", "output"],
    "lora_dropout": ["0.05", "0.1234567890123"],
    "lora_modules_to_save": ["embed,head", "head"],
    "seq_len": ["128", "131072"],
    "varying_lengths": ["600,400,91,20000", "812.5,1021.25,16,51760,truncate"],
    "offload_ratio": ["0.5", "0.3333333333333333"],
}
"""Flags whose accepted text the parser's metadata does not give."""

NUMERIC_SAMPLES = {int: ["3", "4096"], float: ["2.5", "0.3333333333333333", "79.1"]}


def _numeric_kind(action: argparse.Action) -> type | None:
    name = getattr(action.type, "__name__", "")
    if "int" in name:
        return int
    if "float" in name:
        return float
    return None


def samples(action: argparse.Action) -> list[list[str]]:
    """Argument lists that set ``action`` to a value other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [[flag], ["--no-" + flag[2:]]]
    if action.nargs == 0:
        return [[flag]]
    if action.dest in TEXT_SAMPLES:
        return [[flag, text] for text in TEXT_SAMPLES[action.dest]]
    if action.choices is not None:
        cases = [[flag, str(choice)] for choice in action.choices if choice != action.default]
        return cases + ([[flag]] if action.nargs == "?" else [])
    kind = _numeric_kind(action)
    if kind is not None:
        return [[flag, text] for text in NUMERIC_SAMPLES[kind] if action.type(text) != action.default]
    return []


OPTIONS = [a for a in PARSER._actions if a.option_strings and a.dest not in SKIPPED_DESTS]
CASES = [pytest.param(argv, id=" ".join(argv)) for action in OPTIONS for argv in samples(action)]


def test_every_option_of_fit_has_a_sample() -> None:
    missing = [action.option_strings[0] for action in OPTIONS if not samples(action)]
    assert not missing, f"give these flags a sample in TEXT_SAMPLES: {missing}"


def round_trip(argv: list[str]) -> tuple[dict, dict, list[str]]:
    first = vars(PARSER.parse_args(argv))
    rebuilt = flags_of(PARSER, first)
    # Through the shell too: the README and launch lines are shlex-joined command lines.
    second = vars(PARSER.parse_args(shlex.split(shlex.join(rebuilt))))
    kept = {k: v for k, v in first.items() if k not in SKIPPED_DESTS}
    return kept, {k: v for k, v in second.items() if k not in SKIPPED_DESTS}, rebuilt


@pytest.mark.parametrize("argv", CASES)
def test_each_flag_survives_the_rebuild(argv: list[str]) -> None:
    first, second, rebuilt = round_trip([MODEL, *argv])
    assert first == second, rebuilt
    assert rebuilt[0] == MODEL


def test_all_flags_at_once_survive_the_rebuild() -> None:
    """One argument list of every option (its first sample), the model a path with a space."""
    argv = ["models/my model.json"]
    exclusive = {id(action): group for group in PARSER._mutually_exclusive_groups for action in group._group_actions}
    taken = set()
    for action in OPTIONS:
        group = exclusive.get(id(action))
        if group is not None and id(group) in taken:
            continue  # one flag of a mutually exclusive pair (--host-memory-gib / --host-memory-gb)
        taken.add(id(group))
        argv += samples(action)[0]
    first, second, rebuilt = round_trip(argv)
    assert first == second, rebuilt


def test_fit_emit_with_lora_targets_writes_a_validate_line_that_parses_back(tmp_path: Path, capsys) -> None:
    """The reported failure: --lora-targets was rebuilt as the repr of a tuple of enums."""
    from zeroplan.cli.emit import planned_from_fit_flags
    from zeroplan.cli.main import main
    from zeroplan.specs.finetune import LoraTarget

    folder = tmp_path / "run"
    assert main(["fit", MODEL, "--gpus", "8", "--strategies", "zero2", "--lora-rank", "8",
                 "--lora-targets", "q,v,output", "--seq-len", "1024", "--flat-reserve", "--emit", str(folder)]) == 0, \
        capsys.readouterr().err
    readme = (folder / "README.md").read_text()
    assert "--lora-targets q,v,output" in readme
    line = next(l for l in readme.splitlines() if l.startswith("zeroplan validate --from-log"))
    run = planned_from_fit_flags(shlex.split(line)[4:], "")[0]
    assert run.request.training.finetune.lora_targets == (LoraTarget.q, LoraTarget.v, LoraTarget.output)
