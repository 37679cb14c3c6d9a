"""``zeroplan calibrate LOG... --gpu BASE --out FILE.json``: a GPU file fitted to nccl-tests runs."""

from __future__ import annotations

import argparse


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", help="nccl-tests output files (all_reduce_perf, all_gather_perf, reduce_scatter_perf)")
    parser.add_argument("--gpu", required=True, help="catalog GPU whose other figures the file keeps")
    parser.add_argument("--out", required=True, help="GPU JSON to write (accepted by --gpu)")
    parser.add_argument("--collective", choices=["all_reduce", "all_gather", "reduce_scatter"],
                        help="the collective of every log (default: detected)")


def run_calibrate(args: argparse.Namespace) -> int:
    from zeroplan.calibrate.fit import BANDWIDTH_REGIME_FRACTION, calibrated_gpu, fit_log, write_json_atomically
    from zeroplan.calibrate.parse import parse_nccl_tests_runs
    from zeroplan.errors import ZeroplanError
    from zeroplan.presets.gpus import get_gpu

    base = get_gpu(args.gpu)
    fits = [fit_log(run) for path in args.logs for run in parse_nccl_tests_runs(path, args.collective)]
    gpu = calibrated_gpu(base, fits)
    try:
        write_json_atomically(args.out, gpu.model_dump(mode="json"))
    except OSError as error:
        raise ZeroplanError("out", f"cannot write {args.out!r}: {error.strerror or error}") from None
    for fit in fits:
        reported = ("none in the log" if fit.reported_avg_busbw_bytes_per_s is None
                    else f"{fit.reported_avg_busbw_bytes_per_s / 1e9:.2f} GB/s")
        print(f"{fit.source}: {fit.collective} {fit.link} {fit.num_ranks} ranks on {fit.num_nodes} node(s), "
              f"NCCL {fit.nccl_version or 'version not stated'}, {fit.points} sizes: "
              f"alpha {fit.alpha_s * 1e6:.2f} us, bus bandwidth {fit.bus_bandwidth_bytes_per_s / 1e9:.1f} GB/s "
              f"(bandwidth from the {fit.bandwidth_points} sizes at or above {BANDWIDTH_REGIME_FRACTION:.0%} of the peak busbw); model vs measured: "
              f"{fit.largest_size_relative_error:+.0%} at the largest size, worst {fit.max_relative_error:.0%}; "
              f"the log's Avg bus bandwidth (mean over sizes): {reported}")
    print(f"wrote {args.out}")
    return 0
