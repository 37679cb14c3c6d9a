"""Schema of benchmarks/published_memory/rows.csv: the published real-GPU memory figures the
accuracy script scores (no planning here)."""

import csv
from pathlib import Path

import pytest

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "published_memory" / "rows.csv"
STACKS = {"torchtitan", "torchtune", "hf", "deepspeed", "megatron", "megatron-deepspeed", "litgpt", "fsdp_qlora", "fairseq", "ms-swift"}
METRICS = {"allocated", "reserved", "nvidia-smi", "tool-peak"}
UNITS = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}
STRATEGIES = {"ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero3-param-offload",
              "fsdp-full-shard", "fsdp-shard-grad-op", "hsdp"}
FRAMEWORKS = {"zeroplan", "torchtitan", "hf", "torchtune", "megatron", "megatron-deepspeed", "litgpt", "fairseq"}
REQUIRED = ("id", "stack", "source", "source_detail", "model", "gpu", "num_gpus", "gpus_per_node", "strategy",
            "tp", "pp", "cp", "micro_batch", "seq_len", "grad_accum", "activation_checkpointing", "precision",
            "lora_rank", "quantize", "dora", "framework", "extra_flags", "metric", "measured_value", "unit",
            "unit_bytes", "outcome", "grade", "inferred_fields", "expressible", "notes")


@pytest.fixture(scope="module")
def rows():
    with open(ROWS, newline="") as f:
        return list(csv.DictReader(f))


def test_columns_and_count(rows):
    assert len(rows) >= 80
    assert set(REQUIRED) <= set(rows[0])


def test_ids_unique(rows):
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))


def test_every_row_is_sourced_and_graded(rows):
    for r in rows:
        assert r["source"].startswith("https://"), r["id"]
        assert r["source_detail"], r["id"]
        assert r["stack"] in STACKS, r["id"]
        assert r["metric"] in METRICS, r["id"]
        assert r["unit"] in UNITS, r["id"]
        assert int(r["unit_bytes"]) in (2**30, 10**9, 2**20, 10**6), r["id"]
        assert r["grade"] in {"A", "B", "C"}, r["id"]
        assert r["outcome"] in {"completed", "oom"}, r["id"]
        # B and C rows say what they inferred.
        assert r["grade"] == "A" or r["inferred_fields"], r["id"]


def test_setup_fields(rows):
    for r in rows:
        assert r["strategy"] in STRATEGIES, r["id"]
        assert r["framework"] in FRAMEWORKS, r["id"]
        assert r["quantize"] in {"none", "nf4", "int8", "fp8", "gptq-int4"}, r["id"]
        assert r["dora"] in {"yes", "no"}, r["id"]
        for field in ("num_gpus", "gpus_per_node", "tp", "pp", "cp", "micro_batch", "seq_len", "grad_accum"):
            assert int(r[field]) >= 1, (r["id"], field)
        assert int(r["lora_rank"]) >= 0, r["id"]
        assert r["expressible"] == "yes" or r["expressible"] == "" or r["expressible"].startswith("no:"), r["id"]


def test_completed_rows_have_a_figure(rows):
    for r in rows:
        if r["outcome"] == "completed":
            assert float(r["measured_value"]) > 0, r["id"]


def test_config_paths_exist(rows):
    root = ROWS.parent.parent.parent
    for r in rows:
        if r["model"].endswith(".json"):
            assert (root / r["model"]).is_file(), r["id"]


def test_stacks_covered(rows):
    assert len({r["stack"] for r in rows}) >= 6
