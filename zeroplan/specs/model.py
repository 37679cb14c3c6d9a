"""The architecture of a decoder-only transformer, as the planner and the harness both read it."""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from enum import Enum

from pydantic import Field, model_validator

from zeroplan.errors import ZeroplanError
from zeroplan.specs.base import Frozen, JsonTuple
from zeroplan.specs.encoder_decoder import EncoderDecoderSpec


class MlpKind(str, Enum):
    """Feed-forward block: ``gelu`` is GPT's two-matrix MLP, ``swiglu`` Llama's gated three-matrix one,
    ``geglu`` the same gated block with GeLU in place of SiLU (Gemma; Shazeer 2020, "GLU Variants"),
    ``relu`` the two-matrix MLP with ReLU (OPT; Zhang et al. 2022), whose saved output is also the
    second linear's input."""

    gelu = "gelu"
    swiglu = "swiglu"
    geglu = "geglu"
    relu = "relu"

    @property
    def gated(self) -> bool:
        """Whether the block has gate, up and down projections (three matrices) rather than two."""
        return self in (MlpKind.swiglu, MlpKind.geglu)


class NormKind(str, Enum):
    """``layernorm`` has a weight and a bias per channel, ``rmsnorm`` only a weight."""

    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class EagerSoftmax(str, Enum):
    """The dtype a Hugging Face family's eager attention runs its softmax in
    (zeroplan.core.transformers_release.upcasts_softmax): ``fp32``, ``F.softmax(...,
    dtype=torch.float32)`` whatever the compute dtype (Llama's eager_attention_forward and most
    families'); ``scores``, the scores' own dtype (GPT-2's eager_attention_forward), which CUDA
    autocast alone upcasts; ``hidden``, ``dtype=hidden_states.dtype``, the attention's normed
    input (Falcon's own attention), fp32 under any autocast (LayerNorm's output is fp32 there)."""

    fp32 = "fp32"
    scores = "scores"
    hidden = "hidden"


class GeluForm(str, Enum):
    """How a GELU MLP's activation is written where the framework runs transformers' own modules
    (transformers 4.56.2 activations.py ACT2FN, keyed by the config's hidden_act /
    activation_function): ``gelu`` and ``gelu_pytorch_tanh`` call F.gelu (one saved tensor, its
    input); the others are spelled out in Python, each op keeping its own operands
    (zeroplan.core.hf_activation)."""

    gelu = "gelu"
    gelu_pytorch_tanh = "gelu_pytorch_tanh"
    gelu_new = "gelu_new"
    gelu_accurate = "gelu_accurate"
    gelu_python = "gelu_python"
    gelu_fast = "gelu_fast"


class PositionKind(str, Enum):
    """``learned`` adds a (max_positions x hidden) table; ``rope`` has no parameters; ``alibi``
    (Press et al. 2022) adds a per-head linear bias to the attention scores, no parameters
    either, and in transformers' Bloom only through its eager attention."""

    learned = "learned"
    rope = "rope"
    alibi = "alibi"
    relative = "relative"
    """T5's bucketed relative position bias added to the attention scores (Raffel et al. 2020
    sec. 2.1): its table is an encoder-decoder's (EncoderDecoderSpec.relative_attention_buckets)."""


