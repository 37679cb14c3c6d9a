"""Muon's Newton-Schulz products in the planned step (zeroplan.core.muon_time): for a few requests,
the step without them, with them, and their share of the step, under the fitted default HFU and
the roofline.

    python benchmarks/muon_step_time.py
"""

from zeroplan.calibrate.step import planned_step
from zeroplan.cli.fit import request_from_args
from zeroplan.cli.main import build_parser
from zeroplan.core.muon_time import rank_newton_schulz_flops
from zeroplan.core.timing import newton_schulz_seconds
from zeroplan.specs import StrategyKind

BATCH = "--micro-batch 4 --seq-len 2048 --precision bf16-mixed --optimizer muon"
REQUESTS = (
    ("llama-2-7b --gpus 8 --gpu a100-80gb", StrategyKind.ddp, "zeroplan"),
    ("llama-2-7b --gpus 8 --gpu a100-80gb", StrategyKind.zero2, "hf"),
    # DeepSpeed's Muon blog row: Qwen2.5-3B, 8 A100 40GB, ZeRO-2, bf16.
    ("qwen2.5-3b --gpus 8 --gpu a100-40gb", StrategyKind.zero2, "hf"),
)


def main() -> None:
    print(f"{'request':<46} {'model':<8} {'NS TFLOP/rank':>13} {'w/o NS s':>9} {'after s':>9} {'NS s':>7} {'share':>6}")
    for flags, kind, framework in REQUESTS:
        for model in ("hfu", "roofline"):
            args = f"{flags} {BATCH} --framework {framework} --compute-model {model}"
            request = request_from_args(build_parser().parse_args(["fit", *args.split()]), kind)
            after = planned_step(request).step_with_overlap_s
            ns = newton_schulz_seconds(request)
            print(f"{flags.split(' --gpu ')[0] + ' ' + kind.value + ' ' + framework:<46} {model:<8} "
                  f"{rank_newton_schulz_flops(request) / 1e12:>13.2f} {after - ns:>9.3f} {after:>9.3f} {ns:>7.3f} "
                  f"{ns / after:>6.1%}")


if __name__ == "__main__":
    main()
