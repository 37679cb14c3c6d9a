"""Run older transformers releases' causal-LM head and loss on the installed Llama and write the
records the planner's --transformers-version terms are checked against
(tests/test_transformers_release.py):

    python benchmarks/transformers_release_records.py [OUT_DIR]
        (default benchmarks/transformers-release-records)

The shape of benchmarks/kv-cache-records (Llama-2-7B at full width, 2 and 3 blocks deep,
micro-batch 4 x 2048, a bf16 module, fake tensors, torch's non-reentrant checkpoint_wrapper on
every decoder layer, with and without use_cache), with LlamaForCausalLM.forward swapped for
4.45.2's (fp32 logits returned, the shifted copy in the loss) and 4.48.0's (compute-dtype logits,
the loss's upcast and shifted copy): zeroplan.frameworks.transformers_release. About 20 seconds
on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zeroplan.atomic import write_text_atomic
from zeroplan.frameworks.kv_cache import measure_kv_cache
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "transformers-release-records"
RELEASES = ("4.45.2", "4.48.0")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for release in RELEASES:
        record = measure_kv_cache(get_model("llama-2-7b"), BatchSpec(micro_batch_size=4, seq_len=2048),
                                  release=release, checkpointings=("checkpoint_wrapper",))
        write_text_atomic(out / record.file_name, record.model_dump_json(indent=2) + "\n")
        run = record.run(False, "checkpoint_wrapper")
        print(f"{record.name}: output object holds {run.retained_bytes[1] - run.loss_only_bytes[1]:,} bytes of logits; "
              f"forward peak growth {run.forward_peak_bytes[1]:,}")
    return 0


if __name__ == "__main__":
    from script_args import checked_argv

    checked_argv(sys.argv[1:], __doc__)
    raise SystemExit(main(sys.argv[1:]))
