"""What a decoder block saves for backward under torch.compile (inductor's partitioner) and
eagerly: the record round-trips, the committed records agree with the eager framework records,
a tiny norm + SwiGLU block saves less compiled than eager, and refusals name their field."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroplan.errors import ZeroplanError
from zeroplan.frameworks.compiled_record import CompiledBlockRecord, SavedValue, load_compiled_records
from zeroplan.frameworks.record import load_framework_records
from zeroplan.presets.models import get_model
from zeroplan.specs import ActivationCheckpointing, BatchSpec
from zeroplan.specs.framework import Framework

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _record(**changes) -> CompiledBlockRecord:
    fields = dict(
        framework_version="torchtitan 0.3.0", torch_version="2.13.0", model=get_model("llama-3.1-8b"),
        framework=Framework.torchtitan, activation_checkpointing=ActivationCheckpointing.none,
        batch=BatchSpec(seq_len=4096, micro_batch_size=1), module_dtype="torch.bfloat16",
        compiled_saved_values=[
            SavedValue(name="primals_2", op="input L['x']", shape=[1, 4096, 4096], dtype="torch.bfloat16", bytes=2 ** 25, kind="hidden"),
            SavedValue(name="primals_3", op="input w", shape=[6144, 4096], dtype="torch.bfloat16", bytes=6144 * 8192, kind="parameter"),
            SavedValue(name="rsqrt", op="aten::rsqrt", shape=[1, 4096, 1], dtype="torch.float32", bytes=16384, kind="intermediate"),
        ],
        compiled_runtime_saved_bytes=2 ** 25 + 16384, eager_live_bytes=10, wall_time_s=1.0,
    )
    fields.update(changes)
    return CompiledBlockRecord(**fields)


def test_the_record_round_trips_and_counts_only_the_blocks_own_values() -> None:
    record = _record()
    assert CompiledBlockRecord.model_validate_json(record.model_dump_json()) == record
    assert record.compiled_saved_bytes == 2 ** 25 + 16384
    assert record.file_name == "torchtitan_llama-3.1-8b_ac=none_s4096_b1.json"
    assert _record(memory_budget=0.5, float8_recipe="rowwise").name == "torchtitan:llama-3.1-8b:ac=memory-budget-0.5:float8-rowwise:s4096:b1"


def test_a_saved_value_of_an_unknown_kind_is_one_line_naming_the_field() -> None:
    with pytest.raises(ZeroplanError, match="^kind: 'activation' is not a saved-value kind") as error:
        SavedValue(name="x", op="aten::mm", shape=[1], dtype="torch.float32", bytes=4, kind="activation")
    assert "\n" not in str(error.value)


def test_a_bad_record_file_is_one_line(tmp_path) -> None:
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ZeroplanError, match="^compiled block record: bad.json is not a compiled block record") as error:
        load_compiled_records(tmp_path)
    assert "\n" not in str(error.value)


def test_the_committed_eager_figures_are_the_framework_records() -> None:
    # Measured the same way (live bytes of a block's forward with only its graph kept), so the
    # single-block eager figure is what the L / L+1 forwards of benchmarks/framework-records give.
    records = load_compiled_records(BENCHMARKS / "compiled-records")
    assert records
    eager = {}
    for framework_record in load_framework_records(BENCHMARKS / "framework-records"):
        t = framework_record.training
        if t.activation_offloading or t.activation_checkpointing is ActivationCheckpointing.selective_layer:
            continue
        if framework_record.strategy.value == "ddp":
            continue  # HF under DDP trains an fp32 module under autocast; the blocks here are bf16
        key = (t.framework, framework_record.model.name, t.activation_checkpointing,
               framework_record.batch.seq_len, framework_record.batch.micro_batch_size)
        eager[key] = framework_record.block_kept_bytes
    for record in records:
        if record.float8_recipe:
            continue
        key = (record.framework, record.model.name, record.activation_checkpointing,
               record.batch.seq_len, record.batch.micro_batch_size)
        assert record.eager_live_bytes == eager[key], record.name
        # The compiled list, checked against the autograd node's saved tensors at run time.
        assert record.compiled_runtime_saved_bytes == record.compiled_saved_bytes, record.name
        assert 0 < record.compiled_saved_bytes <= record.eager_live_bytes + 2 ** 20, record.name


def test_refusals_name_their_field() -> None:
    pytest.importorskip("torch")
    from zeroplan.frameworks.compiled import check_compiled

    with pytest.raises(ZeroplanError, match="^--framework: 'zeroplan' has no compiled-block measurement"):
        check_compiled(Framework.zeroplan, ActivationCheckpointing.none, None)
    with pytest.raises(ZeroplanError, match="^--activation-checkpointing: 'full' cannot be measured compiled for hf"):
        check_compiled(Framework.hf, ActivationCheckpointing.full, None)
    with pytest.raises(ZeroplanError, match="^memory_budget: must be in"):
        check_compiled(Framework.torchtitan, ActivationCheckpointing.none, 1.5)
    with pytest.raises(ZeroplanError, match="^memory_budget: is torchtitan's MemoryBudgetAC"):
        check_compiled(Framework.torchtune, ActivationCheckpointing.none, 0.5)


@pytest.mark.slow  # about 6 s, most of it importing inductor
def test_a_tiny_norm_and_swiglu_block_saves_less_compiled_than_eager() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    from zeroplan.frameworks.compiled import block_saves
    from zeroplan.simulate import _torch_private as private

    class Block(nn.Module):
        def __init__(self, dim: int = 64, hidden: int = 176) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(dim)
            self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            h = self.norm(x.float()).to(x.dtype)
            return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))

    torch._dynamo.reset()
    with torch.device("meta"):
        block = Block().to(torch.bfloat16)
    with private.fake_tensor_mode():
        block.to_empty(device="cpu")
        x = torch.empty(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
        eager = block_saves(block, x, compiled=False)
        compiled = block_saves(block, x, compiled=True)
    own = [v for v in compiled.values if v.kind in ("intermediate", "hidden")]
    compiled_bytes = sum(v.bytes for v in own)
    assert 0 < compiled_bytes < eager.bytes
    assert compiled.bytes == compiled_bytes
    assert {v.kind for v in compiled.values} >= {"parameter", "intermediate"}
    # Eager keeps silu's output (SiluBackward0's input is w1's output; the product saves silu(w1))
    assert any(v.op == "SiluBackward0" for v in eager.values)
