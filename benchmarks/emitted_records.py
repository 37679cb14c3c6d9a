"""From plan to running job on the CPU: plan tiny-llama on 2 GPUs with ``zeroplan fit --emit``, run
each emitted file through ``zeroplan measure`` (torchrun, gloo, 2 ranks), and keep the file
beside the records in benchmarks/emitted-records/<run>/. notebooks/compare_stages.ipynb and
docs/harness.md reconcile these records with the plan (``zeroplan validate``).

    python benchmarks/emitted_records.py [--out benchmarks/emitted-records]

Needs deepspeed for the first run (DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed==0.19.8').
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from zeroplan.cli.main import main as zeroplan
from zeroplan.harness.presets import HARNESS_PRESETS, llama_config_json

MODEL, NPROC, STEPS, MICRO_BATCH, SEQ_LEN = "tiny-llama", 2, 3, 2, 64
RUNS = [
    # (strategy, emitted file, measure's engine, measure's flag for it, fit's extra flags)
    ("zero3", "deepspeed.json", "deepspeed", "--deepspeed-config", ()),
    ("fsdp-full-shard", "accelerate.yaml", "torch", "--accelerate-config", ()),
    ("fsdp-full-shard", "torchtitan-overrides.txt", "torch", "--torchtitan-config", ("--framework", "torchtitan")),
]


def hf_config(folder: Path) -> Path:
    """The preset as a Hugging Face config.json, the form `zeroplan fit` takes a model in."""
    spec = HARNESS_PRESETS[MODEL]
    path = folder / f"{MODEL}.json"
    path.write_text(json.dumps(llama_config_json(spec)), encoding="utf-8")
    return path


def fit_argv(config: Path, strategy: str, extra: tuple[str, ...], emit: Path) -> list[str]:
    return ["fit", str(config), "--gpus", str(NPROC), "--gpu", "a100-80gb", "--strategies", strategy,
            "--precision", "fp32", "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN), *extra, "--emit", str(emit)]


def measure_argv(strategy: str, engine: str, flag: str, file: Path, out: Path, run_id: str) -> list[str]:
    return ["measure", MODEL, "--strategy", strategy, "--engine", engine, "--nproc", str(NPROC), "--backend", "gloo",
            "--steps", str(STEPS), "--precision", "fp32", "--micro-batch", str(MICRO_BATCH), "--seq-len", str(SEQ_LEN),
            flag, str(file), "--run-id", run_id, "--out", str(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/emitted-records"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        config = hf_config(Path(scratch))
        for strategy, name, engine, flag, extra in RUNS:
            run_id = f"{MODEL}-{strategy}-{name.split('.')[0]}-n{NPROC}"
            emitted = Path(scratch) / run_id
            assert zeroplan(fit_argv(config, strategy, extra, emitted)) == 0
            out = args.out / run_id
            if out.exists():
                shutil.rmtree(out)
            assert zeroplan(measure_argv(strategy, engine, flag, emitted / name, out, run_id)) == 0
            shutil.copy(emitted / name, out / name)
            zeroplan(["validate", str(out)])


if __name__ == "__main__":
    main()
