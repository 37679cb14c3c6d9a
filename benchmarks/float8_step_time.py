"""float8 in the step time (zeroplan.core.float8_time), against torchtitan's and llm-foundry's
published tables.

1. The rows of zeroplan/validate/data/published_throughput.json that ran float8: torchao's
   (torchtitan's benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md at cbccb38) and
   TransformerEngine's (llm-foundry's 'H100 80GB FP8' table, Float8Recipe.te_delayed): predicted
   with float8 timed and with it ignored (the linears at the bf16 rate, the weights gathered in
   bf16), each at the fitted default efficiency the other sources give (leave-one-source-out:
   zeroplan.validate.step_calibration.held_out_fit), under the planner's default attention rate.
2. torchtitan's H100 tables (benchmarks/llama3_h100_202412_torchtitan.md at b5bcd76, Tables 1
   and 3: Llama 3.1 8B, FSDP, local batch 2, selective op checkpointing, 8 and 128 GPUs) ran on
   a 96 GB, 500 W H100 whose peak the source does not know, so they are not rows of the set;
   what they do give without a peak is float8's speed-up over the same compiled run
   (8,532 / 6,667 and 8,380 / 6,514). Printed against the predicted ratio on the catalog's H100
   SXM, with and without FSDP's float8 all-gather (the tables do not say; torchtitan 9dec370,
   the commit they ran, leaves it off by default), tensorwise (9dec370's only float8 recipe)
   and the output projection left in bf16 (9dec370 float8.py module_filter_fn).

Usage: python benchmarks/float8_step_time.py
"""

from __future__ import annotations

from zeroplan.validate.step_time import (
    PublishedThroughput,
    TrainingOptions,
    load_published_throughput,
)

H100_TABLES = "https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/benchmarks/llama3_h100_202412_torchtitan.md"
PUBLISHED_SPEEDUP = {8: (6667, 8532), 128: (6514, 8380)}
"""GPUs -> (FSDP + torch.compile, FSDP + torch.compile + Float8) TPS/GPU, Tables 1 and 3."""


def _ignoring_float8(row: PublishedThroughput) -> PublishedThroughput:
    options = row.training_options.model_copy(update={"float8": None, "float8_all_gather": False,
                                                      "float8_skips_output": False})
    return row.model_copy(update={"training_options": options})


def _held_out_tokens_per_s(table, row: PublishedThroughput, scored: PublishedThroughput) -> float:
    """``scored``'s tokens/s/GPU at the efficiency fitted without ``row``'s source, under the
    planner's default attention rate (kernel): its attention efficiencies and its kernel class's HFU."""
    from zeroplan.validate.step_calibration import (
        held_out_fit,
        held_out_tokens_per_s,
        kernel_mechanism_hfu,
        source_of,
    )

    efficiencies, implied = held_out_fit("kernel", table, source_of(row))
    hfu = kernel_mechanism_hfu(source_of(row), implied, table.rows, row)
    return held_out_tokens_per_s(scored, hfu, "kernel", efficiencies)


def main() -> None:
    table = load_published_throughput()
    rows = [r for r in table.rows if r.training_options.float8 is not None]
    print("float8 rows of the published set, each at the efficiency fitted without its source:")
    print()
    print("| row | published | float8 timed | error | float8 ignored | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        timed = _held_out_tokens_per_s(table, row, row)
        ignored = _held_out_tokens_per_s(table, row, _ignoring_float8(row))
        published = row.published_tokens_per_s_per_gpu
        print(f"| {row.name} | {published:,.0f} | {timed:,.0f} | {timed / published - 1:+.1%} | {ignored:,.0f} | "
              f"{ignored / published - 1:+.1%} |")
    print()
    print("torchtitan's H100 tables 1 and 3 (a 96 GB 500 W H100, not in the catalog): float8's speed-up over the")
    print("same compiled run, published, and predicted on the catalog's H100 SXM at the efficiency fitted on every")
    print("row of the set (none of them from these tables)")
    print()
    print("| GPUs | published | predicted, bf16 gathers | predicted, float8 all-gather |")
    print("|---:|---:|---:|---:|")
    for gpus, (compiled, float8) in PUBLISHED_SPEEDUP.items():
        base = PublishedThroughput(
            name=f"llama-3.1-8b h100 x{gpus} compile b2", source_url=H100_TABLES,
            source_section="Tables 1 and 3", setup_notes="float8 speed-up check", model="llama-3.1-8b",
            gpu="h100-80gb", num_gpus=gpus, gpus_per_node=8, strategy="fsdp-full-shard", framework="torchtitan",
            precision="bf16-mixed", activation_checkpointing="selective-op", micro_batch_size=2, seq_len=8192,
            grad_accum_steps=1, published_tokens_per_s_per_gpu=compiled, compile=True,
            training_options=TrainingOptions(compile=True))
        base_speed = _held_out_tokens_per_s(table, base, base)
        speed = {}
        for gather in (False, True):
            options = TrainingOptions(compile=True, float8="tensorwise", float8_all_gather=gather, float8_skips_output=True)
            speed[gather] = _held_out_tokens_per_s(table, base, base.model_copy(update={"training_options": options})) / base_speed
        print(f"| {gpus} | {float8 / compiled:.3f} | {speed[False]:.3f} | {speed[True]:.3f} |")


if __name__ == "__main__":
    main()
