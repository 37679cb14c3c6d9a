"""The committed records of torchtitan's own tensor/sequence/context parallelism run on a fake
process group (benchmarks/parallel-records): they load without torch, each agrees with itself,
and a live run reproduces its committed record."""

from __future__ import annotations

import subprocess
import sys
from math import prod
from pathlib import Path

import pytest

from zeroplan.frameworks.parallel_record import ParallelRecord, load_parallel_records

from tests.planner_free_imports import planner_modules_loaded

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "parallel-records"
ELEMENT_BYTES = {"torch.float32": 4, "torch.bfloat16": 2}
LLAMA3_8B_PARAMETERS = 8_030_261_248
"""Meta's Llama-3-8B parameter count (its model card: 8.03B; tied nothing, vocab 128256)."""


def _records() -> list[ParallelRecord]:
    return load_parallel_records(RECORDS)


def test_the_records_load_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; from pathlib import Path; "
            "from zeroplan.frameworks.parallel_record import load_parallel_records; "
            f"print(len(load_parallel_records(Path({str(RECORDS)!r}))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(result.stdout) == len(_records()) >= 40


def test_every_record_is_named_after_what_it_measured() -> None:
    for record in _records():
        assert (RECORDS / record.file_name).name == record.file_name
        assert record.framework_version == "torchtitan 0.3.0"
        assert record.world_size == record.tp * record.dp_shard * record.cp


@pytest.mark.parametrize("record", _records(), ids=lambda r: r.name)
def test_each_parameter_shard_agrees_with_its_shapes(record: ParallelRecord) -> None:
    degrees = {1, record.tp, record.dp_shard, record.tp * record.dp_shard}
    for p in record.params:
        assert p.local_bytes == prod(p.local_shape) * ELEMENT_BYTES[p.dtype], p.fqn
        assert len(p.local_shape) == len(p.global_shape), p.fqn
        assert all(g % l == 0 for g, l in zip(p.global_shape, p.local_shape)), p.fqn
        assert prod(p.global_shape) // prod(p.local_shape) in degrees, p.fqn
    parts = sum(record.part_bytes(part) for part in ("embedding", "block", "norm", "output"))
    assert parts == record.local_param_bytes
    blocks = [sum(p.local_bytes for p in record.params if p.fqn.startswith(f"layers.{i}."))
              for i in range(record.built_layers)]
    assert blocks == [record.block_param_bytes] * record.built_layers


