"""How much the expected record sum of ms-swift's January rows (samples above max_length dropped)
depends on the shape assumed for the dataset's lengths: zeroplan.core.length_records'
expectation, in logit-sized tensors of max_length below the longest batch, for length
distributions of other shapes than its moment-matched gamma, against what the page measured.

The January page (ms-swift 4312aeb, docs/source/LLM/Benchmark.md) runs the whole cls-fudan-news-zh
set (4,959 samples) at max_length 512, 1024 and 2048, dropping longer samples, in a random order
(transformers 4.36 Trainer's RandomSampler: SwiftMixin._get_train_sampler with
train_sampler_random True), batch 1, eager tokenization (lazy_tokenize False), no sorting
(test_oom_error False) and no empty_cache in the loop. Its growth over the one step at max_length,
per logit-sized tensor, is (measured - planned step) / (n segments of an fp32 max_length x
151,936 tensor), n the loss tensors the planner keeps a segment of at each record (two for
Qwen-1's own loss under HF's Trainer, zeroplan.core.own_loss; three for the reference's upcast
loss): 1.8B, 7B and 14B alike within 0.3. Each record is counted once per segment size
(zeroplan.allocator.varying_lengths.segment_size_cdf).

    python benchmarks/varying_length_shapes.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.published_memory_accuracy import argv_of, load_rows, predict  # noqa: E402
from benchmarks.varying_length_rows import without_flag  # noqa: E402
from zeroplan.allocator.config import parse_alloc_conf  # noqa: E402
from zeroplan.allocator.rules import allocation_size, round_size  # noqa: E402
from zeroplan.allocator.varying_lengths import record_tensor_bytes, segment_size_cdf  # noqa: E402
from zeroplan.cli.fit import request_from_args  # noqa: E402
from zeroplan.cli.main import build_parser  # noqa: E402
from zeroplan.core.plan import peak_terms  # noqa: E402
from zeroplan.specs.strategy import StrategyKind  # noqa: E402
from zeroplan.core.length_records import expected_record_sum, regularized_gamma_p  # noqa: E402

GIB = 2**30
MEAN, SD, MIN, SAMPLES, VOCAB = 3234.4, 2547.5, 91, 4959, 151_936
LENGTHS = (512, 1024, 2048)
DEFAULT_ALLOCATOR = parse_alloc_conf("")


def gamma_cdf(shape: float):
    """A gamma shifted to MIN with the page's mean (its spread then follows from the shape)."""
    scale = (MEAN - MIN) / shape
    return lambda tokens: regularized_gamma_p(shape, max(0.0, tokens - MIN) / scale)


def lognormal_cdf():
    """A log-normal with the page's mean and deviation (no shift)."""
    sigma2 = math.log(1 + (SD / MEAN) ** 2)
    mu = math.log(MEAN) - sigma2 / 2
    return lambda tokens: 0.5 * math.erfc(-(math.log(max(tokens, 1e-9)) - mu) / math.sqrt(2 * sigma2))


def segment_bytes(tokens: int) -> int:
    """The segment an fp32 logit row of Qwen's vocabulary at ``tokens`` gets (default allocator)."""
    return allocation_size(round_size(4 * VOCAB * tokens, DEFAULT_ALLOCATOR))


def per_tensor_growth(cdf, seq_len: int) -> tuple[float, int]:
    """(expected sum over the record batches below the longest of their segments, in segments of
    seq_len, batches): zeroplan.allocator.varying_lengths' sum for one logit-sized tensor."""
    below = cdf(seq_len)
    batches = max(1, round(SAMPLES * below))
    table = [(tokens, cdf(tokens) / below) for tokens in range(MIN, seq_len + 1)]
    full = segment_bytes(seq_len)
    records, longest = expected_record_sum(segment_size_cdf(table, segment_bytes), batches, lambda t: segment_bytes(t) / full)
    return records - longest, batches


def measured_growth(seq_len: int) -> list[float]:
    out = []
    for row in load_rows():
        if row["id"].startswith("swift-bm-qwen-") and row["id"].endswith(f"-chat-lora-{seq_len}") and row["measured_value"]:
            measured = float(row["measured_value"]) * int(row["unit_bytes"])
            step = predict({**row, "extra_flags": without_flag(row["extra_flags"])})["predicted"]
            request = request_from_args(build_parser().parse_args(argv_of(row)), StrategyKind.ddp)
            tensors = len(record_tensor_bytes(request, peak_terms(request)[1]))
            out.append((measured - step) / (tensors * segment_bytes(seq_len)))
    return out


def main() -> int:
    shapes = [("gamma, moment-matched (zeroplan's)", gamma_cdf(((MEAN - MIN) / SD) ** 2))]
    shapes += [(f"gamma, shape {k} (same mean)", gamma_cdf(k)) for k in (0.5, 1.0, 3.0)]
    shapes += [("log-normal, moment-matched", lognormal_cdf())]
    print(f"{'lengths':36s}" + "".join(f"{L:>16d}" for L in LENGTHS))
    for name, cdf in shapes:
        cells = [per_tensor_growth(cdf, L) for L in LENGTHS]
        print(f"{name:36s}" + "".join(f"{g:9.2f} ({n:4d})" for g, n in cells))
    print(f"{'measured (1.8B, 7B, 14B LoRA)':36s}" + "".join(
        f"{'/'.join(f'{g:.1f}' for g in measured_growth(L)):>16s}" for L in LENGTHS))
    print("growth per logit-sized tensor, in tensors of max_length (batches per epoch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
