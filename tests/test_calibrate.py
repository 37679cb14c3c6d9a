"""``zeroplan calibrate``: nccl-tests parsing, the alpha-beta fit, and the GPU file it writes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from zeroplan.calibrate.fit import bus_factor, calibrated_gpu, fit_alpha_beta, fit_log
from zeroplan.calibrate.parse import nccl_version_from_code, parse_nccl_tests, parse_nccl_tests_runs
from zeroplan.core.network import ring_bandwidth_bytes_per_s
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu, load_gpu_file

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_tests"
ALL_REDUCE = FIXTURES / "all_reduce_8gpu_1node.txt"  # made from alpha 25 us, busbw 360 GB/s
ALL_GATHER = FIXTURES / "all_gather_16gpu_2node.txt"  # made from alpha 40 us, busbw 45 GB/s
MALFORMED = FIXTURES / "malformed.txt"


def test_all_reduce_log_parses_exactly() -> None:
    log = parse_nccl_tests(ALL_REDUCE)
    assert (log.collective, log.num_ranks, log.num_nodes, log.link) == ("all_reduce", 8, 1, "intra_node")
    assert len(log.rows) == 28
    first, last = log.rows[0], log.rows[-1]
    assert (first.size_bytes, first.count, first.type_bytes, first.redop) == (8, 2, 4, "sum")
    assert first.out_of_place_time_s == pytest.approx(25.00e-6)
    assert first.in_place_time_s == pytest.approx(25.25e-6)
    assert last.size_bytes == 2**30 and last.count == 2**28
    line = next(l for l in ALL_REDUCE.read_text().splitlines() if l.split()[:1] == [str(2**30)])
    time_us, busbw_gb = float(line.split()[5]), float(line.split()[7])
    assert last.out_of_place_time_s == pytest.approx(time_us * 1e-6)
    assert last.out_of_place_busbw_bytes_per_s == pytest.approx(busbw_gb * 1e9)


def test_two_host_all_gather_detected_from_rows_through_srun_prefix_and_nccl_info() -> None:
    log = parse_nccl_tests(ALL_GATHER)  # no 'concluded' line: detected from count*4*16 == size, redop none
    assert (log.collective, log.num_ranks, log.num_nodes, log.link) == ("all_gather", 16, 2, "inter_node")
    assert log.rows[0].size_bytes == 1024 and log.rows[0].count == 16 and log.rows[0].redop == "none"


def test_collective_override_must_be_the_logs_own_and_unknown_collective_refused() -> None:
    assert parse_nccl_tests(ALL_GATHER, "all_gather").collective == "all_gather"
    # An all-gather's rows (count x 4 x 16 ranks = size, redop none) are not an all-reduce's or a
    # reduce-scatter's: taken as one, the fit would price the wrong collective.
    for other in ("all_reduce", "reduce_scatter"):
        with pytest.raises(ZeroplanError, match=f"is an all_gather run, not {other}"):
            parse_nccl_tests(ALL_GATHER, other)
    with pytest.raises(ZeroplanError, match="allowed"):
        parse_nccl_tests(ALL_GATHER, "broadcast")


def test_the_logs_gpu_is_read_from_its_rank_lines() -> None:
    assert parse_nccl_tests(ALL_REDUCE).device_name == "NVIDIA H100 80GB HBM3"
    assert parse_nccl_tests(REAL / "all_reduce_2node_16x_a100_oci_one_size.txt").device_name == "NVIDIA A100-SXM4-40GB"


def test_ranks_on_different_gpus_are_refused(tmp_path: Path) -> None:
    text = ALL_REDUCE.read_text().replace("device  1 [0x19] NVIDIA H100 80GB HBM3", "device  1 [0x19] NVIDIA A100-SXM4-80GB")
    mixed = tmp_path / "mixed.txt"
    mixed.write_text(text)
    with pytest.raises(ZeroplanError, match="ranks ran on different GPUs"):
        parse_nccl_tests(mixed)


def test_an_all_zero_busbw_column_is_refused(tmp_path: Path) -> None:
    lines = ALL_REDUCE.read_text().splitlines()
    zeroed = []
    for line in lines:
        fields = line.split()
        if fields and fields[0].isdigit() and len(fields) >= 12:
            fields[7] = fields[11] = "0.00"
            line = "  ".join(fields)
        zeroed.append(line)
    path = tmp_path / "zero.txt"
    path.write_text("\n".join(zeroed))
    with pytest.raises(ZeroplanError, match="busbw column is 0 in every row"):
        fit_log(parse_nccl_tests(path))


def test_malformed_log_names_file_and_line() -> None:
    with pytest.raises(ZeroplanError, match=r"malformed\.txt:17:"):
        parse_nccl_tests(MALFORMED)


def test_weighted_fit_is_exact_on_exact_data_and_clamps_negative_alpha() -> None:
    xs = [1e3, 1e5, 1e7, 1e9]
    alpha, beta = fit_alpha_beta(xs, [5e-6 + x / 2e11 for x in xs])
    assert alpha == pytest.approx(5e-6) and beta == pytest.approx(1 / 2e11)
    alpha, beta = fit_alpha_beta([1.0, 2.0], [1.0, 3.0])  # line through (0, -1): alpha clamped
    assert alpha == 0.0 and beta > 0


@pytest.mark.parametrize(("path", "alpha_s", "busbw"), [(ALL_REDUCE, 25e-6, 360e9), (ALL_GATHER, 40e-6, 45e9)])
def test_fit_recovers_the_generating_parameters(path: Path, alpha_s: float, busbw: float) -> None:
    fit = fit_log(parse_nccl_tests(path))
    assert fit.alpha_s == pytest.approx(alpha_s, rel=0.01)
    assert fit.bus_bandwidth_bytes_per_s == pytest.approx(busbw, rel=0.01)
    assert fit.points == len(parse_nccl_tests(path).rows)


def test_bus_factor_follows_performance_md() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 16) == pytest.approx(15 / 16)


def test_calibrated_gpu_replaces_only_the_calibrated_link() -> None:
    base = get_gpu("h100")
    gpu = calibrated_gpu(base, [fit_log(parse_nccl_tests(ALL_REDUCE))])
    assert gpu.intra_node_link.bandwidth_bytes_per_s == pytest.approx(360e9, rel=0.01)
    assert gpu.intra_node_link.latency_s == pytest.approx(25e-6 / 14, rel=0.01)  # 2(n-1) ring steps
    assert gpu.inter_node_link == base.inter_node_link and gpu.host_link == base.host_link
    assert gpu.memory_bytes == base.memory_bytes and "all_reduce_8gpu_1node.txt" in gpu.source


def _communication(cli, gpu: str, gpus: int = 8, *flags: str) -> tuple[float, int]:
    """(communication seconds, bytes sent per step) of DDP on ``gpus`` (nodes of 8)."""
    code, out, err = cli("compare", "llama-2-7b", "--gpus", str(gpus), "--gpu", gpu, "--strategies", "ddp",
                          "--format", "json", *flags)
    assert code == 0, err
    plan = json.loads(out)["plans"][0]
    return plan["time"]["communication_s"], plan["sent_bytes_per_step"]


def test_cli_writes_a_file_compare_accepts(zeroplan_cli, tmp_path: Path) -> None:
    out_file = tmp_path / "h100-calibrated.json"
    code, out, err = zeroplan_cli("calibrate", str(ALL_REDUCE), str(ALL_GATHER), "--gpu", "h100", "--out", str(out_file))
    assert code == 0, err
    assert "360.0 GB/s" in out and "45.0 GB/s" in out
    gpu = load_gpu_file(out_file)
    # The 2x8 log's busbw is stored as the per-GPU share (busbw / 8 ranks per node), so that a
    # ring with 8 members per node (zeroplan/core/network.py) gets the measured 45 GB/s back.
    assert gpu.inter_node_link.bandwidth_bytes_per_s == pytest.approx(45e9 / 8, rel=0.01)
    assert gpu.node_network is None
    assert ring_bandwidth_bytes_per_s(gpu, 8, 8, spans_nodes=True) == pytest.approx(45e9, rel=0.01)
    base = get_gpu("h100")
    # DDP on one node is intra-node all-reduce only: time = sent / bandwidth + (latency steps) * latency_s,
    # with the same bytes and latency steps on both GPUs; the steps come from the base GPU's figure.
    # (The ring forced on the links' figures: this checks the links the file carries; the test
    # below checks the default, NCCL's choice at the calibrated efficiency.)
    ring = ("--algorithm", "ring", "--bandwidth", "nominal")
    base_s, sent = _communication(zeroplan_cli, "h100", 8, *ring)
    calibrated_s, sent_calibrated = _communication(zeroplan_cli, str(out_file), 8, *ring)
    assert sent_calibrated == sent
    base_link, link = base.intra_node_link, gpu.intra_node_link
    latency_steps = (base_s - sent / base_link.bandwidth_bytes_per_s) / base_link.latency_s
    assert latency_steps > 0
    expected = sent / link.bandwidth_bytes_per_s + latency_steps * link.latency_s
    assert calibrated_s == pytest.approx(expected, rel=1e-6)
    assert calibrated_s != pytest.approx(base_s, rel=1e-3)


def test_cli_malformed_log_is_one_line_exit_2(zeroplan_cli, tmp_path: Path) -> None:
    out_file = tmp_path / "x.json"
    code, out, err = zeroplan_cli("calibrate", str(MALFORMED), "--gpu", "h100", "--out", str(out_file))
    assert code == 2 and "malformed.txt:17:" in err and len(err.strip().splitlines()) == 1
    assert not out_file.exists()


# Published runs (tests/fixtures/nccl_tests/real/README.md gives each one's source). Expected
# ranks and nodes are the source's own "Using devices" block, counted by hand.
REAL = FIXTURES / "real"
REAL_LOGS = {  # file: (collective, ranks, nodes)
    "all_reduce_1node_8x_rtx5090.txt": ("all_reduce", 8, 1),
    "all_reduce_2node_16x_h100_a3mega.txt": ("all_reduce", 16, 2),
    "all_reduce_2node_8x_gh200_alps.txt": ("all_reduce", 8, 2),
    "all_reduce_2node_2x_gh200_alps.txt": ("all_reduce", 2, 2),
    "all_gather_2node_8x_gb300_a4xmax.txt": ("all_gather", 8, 2),
    "all_reduce_2node_16x_a100_oci_one_size.txt": ("all_reduce", 16, 2),
}
SWEEP = re.compile(r"minBytes (\d+) maxBytes (\d+) step: (\d+)\(factor\)")


@pytest.mark.parametrize("name", sorted(REAL_LOGS))
def test_real_log_parses_with_its_ranks_nodes_and_collective(name: str) -> None:
    log = parse_nccl_tests(REAL / name)
    assert (log.collective, log.num_ranks, log.num_nodes) == REAL_LOGS[name]
    assert log.link == ("intra_node" if REAL_LOGS[name][2] == 1 else "inter_node")


@pytest.mark.parametrize("name", sorted(REAL_LOGS))
def test_real_log_every_row_is_read(name: str) -> None:
    """The sweep header says which sizes ran (minBytes x factor^k up to maxBytes): the parser holds
    exactly those rows, and where the log has its footer, nccl-tests' own Avg bus bandwidth (the
    mean of both busbw columns over all rows, src/common.cu) is the mean of what the parser read,
    to the two decimals the columns are printed with."""
    text = (REAL / name).read_text(encoding="utf-8")
    log = parse_nccl_tests(REAL / name)
    sizes = [row.size_bytes for row in log.rows]
    if match := SWEEP.search(text):
        low, high, factor = map(int, match.groups())
        expected = [low * factor**k for k in range(round(math.log(high / low, factor)) + 1)]
        assert sizes == expected
    else:  # the one-size OCI run steps in bytes: -b 10G -e 10G
        assert sizes == [10737418240]
    busbws = [row.out_of_place_busbw_bytes_per_s for row in log.rows] + [row.in_place_busbw_bytes_per_s for row in log.rows]
    if log.reported_avg_busbw_bytes_per_s is not None:
        assert sum(busbws) / len(busbws) == pytest.approx(log.reported_avg_busbw_bytes_per_s, abs=0.005e9)
    else:
        assert name == "all_reduce_1node_8x_rtx5090.txt"  # its published block stops before the footer


@pytest.mark.parametrize("name", sorted(REAL_LOGS))
def test_real_log_bus_factor_is_the_one_nccl_tests_applied(name: str) -> None:
    """busbw as printed = size x factor / time with PERFORMANCE.md's factor for the detected
    collective and rank count; a wrong collective or rank count changes the factor (by 2x for
    all-reduce vs all-gather, 14/8 vs 15/16 for 8 vs 16 ranks). Rows under 1 GB/s are left out:
    their two printed decimals are too coarse."""
    log = parse_nccl_tests(REAL / name)
    factor = bus_factor(log.collective, log.num_ranks)
    checked = [row for row in log.rows if row.out_of_place_busbw_bytes_per_s >= 1e9]
    assert checked
    for row in checked:
        assert row.size_bytes * factor / row.out_of_place_time_s == pytest.approx(row.out_of_place_busbw_bytes_per_s, rel=0.01)


def test_real_log_nccl_version_as_the_log_states_it() -> None:
    assert nccl_version_from_code(22907) == "2.29.7" and nccl_version_from_code(2708) == "2.7.8"
    assert parse_nccl_tests(REAL / "all_reduce_1node_8x_rtx5090.txt").nccl_version == "2.29.7"
    assert parse_nccl_tests(REAL / "all_gather_2node_8x_gb300_a4xmax.txt").nccl_version == "2.28.9"
    assert parse_nccl_tests(REAL / "all_reduce_2node_16x_h100_a3mega.txt").nccl_version is None


def test_real_one_size_run_is_refused_in_one_line() -> None:
    with pytest.raises(ZeroplanError, match=r"one_size\.txt: need at least two non-zero message sizes.*1 size"):
        fit_log(parse_nccl_tests(REAL / "all_reduce_2node_16x_a100_oci_one_size.txt"))


@pytest.mark.parametrize("name", sorted(set(REAL_LOGS) - {"all_reduce_2node_16x_a100_oci_one_size.txt"}))
def test_real_fit_bandwidth_is_the_bandwidth_regime_line(name: str) -> None:
    """busbw is the least-squares line (weights 1/t^2) through the rows at or above half the peak
    printed busbw, and alpha the relative-error-optimal intercept of the other rows given it,
    recomputed here from the rows; the reported errors are the line's against every row."""
    log = parse_nccl_tests(REAL / name)
    fit = fit_log(log)
    factor = bus_factor(log.collective, log.num_ranks)
    peak = max(row.out_of_place_busbw_bytes_per_s for row in log.rows)
    upper = [row for row in log.rows if row.out_of_place_busbw_bytes_per_s >= peak / 2]
    lower = [row for row in log.rows if row.out_of_place_busbw_bytes_per_s < peak / 2]
    _, beta = fit_alpha_beta([r.size_bytes * factor for r in upper], [r.out_of_place_time_s for r in upper])
    assert fit.bus_bandwidth_bytes_per_s == pytest.approx(1 / beta)
    assert fit.bandwidth_points == len(upper) and fit.points == len(log.rows)
    weights = [1 / r.out_of_place_time_s**2 for r in lower]
    alpha = sum(w * (r.out_of_place_time_s - r.size_bytes * factor * beta) for w, r in zip(weights, lower)) / sum(weights)
    assert fit.alpha_s == pytest.approx(max(alpha, 0.0))
    errors = [(fit.alpha_s + r.size_bytes * factor * beta) / r.out_of_place_time_s - 1 for r in log.rows]
    assert fit.max_relative_error == pytest.approx(max(map(abs, errors)))
    assert fit.largest_size_relative_error == pytest.approx(errors[-1])


