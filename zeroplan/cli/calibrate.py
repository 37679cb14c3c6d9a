"""``zeroplan calibrate LOG... --gpu BASE --out FILE.json``: a GPU file fitted to nccl-tests runs."""

from __future__ import annotations

import argparse
import json


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", help="nccl-tests output files (all_reduce_perf, all_gather_perf, reduce_scatter_perf)")
    parser.add_argument("--gpu", required=True, help="catalog GPU whose other figures the file keeps")
    parser.add_argument("--out", required=True, help="GPU JSON to write (accepted by --gpu)")
    parser.add_argument("--collective", choices=["all_reduce", "all_gather", "reduce_scatter"],
                        help="the collective of every log (default: detected)")


def run_calibrate(args: argparse.Namespace) -> int:
    from zeroplan.atomic import writable_file, write_text_atomic
    from zeroplan.calibrate.fit import BANDWIDTH_REGIME_FRACTION, calibrated_gpu, fit_log
    from zeroplan.calibrate.parse import parse_nccl_tests_runs
    from zeroplan.presets.gpus import get_gpu

    base = get_gpu(args.gpu)
    writable_file(args.out, "out")  # refused before the logs are read
    runs = [run for path in args.logs for run in parse_nccl_tests_runs(path, args.collective)]
    cautions = _check_devices(runs, args.gpu)
    fits = [fit_log(run) for run in runs]
    gpu = calibrated_gpu(base, fits)
    write_text_atomic(args.out, json.dumps(gpu.model_dump(mode="json"), indent=2) + "\n", "out")
    for fit in fits:
        reported = ("none in the log" if fit.reported_avg_busbw_bytes_per_s is None
                    else f"{fit.reported_avg_busbw_bytes_per_s / 1e9:.2f} GB/s")
        print(f"{fit.source}: {fit.collective} {fit.link} {fit.num_ranks} ranks on {fit.num_nodes} node(s), "
              f"NCCL {fit.nccl_version or 'version not stated'}, {fit.points} sizes: "
              f"alpha {fit.alpha_s * 1e6:.2f} us, bus bandwidth {fit.bus_bandwidth_bytes_per_s / 1e9:.1f} GB/s "
              f"(bandwidth from the {fit.bandwidth_points} sizes at or above {BANDWIDTH_REGIME_FRACTION:.0%} of the peak busbw); model vs measured: "
              f"{fit.largest_size_relative_error:+.0%} at the largest size, worst {fit.max_relative_error:.0%}; "
              f"the log's Avg bus bandwidth (mean over sizes): {reported}")
        if fit.alpha_s == 0 or fit.points < 3:
            print(f"caution: {fit.source}: the latency is not measured ({fit.points} sizes, alpha "
                  f"{fit.alpha_s * 1e6:.2f} us): a sweep from small messages (-b 8) pins it")
    for caution in cautions:
        print(f"caution: {caution}")
    print(f"wrote {args.out}")
    return 0


def _check_devices(runs, gpu_name: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Refuse logs of different GPUs, or of a catalog GPU other than --gpu; cautions for a GPU
    the catalog does not have (its other figures then come from --gpu)."""
    from zeroplan.calibrate.fit import device_is_catalog_gpu
    from zeroplan.errors import ZeroplanError
    from zeroplan.presets.gpus import get_gpu, gpu_names

    named = {run.device_name for run in runs if run.device_name}
    if len(named) > 1:
        raise ZeroplanError("logs", f"ran on different GPUs ({'; '.join(sorted(named))}) (allowed: logs of one GPU model)")
    if not named:
        return []
    device = named.pop()
    canonical = [name for name in gpu_names() if device_is_catalog_gpu(device, name)]
    base = get_gpu(gpu_name)
    if not canonical:
        return [f"the logs ran on {device}, which the catalog does not have: the file keeps --gpu "
                f"{gpu_name}'s memory and FLOP/s ({base.display_name})"]
    if not any(get_gpu(name) == base for name in canonical):
        raise ZeroplanError("--gpu", f"{gpu_name!r}, but the logs ran on {device} (allowed: {', '.join(canonical)})")
    return []
