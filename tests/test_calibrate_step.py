"""``zeroplan calibrate step``: the HFU one measured step implies, the efficiency file it writes,
and ``--efficiency`` on fit, compare and plan (zeroplan/calibrate/step.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.calibrate.step import StepEfficiency, load_efficiency, solve_hfu
from zeroplan.cli.main import build_parser, main
from zeroplan.core.plan import plan
from zeroplan.errors import ZeroplanError
from zeroplan.presets.gpus import get_gpu
from zeroplan.presets.models import get_model
from zeroplan.specs import BatchSpec, PerformanceAssumptions, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus
from zeroplan.validate.rows import FLAT_RESERVE


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _request(kind: StrategyKind, gpus: int, hfu: float, model: str = "llama-3.1-8b") -> PlanRequest:
    return PlanRequest(
        model=get_model(model), batch=BatchSpec(micro_batch_size=1, seq_len=4096),
        cluster=cluster_from_gpus(get_gpu("h100-80gb"), gpus), strategy=StrategySpec(kind=kind),
        performance=PerformanceAssumptions(hardware_flops_utilization=hfu), assumptions=FLAT_RESERVE,
    )


@pytest.mark.parametrize("kind, gpus", [(StrategyKind.fsdp_full_shard, 8), (StrategyKind.zero1, 64), (StrategyKind.ddp, 16)])
def test_the_hfu_solved_gives_back_the_step_it_was_solved_on(kind: StrategyKind, gpus: int) -> None:
    # Communication is kept as the planner prices it: zero1's all-gather after the backward is
    # exposed, so the solved HFU is the one the step was timed at, not step / compute.
    for hfu in (0.25, 0.55):
        time = plan(_request(kind, gpus, hfu)).time
        assert solve_hfu(_request(kind, gpus, 0.4), time.step_with_overlap_s) == pytest.approx(hfu, rel=1e-6)
    exposed = plan(_request(StrategyKind.zero1, 64, 0.4)).time.exposed_communication_s
    assert exposed > 0


def test_a_step_faster_than_hfu_one_is_refused() -> None:
    fastest = plan(_request(StrategyKind.fsdp_full_shard, 8, 1.0)).time.step_with_overlap_s
    with pytest.raises(ZeroplanError, match="shorter than the planner's step at HFU 1"):
        solve_hfu(_request(StrategyKind.fsdp_full_shard, 8, 0.4), fastest * 0.9)


def _calibrate(capsys, tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "eff.json"
    code, text, err = run(capsys, "calibrate", "step", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb",
                          "--strategy", "fsdp-full-shard", "--tokens-per-s-per-gpu", "7000", "--out", str(out), *extra)
    assert code == 0, err
    assert f"wrote {out}" in text
    return out


def test_calibrate_step_writes_a_typed_file_and_compare_gives_the_measured_step_back(capsys, tmp_path: Path) -> None:
    out = _calibrate(capsys, tmp_path, "--note", "one measured step")
    efficiency = load_efficiency(out)
    assert isinstance(efficiency, StepEfficiency)
    assert (efficiency.gpu, efficiency.framework.value, efficiency.source.strategy) == ("h100-80gb", "zeroplan", "fsdp-full-shard")
    assert efficiency.source.measured_tokens_per_s_per_gpu == pytest.approx(7000)
    assert efficiency.source.note == "one measured step"
    code, text, err = run(capsys, "compare", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb",
                          "--strategies", "fsdp-full-shard", "--format", "json", "--efficiency", str(out))
    assert code == 0, err
    time = json.loads(text)["plans"][0]["time"]
    assert time["tokens_per_s_per_gpu"] == pytest.approx(7000, rel=1e-6)


def test_compare_and_plan_say_calibrated_or_default(capsys, tmp_path: Path) -> None:
    out = _calibrate(capsys, tmp_path)
    # The detail view keeps the line whole (the first screen wraps it at the screen's width).
    code, text, _ = run(capsys, "compare", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-80gb", "--efficiency", str(out),
                        "--detail")
    assert code == 0
    line = text.splitlines()[-1]
    assert line.startswith("step time: calibrated, HFU 0.436 from ") and "band" in line
    # The band of the rate the file was solved under (the default, 'kernel').
    from zeroplan.calibrate.basis import CALIBRATED_BANDS

    assert f"median {CALIBRATED_BANDS['kernel'][0]:.1%}, max {CALIBRATED_BANDS['kernel'][1]:.1%}" in line
    code, text, _ = run(capsys, "compare", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-80gb", "--detail")
    assert text.splitlines()[-1].startswith("step time: fitted default HFU ")
    # The large-scale llm-foundry table's FlashAttention-2 rows give h100's eager-timed flash-attn-2
    # class rows of three sources (with Megatron-LM's and llm.c's GPT-2 1558M row, cuDNN's flash attention).
    assert "(h100, flash-attn-2, not compiled: median of 22 published rows, 3 sources)" in text.splitlines()[-1]
    code, text, _ = run(capsys, "compare", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-80gb", "--hfu", "0.5", "--detail")
    assert "HFU 0.5 as given (--hfu), not calibrated; band not measured" in text
    code, text, err = run(capsys, "plan", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--global-batch", "16",
                          "--no-model-parallel", "--top", "2", "--efficiency", str(out), "--detail")
    assert code == 0, err
    assert "step time: calibrated, HFU 0.436" in text


@pytest.mark.parametrize("extra, needle", [
    (("--gpu", "a100-80gb"), "was calibrated on h100-80gb, not a100-80gb"),
    (("--gpu", "h100-80gb", "--framework", "torchtitan"), "was calibrated on framework zeroplan, not torchtitan"),
    (("--gpu", "h100-80gb", "--hfu", "0.5"), "drop --hfu or --efficiency"),
    (("--gpu", "h100-80gb", "--compute-model", "roofline"), "drop --compute-model roofline"),
])
def test_a_file_that_does_not_apply_is_one_line(capsys, tmp_path: Path, extra, needle) -> None:
    out = _calibrate(capsys, tmp_path)
    code, text, err = run(capsys, "compare", "llama-3.1-70b", "--gpus", "64", "--efficiency", str(out), *extra)
    assert code == 2 and text == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_a_file_of_another_kind_is_one_line(capsys, tmp_path: Path) -> None:
    other = tmp_path / "gpu.json"
    other.write_text(json.dumps(get_gpu("h100-80gb").model_dump(mode="json")))
    code, _, err = run(capsys, "compare", "gpt2", "--gpus", "8", "--efficiency", str(other))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--efficiency" in err


def test_calibrate_step_refuses_a_measured_step_the_planner_cannot_reach(capsys, tmp_path: Path) -> None:
    code, _, err = run(capsys, "calibrate", "step", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb",
                       "--strategy", "fsdp-full-shard", "--tokens-per-s-per-gpu", "1e6", "--out", str(tmp_path / "x.json"))
    assert code == 2 and "shorter than the planner's step at HFU 1" in err and not (tmp_path / "x.json").exists()


def test_step_s_and_tokens_per_s_are_the_same_measurement(capsys, tmp_path: Path) -> None:
    by_tokens = load_efficiency(_calibrate(capsys, tmp_path))
    step_s = 4096 / 7000
    out = tmp_path / "by-step.json"
    code, _, err = run(capsys, "calibrate", "step", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb",
                       "--strategy", "fsdp-full-shard", "--step-s", repr(step_s), "--out", str(out))
    assert code == 0, err
    assert load_efficiency(out).hardware_flops_utilization == pytest.approx(by_tokens.hardware_flops_utilization)


def test_the_nccl_tests_mode_parses_as_before() -> None:
    args = build_parser().parse_args(["calibrate", "a.log", "b.log", "--gpu", "h100-80gb", "--out", "x.json"])
    assert args.logs == ["a.log", "b.log"] and args.out == "x.json"
    step = build_parser().parse_args(["calibrate", "step", "gpt2", "--strategy", "ddp", "--step-s", "1", "--out", "x.json"])
    assert step.model == "gpt2" and step.step_s == 1.0 and step.run.__name__ == "run_calibrate_step"


def test_calibrate_step_refuses_a_device_as_out_before_computing(capsys) -> None:
    code, _, err = run(capsys, "calibrate", "step", "gpt2", "--strategy", "ddp", "--step-s", "1", "--out", "/dev/null")
    assert code == 2 and "is a character device" in err and len(err.strip().splitlines()) == 1


def _training(request: PlanRequest, **update) -> PlanRequest:  # type: ignore[no-untyped-def]
    return request.model_copy(update={"training": request.training.model_copy(update=update)})


def test_the_file_records_compile_and_the_overlap_flags_it_was_solved_under() -> None:
    from zeroplan.calibrate.step import calibrate_step

    request = _request(StrategyKind.zero2, 16, 0.4)
    source = calibrate_step(request, plan(request).time.step_with_overlap_s, model="llama-3.1-8b").source
    # DeepSpeed ZeRO-2 reduces outside the backward by default (overlap_comm false below stage 3)
    assert (source.compile, source.overlap_grad_reduce, source.overlap_param_gather, source.tp_comm_overlap) == (
        False, False, False, False)
    gather = request.model_copy(update={"performance": request.performance.model_copy(update={"overlap_param_gather": True})})
    assert calibrate_step(gather, plan(gather).time.step_with_overlap_s, model="m").source.overlap_param_gather


def test_a_file_is_applied_across_modelled_mechanisms_and_refused_across_untimed_ones() -> None:
    from zeroplan.calibrate.step import calibrate_step, calibrated_under, check_calibrated_under
    from zeroplan.specs.framework import Framework
    from zeroplan.specs.training import Float8Recipe

    eager = _training(_request(StrategyKind.fsdp_full_shard, 8, 0.4), framework=Framework.torchtitan)
    efficiency = calibrate_step(eager, plan(eager).time.step_with_overlap_s, model="llama-3.1-8b")
    compiled = _training(eager, compile=True)
    check_calibrated_under(efficiency, "f.json", compiled)  # compile's saved traffic is modelled
    assert calibrated_under(efficiency, compiled) == "eager -> compiled (compile's saved memory traffic modelled)"
    assert calibrated_under(efficiency, eager) == ""
    no_overlap = eager.model_copy(update={"performance": eager.performance.model_copy(update={"overlap_grad_reduce": False})})
    assert calibrated_under(efficiency, no_overlap) == "overlap-grad-reduce on -> off (communication modelled)"
    # float8 is timed on a GPU with an fp8 peak (zeroplan.core.float8_time), refused on one without
    float8 = _training(compiled, float8=Float8Recipe.tensorwise)
    check_calibrated_under(efficiency, "f.json", float8)
    assert calibrated_under(efficiency, float8).endswith("; float8 off -> tensorwise (the float8 products at the fp8 "
                                                         "peak, their casts at the copy bandwidth, modelled)")
    on_l40s = float8.model_copy(update={"cluster": cluster_from_gpus(get_gpu("l40s"), 8)})
    with pytest.raises(ZeroplanError, match=r"^--efficiency: 'f.json' was calibrated with float8 off, not tensorwise, and "
                                            r"float8 is not timed on l40s, which has no fp8 peak in the catalog \(allowed: "
                                            r"a file calibrated with float8 tensorwise\)$"):
        check_calibrated_under(efficiency, "f.json", on_l40s)
    # where compile is not timed (no measured bandwidth of the GPU) an eager file is refused compiled
    v100 = eager.model_copy(update={"cluster": cluster_from_gpus(get_gpu("v100-32gb"), 8)})
    on_v100 = calibrate_step(v100, plan(v100).time.step_with_overlap_s, model="llama-3.1-8b")
    with pytest.raises(ZeroplanError, match=r"^--efficiency: 'f.json' was calibrated eager, not compiled, and compile "
                                            r"not timed: no measured memory bandwidth for gpu v100-32gb \(allowed: a file "
                                            r"calibrated compiled\)$"):
        check_calibrated_under(on_v100, "f.json", _training(v100, compile=True))


def test_efficiency_on_the_command_line_refuses_an_untimed_mechanism_in_one_line(tmp_path: Path, capsys) -> None:
    from zeroplan.calibrate.step import calibrate_step
    from zeroplan.specs.framework import Framework

    v100 = _training(_request(StrategyKind.fsdp_full_shard, 8, 0.4), framework=Framework.torchtitan)
    v100 = v100.model_copy(update={"cluster": cluster_from_gpus(get_gpu("v100-32gb"), 8)})
    path = tmp_path / "v100.json"
    path.write_text(calibrate_step(v100, plan(v100).time.step_with_overlap_s, model="llama-3.1-8b").model_dump_json())
    code, _, err = run(capsys, "compare", "llama-3.1-8b", "--gpus", "8", "--gpu", "v100-32gb", "--framework", "torchtitan",
                       "--compile", "--efficiency", str(path))
    assert code != 0
    assert err.strip().splitlines()[-1].startswith("zeroplan: error: --efficiency:")
    assert "was calibrated eager, not compiled" in err


def test_a_file_of_the_old_compute_basis_is_refused_in_one_line(capsys, tmp_path: Path) -> None:
    # Before the memory-bound kernels were timed apart an HFU covered every kernel: such a file
    # (no compute_basis) would count the memory-bound time twice, so --efficiency refuses it.
    from zeroplan.core.timing import COMPUTE_BASIS

    out = _calibrate(capsys, tmp_path)
    assert load_efficiency(out).compute_basis == COMPUTE_BASIS == "matmul-attention"
    data = json.loads(out.read_text())
    del data["compute_basis"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    with pytest.raises(ZeroplanError, match="compute_basis all-kernels .* rerun zeroplan calibrate step"):
        load_efficiency(old)
    code, text, err = run(capsys, "compare", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--efficiency", str(old))
    assert code == 2 and text == ""
    assert len(err.strip().splitlines()) == 1 and "--efficiency" in err and "allowed: compute_basis matmul-attention" in err


@pytest.mark.slow  # three CLI runs, about 0.5 s
def test_a_file_solved_under_the_kernel_rate_carries_its_attention_efficiency(capsys, tmp_path: Path) -> None:
    # zeroplan.core.attention_efficiency: the file records the e it solved at and --efficiency
    # applies it with the HFU, so the measured step comes back; a larger e times attention faster.
    flags = ("--attention-rate", "kernel", "--attention-impl", "flash-attn-triton")
    out = _calibrate(capsys, tmp_path, *flags)
    efficiency = load_efficiency(out)
    from zeroplan.core.default_efficiency import default_table

    assert efficiency.attention_efficiency == default_table().attention_efficiency["flash-attn-triton"]

    def tokens(path: Path) -> float:
        code, text, err = run(capsys, "compare", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", *flags,
                              "--strategies", "fsdp-full-shard", "--format", "json", "--efficiency", str(path))
        assert code == 0, err
        return json.loads(text)["plans"][0]["time"]["tokens_per_s_per_gpu"]

    assert tokens(out) == pytest.approx(7000, rel=1e-6)
    faster = tmp_path / "faster.json"
    faster.write_text(efficiency.model_copy(update={"attention_efficiency": 2 * efficiency.attention_efficiency}).model_dump_json())
    assert tokens(faster) > 7000 * 1.01


def _bisection(step_s, measured_step_s: float) -> float:
    # The plain bisection solve_hfu's answer is defined by: every midpoint timed.
    from zeroplan.calibrate.step import HFU_TOLERANCE

    low, high = 0.0, 1.0
    while high - low > HFU_TOLERANCE:
        middle = (low + high) / 2
        if step_s(middle) > measured_step_s:
            low = middle
        else:
            high = middle
    return high


@pytest.mark.parametrize("measured_step_s", [0.65, 0.66, 0.7, 1.0, 1.6, 2.5, 9.0, 40.0])
def test_the_narrowed_bisection_returns_the_plain_bisections_hfu_with_fewer_steps_timed(measured_step_s: float) -> None:
    """bisect_hfu times only the midpoints its interpolation has not already placed: the same
    float as the plain bisection, on a step piecewise linear in 1/HFU with a flat
    (communication-bound) stretch up to HFU 1 and a second kink."""
    from zeroplan.calibrate.step import bisect_hfu

    def step_s(hfu: float) -> float:
        compute = 0.25 / hfu
        return max(compute, 0.6) + 0.2 * max(0.0, compute - 1.5) + 0.05

    timed: list[float] = []

    def counted(hfu: float) -> float:
        timed.append(hfu)
        return step_s(hfu)

    assert bisect_hfu(counted, measured_step_s, step_s(1.0)) == _bisection(step_s, measured_step_s)
    assert len(timed) <= 10  # the plain bisection times 30


def test_a_file_is_carried_to_another_kernel_class_by_the_fitted_defaults_ratio() -> None:
    # One measured step fixes its own kernel class's HFU; a request of another class on the same
    # GPU is timed at that HFU times the fitted default's ratio between the two classes, and its
    # attention at its own kernel's efficiency, not the file's kernel's.
    from zeroplan.calibrate.step import calibrate_step, carried_hfu, mechanism_of, with_carried_hfu
    from zeroplan.core.default_efficiency import default_table, resolve
    from zeroplan.specs.training import AttentionImplementation

    flash2 = _request(StrategyKind.fsdp_full_shard, 8, 0.4)
    flash2 = flash2.model_copy(update={"performance": flash2.performance.model_copy(update={"attention_rate": "kernel"})})
    efficiency = calibrate_step(flash2, plan(flash2).time.step_with_overlap_s * 1.1, model="llama-3.1-8b")
    assert (efficiency.attention_class, efficiency.compiled_untimed) == mechanism_of(flash2)[:2] == ("flash-attn-2", False)
    assert carried_hfu(efficiency, flash2) == efficiency.hardware_flops_utilization
    triton = _training(flash2, attention_implementation=AttentionImplementation.flash_attn_triton)
    table = default_table()
    mechanisms, gpu = table.mechanisms["kernel"], flash2.cluster.gpu
    ratio = (resolve(mechanisms, table.generations, gpu, "flash-attn-triton", False).hfu
             / resolve(mechanisms, table.generations, gpu, "flash-attn-2", False).hfu)
    assert ratio != pytest.approx(1.0, abs=1e-3)
    assert carried_hfu(efficiency, triton) == pytest.approx(min(1.0, efficiency.hardware_flops_utilization * ratio), rel=1e-12)
    applied = with_carried_hfu(efficiency, triton.model_copy(update={"performance": triton.performance.model_copy(
        update={"attention_efficiency": efficiency.attention_efficiency})}))
    assert applied.performance.hardware_flops_utilization == carried_hfu(efficiency, triton)
    assert applied.performance.attention_efficiency is None  # the triton kernel's shipped efficiency
    # A file that does not record its kernel class (written before it was) applies as solved.
    old = efficiency.model_copy(update={"attention_class": None, "compiled_untimed": None})
    assert carried_hfu(old, triton) == efficiency.hardware_flops_utilization
