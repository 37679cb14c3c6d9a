"""Inputs that were a traceback or a silent (wrong or ignored) answer: each is now one line on
stderr naming the flag or field and what is allowed, exit status 2, nothing on stdout. No case
launches torchrun: measure's refusals happen before it starts a rank."""

from __future__ import annotations

import pytest

from refusals import run_refused


def _one_line(capsys, argv: list[str], *words: str) -> str:
    from zeroplan.cli.main import main

    err = run_refused(main, argv, capsys)
    for word in words:
        assert word in err, (argv, word, err)
    return err


@pytest.mark.parametrize("argv,flag", [
    # cp 3 gives no layout (2 x cp does not divide 4096), and asking which cp would recursed
    # between the layout enumeration and its own error path.
    (["plan", "llama-3.1-8b", "--global-batch", "8", "--cp", "3", "--gpus", "6", "--gpus-per-node", "6"], "--cp: 3"),
    (["plan", "llama-3.1-8b", "--global-batch", "8", "--cp", "2", "--seq-len", "4097", "--gpus", "8"], "--cp: 2"),
])
def test_a_fixed_degree_without_layout_is_one_line(capsys, argv, flag) -> None:
    _one_line(capsys, argv, flag, "allowed: 1")


@pytest.mark.parametrize("argv,words", [
    (["fit", "{deep}"], ("model: ", "nests")),
    (["fit", "gpt2", "--gpu", "{deep}"], ("gpu: ", "nests")),
    # Records are parsed by pydantic's own JSON reader, which has a recursion limit of its own.
    (["validate", "{deep}"], ("records: ", "recursion limit")),
])
def test_a_file_nested_200000_deep_is_one_line(capsys, tmp_path, argv, words) -> None:
    """The JSON decoder recurses once per level: a RecursionError, not a refusal naming the file."""
    deep = tmp_path / "config.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    _one_line(capsys, [a.format(deep=deep) for a in argv], str(deep), *words)