def test_real_logs_concatenated_are_several_runs(tmp_path: Path) -> None:
    """A script that runs the tests one after another into one log: one run per '# nThread' header,
    each with its own ranks, rows and footer."""
    first, second = REAL / "all_reduce_2node_2x_gh200_alps.txt", REAL / "all_gather_2node_8x_gb300_a4xmax.txt"
    both = tmp_path / "both.log"
    both.write_text(first.read_text(encoding="utf-8") + second.read_text(encoding="utf-8"), encoding="utf-8")
    runs = parse_nccl_tests_runs(both)
    assert [(run.collective, run.num_ranks, len(run.rows)) for run in runs] == [
        (log.collective, log.num_ranks, len(log.rows)) for log in (parse_nccl_tests(first), parse_nccl_tests(second))]
    assert [run.reported_avg_busbw_bytes_per_s for run in runs] == [14.9966e9, 146.047e9]
    assert "run at line 4" in runs[0].source
    with pytest.raises(ZeroplanError, match=r"holds 2 runs"):
        parse_nccl_tests(both)


def test_mpirun_tagged_lines_parse_like_the_plain_log(tmp_path: Path) -> None:
    """mpirun --tag-output puts '[1,0]<stdout>:' before every line of rank 0's output."""
    plain = REAL / "all_reduce_2node_16x_h100_a3mega.txt"
    tagged = tmp_path / "tagged.log"
    tagged.write_text("".join(f"[1,0]<stdout>:{line}\n" for line in plain.read_text(encoding="utf-8").splitlines()))
    assert parse_nccl_tests(tagged).rows == parse_nccl_tests(plain).rows