class ModelSpec(Frozen):
    """A decoder-only transformer. Symbols follow Korthikanti et al. (2022): h, a, L, V, s."""

    name: str = Field(min_length=1)
    """Human-readable name, e.g. 'llama-2-7b'."""
    vocab_size: int = Field(gt=0)
    """V: vocabulary size (rows of the embedding table)."""
    hidden_size: int = Field(gt=0)
    """h: model width."""
    num_layers: int = Field(gt=0, le=1024)
    """L: number of transformer blocks; at most 1,024 (the deepest published models have under
    200; the planner builds every block's parameter units, docs/input-bounds.md)."""
    num_heads: int = Field(gt=0)
    """a: number of attention (query) heads; must divide hidden_size."""
    num_kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads for grouped-query attention; None means num_heads (multi-head attention)."""
    head_dim: int | None = Field(default=None, gt=0)
    """Width of one head; None means hidden_size // num_heads."""
    ffn_hidden_size: int = Field(gt=0)
    """f: inner width of the feed-forward block (4h for GPT-2, 11008 for Llama-2-7B)."""
    mlp: MlpKind = MlpKind.swiglu
    """Feed-forward kind."""
    gelu_form: GeluForm = Field(default=GeluForm.gelu, exclude_if=lambda form: form is GeluForm.gelu)
    """For a GELU MLP read from a transformers config, the activation its config names (GPT-2's,
    GPT-J's and Phi's gelu_new); what the op keeps under the hf profile is
    zeroplan.core.hf_activation's. Other frameworks run their own F.gelu."""
    norm: NormKind = NormKind.rmsnorm
    """Normalisation kind (pre-norm, two per block plus a final one)."""
    norm_scales_fp32: bool = Field(default=False, exclude_if=lambda fp32: not fp32)
    """Whether the RMSNorm scales the fp32 normalised tensor by (1 + weight) in fp32 and casts
    after (Gemma and Gemma 2: transformers 4.56.2 models/gemma/modeling_gemma.py GemmaRMSNorm.forward,
    lines 55-60, "Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)"), where
    Llama's casts first and scales in the input dtype."""
    norm_bias: bool = True
    """Whether a LayerNorm carries its bias (MPT's norms have none: transformers 4.56.2
    models/mpt/modeling_mpt.py sets norm_1.bias, norm_2.bias and norm_f.bias to None)."""
    position: PositionKind = PositionKind.rope
    """Position encoding."""
    max_positions: int = Field(default=4096, gt=0)
    """Longest sequence; sizes the learned position table."""
    positions_causal_mask: bool = Field(default=False, exclude_if=lambda builds: not builds)
    """Whether the model's Hugging Face code is LlamaModel's or GemmaModel's, which in transformers
    4.38.x register a max_positions-square boolean causal mask and expand it to a b x 1 x P x P
    mask in the embeddings' dtype at every forward (zeroplan.core.transformers_release.
    POSITIONS_MASK_RELEASES); set by zeroplan.presets.hf_config for model_type llama and gemma.
    Mistral's, Mixtral's and Qwen2's 4.38 code builds an s x s mask instead."""
    position_offset: int = Field(default=0, ge=0)
    """Rows of the learned position table before position 0 (OPT's 2: transformers 4.56.2
    models/opt/modeling_opt.py OPTLearnedPositionalEmbedding, max_positions + 2 rows)."""
    bias: bool = False
    """Whether linear layers carry biases (GPT-2/3: yes; Llama: no)."""
    mlp_bias: bool | None = None
    """Whether the MLP's linears carry biases where the attention's do not (GPT-J: fc_in and
    fc_out biased, q/k/v/out_proj not); None: as ``bias``."""
    qkv_bias: bool = False
    """Whether only the q/k/v projections carry biases while the rest do not (Qwen2; HF modeling_qwen2.py)."""
    qk_norm: bool = False
    """Whether each block RMS-normalises queries and keys per head (q_norm/k_norm of head_dim each; Qwen3)."""
    post_norms: bool = False
    """Whether each block also normalises the attention and MLP outputs before adding them to the residual
    stream: four norms per block instead of two (Gemma 2; HF modeling_gemma2.py, post_attention_layernorm
    and post_feedforward_layernorm)."""
    attention_softcapping: bool = Field(default=False, exclude_if=lambda capped: not capped)
    """Whether the attention scores pass a tanh soft-cap before the softmax (Gemma 2:
    attn_logit_softcapping; HF modeling_gemma2.py, litgpt model.py's attention_logit_softcapping)."""
    causal: bool = True
    """Whether attention is causal (decoders); an encoder's (BERT's) computes every score."""
    token_types: int = Field(default=0, ge=0)
    """Rows of a token-type embedding added to the input (BERT's type_vocab_size; 0: none)."""
    head_transform: bool = False
    """Whether the output projection is preceded by a dense h -> h layer with bias and GELU
    (BERT's masked-LM head: cls.predictions.transform; its LayerNorm is the final norm)."""
    embedding_projection: int = Field(default=0, ge=0, exclude_if=lambda width: not width)
    """OPT's word_embed_proj_dim where it differs from hidden_size (OPT-350m's 512; 0: none): the
    token embedding and the tied output projection are that wide, and bias-free project_in and
    project_out linears join them to the blocks (transformers models/opt/modeling_opt.py OPTDecoder
    ``project_in``/``project_out``, 4.31.0 alike)."""
    final_norm: bool = Field(default=True, exclude_if=lambda final: final)
    """Whether a norm follows the last block (OPTDecoder builds none where do_layer_norm_before is
    False, OPT-350m's post-norm blocks, whose second norm ends each block)."""
    embedding_norm: bool = False
    """Whether the embedding output passes a LayerNorm before the first block (Bloom's
    word_embeddings_layernorm; transformers 4.56 models/bloom/modeling_bloom.py)."""
    parallel_block: bool = False
    """Whether attention and MLP both read one normed copy of the block input and add to the
    residual stream together: one norm per block (Phi-1/1.5/2; transformers 4.56
    models/phi/modeling_phi.py PhiDecoderLayer, input_layernorm only)."""
    parallel_residual: bool = Field(default=False, exclude_if=lambda parallel: not parallel)
    """Whether attention and the MLP each read their own norm of the block input and add to the
    residual stream together (GPT-NeoX's use_parallel_residual: transformers 4.56.2
    models/gpt_neox/modeling_gpt_neox.py GPTNeoXLayer.forward, input_layernorm and
    post_attention_layernorm both over hidden_states; litgpt's parallel_residual without
    shared_attention_norm): two norms, whose one input is saved once, and the MLP reads its own
    normed copy."""
    rotary_cat: bool = Field(default=False, exclude_if=lambda cat: not cat)
    """Whether the attention writes the rotated q and k with torch.cat, new [b, heads, s, d]
    tensors, and (with fused_qkv) slices q, k and v as views of the fused qkv output
    (transformers 4.56.2 models/gpt_neox/modeling_gpt_neox.py:157-161, qkv.chunk(3) and
    apply_rotary_pos_emb's cat of the rotated and pass-through parts, lines 82-93; Phi's separate
    projections and the same partial-rotary cat, models/phi/modeling_phi.py:155-168):
    zeroplan.core.frameworks.rotary_cat_extra_bytes."""
    head_bias: bool = False
    """Whether the output projection carries a bias (Phi's lm_head; BERT's decoder, tied to the
    embedding, has one of its own)."""
    tied_embeddings: bool = False
    """Whether the output projection reuses the input embedding matrix."""
    num_experts: int = Field(default=1, gt=0)
    """Experts per MoE layer; 1 is a dense model."""
    experts_per_token: int = Field(default=1, gt=0)
    """Experts each token is routed to (top-k)."""
    moe_ffn_hidden_size: int | None = Field(default=None, gt=0)
    """Inner width of one routed expert; None means ffn_hidden_size (Mixtral's experts are as wide
    as its intermediate_size; Qwen-MoE and DeepSeek give moe_intermediate_size apart from the dense
    intermediate_size of their dense blocks)."""
    shared_expert_ffn_hidden_size: int = Field(default=0, ge=0)
    """Inner width of the MoE block's shared expert, an always-on gated MLP every token passes
    through beside its routed experts; 0 means none. DeepSeek's n_shared_experts are one MLP of
    n_shared_experts x moe_intermediate_size (transformers DeepseekV2MoE.shared_experts);
    Qwen-MoE's is shared_expert_intermediate_size wide."""
    shared_expert_gate: bool = False
    """Whether the shared expert's output is scaled by sigmoid(x W), W of h x 1 (Qwen2-MoE,
    transformers Qwen2MoeSparseMoeBlock.shared_expert_gate)."""
    first_dense_layers: int = Field(default=0, ge=0)
    """Blocks at the start whose feed-forward is a dense MLP of ffn_hidden_size instead of the
    experts (DeepSeek's first_k_dense_replace)."""
    moe_layer_interval: int = Field(default=1, gt=0)
    """Block i (from 0) holds experts when (i + 1) is a multiple of this (Qwen-MoE's
    decoder_sparse_step); the others are dense."""
    dense_layers: JsonTuple[int] = ()
    """Further blocks (indices from 0) that are dense (Qwen-MoE's mlp_only_layers)."""
    moe_capacity_factor: float | None = Field(default=None, gt=0.0, le=64.0)
    """None: dropless routing, every routed token copy processed (torchtitan, Megatron-LM's
    default). A number: each expert processes at most ceil(k x tokens x cf / E) tokens, its
    input padded to that (DeepSpeed-MoE's capacity_factor; GShard sec. 2.2)."""
    q_lora_rank: int | None = Field(default=None, gt=0)
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1.2): width of the query's low-rank
    compression; None projects the query directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int | None = Field(default=None, gt=0)
    """Width of the compressed key-value latent; set, it makes attention MLA (then head_dim is
    the query/key head width qk_nope_head_dim + qk_rope_head_dim)."""
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    """MLA: the part of each query/key head that carries RoPE (the key's part shared by all heads)."""
    v_head_dim: int | None = Field(default=None, gt=0)
    """MLA: width of each value head (None: head_dim)."""
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on attention probabilities; >0 stores a 1-byte mask (Korthikanti sec. 4.1)."""
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout after the attention and MLP blocks; >0 stores 1-byte masks."""
    encoder_decoder: EncoderDecoderSpec | None = None
    """Set for an encoder-decoder (T5, BART): num_layers then counts the encoder's blocks and the
    decoder's (zeroplan.specs.encoder_decoder); None: one stack of blocks."""
    fused_qkv: bool = Field(default=False, exclude_if=lambda fused: not fused)
    """Whether the model's Hugging Face implementation computes q, k and v with one linear module
    (GPT-2's and GPTBigCode's c_attn, GPT-NeoX's, BLOOM's and Falcon's query_key_value, MPT's Wqkv,
    Phi-3's qkv_proj, Qwen-1's c_attn): the parameters are the same, but peft wraps that module
    with one LoRA adapter (zeroplan.specs.finetune.lora_adapters)."""
    fused_gate_up: bool = Field(default=False, exclude_if=lambda fused: not fused)
    """Whether the gated MLP's gate and up projections are one linear module in the model's
    Hugging Face implementation (Phi-3's gate_up_proj): one LoRA adapter under peft."""
    eager_softmax: EagerSoftmax = Field(default=EagerSoftmax.fp32, exclude_if=lambda kind: kind is EagerSoftmax.fp32)
    """The dtype the model's Hugging Face eager attention runs its softmax in (EagerSoftmax):
    fp32 whatever the compute dtype for Llama and most families; GPT-2's and Falcon's in the
    compute dtype outside autocast."""
    own_loss_in_compute_dtype: bool = Field(default=False, exclude_if=lambda own: not own)
    """Its own modeling code (trust_remote_code) computes nn.CrossEntropyLoss on lm_head's output
    in the compute dtype, with no fp32 upcast: Qwen-1's modeling_qwen.py
    (QWenLMHeadModel.forward). Read where the model's own forward runs, framework hf
    (zeroplan.core.own_loss)."""
    parameter_count_exact: bool = True
    """Whether the parameter count is known to equal the checkpoint's; False when a config.json carried
    keys the reader does not model (parameter_count_caveat names them)."""
    parameter_count_caveat: str = ""
    """Why the count may not be exact (empty when it is); shown by ``zeroplan fit`` as a caution."""

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelSpec":
        if self.norm_scales_fp32 and self.norm is not NormKind.rmsnorm:
            raise ZeroplanError("model.norm_scales_fp32", "describes an RMSNorm (allowed: false with a LayerNorm)")
        if self.gelu_form is not GeluForm.gelu and self.mlp is not MlpKind.gelu:
            raise ZeroplanError("model.gelu_form", f"{self.gelu_form.value!r} names a GELU MLP's activation "
                                f"(allowed: gelu with mlp {self.mlp.value!r})")
        if self.head_dim is None and self.hidden_size % self.num_heads != 0:
            raise ZeroplanError(
                "model.num_heads",
                f"{self.num_heads} heads do not divide hidden_size {self.hidden_size}",
            )
        if self.num_heads % self.kv_heads != 0:
            raise ZeroplanError(
                "model.num_kv_heads",
                f"{self.kv_heads} key/value heads do not divide num_heads {self.num_heads}",
            )
        if self.parameter_count_exact == bool(self.parameter_count_caveat):
            raise ZeroplanError(
                "model.parameter_count_caveat",
                "must be empty when parameter_count_exact is true and say why when it is false",
            )
        if self.experts_per_token > self.num_experts:
            raise ZeroplanError(
                "model.experts_per_token",
                f"{self.experts_per_token} exceeds num_experts {self.num_experts}",
            )
        if self.parallel_block and (self.post_norms or self.is_moe or self.is_mla):
            raise ZeroplanError("model.parallel_block", "is modelled for dense blocks without post-norms or latent attention (allowed: false "
                                "with post_norms, experts or latent attention)")
        if self.parallel_residual and (self.parallel_block or self.post_norms or self.is_moe or self.is_mla):
            raise ZeroplanError("model.parallel_residual", "is modelled for dense blocks with two pre-norms (allowed: false "
                                "with parallel_block, post_norms, experts or latent attention)")
        if self.rotary_cat and self.position is not PositionKind.rope:
            raise ZeroplanError("model.rotary_cat", "applies to rotary positions (allowed: false without rope)")
        if self.fused_gate_up and not self.mlp.gated:
            raise ZeroplanError("model.fused_gate_up", "applies to a gated MLP (allowed: false with mlp gelu or relu)")
        if not self.norm_bias and self.norm is not NormKind.layernorm:
            raise ZeroplanError("model.norm_bias", "applies to LayerNorm only (allowed: true with rmsnorm)")
        if self.position_offset and self.position is not PositionKind.learned:
            raise ZeroplanError("model.position_offset", "sizes a learned position table (allowed: 0 without learned positions)")
        self._check_moe()
        self._check_mla()
        self._check_encoder_decoder()
        return self

    def _check_encoder_decoder(self) -> None:
        stacks = self.encoder_decoder
        if stacks is None:
            if self.position is PositionKind.relative:
                raise ZeroplanError("model.position", "relative (T5's bias) is an encoder-decoder's (allowed: with encoder_decoder)")
            return
        if stacks.encoder_layers >= self.num_layers:
            raise ZeroplanError("model.encoder_decoder.encoder_layers", f"{stacks.encoder_layers} leaves no decoder block "
                                f"(allowed: 1 to {self.num_layers - 1}; num_layers counts both stacks)")
        if (self.is_moe or self.is_mla or self.parallel_block or self.parallel_residual or self.post_norms or self.qk_norm
                or self.token_types or self.head_transform):
            raise ZeroplanError("model.encoder_decoder", "is modelled for dense T5 and BART blocks (allowed: without experts, "
                                "latent attention, parallel blocks, post-norms, q/k norms, token types or a head transform)")
        if (stacks.relative_attention_buckets > 0) != (self.position is PositionKind.relative):
            raise ZeroplanError("model.encoder_decoder.relative_attention_buckets",
                                "must be set exactly when position is relative (T5's bias; allowed: 0 otherwise)")
        if self.position in (PositionKind.rope, PositionKind.alibi):
            raise ZeroplanError("model.position", f"{self.position.value} is not an encoder-decoder's here (allowed: relative, learned)")

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder_decoder is not None

    @property
    def encoder_layers(self) -> int:
        """Blocks of the encoder stack (0 for one stack)."""
        return self.encoder_decoder.encoder_layers if self.encoder_decoder is not None else 0

    @property
    def decoder_layers(self) -> int:
        """Blocks of the decoder stack (num_layers for one stack)."""
        return self.num_layers - self.encoder_layers

    def _check_moe(self) -> None:
        moe_only = {"moe_ffn_hidden_size": self.moe_ffn_hidden_size is not None,
                    "shared_expert_ffn_hidden_size": self.shared_expert_ffn_hidden_size > 0,
                    "shared_expert_gate": self.shared_expert_gate, "first_dense_layers": self.first_dense_layers > 0,
                    "moe_layer_interval": self.moe_layer_interval > 1, "dense_layers": bool(self.dense_layers),
                    "moe_capacity_factor": self.moe_capacity_factor is not None}
        if not self.is_moe:
            for field, set_ in moe_only.items():
                if set_:
                    raise ZeroplanError(f"model.{field}", "applies to mixture-of-experts models only (allowed: with num_experts > 1)")
            return
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ZeroplanError("model.shared_expert_gate", "needs a shared expert (allowed: with shared_expert_ffn_hidden_size > 0)")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ZeroplanError("model.dense_layers", f"{list(self.dense_layers)} (allowed: distinct indices 0 to {self.num_layers - 1})")
        if self.moe_layer_count == 0:
            raise ZeroplanError(
                "model.first_dense_layers",
                "leaves no block with experts (allowed: fewer dense blocks than num_layers)",
            )

    def _check_mla(self) -> None:
        mla = {"q_lora_rank": self.q_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}
        if self.kv_lora_rank is None:
            for field, value in mla.items():
                if value is not None:
                    raise ZeroplanError(f"model.{field}", "applies to multi-head latent attention only (allowed: with kv_lora_rank)")
            return
        if self.qk_rope_head_dim is None or self.head_dim is None:
            raise ZeroplanError("model.qk_rope_head_dim", "MLA needs head_dim (query/key head width) and qk_rope_head_dim")
        if self.qk_rope_head_dim >= self.head_dim:
            raise ZeroplanError("model.qk_rope_head_dim", f"{self.qk_rope_head_dim} must be below head_dim {self.head_dim}")
        if self.kv_heads != self.num_heads:
            raise ZeroplanError("model.num_kv_heads", "MLA expands the latent to every query head (allowed: num_heads)")

    @property
    def mlp_biased(self) -> bool:
        """Whether the MLP's linears carry biases."""
        return self.bias if self.mlp_bias is None else self.mlp_bias

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (a * head_size)."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output."""
        return self.kv_heads * self.head_size

    @property
    def norms_per_block(self) -> int:
        """Normalisation layers in one block: 2 (pre-attention, pre-MLP), 4 with post_norms, 1
        in a parallel block."""
        return 1 if self.parallel_block else 4 if self.post_norms else 2

    @property
    def saved_norm_inputs(self) -> int:
        """Norm inputs one block saves: one a norm, but one for both norms of a parallel residual
        (they read the same block input)."""
        return 1 if self.parallel_residual else self.norms_per_block

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def is_dense_llama_layout(self) -> bool:
        """A dense decoder laid out as Llama's: RoPE, RMSNorm, SwiGLU, sequential causal blocks,
        no experts, latent attention, biases, q/k norms, post-norms or embedding norm (what the
        frameworks' Llama builders make, so what their measurements cover)."""
        return (not self.is_moe and not self.is_mla and self.position is PositionKind.rope
                and self.norm is NormKind.rmsnorm and self.mlp is MlpKind.swiglu and self.causal
                and not (self.bias or self.mlp_biased or self.qkv_bias or self.head_bias or self.qk_norm or self.post_norms
                         or self.parallel_block or self.parallel_residual or self.embedding_norm))

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 sec. 2.1)."""
        return self.kv_lora_rank is not None

    @property
    def v_head_size(self) -> int:
        """Width of one value head (head_size except under MLA's v_head_dim)."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_size

    @property
    def v_size(self) -> int:
        """Width of the value projection's output, after MLA's up-projection."""
        return self.kv_heads * self.v_head_size

    @property
    def attention_output_size(self) -> int:
        """Input width of the attention's output projection: a x value head width."""
        return self.num_heads * self.v_head_size

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (from 0) holds experts; transformers 4.56
        DeepseekV2DecoderLayer (layer_idx >= first_k_dense_replace) and Qwen2MoeDecoderLayer
        (not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0)."""
        return (self.is_moe and index >= self.first_dense_layers and (index + 1) % self.moe_layer_interval == 0
                and index not in self.dense_layers)

    @property
    def moe_layer_count(self) -> int:
        """Blocks that hold experts (the others have a dense MLP)."""
        if not self.is_moe:
            return 0  # is_moe_layer is False for every block (the planner asks this per plan)
        return sum(1 for i in range(self.num_layers) if self.is_moe_layer(i))
