"""Measure transformers' KV cache in a training forward of its own Llama and write the record the
planner's cache terms are checked against (tests/test_kv_cache.py):

    python benchmarks/kv_cache_records.py [OUT_DIR]
        (default benchmarks/kv-cache-records)

Llama-2-7B at full width, 2 and 3 blocks deep, micro-batch 4 x 2048 (llama-recipes' samsum runs),
a bf16 module, on fake tensors: with and without use_cache, without checkpointing and under
torch's non-reentrant checkpoint_wrapper on every decoder layer (zeroplan.frameworks.kv_cache).
About 20 seconds on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.kv_cache import measure_kv_cache
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "kv-cache-records"
SHAPES = [("llama-2-7b", 2048, 4)]


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for name, seq_len, micro_batch in SHAPES:
        record = measure_kv_cache(get_model(name), BatchSpec(micro_batch_size=micro_batch, seq_len=seq_len))
        write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
        print(f"{record.name}: cache {record.cache_block_bytes('checkpoint_wrapper'):,} bytes per block under "
              f"checkpoint_wrapper, {record.cache_block_bytes('none'):,} without checkpointing")
    return 0


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    raise SystemExit(main(sys.argv[1:]))