@pytest.mark.parametrize("record", [r for r in _records() if r.dp_shard == 1], ids=lambda r: r.name)
def test_tensor_parallelism_splits_every_matrix_and_no_norm(record: ParallelRecord) -> None:
    # Column- and row-parallel linears and the vocab-parallel embedding and lm_head hold 1/tp of
    # their parameter, along one dimension; the RMSNorm weights stay whole on every rank.
    for p in record.params:
        split = [g // l for g, l in zip(p.global_shape, p.local_shape) if g != l]
        if p.fqn.endswith("norm.weight"):
            assert split == [], p.fqn
        else:
            assert split == ([record.tp] if record.tp > 1 else []), p.fqn


def test_the_8b_parameters_at_full_depth_are_llama3_8b() -> None:
    states = {(r.tp, r.spmd_backend): r for r in _records() if r.flavor == "8B" and r.activations is None and r.dp_shard == 1}
    full = states[(1, "spmd_types")].full_depth_param_bytes()
    assert full == 4 * LLAMA3_8B_PARAMETERS
    for tp in (2, 4, 8):
        record = states[(tp, "spmd_types")]
        norms = record.part_bytes("norm") + 2 * record.n_layers_full * 4 * record.dim
        # Everything but the norms is split tp ways.
        assert record.full_depth_param_bytes() == (full - norms) // tp + norms


def _activation_records() -> list[ParallelRecord]:
    return [r for r in _records() if r.activations is not None]


@pytest.mark.parametrize("record", _activation_records(), ids=lambda r: r.name)
def test_what_a_block_saved_accounts_for_what_it_kept(record: ParallelRecord) -> None:
    a = record.activations
    assert a.backward_ran
    # The two runs' growth per block is one and the same block.
    assert len(set(a.block_growth_bytes)) == 1
    if a.activation_checkpointing == "none":
        # The saved-tensor list also holds the block mask every block shares (a few KiB), which
        # the difference of the two runs does not count.
        assert 0 <= a.block_saved_bytes - a.block_kept_bytes < 64 * 1024
    assert a.outside_blocks_bytes > 0


@pytest.mark.parametrize("record", [r for r in _activation_records() if r.dp_shard > 1], ids=lambda r: r.name)
def test_fsdp_on_top_gathers_and_reduces_each_blocks_tensor_parallel_shard(record: ParallelRecord) -> None:
    # torchtitan's apply_fsdp_to_decoder: bf16 parameters gathered (forward, and again in
    # backward after resharding), fp32 gradients reduce-scattered, over the dp_shard group;
    # what is gathered is the block's TP shard.
    a, dp = record.activations, record.dp_shard
    shard = record.block_param_bytes  # fp32, this rank's 1/(tp x dp)
    fsdp = [(c.phase, c.kind, c.dtype, c.input_bytes, c.output_bytes, c.count) for c in a.block_collectives
            if c.input_bytes in (shard // 2, shard * dp) and c.group_size == dp]
    assert sorted(fsdp) == [
        ("backward", "all_gather", "torch.bfloat16", shard // 2, shard // 2 * dp, 1),
        ("backward", "reduce_scatter", "torch.float32", shard * dp, shard, 1),
        ("forward", "all_gather", "torch.bfloat16", shard // 2, shard // 2 * dp, 1),
    ]
    # FSDP changes nothing the block keeps: the same block without FSDP2.
    same = [r for r in _activation_records() if r.dp_shard == 1 and r.spmd_backend == record.spmd_backend
            and (r.tp, r.sequence_parallel, r.cp) == (record.tp, record.sequence_parallel, record.cp)
            and r.activations.seq_len == a.seq_len and r.activations.norm_formula == a.norm_formula]
    for other in same:
        assert other.activations.block_kept_bytes == a.block_kept_bytes


@pytest.mark.parametrize("record", [r for r in _activation_records() if r.cp == 1 and r.dp_shard == 1], ids=lambda r: r.name)
def test_a_blocks_collectives_are_those_of_its_tensor_parallel_layout(record: ParallelRecord) -> None:
    a = record.activations
    tokens_bytes = a.micro_batch_size * a.seq_len * record.dim * 2  # one bf16 [b, s, h] activation
    forward = {(c.kind, c.input_bytes, c.output_bytes, c.group_size): c.count
               for c in a.block_collectives if c.phase == "forward"}
    if record.tp == 1:
        assert a.block_collectives == []
    elif record.sequence_parallel:
        # attention and feed-forward: all-gather the sequence shard in, reduce-scatter out.
        assert forward == {("all_gather", tokens_bytes // record.tp, tokens_bytes, record.tp): 2,
                           ("reduce_scatter", tokens_bytes, tokens_bytes // record.tp, record.tp): 2}
    else:
        assert forward == {("all_reduce", tokens_bytes, tokens_bytes, record.tp): 2}
    # Backward mirrors each forward collective with one of the same bytes (an all-gather's
    # gradient is a reduce-scatter, and back); full checkpointing first reruns the forward's.
    if record.spmd_backend == "partial_dtensor":
        # DTensor carries Partial gradients and reduces them where its sharding rules need it:
        # without SP, one reduce-scatter a block in backward instead of two all-reduces.
        return
    if a.activation_checkpointing == "selective-op":
        # SelectiveAC saves the collectives' outputs; what else it reruns is its own choice.
        assert a.block_collective_bytes("backward") >= a.block_collective_bytes("forward")
        return
    passes = 2 if a.activation_checkpointing == "full" else 1
    assert a.block_collective_bytes("backward") == passes * a.block_collective_bytes("forward")


def test_sequence_parallelism_keeps_less_and_the_linears_keep_the_gathered_sequence() -> None:
    records = {(r.tp, r.sequence_parallel): r.activations for r in _activation_records()
               if r.flavor == "8B" and r.cp == 1 and r.activations.seq_len == 2048
               and r.activations.activation_checkpointing == "none" and r.activations.norm_formula == "cpu"}
    for tp in (2, 4, 8):
        on, off = records[(tp, True)], records[(tp, False)]
        assert on.block_kept_bytes < off.block_kept_bytes
        # Under SP the column-parallel linears still save their all-gathered input: the whole
        # sequence, not the 1/tp shard the norms see.
        w1 = next(t for t in on.block_saved if t.module == "feed_forward.w1")
        assert w1.shape == [2048, 4096]
        norm = next(t for t in on.block_saved if t.module == "ffn_norm" and t.shape[-1] == 4096)
        assert norm.shape == [1, 2048 // tp, 4096]


def test_the_cuda_norm_formula_saves_the_norms_input_and_rstd_only() -> None:
    pairs = {}
    for r in _activation_records():
        a = r.activations
        if r.flavor == "8B" and r.cp == 1 and a.activation_checkpointing == "none":
            pairs.setdefault((r.tp, r.sequence_parallel, a.seq_len), {})[a.norm_formula] = a
    assert len(pairs) == 14
    for (tp, sp, seq), by_formula in pairs.items():
        cpu, cuda = by_formula["cpu"], by_formula["cuda"]
        rows = seq // tp if sp else seq
        norm = [t for t in cuda.block_saved if t.module == "ffn_norm"]
        assert sorted((t.dtype, t.shape) for t in norm) == [("torch.bfloat16", [1, rows, 4096]), ("torch.float32", [1, rows, 1])]
        # Per norm, the CPU composite saves two fp32 [rows, h] tensors and the fp32 rstd; the
        # CUDA formula the bf16 input and the rstd: 6 bytes per element less, twice per block.
        assert cpu.block_kept_bytes - cuda.block_kept_bytes == 2 * 6 * rows * 4096


@pytest.mark.slow
def test_a_live_run_reproduces_its_committed_activation_record() -> None:
    pytest.importorskip("torchtitan")
    from zeroplan.frameworks.tensor_parallel import measure_activations

    record = measure_activations("8B", 2, True, 2048)
    _assert_reproduces(record)


def test_a_live_run_reproduces_its_committed_states_record() -> None:
    pytest.importorskip("torchtitan")
    from zeroplan.frameworks.tensor_parallel import measure_states

    _assert_reproduces(measure_states("8B", 4, 2, spmd_backend="partial_dtensor"))
    _assert_reproduces(measure_states("8B", 2))


def _assert_reproduces(record: ParallelRecord) -> None:
    committed = ParallelRecord.model_validate_json((RECORDS / record.file_name).read_text())
    assert record.framework_version == committed.framework_version
    assert record.model_dump(exclude={"wall_time_s"}) == committed.model_dump(exclude={"wall_time_s"})


def test_a_collective_on_one_axis_of_a_2d_mesh_counts_that_axis() -> None:
    # A c10d operator gets its group as a TorchScript object; the recorder must read the
    # sub-group's size, not the world's.
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zeroplan.simulate import _torch_private as private
    from zeroplan.simulate.collectives import CollectiveRecorder
    from zeroplan.simulate.fake_world import fake_process_group

    with fake_process_group(4, 0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        with private.fake_tensor_mode():
            shard, gathered = torch.empty(4), torch.empty(8)
            with CollectiveRecorder() as recorder:
                dist.all_gather_into_tensor(gathered, shard, group=mesh.get_group("b"))
    assert [(r.kind.value, r.group_size, r.output_elements) for r in recorder.records] == [("all_gather", 2, 8)]


def test_the_measurement_never_imports_the_planner() -> None:
    pytest.importorskip("torchtitan")
    assert planner_modules_loaded()["zeroplan.frameworks.tensor_parallel"] == []
