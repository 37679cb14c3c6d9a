"""The ~45B minGPT row (benchmarks/published_memory/rows.csv, mingpt-ds-45b-zero3-offload): its
command's --cpu_offload is pytorch-lightning 1.3's DeepSpeedPlugin(stage=3, cpu_offload=True)
(plugins/training_type/deepspeed.py at 1.3.0, lines 81-83 and 125-129: cpu_offload offloads the
optimizer, cpu_offload_params the parameters), so the config it wrote offloads the optimizer
alone, and DeepSpeed's ZeRO-3 then keeps the rank's flat fp16 partition on the GPU (0.3.13
runtime/zero/stage3.py lines 621-623: host parameters need both keys; lines 955-966: without
them the partition is flattened and moved to torch.cuda.current_device())."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.plan import memory_breakdown
from zeroplan.specs.deepspeed_config import read_deepspeed_config
from zeroplan.specs.strategy import StrategyKind
from zeroplan.units import ceil_div

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "published_memory" / "rows.csv"
CONFIGS = ROOT / "benchmarks" / "published_memory" / "deepspeed"
ROW_ID = "mingpt-ds-45b-zero3-offload"


def _row() -> dict[str, str]:
    with open(ROWS, newline="") as f:
        return next(r for r in csv.DictReader(f) if r["id"] == ROW_ID)


def _config_path(row: dict[str, str]) -> Path:
    flags = shlex.split(row["extra_flags"])
    return ROOT / flags[flags.index("--deepspeed-config") + 1]


def _request(row: dict[str, str], config: Path, kind: StrategyKind):
    argv = ["fit", row["model"], "--gpus", row["num_gpus"], "--gpus-per-node", row["gpus_per_node"],
            "--micro-batch", row["micro_batch"], "--seq-len", row["seq_len"],
            "--activation-checkpointing", row["activation_checkpointing"], "--precision", row["precision"],
            "--framework", row["framework"], "--attention", "eager", "--state-convention", "deepspeed",
            "--deepspeed-config", str(config)]
    return request_from_args(build_parser().parse_args(argv), kind)


# minGPT at SeanNaren/minGPT@0139bda mingpt/model.py: per block two LayerNorms (weight and bias),
# key, query, value and proj Linears of h x h with bias, an MLP of h -> 4h -> h with biases;
# a token embedding and an untied bias-free head over the 65 characters, a learned position
# Parameter of block_size 128 and the final LayerNorm.
def _mingpt_parameters(layers: int, hidden: int, vocab: int = 65, block_size: int = 128) -> int:
    norms = 2 * 2 * hidden
    attention = 4 * (hidden * hidden + hidden)
    mlp = (4 * hidden * hidden + 4 * hidden) + (4 * hidden * hidden + hidden)
    block = norms + attention + mlp
    return layers * block + vocab * hidden + block_size * hidden + 2 * hidden + vocab * hidden


def test_the_row_runs_the_optimizer_only_offload_its_config_writes() -> None:
    row = _row()
    config = read_deepspeed_config(_config_path(row), hf_auto=False)
    assert config.kind is StrategyKind.zero3_offload
    assert row["strategy"] == config.kind.value


def test_the_rank_keeps_its_fp16_partition_on_the_gpu() -> None:
    row = _row()
    planned = memory_breakdown(_request(row, _config_path(row), StrategyKind.zero3_offload))[0]
    assert planned.parameter_bytes == 2 * ceil_div(_mingpt_parameters(56, 8192), int(row["num_gpus"]))
    # Under cpu_offload_params as well (offload_param in today's keys) the partition is host memory.
    offloaded = memory_breakdown(_request(row, CONFIGS / "mingpt-lightning-zero3-offload-ckpt.json",
                                          StrategyKind.zero3_param_offload))[0]
    assert offloaded.parameter_bytes == 0
    assert planned.allocated_peak_bytes - offloaded.allocated_peak_bytes >= planned.parameter_bytes
