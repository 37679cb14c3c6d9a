"""DeepSpeed 0.19.8's own activation checkpointing, run on two gloo ranks in one model-parallel
group (benchmarks/deepspeed_checkpointing_records.py): what each checkpointed block keeps between
its forward and backward under each setting, read from the blocks' autograd contexts and checked
against the allocator's live bytes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "deepspeed_checkpointing_records.py"
MP = 2
LAYERS = 4
# torch.empty([]) with no dtype: what DeepSpeed leaves in an input it has emptied, whatever its dtype.
PLACEHOLDER_BYTES = 4


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=600,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")]


def test_kept_bytes_per_block(ranks: list[dict]) -> None:
    for result in ranks:
        settings = result["settings"]
        for block in settings["a"]["blocks"]:  # neither option: the whole input, the input itself
            assert block["kept_bytes"] == block["input_storage_bytes"] == block["input_bytes"]
            assert block["kept_is_input_storage"]
        for label in ("b", "c", "e"):  # partitioned: this rank's 1/mp slice; the input's storage freed
            for block in settings[label]["blocks"]:
                assert block["kept_bytes"] * MP == block["input_bytes"], label
                assert not block["kept_is_input_storage"]
                assert block["input_storage_bytes"] == PLACEHOLDER_BYTES, label
            # each block's recomputation is handed the whole input again
            assert [g["bytes"] for g in settings[label]["gathered"]] == [settings[label]["blocks"][0]["input_bytes"]] * LAYERS
            assert settings[label]["error"] is None and settings[label]["grad_max_abs_diff"] == 0
        # checkpoint_in_cpu alone on a CPU accelerator: .to('cpu') is the input itself, then emptied
        assert all(block["kept_bytes"] == PLACEHOLDER_BYTES for block in settings["d"]["blocks"])
        assert settings["d"]["error"] is not None


def test_live_bytes_are_what_the_contexts_hold(ranks: list[dict]) -> None:
    for result in ranks:
        for label, record in result["settings"].items():
            assert record["live"]["end_of_forward"] == record["held_by_contexts_bytes"] + record["output_bytes"], label


def test_a_partitioned_blocks_backward_holds_the_gathered_input(ranks: list[dict]) -> None:
    """Beyond what it holds without partitioning, each block's backward holds the whole gathered
    input in place of its slice and the emptied input's placeholder."""
    for result in ranks:
        whole = result["settings"]["a"]
        partitioned = result["settings"]["b"]
        input_bytes = whole["blocks"][0]["input_bytes"]
        for (start_a, peak_a), (start_b, peak_b) in zip(whole["live"]["block_backward"],
                                                        partitioned["live"]["block_backward"], strict=True):
            assert (peak_b - start_b) - (peak_a - start_a) == input_bytes - input_bytes // MP - PLACEHOLDER_BYTES


def test_the_planners_rules_are_what_deepspeed_keeps(ranks: list[dict]) -> None:
    """zeroplan.core.deepspeed_checkpointing against the run: the device's kept part of each
    block input under partitioning (the partition; the host's with cpu_checkpointing, which the
    CPU cannot tell apart from the device) and what the recompute gathers beyond it."""
    from zeroplan.core.deepspeed_checkpointing import (
        device_checkpoint_bytes,
        host_checkpoint_bytes_per_block,
        restored_input_bytes,
    )
    from zeroplan.specs.training import TrainingSpec

    partitioned = TrainingSpec(partition_activations=True)
    on_host = TrainingSpec(partition_activations=True, cpu_checkpointing=True)
    for result in ranks:
        settings = result["settings"]
        for block in settings["b"]["blocks"]:
            x = block["input_bytes"]
            assert device_checkpoint_bytes(x, MP, partitioned) == block["kept_bytes"]
            assert restored_input_bytes(x, MP, partitioned) == x - block["kept_bytes"]
        for block in settings["c"]["blocks"]:
            x = block["input_bytes"]
            assert host_checkpoint_bytes_per_block(x, MP, on_host) == block["kept_bytes"]
            assert device_checkpoint_bytes(x, MP, on_host) == 0 and restored_input_bytes(x, MP, on_host) == x
