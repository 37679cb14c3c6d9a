"""One GPU's step, operation by operation: the data the per-operation step-time model is checked on.

Two phases, each case in a fresh process:

1. steps: per case (strategy:engine, micro-batch, sequence, checkpointing), rank 0 of an N-way
   shard on a fake process group (gpu_measure.py says why: the compute is rank 0's, the
   collectives return at once), as gpu_allocator.py's profile phase runs it: CUDA events around
   forward+backward, optimizer step and zero_grad over five steps after three warm-ups, then
   one step under torch.profiler (operators by input shape with their device time, and every
   device kernel).
2. kernels: the model's own GEMM shapes (forward, input-gradient and weight-gradient products of
   every projection at the case's token count), flash attention forward and backward through
   scaled_dot_product_attention at the cases' shapes, an 8192^3 product and a device-to-device
   copy, each timed with CUDA events (median of ten after three warm-ups).

    python3 benchmarks/gpu_step_profile.py --out "$OUT"              # on a GPU machine, ~3 minutes
    python3 benchmarks/gpu_step_profile.py --smoke --out /tmp/smoke  # tiny CPU run of the same code

Writes <out>/steps/<case>.json.gz and <out>/kernels.json. Measurements only: nothing here
reads the planner, so the per-operation model (zeroplan/core/roofline) is checked against an
independent record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from zeroplan.atomic import write_text_atomic  # noqa: E402

CASES = (
    "fsdp-full-shard:torch:2:4096:none",
    "fsdp-full-shard:torch:2:4096:full",
    "ddp:torch:2:4096:none",
    "fsdp-full-shard:torch:1:8192:none",
)
"""strategy:engine:micro-batch:sequence:checkpointing. FSDP2 computes in bf16 parameters
(MixedPrecisionPolicy), DDP under autocast over fp32 parameters: both ways users train."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-step-profile")))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--phases", default="steps,kernels")
    parser.add_argument("--smoke", action="store_true", help="micro-llama on the CPU, tiny kernels: checks the code only")
    parser.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: one case
    return parser


def _case_args(args: argparse.Namespace, case: str) -> argparse.Namespace:
    strategy, engine, batch, seq, checkpointing = case.split(":")
    return argparse.Namespace(world_size=args.world_size, micro_batch=int(batch), seq_len=int(seq),
                              model="micro-llama" if args.smoke else "llama-1b-like", steps=2,
                              checkpointing=checkpointing, case=f"{strategy}:{engine}")


def _profile_case(args: argparse.Namespace, case: str, out: Path) -> None:
    from gpu_allocator import _setup, phase_summary, profile_steps, write_gzip_json

    run = _case_args(args, case)
    spec, device, engine = _setup(run, run.case, checkpointing=run.checkpointing == "full")
    steps = profile_steps(run, spec, device, engine)
    document = {"case": case, "strategy_engine": run.case, "world_size": run.world_size, "micro_batch": run.micro_batch,
                "seq_len": run.seq_len, "activation_checkpointing": run.checkpointing, "precision": "bf16-mixed",
                "model": spec.model_dump(mode="json"), **steps}
    write_gzip_json(out, document)
    print(f"{case}: {phase_summary(steps)}", flush=True)