def test_wrong_results_are_refused_and_unchecked_ones_are_not(tmp_path: Path) -> None:
    """'#wrong' > 0 means the collective returned wrong data: refused, naming file:line. 'N/A'
    (validation off, -c 0) is read as not checked."""
    lines = (REAL / "all_reduce_2node_2x_gh200_alps.txt").read_text(encoding="utf-8").splitlines()
    row = 14  # the 4 MiB row (line 15)
    assert lines[row].split()[0] == "4194304"
    wrong = tmp_path / "wrong.log"
    wrong.write_text("\n".join(lines[:row] + [lines[row][:-1] + "3"] + lines[row + 1:]))
    with pytest.raises(ZeroplanError, match=r"wrong\.log:15: nccl-tests counted 3 wrong results at size 4194304"):
        parse_nccl_tests(wrong)
    unchecked = tmp_path / "unchecked.log"
    fields = lines[row].split()
    fields[8] = fields[12] = "N/A"
    unchecked.write_text("\n".join(lines[:row] + ["  ".join(fields)] + lines[row + 1:]))
    assert parse_nccl_tests(unchecked).rows == parse_nccl_tests(REAL / "all_reduce_2node_2x_gh200_alps.txt").rows


def test_real_logs_calibrate_files_compare_uses(zeroplan_cli, tmp_path: Path) -> None:
    """End to end on published runs: `calibrate` writes a GPU file per machine, and `compare`'s DDP
    communication time on that machine's shape is the one the fitted figures imply, derived here:
    sent / busbw + (all-reduce calls) x alpha, since a ring all-reduce over the log's n ranks pays
    2(n-1) steps of alpha / 2(n-1). Calls and bytes come from the base GPU's run."""
    cases = [  # (log, base GPU, GPUs of the DDP run = the log's ranks, link)
        ("all_reduce_1node_8x_rtx5090.txt", "rtx-4090", 8, "intra_node"),
        ("all_reduce_2node_16x_h100_a3mega.txt", "h100-80gb", 16, "inter_node"),
    ]
    for name, base_name, gpus, link in cases:
        fit = fit_log(parse_nccl_tests(REAL / name))
        assert (fit.link, fit.num_ranks) == (link, gpus)
        out_file = tmp_path / f"{name}.json"
        code, out, err = zeroplan_cli("calibrate", str(REAL / name), "--gpu", base_name, "--out", str(out_file))
        assert code == 0, err
        assert f"bus bandwidth {fit.bus_bandwidth_bytes_per_s / 1e9:.1f} GB/s" in out
        assert f"alpha {fit.alpha_s * 1e6:.2f} us" in out
        base = get_gpu(base_name)
        # The derivation below is the ring over the links' figures: force both (the default picks
        # NCCL's algorithm and the achievable entries, tests/test_algorithms.py).
        ring = ("--algorithm", "ring", "--bandwidth", "nominal")
        base_s, sent = _communication(zeroplan_cli, base_name, gpus, *ring)
        calibrated_s, sent_calibrated = _communication(zeroplan_cli, str(out_file), gpus, *ring)
        assert sent_calibrated == sent
        if link == "intra_node":
            base_bandwidth, base_latency = base.intra_node_link.bandwidth_bytes_per_s, base.intra_node_link.latency_s
            bandwidth = fit.bus_bandwidth_bytes_per_s
        else:  # the A3 Mega ring crosses nodes and its NVLink hops: the slower of the two bounds it
            base_bandwidth = min(base.intra_node_link.bandwidth_bytes_per_s, base.node_network.nics_per_node
                                 * base.node_network.nic_bandwidth_bytes_per_s)
            base_latency = base.inter_node_link.latency_s
            bandwidth = min(base.intra_node_link.bandwidth_bytes_per_s, fit.bus_bandwidth_bytes_per_s)
        steps = (base_s - sent / base_bandwidth) / base_latency
        calls = steps / (2 * (gpus - 1))
        assert calls == pytest.approx(round(calls), abs=1e-6) and calls >= 1
        assert calibrated_s == pytest.approx(sent / bandwidth + round(calls) * fit.alpha_s, rel=1e-6)
        assert calibrated_s != pytest.approx(base_s, rel=1e-2)