def test_measure_refuses_fewer_micro_batches_than_1f1b_stages_before_launch(capsys, monkeypatch, tmp_path) -> None:
    """torch's Schedule1F1B raised this on rank 0 after 11-20 s of start-up."""
    from zeroplan.harness import launch as launch_module

    def no_launch(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(launch_module, "launch", no_launch)
    _one_line(capsys, ["measure", "tiny-llama", "--strategy", "fsdp-full-shard", "--nproc", "4", "--pp", "2",
                       "--grad-accum", "1", "--backend", "gloo", "--out", str(tmp_path / "out")],
              "--grad-accum: 1", "Schedule1F1B", "allowed: 2 or more")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,words", [
    (["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "4"], ("--grad-accum: 1", "allowed: 4 or more")),
    (["compare", "llama-3.1-8b", "--gpus", "8", "--pp", "4", "--grad-accum", "3"], ("--grad-accum: 3",)),
    # pp 2, 5 micro-batches: max(1, 5 // 2) = 2 rounds, which do not divide 5.
    (["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "5"],
     ("--grad-accum: 5", "2 rounds", "4 or 6")),
    (["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "zero-bubble", "--grad-accum", "7"],
     ("--grad-accum: 7", "3 rounds")),
])
def test_fit_refuses_micro_batch_counts_torchs_schedules_refuse(capsys, argv, words) -> None:
    _one_line(capsys, argv, *words)


@pytest.mark.parametrize("argv", [
    ["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--grad-accum", "2"],
    ["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "gpipe"],
    ["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "3"],
    ["fit", "llama-3.1-8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "6"],
])
def test_micro_batch_counts_torchs_schedules_run_are_answered(capsys, argv) -> None:
    from zeroplan.cli.main import main

    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_plan_skips_accumulation_counts_the_schedule_refuses() -> None:
    """The search answered 1F1B with fewer micro-batches than stages, and interleaved 1F1B with a
    count its rounds do not divide: such splits are not searched."""
    from zeroplan.core.search import LayoutSpace, search
    from zeroplan.presets.gpus import get_gpu
    from zeroplan.presets.models import get_model
    from zeroplan.specs import BatchSpec, PlanRequest, StrategyKind, StrategySpec, cluster_from_gpus
    from zeroplan.specs.parallel import PipelineSchedule

    base = PlanRequest(model=get_model("llama-3.1-8b"), cluster=cluster_from_gpus(get_gpu("h100-80gb"), 8),
                       strategy=StrategySpec(kind=StrategyKind.ddp), batch=BatchSpec(seq_len=1024))
    one_f_one_b = search(base, 8, top=50, space=LayoutSpace(tp=1, pp=4, cp=1, pp_schedules=(PipelineSchedule.one_f_one_b,)))
    assert one_f_one_b.ranked and all(c.grad_accum_steps >= 4 for c in one_f_one_b.ranked + one_f_one_b.pareto)
    # dp 4, 20 sequences per rank: 5 micro-batches (2 rounds) and 20 (10 rounds) are refused.
    interleaved = search(base, 80, top=50, space=LayoutSpace(tp=1, pp=2, cp=1, pp_schedules=(PipelineSchedule.interleaved_1f1b,)))
    counts = {c.grad_accum_steps for c in interleaved.ranked + interleaved.pareto}
    assert counts and all(m % max(1, m // 2) == 0 for m in counts), counts
    with pytest.raises(Exception, match="global-batch"):
        search(base, 4, space=LayoutSpace(tp=1, pp=4, cp=1, pp_schedules=(PipelineSchedule.one_f_one_b,)))


@pytest.mark.parametrize("argv", [
    ["fit", "llama-3.1-8b", "--pp", "32", "--gpus", "32", "--grad-accum", "32"],
    ["fit", "llama-3.1-8b", "--pp", "2", "--tp", "2", "--cp", "2", "--gpus", "8", "--grad-accum", "2"],
    ["compare", "llama-3.1-8b", "--pp", "2", "--gpus", "4", "--grad-accum", "4", "--pp-schedule", "zero-bubble"],
])
def test_default_strategies_that_cannot_apply_are_left_out_with_a_note(capsys, argv) -> None:
    """HSDP's default group (a node's GPUs over tp) refused the whole question, which never named hsdp."""
    from zeroplan.cli.main import main

    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "Left out: hsdp: shard group" in out, out
    assert not any(line.startswith("hsdp ") for line in out.splitlines()), out


def test_a_named_strategy_that_cannot_apply_is_still_refused(capsys) -> None:
    _one_line(capsys, ["fit", "llama-3.1-8b", "--pp", "2", "--tp", "2", "--cp", "2", "--gpus", "8", "--grad-accum", "2",
                       "--strategies", "hsdp"], "--hsdp-group: shard group 4", "allowed: a divisor of 2")


PLAN = ["plan", "llama-3.1-8b", "--global-batch", "8"]


@pytest.mark.parametrize("argv,words", [
    # --virtual-stages without --pp was refused while --pp-schedule was ignored.
    (["fit", "llama-3.1-8b", "--pp-schedule", "gpipe"], ("--pp-schedule", "allowed: with --pp 2 or more")),
    (["compare", "llama-3.1-8b", "--pp-schedule", "zbv"], ("--pp-schedule",)),
    (["measure", "tiny-llama", "--strategy", "ddp", "--pp-schedule", "gpipe", "--out", "out"], ("--pp-schedule",)),
    ([*PLAN, "--pp", "1", "--pp-schedule", "interleaved-1f1b"], ("--pp-schedule", "--pp 2 or more")),
    # plan answered with tp 4.
    ([*PLAN, "--tp", "4", "--max-tp", "2"], ("--max-tp: 2 is below --tp 4", "allowed:")),
    # The schedule (or bound) was ignored by a search without layouts.
    ([*PLAN, "--pp-schedule", "1f1b", "--no-model-parallel"], ("--pp-schedule", "--no-model-parallel")),
    ([*PLAN, "--max-tp", "2", "--no-model-parallel"], ("--max-tp", "--no-model-parallel")),
    ([*PLAN, "--lora-rank", "8", "--pp-schedule", "1f1b"], ("--pp-schedule", "--lora-rank")),
    (["plan", "llama-2-7b", "--framework", "hf", "--global-batch", "8", "--pp-schedule", "1f1b"],
     ("--pp-schedule", "not modelled for hf")),
])
def test_layout_flags_that_would_be_ignored_are_refused(capsys, monkeypatch, tmp_path, argv, words) -> None:
    monkeypatch.chdir(tmp_path)
    _one_line(capsys, argv, *words)


def test_a_data_parallel_only_plan_names_what_the_user_typed(capsys) -> None:
    """'--tp: 2 with --no-model-parallel' was the answer to a --lora-rank search that never had that flag."""
    err = _one_line(capsys, [*PLAN, "--lora-rank", "8", "--tp", "2"], "--tp: 2 with --lora-rank", "allowed: 1")
    assert "--no-model-parallel" not in err
    err = _one_line(capsys, [*PLAN, "--frozen-blocks", "2", "--pp", "2"], "--pp: 2 with --frozen-blocks")
    assert "--no-model-parallel" not in err


FIT_LORA = ["fit", "llama-3.1-8b", "--framework", "hf", "--lora-rank"]


@pytest.mark.parametrize("argv,words", [
    # An adapter of a 4096 x 1024 layer has rank at most 1024.
    ([*FIT_LORA, "8192"], ("--lora-rank: 8192 exceeds 1024", "allowed: 1 to 1024")),
    ([*FIT_LORA, "1025", "--lora-targets", "q,v"], ("--lora-rank: 1025", "v: 4096 x 1024")),
    # bitsandbytes quantizes 4-bit blocks of a power of two elements.
    ([*FIT_LORA, "8", "--quantize", "nf4", "--quant-block-size", "63"], ("--quant-block-size: 63", "allowed: 32, 64,")),
    # 64 (the default's value) without nf4 was accepted where 128 was refused.
    ([*FIT_LORA, "8", "--quant-block-size", "64"], ("--quant-block-size", "nf4")),
    ([*FIT_LORA, "8", "--quant-block-size", "128"], ("--quant-block-size", "nf4")),
    ([*FIT_LORA, "8", "--double-quant"], ("--double-quant", "nf4")),
    ([*FIT_LORA, "8", "--no-double-quant"], ("--double-quant", "nf4")),
])
def test_finetune_values_bitsandbytes_or_lora_cannot_take_are_refused(capsys, argv, words) -> None:
    _one_line(capsys, argv, *words)


def test_lora_rank_at_the_bound_and_block_sizes_bitsandbytes_takes_are_answered(capsys) -> None:
    from zeroplan.cli.main import main

    for argv in ([*FIT_LORA, "1024"], [*FIT_LORA, "8", "--quantize", "nf4", "--quant-block-size", "4096"]):
        assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_a_config_loading_in_4_and_8_bits_is_refused(capsys, tmp_path) -> None:
    import json

    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 2,
              "num_attention_heads": 32, "intermediate_size": 11008, "max_position_embeddings": 4096,
              "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True,
                                      "bnb_4bit_quant_type": "nf4"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _one_line(capsys, ["fit", str(path), "--lora-rank", "8", "--framework", "hf"],
              "config.quantization_config", "load_in_4bit and load_in_8bit")


DEEPSEEK = str(__import__("pathlib").Path(__file__).parent / "fixtures" / "hf" / "deepseek-v2-lite.json")


def test_a_capacity_factor_under_torchtitans_dropless_moe_is_refused(capsys) -> None:
    """torchtitan routes dropless: the capacity factor changed its answer silently."""
    _one_line(capsys, ["fit", DEEPSEEK, "--gpus", "16", "--framework", "torchtitan", "--ep", "8",
                       "--moe-capacity-factor", "1.25"], "--moe-capacity-factor", "dropless")


@pytest.mark.parametrize("argv,flag", [
    (["fit", "llama-3.1-8b", "--ep", "2"], "--ep: 2 needs a mixture-of-experts model"),
    (["fit", DEEPSEEK, "--gpus", "16", "--framework", "torchtitan", "--ep", "3"], "--ep: 3 does not divide"),
])
def test_ep_refusals_name_the_flag(capsys, argv, flag) -> None:
    err = _one_line(capsys, argv, flag)
    assert "parallel.ep" not in err


SAMPLE_RECORD = (__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed-records"
                 / "tiny-llama-zero1-deepspeed-fp32-n2" / "rank00000.json")


def _record_with(tmp_path, edit) -> str:
    import json

    record = json.loads(SAMPLE_RECORD.read_text(encoding="utf-8"))
    edit(record)
    path = tmp_path / "rank00000.json"
    path.write_text(json.dumps(record))
    return str(path)


@pytest.mark.parametrize("edit,field", [
    # Coerced before: a string for a count or a flag, a negative peak (printed as -0.000), 10^9 nodes.
    (lambda r: r["description"].update(world_size="2"), "description.world_size"),
    (lambda r: r.update(rank="0"), "rank"),
    (lambda r: r.update(complete="yes"), "complete"),
    (lambda r: r["description"].update(steps="6"), "description.steps"),
    (lambda r: r["steps"][0]["memory"].update(peak_bytes=-1), "steps.0.memory.peak_bytes"),
    (lambda r: r.update(nnodes=10**9), "nnodes"),
])
def test_validate_reads_records_strictly(capsys, tmp_path, edit, field) -> None:
    path = _record_with(tmp_path, edit)
    _one_line(capsys, ["validate", path], "records: ", path, field)


def test_validate_names_the_record_and_its_field_for_a_bad_layout(capsys, tmp_path) -> None:
    """It blamed fit's flags ('--tp/--cp/--pp: ...') and named no file."""
    def edit(record):
        record["description"]["world_size"] = 1
        record["description"]["parallel"] = {**record["description"].get("parallel", {}), "tp": 3}

    path = _record_with(tmp_path, edit)
    err = _one_line(capsys, ["validate", path], f"records: '{path}': description.parallel: ")
    assert "--tp" not in err