def _timed_s(fn, device, warmups: int = 3, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn()`` over ``reps`` calls after ``warmups``, CUDA events on a GPU."""
    import torch

    for _ in range(warmups):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _gemm_shapes(hidden: int, q_size: int, kv_size: int, ffn: int, vocab: int, tokens: int) -> list[dict]:
    """Every matrix product of one Llama step at ``tokens`` tokens: (m, k, n) of out[m, n] = a[m, k] b[k, n]."""
    shapes = []
    for name, d_in, d_out in (("q", hidden, q_size), ("k", hidden, kv_size), ("v", hidden, kv_size),
                              ("o", q_size, hidden), ("gate_up", hidden, ffn), ("down", ffn, hidden),
                              ("head", hidden, vocab)):
        shapes.append({"projection": name, "pass": "forward", "m": tokens, "k": d_in, "n": d_out})
        shapes.append({"projection": name, "pass": "input_grad", "m": tokens, "k": d_out, "n": d_in})
        shapes.append({"projection": name, "pass": "weight_grad", "m": d_out, "k": tokens, "n": d_in})
    return shapes


def _kernels(args: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    scale = 16 if args.smoke else 1
    results: dict = {"torch_version": torch.__version__, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
                     "timing": "median of 10 after 3 warm-ups; CUDA events", "gemm": [], "attention": []}
    with torch.device(device):
        side = 8192 // scale
        a, b = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
        seconds = _timed_s(lambda a=a, b=b: a @ b, device)
        results["square_gemm"] = {"m": side, "k": side, "n": side, "seconds": seconds,
                                  "tflops": 2 * side**3 / seconds / 1e12}
        del a, b
        count = (2**30 if cuda else 2**22) // 2
        source = torch.empty(count, dtype=dtype)
        target = torch.empty_like(source)
        seconds = _timed_s(lambda target=target, source=source: target.copy_(source), device)
        results["copy"] = {"bytes_read_and_written": 4 * count, "seconds": seconds,
                           "tb_per_s": 4 * count / seconds / 1e12}
        del source, target
        hidden, heads, kv_heads, head_size, ffn, vocab = 2048, 32, 8, 64, 8192, 32000
        for tokens in (8192,):
            for shape in _gemm_shapes(hidden // scale, heads * head_size // scale, kv_heads * head_size // scale,
                                      ffn // scale, vocab // scale, tokens // scale):
                m, k, n = shape["m"], shape["k"], shape["n"]
                left, right = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
                seconds = _timed_s(lambda left=left, right=right: left @ right, device)
                results["gemm"].append({**shape, "tokens": tokens, "seconds": seconds, "tflops": 2 * m * k * n / seconds / 1e12})
                del left, right
        for batch, seq in ((2, 4096), (1, 8192)):
            seq //= scale
            q = torch.randn(batch, heads, seq, head_size, dtype=dtype, requires_grad=True)
            k = torch.randn(batch, kv_heads, seq, head_size, dtype=dtype, requires_grad=True)
            v = torch.randn(batch, kv_heads, seq, head_size, dtype=dtype, requires_grad=True)
            grad = torch.randn(batch, heads, seq, head_size, dtype=dtype)

            def forward():  # type: ignore[no-untyped-def]
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def forward_backward():  # type: ignore[no-untyped-def]
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.backward(grad)

            forward_s = _timed_s(forward, device)
            both_s = _timed_s(forward_backward, device)
            results["attention"].append({"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq_len": seq,
                                         "head_size": head_size, "causal": True, "forward_s": forward_s,
                                         "forward_backward_s": both_s})
    write_text_atomic(out, json.dumps(results, indent=1))
    print(f"kernels: square gemm {results['square_gemm']['tflops']:.0f} TFLOP/s, copy {results['copy']['tb_per_s']:.2f} TB/s, "
          f"{len(results['gemm'])} gemm shapes, {len(results['attention'])} attention shapes", flush=True)


def _child(args: argparse.Namespace, single: str, timeout_s: float = 200) -> tuple[int, str]:
    from gpu_allocator import run_child

    command = [sys.executable, __file__, "--world-size", str(args.world_size), "--single", single]
    return run_child(command + ["--smoke"] if args.smoke else command, timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.single:
        kind, _, rest = args.single.partition("|")
        if kind == "kernels":
            _kernels(args, Path(rest))
        else:
            _profile_case(args, kind, Path(rest))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failures = 0
    for phase in args.phases.split(","):
        start = time.perf_counter()
        if phase == "steps":
            for case in args.cases.split(","):
                name = case.replace(":", "-") + ".json.gz"
                code, text = _child(args, f"{case}|{args.out / 'steps' / name}")
                failures += code != 0
                print(text.splitlines()[-1] if code == 0 else f"{case}: FAILED ({code}): {text[-3000:]}", flush=True)
        elif phase == "kernels":
            code, text = _child(args, f"kernels|{args.out / 'kernels.json'}")
            failures += code != 0
            print(text.splitlines()[-1] if code == 0 else f"kernels: FAILED ({code}): {text[-3000:]}", flush=True)
        print(f"phase {phase}: {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
