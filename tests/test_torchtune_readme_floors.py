"""The torchtune README rows (@30b8519) that benchmarks/published_memory/rows.csv marks not
expressible because their figure is below what the named configuration must hold: the floor each
row's reason adds up, recomputed from zeroplan's own accounting of that configuration (bf16 or
NF4 shards, the units FSDP2 gathers, the checkpointed block inputs, the logits the loss keeps).
If that accounting moves below a published figure, the row's reason no longer holds."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.finetune.activations import largest_quantized_elements
from zeroplan.core.model_states import model_state_bytes, unit_gather_bytes
from zeroplan.specs.strategy import StrategyKind

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def _rows() -> dict[str, dict[str, str]]:
    with open(ROOT / "benchmarks" / "published_memory" / "rows.csv", newline="") as f:
        return {row["id"]: row for row in csv.DictReader(f)}


ROWS = _rows()


def _request(row: dict[str, str]):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_memory_accuracy import argv_of

    return request_from_args(build_parser().parse_args(argv_of(row)), StrategyKind(row["strategy"]))


def _checkpointed_inputs(request) -> int:
    """Every block's saved input under full checkpointing: b x s x h in bf16."""
    model, batch = request.model, request.batch
    return model.num_layers * batch.micro_batch_size * batch.seq_len * model.hidden_size * 2


def _published(row: dict[str, str]) -> int:
    return int(float(row["measured_value"]) * int(row["unit_bytes"]))


# At every block's backward under FSDP2 (training.shard_model: each layer, then the root holding
# the embedding and output): the shards, the checkpointed inputs, the root gathered and two
# gathered layers (the one running and the one prefetched).
@pytest.mark.parametrize("row_id", ["tt31-70b-lora-8xa100", "tt31-405b-qlora-8xa100"])
def test_fsdp2_rows_are_below_the_block_backward_floor(row_id: str) -> None:
    row = ROWS[row_id]
    request = _request(row)
    units = unit_gather_bytes(request, request.shard_group_size, 2)
    root, layer = units[0] + units[-1], max(units[1:-1])
    floor = model_state_bytes(request).parameter_bytes + _checkpointed_inputs(request) + root + 2 * layer
    if request.training.finetune.quantize.is_quantized:
        floor += largest_quantized_elements(request) * 2  # LinearNF4.backward's bf16 weight
    assert floor > _published(row), (row_id, floor / GIB)
    assert row["expressible"].startswith("no: the published"), row_id


# One GPU: the bf16 weights, the checkpointed inputs and the bf16 logits the compiled loss saves.
def test_single_gpu_lora_row_is_below_its_floor_and_qlora_is_not() -> None:
    floors = {}
    for row_id in ("tt31-8b-lora-4090", "tt31-8b-qlora-4090"):
        row = ROWS[row_id]
        request = _request(row)
        batch, model = request.batch, request.model
        logits = batch.micro_batch_size * batch.seq_len * model.vocab_size * 2
        floors[row_id] = model_state_bytes(request).parameter_bytes + _checkpointed_inputs(request) + logits
    assert floors["tt31-8b-lora-4090"] > _published(ROWS["tt31-8b-lora-4090"])
    assert ROWS["tt31-8b-lora-4090"]["expressible"].startswith("no: the published")
    assert floors["tt31-8b-qlora-4090"] < _published(ROWS["tt31-8b-qlora-4090"])
    assert ROWS["tt31-8b-qlora-4090"]["expressible"] in ("", "yes")