def test_older_nccl_tests_layout_reads_the_same_run(tmp_path: Path) -> None:
    """Older nccl-tests printed no root column, an 'error' column (max error, not a count) where
    '#wrong' is now, and Rank lines without 'Group' (as pasted in NVIDIA/nccl issue #583, 2021):
    the A3 Mega run rewritten in that layout reads as the same rows, ranks and nodes."""
    modern = REAL / "all_reduce_2node_16x_h100_a3mega.txt"
    old_lines = []
    for line in modern.read_text(encoding="utf-8").splitlines():
        if line.startswith("#  Rank"):
            line = re.sub(r"Group\s+\d+\s+", "", line)
        elif line.startswith("#       size"):
            line = "#       size         count      type   redop     time   algbw   busbw  error     time   algbw   busbw  error"
        elif re.match(r"^\s*\d+\s+\d+\s+float", line):
            fields = line.split()
            del fields[4]  # root
            fields[7] = fields[11] = "0e+00"
            line = "  ".join(fields)
        old_lines.append(line)
    old = tmp_path / "old.log"
    old.write_text("\n".join(old_lines), encoding="utf-8")
    assert parse_nccl_tests(old).rows == parse_nccl_tests(modern).rows
    assert (parse_nccl_tests(old).num_ranks, parse_nccl_tests(old).num_nodes) == (16, 2)


