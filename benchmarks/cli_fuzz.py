"""Random command lines for every planning sub-command, answered in this process through
zeroplan.cli.main.main: each must either answer (exit status 0, something on stdout) or refuse
in one line (exit status 2, one line on stderr, nothing on stdout), never raise.

Each case is a valid base line of a sub-command (fit, compare, plan, validate, calibrate,
calibrate step, models, gpus) with up to five flags drawn from that sub-command's own parser
(so a new flag is fuzzed without a new row): choices valid or unknown, numbers in range, at the
bounds or out of them, and file arguments pointing at mutated copies of the repository's own
inputs (a model's config.json, a GPU file, a DeepSpeed config, an efficiency file, Megatron-LM
arguments, nccl-tests output, a framework's log, a harness record) with one field replaced,
removed or the text cut short, or at a missing file, a directory, an empty file or non-UTF-8
bytes. Files are written into a temporary folder that is the working directory of the run.
`measure` and `simulate` are left out: a valid line there launches ranks or imports torch.

    python benchmarks/cli_fuzz.py --cases 2000 --seed 0

Prints the counts by sub-command and outcome, then every case that raised, refused in more or
fewer than one line, answered nothing, or exited with another status, as a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shlex
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt2", "qwen2.5-0.5b", "tinyllama-1.1b", "llama-2-7b", "llama-3.1-8b", "mixtral-8x7b", "t5-large")
CONFIGS = ("tests/fixtures/hf/qwen2.5-7b.json", "tests/fixtures/hf/gemma-2-2b.json", "tests/fixtures/hf/opt-350m.json",
           "tests/fixtures/hf/qwen3-30b-a3b.json", "tests/fixtures/hf/falcon-7b.json", "tests/fixtures/hf/phi-2.json")
DEEPSPEED_CONFIGS = ("benchmarks/published_memory/deepspeed/mingpt-lightning-zero3-offload.json",
                     "benchmarks/published_memory/deepspeed/qwen-finetune-ds-config-zero3.json",
                     "benchmarks/published_memory/deepspeed/deepspeedexamples-bf16mw-baseline.json")
EFFICIENCY = "docs/examples/h100-llm-foundry-efficiency.json"
MEGATRON_ARGS = ("tests/fixtures/megatron/llama3_8b.args", "tests/fixtures/megatron/gpt3_175b.args")
NCCL_TESTS = ("tests/fixtures/nccl_tests/all_reduce_8gpu_1node.txt", "tests/fixtures/nccl_tests/all_gather_16gpu_2node.txt")
LOGS = ("tests/fixtures/logs/torchtitan.log", "tests/fixtures/logs/torchtune.log", "tests/fixtures/logs/hf_trainer.log",
        "tests/fixtures/logs/deepspeed.log")
RECORD = "benchmarks/deepspeed-records/tiny-llama-zero1-deepspeed-fp32-n2/rank00000.json"

BAD_VALUES = (None, -1, 0, 1.5, "x", "", True, [], {}, 10**30, -(10**30), 1e308, "NaN")
"""What a mutated JSON field is set to (None: the key removed)."""
INTEGERS = ("1", "2", "3", "4", "8", "16", "64", "0", "-1", "abc", "1.5", "", "1e3", str(2**20), str(2**20 + 1),
            str(2**63), "07", " 4", "٣")
FLOATS = ("0.5", "1", "24", "80", "141", "1e-9", "0", "-3", "nan", "inf", "1e999", "abc", "1,5", str(2.0**40),
          str(2.0**41), "1e-320")
TEXTS = ("", " ", "x", ",", "a,b", "1,2,3", "-", "--", "\u00e9", "a" * 300, "0", "-1", "none", "null", "/", ".", "..",
         "1,,2", "q,v", "q,q", "all", "embed,head", "head,head", "64", "1.5", "900,400,64,20000", "900,400,64,20000,cut",
         "900,-1,64,20000", "0,0,0,0", "1e9,1,1,1", "expandable_segments:True", "expandable_segments:maybe",
         "max_split_size_mb:0", "garbage_collection_threshold:2", "pinned_use_cuda_host_register:True", "pm1743", "4x-pm1743",
         "7", "7,3", "0,3", "nan,1", "dgx-a100", "dgx-2", "dgx-9", "h100", "a100", "h100-80gb", "b200", "no-such-gpu",
         "0.19.8", "4.56.2", "2.13.0", "0.0.0", "99.0", "1.10.1", "0.43.1", "0.50.2", "v1", "1.x")
STRATEGY_LISTS = ("ddp", "zero1,zero2", "zero3", "fsdp-full-shard", "hsdp", "zero3-offload", "zero3-nvme", "zero3-hpz",
                  "zero3-mics", "zero3-zeropp", "zero3-param-offload", "zero2-offload", "zero1,zero1", "zero4", "",
                  ",", "ddp,", "fsdp-shard-grad-op,zero3-offload", "ZERO3", " zero3")
VALID_SHARE = 0.6
"""Share of the numeric flags drawn from in-range values (the rest from every value, bad ones
included), so that most lines with several flags still reach the planner."""
NO_VALUE_ACTIONS = ("_StoreTrueAction", "_StoreFalseAction", "BooleanOptionalAction", "_StoreConstAction", "_CountAction")


class Fixtures:
    """The files the cases point at, written into ``folder``: mutated on demand."""

    def __init__(self, folder: Path, rng: random.Random) -> None:
        self.folder, self.rng, self.count = folder, rng, 0
        (folder / "a-directory").mkdir()
        (folder / "empty.json").write_text("")
        (folder / "latin1.json").write_bytes(b'{"name": "caf\xe9"}')
        (folder / "nul.json").write_bytes(b"\x00\x01\x02")
        (folder / "array.json").write_text("[1, 2]")
        (folder / "null.json").write_text("null")
        (folder / "deep.json").write_text("[" * 100000 + "]" * 100000)
        (folder / "bom.json").write_bytes(b"\xef\xbb\xbf" + (ROOT / CONFIGS[0]).read_bytes())
        from zeroplan.presets.gpus import get_gpu

        # A GPU file as calibrate writes one (an absolute path: ROOT / it is itself).
        self.gpu_source = str(folder / "gpu-source.json")
        Path(self.gpu_source).write_text(json.dumps(get_gpu("h100-80gb").model_dump(mode="json")), encoding="utf-8")
        self.bad = ("a-directory", "empty.json", "latin1.json", "nul.json", "array.json", "null.json", "deep.json",
                    "bom.json", "missing.json", "missing/dir/file.json")

    def _name(self, suffix: str) -> str:
        self.count += 1
        return f"f{self.count}{suffix}"

    def json_mutant(self, source: str) -> str:
        data = json.loads((ROOT / source).read_text(encoding="utf-8"))
        rng = self.rng
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            if rng.random() < 0.1:
                data = _set_path(data, ["zz_unknown_key"], rng.choice(BAD_VALUES[1:]))
                continue
            path = _random_path(data, rng)
            if path:
                data = _set_path(data, path, rng.choice(BAD_VALUES))
        text = json.dumps(data, indent=1)
        if rng.random() < 0.1:
            text = text[: rng.randrange(len(text))]
        name = self._name(Path(source).suffix or ".json")
        (self.folder / name).write_text(text, encoding="utf-8")
        return name

    def text_mutant(self, source: str) -> str:
        lines = (ROOT / source).read_text(encoding="utf-8").splitlines()
        rng = self.rng
        for _ in range(rng.choice((1, 2, 4))):
            if not lines:
                break
            i = rng.randrange(len(lines))
            how = rng.random()
            if how < 0.3:
                del lines[i]
            elif how < 0.5:
                lines.insert(i, lines[i])
            elif how < 0.8:
                words = lines[i].split()
                if words:
                    words[rng.randrange(len(words))] = rng.choice(("-1", "0", "nan", "inf", "x", "1e400", "", "9" * 30))
                lines[i] = " ".join(words)
            else:
                lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
        name = self._name(Path(source).suffix or ".txt")
        (self.folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        return name

    def file(self, sources: tuple[str, ...], text: bool = False) -> str:
        draw = self.rng.random()
        if draw < 0.15:
            return self.rng.choice(self.bad)
        source = self.rng.choice(sources)
        if draw < 0.3:
            return str(ROOT / source)
        return self.text_mutant(source) if text else self.json_mutant(source)


def _random_path(data, rng: random.Random) -> list:
    path = []
    while isinstance(data, (dict, list)) and data and (not path or rng.random() < 0.5):
        key = rng.choice(list(data)) if isinstance(data, dict) else rng.randrange(len(data))
        path.append(key)
        data = data[key]
    return path


def _set_path(data, path: list, value):
    if not path:
        return value
    if not isinstance(data, (dict, list)):
        return data
    head, rest = path[0], path[1:]
    if value is None and not rest:
        if isinstance(data, dict):
            data.pop(head, None)
        else:
            del data[head]
        return data
    if isinstance(data, dict) or (isinstance(head, int) and head < len(data)):
        data[head] = _set_path(data[head] if isinstance(data, list) or head in data else {}, rest, value)
    return data


def _subparser(command: str) -> argparse.ArgumentParser:
    from zeroplan.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _step_parser() -> argparse.ArgumentParser:
    from zeroplan.cli.calibrate_step import add_calibrate_step_arguments
    from zeroplan.cli.parser import OneLineParser

    parser = OneLineParser(prog="zeroplan calibrate step")
    add_calibrate_step_arguments(parser)
    return parser


def flag_value(flag: str, action: argparse.Action, fixtures: Fixtures, rng: random.Random) -> list[str]:
    """The tokens of one random use of ``flag``."""
    kind = type(action).__name__
    if kind in NO_VALUE_ACTIONS:
        return [rng.choice(action.option_strings)]
    type_name = getattr(action.type, "__name__", "")
    if action.choices is not None:
        choices = [str(c) for c in action.choices]
        value = rng.choice(choices) if rng.random() < 0.85 else rng.choice(("no-such", "", choices[0].upper(), "1"))
    elif flag in ("--gpu",):
        value = rng.choice(("a100-80gb", "h100-80gb", "h200-141gb", "v100-16gb", "a10g", "b200", "mi300x", "h100", "x",
                            "")) if rng.random() < 0.7 else fixtures.file((fixtures.gpu_source,))
    elif flag == "--strategies":
        value = rng.choice(STRATEGY_LISTS)
    elif flag == "--deepspeed-config":
        value = fixtures.file(DEEPSPEED_CONFIGS)
    elif flag == "--efficiency":
        value = fixtures.file((EFFICIENCY,))
    elif flag in ("--from-log",):
        value = fixtures.file(LOGS, text=True)
    elif flag in ("--emit", "--out", "--plot"):
        value = rng.choice(("out-dir", "a-directory", "empty.json", "x.png", "x.txt", "/dev/null", "missing/dir/x.json",
                            "empty.json/child", "x.svg", "gpu.json"))
    elif "integer" in type_name or type_name == "int":
        value = rng.choice(INTEGERS[:6] if rng.random() < VALID_SHARE else INTEGERS)
    elif "float" in type_name:
        value = rng.choice(FLOATS[:5] if rng.random() < VALID_SHARE else FLOATS)
    else:
        value = rng.choice(TEXTS)
    return [f"{flag}={value}"] if value.startswith("-") or value == "" else [flag, value]


def base_line(command: str, fixtures: Fixtures, rng: random.Random) -> tuple[list[str], argparse.ArgumentParser | None]:
    """A (mostly) valid line of ``command`` and the parser whose flags are drawn."""
    if command in ("fit", "compare", "plan"):
        draw = rng.random()
        if draw < 0.7:
            model = rng.choice(MODELS)
        elif draw < 0.85:
            model = fixtures.file(CONFIGS)
        elif draw < 0.95:
            model = fixtures.file(MEGATRON_ARGS, text=True)
        else:
            model = rng.choice(("no-such-model", "meta-llama/Llama-2-7b-hf", "", "GPT2", "a-directory"))
        line = [command, model, "--gpus", rng.choice(("1", "2", "8", "16", "64"))]
        if command == "plan":
            line += ["--global-batch", rng.choice(("8", "16", "64", "128", "3"))]
        return line, _subparser(command)
    if command == "validate":
        if rng.random() < 0.3:
            # The run's fit flags follow the log (validate --from-log FILE --help).
            return [command, "--from-log", fixtures.file(LOGS, text=True), rng.choice(MODELS), "--gpus",
                    rng.choice(("1", "8"))], _subparser("fit")
        return [command, fixtures.file((RECORD,)) if rng.random() < 0.8 else str(ROOT / Path(RECORD).parent)], \
            _subparser(command)
    if command == "calibrate":
        return [command, fixtures.file(NCCL_TESTS, text=True), "--gpu", "h100-80gb", "--out", "gpu.json"], \
            _subparser(command)
    if command == "calibrate step":
        measured = rng.choice(("--tokens-per-s-per-gpu", "--step-s"))
        return ["calibrate", "step", rng.choice(MODELS), "--gpus", "8", "--gpu", "h100-80gb", "--strategy",
                rng.choice(("fsdp-full-shard", "zero3", "ddp")), f"{measured}={rng.choice(('3000', '2.5', '0', '-5', 'nan', '1e12', 'x'))}",
                "--out", "eff.json"], _step_parser()
    return [command], None


COMMANDS = (("fit", 0.3), ("compare", 0.12), ("plan", 0.2), ("validate", 0.12), ("calibrate", 0.1),
            ("calibrate step", 0.12), ("models", 0.02), ("gpus", 0.02))


def random_case(fixtures: Fixtures, rng: random.Random) -> tuple[str, list[str]]:
    command = rng.choices([c for c, _ in COMMANDS], [w for _, w in COMMANDS])[0]
    line, parser = base_line(command, fixtures, rng)
    if parser is not None:
        actions = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
                   and "--help" not in a.option_strings]
        for _ in range(rng.choice((0, 1, 2, 3, 5))):
            action = rng.choice(actions)
            line += flag_value(action.option_strings[-1], action, fixtures, rng)
    if rng.random() < 0.03:
        line.append(rng.choice(("--no-such-flag", "extra-positional", "-x")))
    return command, line


def run_case(argv: list[str]) -> tuple[str, object, str, str, float]:
    """(outcome, status, stdout, stderr, seconds) of ``zeroplan ARGV`` in this process."""
    from zeroplan.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
        except BaseException as error:  # noqa: BLE001 - the point is to catch every escape
            if isinstance(error, KeyboardInterrupt):
                raise
            return "traceback", None, "", traceback.format_exc(), time.perf_counter() - start
    seconds = time.perf_counter() - start
    stdout, stderr = out.getvalue(), err.getvalue()
    if status in (0, None):
        return ("answered" if stdout.strip() else "empty answer"), status, stdout, stderr, seconds
    if status == 2:
        lines = stderr.strip("\n").split("\n")
        ok = len(lines) == 1 and stderr.endswith("\n") and lines[0].strip() and not stdout and "Traceback" not in stderr
        return ("refused" if ok else "refusal not one line"), status, stdout, stderr, seconds
    return "other status", status, stdout, stderr, seconds


BAD_OUTCOMES = ("traceback", "empty answer", "refusal not one line", "other status")


def run(cases: int, seed: int, slow_s: float = 30.0) -> tuple[Counter, dict[str, list[str]], Counter]:
    rng = random.Random(seed)
    counts: Counter = Counter()
    bad: dict[str, list[str]] = defaultdict(list)
    fields: Counter = Counter()
    home = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="zeroplan-fuzz-") as folder:
        os.chdir(folder)
        try:
            fixtures = Fixtures(Path(folder), rng)
            for _ in range(cases):
                command, argv = random_case(fixtures, rng)
                outcome, status, stdout, stderr, seconds = run_case(argv)
                counts[(command, outcome)] += 1
                shown = "zeroplan " + shlex.join(argv)
                if outcome in BAD_OUTCOMES:
                    detail = stderr.strip().splitlines()[-1] if stderr.strip() else f"status {status}, stdout {stdout[:80]!r}"
                    bad[outcome].append(f"{shown}\n      {detail}\n      files: " + _fixture_note(argv, Path(folder)))
                elif outcome == "refused":
                    fields[stderr.split("error: ", 1)[-1].split(":")[0][:40]] += 1
                if seconds > slow_s:
                    bad[f"slower than {slow_s:g} s"].append(f"{shown}\n      {seconds:.0f} s, {outcome}")
        finally:
            os.chdir(home)
    return counts, bad, fields


def _fixture_note(argv: list[str], folder: Path) -> str:
    """The mutated files a line names, shown in full (they are gone with the temporary folder)."""
    notes = []
    for token in argv:
        for part in token.split("=")[-1:]:
            path = folder / part
            if part.startswith("f") and path.is_file() and path.stat().st_size < 4000:
                notes.append(f"{part}: {path.read_text(encoding='utf-8', errors='replace')!r}")
    return "; ".join(notes) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show-fields", action="store_true", help="also count the refusals by the field they name")
    args = parser.parse_args()
    start = time.perf_counter()
    counts, bad, fields = run(args.cases, args.seed)
    print(f"{args.cases} cases (seed {args.seed}) in {time.perf_counter() - start:.0f} s")
    for command, _ in COMMANDS:
        row = {outcome: n for (c, outcome), n in counts.items() if c == command}
        print(f"  {command:15s} " + ", ".join(f"{k} {v}" for k, v in sorted(row.items())))
    if args.show_fields:
        print("refusals by field: " + ", ".join(f"{k} {v}" for k, v in fields.most_common()))
    print(f"bad: {sum(len(v) for v in bad.values())}")
    for outcome, lines in bad.items():
        for line in lines:
            print(f"[{outcome}] {line}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
