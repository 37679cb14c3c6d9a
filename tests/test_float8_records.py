"""float8 training (torchao Float8Linear on torchtitan's block, and its FSDP2 float8 all-gather):
the committed records are consistent and refusals name their field."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.compiled_record import load_compiled_records
from zeroplan.frameworks.float8_record import Float8AllGatherRecord
from zeroplan.frameworks.record import load_records

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_float8_blocks_save_no_more_than_bf16_and_nothing_in_float8() -> None:
    records = load_compiled_records(BENCHMARKS / "compiled-records")
    plain = {(r.model.name, r.activation_checkpointing, r.batch.seq_len): r for r in records
             if r.framework.value == "torchtitan" and not r.float8_recipe and r.memory_budget is None}
    float8 = [r for r in records if r.float8_recipe]
    assert {r.float8_recipe for r in float8} == {"tensorwise", "rowwise", "rowwise_with_gw_hp"}
    for record in float8:
        bf16 = plain[(record.model.name, record.activation_checkpointing, record.batch.seq_len)]
        # Eager Float8Linear saves its high-precision input and weight, as nn.Linear does.
        assert record.eager_live_bytes == bf16.eager_live_bytes, record.name
        # Compiled: the partitioner saves bf16 matmul outputs and amax scalars, never a float8 copy.
        assert record.compiled_saved_bytes <= bf16.compiled_saved_bytes + 2 ** 16, record.name
        assert not any("float8" in v.dtype for v in record.compiled_saved_values), record.name
        assert record.compiled_runtime_saved_bytes == record.compiled_saved_bytes, record.name


def test_rowwise_with_gw_hp_keeps_bf16s_matmul_inputs_without_recomputation_and_rowwises_otherwise() -> None:
    records = load_compiled_records(BENCHMARKS / "compiled-records")
    by_key = {(r.model.name, r.activation_checkpointing.value, r.batch.seq_len, r.float8_recipe): r for r in records
              if r.framework.value == "torchtitan" and r.memory_budget is None}
    gw_hp = [key for key in by_key if key[3] == "rowwise_with_gw_hp"]
    assert len(gw_hp) == 9
    for model, policy, seq_len, _ in gw_hp:
        record = by_key[(model, policy, seq_len, "rowwise_with_gw_hp")]
        # The bf16 grad-weight product reads the high-precision input: without recomputation the
        # partitioner keeps it, as the bf16 block does; with it, what rowwise keeps.
        like = by_key[(model, policy, seq_len, None if policy == "none" else "rowwise")]
        assert record.compiled_saved_bytes == like.compiled_saved_bytes, record.name
        if policy == "none":
            assert record.compiled_saved_bytes > by_key[(model, policy, seq_len, "rowwise")].compiled_saved_bytes


def test_the_float8_all_gather_moves_one_byte_per_linear_weight_element() -> None:
    gathers = load_records(BENCHMARKS / "float8-all-gather-records", Float8AllGatherRecord, "float8 all-gather record")
    by_model = {}
    for record in gathers:
        assert Float8AllGatherRecord.model_validate_json(record.model_dump_json()) == record
        by_model.setdefault(record.model.name, {})[record.float8_all_gather] = record
    assert by_model
    for pair in by_model.values():
        bf16, fp8 = pair[False], pair[True]
        assert bf16.gathered_bytes == 2 * bf16.parameter_elements
        # The norms' weights stay bf16 (2 bytes); the Float8Linear weights move as float8 (1 byte).
        assert bf16.parameter_elements < fp8.gathered_bytes < bf16.parameter_elements + 2 * bf16.model.hidden_size + 1
        assert all(c.output_elements == c.input_elements * fp8.world_size for c in fp8.collectives)


def test_float8_refusals_name_their_field() -> None:
    pytest.importorskip("torchao")
    from zeroplan.frameworks.float8 import check_recipe, float8_config

    with pytest.raises(ZeroplanError, match="^float8_recipe: 'mxfp8' is not a torchao float8 recipe"):
        check_recipe("mxfp8")
    with pytest.raises(ZeroplanError, match="^float8_recipe: 'rowwise': torchao's float8 all-gather needs tensorwise"):
        float8_config("rowwise", fsdp_all_gather=True)
    assert float8_config("tensorwise", fsdp_all_gather=True).enable_fsdp_float8_all_gather