def test_a_column_header_without_two_timed_blocks_is_refused(tmp_path: Path) -> None:
    lines = (REAL / "all_reduce_2node_2x_gh200_alps.txt").read_text(encoding="utf-8").splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#       size"))
    lines[header] = "#       size         count      type   redop    root     time   algbw   busbw  #wrong"
    odd = tmp_path / "odd.log"
    odd.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(ZeroplanError, match=rf"odd\.log:{header + 1}: column header not understood"):
        parse_nccl_tests(odd)


def test_the_logs_gpu_must_be_the_base_gpu(zeroplan_cli, tmp_path: Path) -> None:
    out_file = tmp_path / "x.json"
    code, out, err = zeroplan_cli("calibrate", str(ALL_REDUCE), "--gpu", "a10g", "--out", str(out_file))
    assert code == 2 and out == "" and not out_file.exists()
    assert err.strip().splitlines() == [
        "zeroplan: error: --gpu: 'a10g', but the logs ran on NVIDIA H100 80GB HBM3 (allowed: h100-80gb)"]


def test_logs_of_two_gpus_are_not_merged(zeroplan_cli, tmp_path: Path) -> None:
    a100 = REAL / "all_reduce_2node_16x_h100_a3mega.txt"
    gh200 = REAL / "all_reduce_2node_8x_gh200_alps.txt"
    code, out, err = zeroplan_cli("calibrate", str(a100), str(gh200), "--gpu", "h100", "--out", str(tmp_path / "x.json"))
    assert code == 2 and "ran on different GPUs" in err and len(err.strip().splitlines()) == 1


