"""Other estimators' model-state formulas, restated so benchmarks can print them beside
zeroplan's predictions on the same cases.

DeepSpeed: deepspeed/runtime/zero/stage_1_and_2.py (estimate_zero2_model_states_mem_needs)
and deepspeed/runtime/zero/stage3.py (estimate_zero3_model_states_mem_needs), without
their additional_buffer_factor (1.5, applied to host memory only). llm-analysis is used
through its own package when installed (`pip install "zeroplan[peers]"`, i.e.
llm-analysis==0.2.2); it is optional.
"""

from __future__ import annotations

LLM_ANALYSIS_INSTALL = 'pip install "llm-analysis==0.2.2"  (or: pip install -e ".[peers]")'

# zeroplan strategy -> the llm-analysis DSZeRO stage that shards the same states: its
# analysis.py shards optimizer states from stage 1, gradients from stage 2, weights at stage 3.
LLM_ANALYSIS_STAGE = {
    "ddp": "NONE", "zero1": "STAGE_1", "zero2": "STAGE_2", "zero3": "STAGE_3",
    "fsdp-shard-grad-op": "STAGE_2", "fsdp-full-shard": "STAGE_3",
}


# stage3.py: GPU = the largest layer gathered in fp32-sized buffers (4 bytes/param) + 18 bytes
# per param split over the GPUs; optimizer offload leaves 2 bytes/param, param offload none.
def deepspeed_zero3_gpu_bytes(
    total_params: int, largest_layer_params: int, total_gpus: int, cpu_offload: bool, cpu_offload_params: bool
) -> int:
    largest_layer = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        return largest_layer
    if cpu_offload:
        return largest_layer + int(2 * total_params / total_gpus)
    return largest_layer + int(18 * total_params / total_gpus)


def llm_analysis_available() -> bool:
    try:
        import llm_analysis  # noqa: F401
    except ImportError:
        return False
    return True


def _llm_analysis_ffn(ffn: int, hidden: int, gated: bool) -> int:
    if not gated:
        return ffn
    return max(1, round(1.5 * ffn / hidden)) * hidden


def llm_analysis_memory(model, strategy: str, world_size: int, precision: str, micro_batch: int, seq_len: int,
                        full_checkpointing: bool = False, flash_attention: bool = True) -> dict[str, float]:
    """llm-analysis 0.2.2's per-GPU bytes for a zeroplan ModelSpec: weights, gradients, optimizer
    states, activations, as LLMAnalysis.training (llm_analysis/analysis.py) adds them up.

    How the case is told to llm-analysis: ModelConfig from the spec's shapes, with
    ffn_embed_dim = 1.5 f for gated (SwiGLU) MLPs, since its MLP has two h x f matrices, rounded to
    a multiple of h because its ModelConfig insists on an integer expansion ratio (its own
    Llama-2-7B config does the same: 16384 for f = 11008); dp_size = N, tp = pp = 1; the DSZeRO
    stage of LLM_ANALYSIS_STAGE. bf16-mixed is its default w16a16e16 with an fp32 master and two
    fp32 Adam states (master_weights_dtype_bytes=4, other_op_bytes=None). fp32 is a 32-bit
    DtypeConfig with AdamW's two fp32 states and no master copy (other_op_bytes=4 +
    master_weights_dtype_bytes=4, which is also its gradient bytes per parameter); training()
    refuses 32-bit configs (get_TFLOPS_per_gpu asserts 4, 8 or 16 bits, for its latency model),
    so the figures are summed from the same per-part methods training() sums; for bf16-mixed
    training()'s own figures are returned, after checking that the sum reproduces them. The GPU is its H100 SXM 80 GB with the memory
    raised to 1e6 GB so that its fit checks never stop the estimate (no memory figure depends on
    the GPU).
    """
    import logging

    from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
    from llm_analysis.config import DtypeConfig, GPUConfig, ModelConfig, ParallelismConfig, get_gpu_config_by_name

    logging.getLogger("__name__").setLevel(logging.ERROR)  # llm_analysis/logger.py's logger name
    gated = model.mlp.value in ("swiglu", "geglu")
    config = ModelConfig(
        name=model.name, num_layers=model.num_layers, n_head=model.num_heads, hidden_dim=model.hidden_size,
        vocab_size=model.vocab_size, max_seq_len=max(model.max_positions, seq_len),
        num_key_value_heads=model.num_kv_heads or model.num_heads,
        ffn_embed_dim=_llm_analysis_ffn(model.ffn_hidden_size, model.hidden_size, gated),
        moe_num_experts=model.num_experts, moe_top_k=model.experts_per_token,
    )
    gpu = GPUConfig(**{**get_gpu_config_by_name("h100-sxm-80gb").__dict__, "mem_per_GPU_in_GB": 1e6})
    if precision == "fp32":
        dtype, master, other = DtypeConfig(name="w32a32e32", weight_bits=32, activation_bits=32, embedding_bits=32), 4, 4
    else:
        dtype, master, other = DtypeConfig(), 4, None
    analysis = LLMAnalysis(config, gpu, dtype, ParallelismConfig(dp_size=world_size))
    stage = DSZeRO[LLM_ANALYSIS_STAGE[strategy]]
    recompute = ActivationRecomputation.FULL if full_checkpointing else ActivationRecomputation.NONE
    layers = model.num_layers
    # The sums of LLMAnalysis.training (analysis.py), part by part.
    optimizer_layer, gradient_layer = analysis.get_memory_optimizer_state_and_gradient_per_layer(master, other, stage)
    optimizer_embedding, gradient_embedding = analysis.get_memory_optimizer_state_and_gradient_embedding(master, other, stage)
    optimizer_norm, gradient_norm = analysis.get_memory_optimizer_state_and_gradient_last_layernorm(master, other, stage)
    activations = layers * analysis.get_activation_memory_per_layer(
        micro_batch, seq_len, is_inference=False, activation_recomputation=recompute, flash_attn=flash_attention,
        mlp_gated_linear_units=gated)
    outside_layers = (analysis.get_activation_memory_output_embedding(micro_batch, seq_len)
                      + analysis.get_activation_memory_per_layernorm(micro_batch, seq_len, recompute))
    activations += outside_layers
    figures = {
        "parameters": analysis.get_memory_embedding(stage) + layers * analysis.get_weight_memory_per_layer(stage)
        + analysis.get_weight_memory_last_layernorm(stage),
        "gradients": layers * gradient_layer + gradient_embedding + gradient_norm,
        "optimizer states": layers * optimizer_layer + optimizer_embedding + optimizer_norm,
        "activations": activations,
    }
    if precision != "fp32":
        summary = analysis.training(
            batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1, seq_len=seq_len,
            activation_recomputation=recompute, ds_zero=stage, master_weights_dtype_bytes=master,
            other_op_bytes=other, flash_attn=flash_attention, mlp_gated_linear_units=gated,
        )
        theirs = {"parameters": summary["weight_memory_per_gpu"], "gradients": summary["gradient_memory_per_gpu"],
                  "optimizer states": summary["optimizer_state_memory_per_gpu"],
                  "activations": summary["activation_memory_per_gpu"]}
        # At micro-batch 1, training() adds the logits and the last norm's activations twice (its
        # activation_memory_per_gpu starts from activation_memory_batch_size_1, which has them).
        expected = dict(figures, activations=figures["activations"] + (outside_layers if micro_batch == 1 else 0))
        for key, value in theirs.items():
            assert abs(value - expected[key]) <= 1e-6 * max(1.0, value), (key, value, expected[key])
        return theirs
    return figures