def test_a_gpu_the_catalog_lacks_is_kept_with_a_caution(zeroplan_cli, tmp_path: Path) -> None:
    code, out, err = zeroplan_cli("calibrate", str(REAL / "all_reduce_1node_8x_rtx5090.txt"), "--gpu", "rtx-4090",
                                  "--out", str(tmp_path / "x.json"))
    assert code == 0, err
    assert "caution: the logs ran on NVIDIA GeForce RTX 5090, which the catalog does not have" in out


def test_a_fit_without_small_sizes_cautions_that_the_latency_is_unknown(zeroplan_cli, tmp_path: Path) -> None:
    lines = ALL_REDUCE.read_text().splitlines()
    rows = [i for i, line in enumerate(lines) if line.split() and line.split()[0].isdigit()]
    two = [line for i, line in enumerate(lines) if i not in rows or i in rows[-2:]]
    path = tmp_path / "two.txt"
    path.write_text("\n".join(two))
    code, out, err = zeroplan_cli("calibrate", str(path), "--gpu", "h100", "--out", str(tmp_path / "x.json"))
    assert code == 0, err
    assert "caution: " in out and "the latency is not measured (2 sizes" in out


@pytest.mark.parametrize("device,names", [
    ("NVIDIA H100 80GB HBM3", ["h100-80gb"]), ("NVIDIA H100 PCIe", ["h100-pcie"]), ("NVIDIA H100 NVL", ["h100-nvl"]),
    ("NVIDIA A100-SXM4-80GB", ["a100-40gb", "a100-80gb"]), ("NVIDIA A100-PCIE-40GB", ["a100-pcie-40gb", "a100-pcie-80gb"]),
    ("NVIDIA A10G", ["a10g"]), ("NVIDIA A10", ["a10"]), ("NVIDIA L40S", ["l40s"]), ("NVIDIA L40", ["l40"]),
    ("NVIDIA L4", ["l4"]), ("NVIDIA GeForce RTX 3090", ["rtx-3090"]), ("NVIDIA RTX A6000", ["rtx-a6000"]),
    ("NVIDIA GH200 480GB", []), ("NVIDIA H200 NVL", []),
])
def test_a_logs_device_names_its_catalog_board(device: str, names: list[str]) -> None:
    # nvidia-smi's names (nccl-tests' Rank lines): the model as a whole word, and the board
    # (PCIe, NVL) where the catalog has it apart from the SXM module.
    from zeroplan.calibrate.fit import device_is_catalog_gpu
    from zeroplan.presets.gpus import gpu_names

    assert [name for name in gpu_names() if device_is_catalog_gpu(device, name)] == names
