"""Read Megatron-LM's own launch arguments (``--num-layers 36 --hidden-size 1280 ...``, as a
``pretrain_gpt.py`` script passes them) into a ModelSpec and the run's layout, batch, precision
and recomputation.

The arguments are Megatron-LM's at github.com/NVIDIA/Megatron-LM commit d98e8a6 (the release the
megatron profile plans; docs/frameworks.md, "Megatron-LM"): ``megatron/training/arguments.py``
(its own add_argument calls, validate_args), ``megatron/training/argument_utils.py``
(core_transformer_config_from_args), and the dataclass fields ``ArgumentGroupFactory`` turns into
flags (``megatron/core/transformer/transformer_config.py``: a bool field defaulting to False
becomes ``--field-name``, one defaulting to True ``--no-field-name``/``--disable-field-name``,
argument_utils.py:189-196, unless ``arg_names`` renames it). File:line below are at that commit.

Every argument is read, listed as ignored with the reason it changes no byte the planner models
(IGNORED), or refused in one line naming it: none is dropped silently.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pydantic import ValidationError

from zeroplan.errors import ZeroplanError
from zeroplan.presets.hf_config import MAX_CONFIG_LAYERS, MAX_CONFIG_POSITIONS, MAX_CONFIG_SIZE
from zeroplan.presets.hf_fields import strict_model_spec
from zeroplan.specs.base import Frozen, JsonTuple, first_error
from zeroplan.specs.model import MlpKind, ModelSpec, NormKind, PositionKind
from zeroplan.specs.request import MEGATRON_VOCAB_MULTIPLE
from zeroplan.specs.training import ActivationCheckpointing, Precision

MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""The Megatron-LM source whose arguments are read (the megatron profile's training defaults)."""

GPT2_BPE_VOCAB = 50257
"""Entries of GPT-2's gpt2-vocab.json, the --vocab-file every Megatron-LM GPT example names
(examples/gpt3/train_gpt3_175b_distributed.sh: ``VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json``);
the GPT2BPETokenizer's vocabulary (a Megatron-LM run's log prints ``padded vocab (size: 50257)``)."""

# Arguments that take a value, by how it is read; the flags (store_true / store_false) are FLAGS.
_INTS = frozenset({
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--kv-channels",
    "--num-query-groups", "--max-position-embeddings", "--seq-length", "--vocab-size",
    "--make-vocab-size-divisible-by", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--micro-batch-size", "--global-batch-size", "--recompute-num-layers",
    "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
})
_FLOATS = frozenset({"--attention-dropout", "--hidden-dropout", "--rotary-percent"})
CHOICES = {
    # arguments.py:2397-2399.
    "--position-embedding-type": ("learned_absolute", "rope", "yarn", "mrope", "relative", "none"),
    # transformer_config.py:256.
    "--normalization": ("LayerNorm", "RMSNorm"),
    # transformer_config.py:532 and 543.
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    # training_config.py:698-711.
    "--tokenizer-type": ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                         "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                         "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"),
}
FLAGS = frozenset({
    "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--add-qkv-bias", "--use-rotary-position-embeddings", "--no-position-embedding", "--sequence-parallel",
    "--fp16", "--bf16", "--use-distributed-optimizer", "--recompute-activations", "--overlap-grad-reduce",
    "--overlap-param-gather", "--tp-comm-overlap",
})
DEFAULT_ONLY = {
    # transformer_config.py:151: AttnBackend.auto, Transformer Engine's choice (the kernel the
    # megatron profile plans); flash, fused, unfused and local keep other tensors.
    "--attention-backend": "auto",
    # transformer_config.py:1314-1316: Transformer Engine's layers, the profile's; 'local' and
    # 'inference_optimized' are other modules.
    "--transformer-impl": "transformer_engine",
}
"""Arguments accepted at Megatron-LM's default value only (a script may spell the default out)."""
READ = frozenset(_INTS | _FLOATS | set(CHOICES) | FLAGS | set(DEFAULT_ONLY))
DEFAULTS: dict[str, object] = {
    # transformer_config.py:188-191.
    "--attention-dropout": 0.1, "--hidden-dropout": 0.1,
    # arguments.py:2441.
    "--make-vocab-size-divisible-by": MEGATRON_VOCAB_MULTIPLE,
    # transformer_config.py:760, 175-177 (argparse default 1), 256; arguments.py:2397, 2420.
    "--moe-router-topk": 2, "--num-query-groups": 1, "--normalization": "LayerNorm",
    "--position-embedding-type": "learned_absolute", "--rotary-percent": 1.0,
    # model_parallel_config.py: every parallel size 1.
    "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
    "--expert-model-parallel-size": 1,
}
"""Megatron-LM's defaults of the arguments the reader reads where they are left out
(benchmarks/megatron-args-records/records.json holds its parser's own; tests compare them)."""
RUN_ARGUMENTS = frozenset({
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
    "--sequence-parallel", "--micro-batch-size", "--global-batch-size", "--seq-length", "--fp16", "--bf16",
    "--use-distributed-optimizer", "--recompute-granularity", "--recompute-activations", "--recompute-method",
    "--recompute-num-layers", "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
})
"""The arguments read as the run's settings (zeroplan.cli.megatron_args maps them onto fit's flags)."""
"""The Megatron-LM arguments that set a ModelSpec field or a zeroplan option."""

# Arguments that change no byte the planner models, each with the reason. ``True`` marks those
# that take a value.
_SCHEDULE = "a learning-rate, loss-scale or optimizer hyper-parameter: no tensor's size"
_DATA = "data, tokenizer-file and cache paths: read on the host, no GPU tensor's size"
_LOGGING = "logging, evaluation and checkpoint-saving cadence: outside the training step planned"
IGNORED: dict[str, tuple[bool, str]] = {
    **{name: (True, _SCHEDULE) for name in (
        "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-fraction",
        "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-init", "--train-iters", "--train-samples",
        "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style", "--clip-grad",
        "--adam-beta1", "--adam-beta2", "--adam-eps", "--init-method-std", "--seed", "--initial-loss-scale",
        "--min-loss-scale", "--loss-scale-window", "--hysteresis", "--loss-scale")},
    **{name: (True, _DATA) for name in (
        "--data-path", "--vocab-file", "--merge-file", "--split", "--data-cache-path", "--tokenizer-model")},
    **{name: (True, _LOGGING) for name in (
        "--log-interval", "--save", "--load", "--save-interval", "--eval-interval", "--eval-iters",
        "--tensorboard-dir", "--tensorboard-log-interval", "--timing-log-level", "--exit-interval",
        "--exit-duration-in-mins", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir")},
    **{name: (False, _LOGGING) for name in (
        "--log-memory-to-tensorboard", "--log-timers-to-tensorboard", "--log-throughput",
        "--log-params-norm", "--log-num-zeros-in-grad")},
    # megatron/training/training.py: --profile (without --use-pytorch-profiler) brackets steps
    # --profile-step-start to --profile-step-end with torch.cuda.cudart().cudaProfilerStart() and
    # Stop, nsys's capture range: no allocation.
    "--profile": (False, "nsys's capture range (cudaProfilerStart/Stop): no allocation"),
    "--profile-step-start": (True, "nsys's capture range (cudaProfilerStart/Stop): no allocation"),
    "--profile-step-end": (True, "nsys's capture range (cudaProfilerStart/Stop): no allocation"),
    "--distributed-backend": (True, "the process-group backend; NCCL's is the one planned"),
    # RoPE's base and the norms' epsilon are constants in their kernels: no tensor's size.
    "--rotary-base": (True, "RoPE's frequency base: no tensor's size"),
    "--norm-epsilon": (True, "the norms' epsilon: no tensor's size"),
    # arguments.py:2444 defines --openai-gelu, and nothing at d98e8a6 reads args.openai_gelu
    # (core_transformer_config_from_args keeps TransformerConfig's F.gelu).
    "--openai-gelu": (False, "defined (arguments.py:2444) but read nowhere in Megatron-LM d98e8a6: F.gelu runs"),
    # arguments.py:2949: dest deprecated_use_mcore_models, which nothing reads (megatron-core's
    # GPTModel is the only one built).
    # transformer_config.py:206-210 layernorm_zero_centered_gamma: the weight is applied as
    # 1 + weight inside Transformer Engine's norm kernels (extensions/transformer_engine.py:1100).
    "--apply-layernorm-1p": (False, "the norms' weight applied as 1 + weight inside Transformer Engine's kernels: "
                                    "the same parameters, no other tensor"),
    "--use-mcore-models": (False, "deprecated (arguments.py:2949): megatron-core's GPTModel is the only model built"),
}


class MegatronLaunch(Frozen):
    """A Megatron-LM launch as its arguments describe it: the model and the run's settings that
    map onto zeroplan's own options (None: the argument was not given)."""

    model: ModelSpec
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_stages: int | None = None
    """Model chunks a pipeline rank holds (--num-virtual-stages-per-pipeline-rank): the
    interleaved 1F1B schedule."""
    sequence_parallel: bool = False
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    seq_len: int | None = None
    precision: Precision = Precision.fp32
    distributed_optimizer: bool = False
    checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    given: JsonTuple[str] = ()
    """The arguments the text gave (read or ignored), in order."""
    ignored: JsonTuple[str] = ()
    """'--argument: why it changes no byte', for each ignored argument given."""


def split_arguments(text: str) -> list[str]:
    """The argument words of ``text`` as a shell splits them: ``#`` comments, quotes and
    backslash-newline continuations (a script's GPT_ARGS pasted as they are)."""
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as error:
        raise ZeroplanError("megatron-args", f"cannot be split as shell words ({error})") from None


def looks_like_megatron_arguments(text: str) -> bool:
    """Whether ``text`` is a list of Megatron-LM arguments: its first word starts with ``--``
    (a config.json starts with ``{``)."""
    try:
        words = split_arguments(text)
    except ZeroplanError:
        return False
    return bool(words) and words[0].startswith("--")


def _parse_words(words: list[str]) -> tuple[dict[str, object], list[str]]:
    """{argument: value} (True for a flag) as argparse reads them, the last of a repeated one
    winning; and the arguments in the order given."""
    values: dict[str, object] = {}
    order: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        name, _, inline = word.partition("=")
        if not name.startswith("--") and order and values[order[-1]] is True:
            raise ZeroplanError(order[-1], f"is a flag and takes no value (got {word!r})")
        if not name.startswith("--"):
            raise ZeroplanError("megatron-args", f"{word!r} is not an argument (allowed: --name [value] words, as "
                                                 "pretrain_gpt.py takes them)")
        if name not in READ and name not in IGNORED:
            raise ZeroplanError(name, "a Megatron-LM argument zeroplan does not read (it may change the model or the run; "
                                      "docs/frameworks.md, \"A run's own Megatron-LM arguments\", lists those read and those ignored)")
        takes_value = (name in _INTS or name in _FLOATS or name in CHOICES or name in DEFAULT_ONLY
                       or IGNORED.get(name, (False, ""))[0])
        if not takes_value:
            if inline:
                raise ZeroplanError(name, f"is a flag and takes no value (got {inline!r})")
            value: object = True
            i += 1
        elif inline:
            value, i = inline, i + 1
        else:
            if i + 1 >= len(words) or words[i + 1].startswith("--"):
                raise ZeroplanError(name, "expects a value")
            value, i = words[i + 1], i + 2
        values[name] = _typed(name, value)
        order.append(name)
    return values, order


def _typed(name: str, value: object) -> object:
    if name in _INTS:
        try:
            number = int(str(value))
        except ValueError:
            raise ZeroplanError(name, f"expects an integer, got {value!r}") from None
        limit = (MAX_CONFIG_POSITIONS if name in ("--max-position-embeddings", "--seq-length")
                 else MAX_CONFIG_LAYERS if name == "--num-layers" else MAX_CONFIG_SIZE)
        if number < (0 if name == "--num-experts" else 1) or number > limit:
            raise ZeroplanError(name, f"must be a positive integer at most {limit:,}, got {number}")
        return number
    if name in _FLOATS:
        try:
            number = float(str(value))
        except ValueError:
            raise ZeroplanError(name, f"expects a number, got {value!r}") from None
        if not 0.0 <= number <= 1.0:
            raise ZeroplanError(name, f"must be in [0, 1], got {value}")
        return number
    if name in DEFAULT_ONLY and value != DEFAULT_ONLY[name]:
        raise ZeroplanError(name, f"{value!r} is not planned (allowed: {DEFAULT_ONLY[name]}, Megatron-LM's default)")
    if name in CHOICES and value not in CHOICES[name]:
        raise ZeroplanError(name, f"{value!r} is not one of Megatron-LM's choices ({', '.join(CHOICES[name])})")
    return value


# ModelSpec's fields and the arguments that set them, for its validation errors.
_ARGUMENT_OF_FIELD = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_heads": "--num-attention-heads",
    "num_kv_heads": "--num-query-groups", "head_dim": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "max_positions": "--max-position-embeddings", "vocab_size": "--vocab-size", "experts_per_token": "--moe-router-topk",
    "num_experts": "--num-experts", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "attention_dropout": "--attention-dropout", "hidden_dropout": "--hidden-dropout",
}


def read_megatron_arguments(text: str, name: str) -> MegatronLaunch:
    """The launch ``text`` (Megatron-LM arguments) describes; ``name`` names its model."""
    values, order = _parse_words(split_arguments(text))
    model = _model_spec(values, name)
    launch = dict(
        model=model,
        tp=_given(values, "--tensor-model-parallel-size"),
        pp=_given(values, "--pipeline-model-parallel-size"),
        cp=_given(values, "--context-parallel-size"),
        ep=_given(values, "--expert-model-parallel-size"),
        virtual_stages=_virtual_stages(values, model.num_layers),
        # arguments.py:1430-1438: sequence parallelism is turned off at tensor-parallel size 1.
        sequence_parallel=bool(values.get("--sequence-parallel")) and _given(values, "--tensor-model-parallel-size") > 1,
        micro_batch_size=values.get("--micro-batch-size"),
        global_batch_size=values.get("--global-batch-size"),
        seq_len=values.get("--seq-length"),
        precision=_precision(values),
        distributed_optimizer=bool(values.get("--use-distributed-optimizer")),
        checkpointing=_checkpointing(values, model.num_layers),
        overlap_grad_reduce=bool(values.get("--overlap-grad-reduce")),
        overlap_param_gather=bool(values.get("--overlap-param-gather")),
        tp_comm_overlap=bool(values.get("--tp-comm-overlap")),
        given=tuple(dict.fromkeys(order)),
        ignored=tuple(f"{arg}: {IGNORED[arg][1]}" for arg in dict.fromkeys(order) if arg in IGNORED),
    )
    seq_len = launch["seq_len"]
    if seq_len is not None and seq_len > model.max_positions:
        # arguments.py:1353-1356: max_position_embeddings must be at least seq_length.
        raise ZeroplanError("--seq-length", f"{seq_len} exceeds --max-position-embeddings {model.max_positions} "
                                            "(Megatron-LM asserts max_position_embeddings >= seq_length)")
    return MegatronLaunch(**launch)


def _given(values: dict[str, object], name: str) -> object:
    """The argument's value, or Megatron-LM's default where it is left out."""
    return values.get(name, DEFAULTS[name])


def _precision(values: dict[str, object]) -> Precision:
    # arguments.py --fp16 / --bf16 (exclusive: validate_args asserts not both): 16-bit
    # parameters (Float16Module) over fp32 main parameters; neither trains in fp32.
    if values.get("--fp16") and values.get("--bf16"):
        raise ZeroplanError("--bf16", "and --fp16 are both given (Megatron-LM allows one)")
    return Precision.fp16_mixed if values.get("--fp16") else Precision.bf16_mixed if values.get("--bf16") else Precision.fp32


# arguments.py:607-608 (--recompute-activations sets recompute_granularity 'selective') and
# transformer_config.py:532-556: 'selective' recomputes the modules of --recompute-modules, by
# default core_attn (the attention core: zeroplan's selective); 'full' recomputes whole layers,
# uniform in chunks of recompute_num_layers layers, block the first recompute_num_layers layers of
# each pipeline stage, one checkpoint a layer (transformer_block.py _checkpointed_forward).
def _checkpointing(values: dict[str, object], num_layers: int) -> ActivationCheckpointing:
    granularity = values.get("--recompute-granularity")
    if values.get("--recompute-activations"):
        if granularity not in (None, "selective"):
            raise ZeroplanError("--recompute-activations", f"sets selective recomputation but --recompute-granularity is "
                                                           f"{granularity} (give one)")
        granularity = "selective"
    method, layers = values.get("--recompute-method"), values.get("--recompute-num-layers")
    if granularity is None:
        if method is not None or layers is not None:
            raise ZeroplanError("--recompute-method", "needs --recompute-granularity full (Megatron-LM recomputes nothing "
                                                      "without a granularity)")
        return ActivationCheckpointing.none
    if granularity == "selective":
        if method is not None or layers is not None:
            # arguments.py:1425-1428.
            raise ZeroplanError("--recompute-method", "is not supported with --recompute-granularity selective "
                                                      "(Megatron-LM asserts it is unset)")
        return ActivationCheckpointing.selective
    per_stage = num_layers // _given(values, "--pipeline-model-parallel-size")
    if method == "uniform" and layers == 1:
        return ActivationCheckpointing.full
    if method == "block" and layers is not None and layers >= per_stage:
        return ActivationCheckpointing.full
    raise ZeroplanError("--recompute-method", f"{method} with --recompute-num-layers {layers} is not planned (allowed: "
                                              f"uniform with 1, or block with at least the {per_stage} layers of a "
                                              "pipeline stage: every layer checkpointed alone)")


def _virtual_stages(values: dict[str, object], num_layers: int) -> int | None:
    """Model chunks a pipeline rank holds: --num-virtual-stages-per-pipeline-rank, or
    (layers / pp) / --num-layers-per-virtual-pipeline-stage; one chunk is no interleaving
    (arguments.py:953-979, which allows one of the two)."""
    virtual = values.get("--num-virtual-stages-per-pipeline-rank")
    per_chunk = values.get("--num-layers-per-virtual-pipeline-stage")
    if per_chunk is not None:
        if virtual is not None:
            raise ZeroplanError("--num-layers-per-virtual-pipeline-stage", "and --num-virtual-stages-per-pipeline-rank "
                                                                           "are both given (Megatron-LM allows one)")
        pp = _given(values, "--pipeline-model-parallel-size")
        virtual, rest = divmod(num_layers // pp, per_chunk)
        if rest or num_layers % pp:
            raise ZeroplanError("--num-layers-per-virtual-pipeline-stage", f"{per_chunk} does not divide the "
                                                                           f"{num_layers} layers of {pp} pipeline stages")
    return None if virtual == 1 else virtual


def _vocab(values: dict[str, object]) -> int:
    """The tokenizer's vocabulary before padding: --vocab-size (NullTokenizer's
    megatron/core/tokenizers/text/libraries/null_tokenizer.py:16-19, vocab_size), or GPT-2's
    for the GPT2BPETokenizer, whose vocabulary is its --vocab-file's."""
    tokenizer, size = values.get("--tokenizer-type"), values.get("--vocab-size")
    if tokenizer == "GPT2BPETokenizer":
        if size is not None:
            raise ZeroplanError("--vocab-size", "the GPT2BPETokenizer takes its vocabulary from --vocab-file, not "
                                                "--vocab-size (give one of them)")
        return GPT2_BPE_VOCAB
    if size is None:
        raise ZeroplanError("--vocab-size", "the tokenizer's vocabulary is not in the arguments (allowed: --vocab-size N, "
                                            f"its size before padding, or --tokenizer-type GPT2BPETokenizer, GPT-2's {GPT2_BPE_VOCAB:,})")
    return size


def _required(values: dict[str, object], name: str) -> int:
    # arguments.py:1314-1317: num_layers, hidden_size, num_attention_heads and
    # max_position_embeddings must be given.
    if name not in values:
        raise ZeroplanError(name, "missing (Megatron-LM requires --num-layers, --hidden-size, --num-attention-heads and "
                                  "--max-position-embeddings)")
    return values[name]


def _model_spec(values: dict[str, object], name: str) -> ModelSpec:
    """Megatron-LM's GPTModel (megatron-core models/gpt/gpt_layer_specs.py) as a ModelSpec, as
    zeroplan.presets.hf_config reads the same shapes from a config.json."""
    hidden, heads = _required(values, "--hidden-size"), _required(values, "--num-attention-heads")
    layers, positions = _required(values, "--num-layers"), _required(values, "--max-position-embeddings")
    divisor = _given(values, "--make-vocab-size-divisible-by")
    if divisor != MEGATRON_VOCAB_MULTIPLE:
        # The megatron profile pads to 128 x tp (PlanRequest._megatron_vocab_padding; Megatron-LM's
        # vocab_size_with_padding, build_tokenizer.py:133-146).
        raise ZeroplanError("--make-vocab-size-divisible-by", f"{divisor} is not planned (allowed: "
                                                              f"{MEGATRON_VOCAB_MULTIPLE}, Megatron-LM's default)")
    swiglu = bool(values.get("--swiglu"))
    # arguments.py:1320-1329: 4h, or with --swiglu int((4h x 2/3) / 64) x 64.
    ffn = values.get("--ffn-hidden-size") or (int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden)
    # arguments.py:1331-1333: kv_channels defaults to hidden / heads.
    kv_channels = values.get("--kv-channels")
    head_dim = kv_channels if kv_channels is not None and (hidden % heads or kv_channels != hidden // heads) else None
    position = _position(values)
    rotary_percent = _given(values, "--rotary-percent")
    if rotary_percent != 1.0:
        # megatron-core's partial RoPE concatenates the rotated and passed-through parts, a copy
        # the megatron profile does not plan.
        raise ZeroplanError("--rotary-percent", f"{rotary_percent} is not planned (allowed: 1.0, every channel rotated)")
    experts = values.get("--num-experts") or 1  # arguments.py:1648-1649: 0 is no experts
    try:
        return strict_model_spec(
            name=name,
            vocab_size=_vocab(values),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            # argument_utils.py:330-333: --num-query-groups counts only with --group-query-attention.
            num_kv_heads=_given(values, "--num-query-groups") if values.get("--group-query-attention") else None,
            head_dim=head_dim,
            ffn_hidden_size=ffn,
            # argument_utils.py:316-319: --swiglu is F.silu with gated_linear_unit; else
            # TransformerConfig's F.gelu (transformer_config.py:224).
            mlp=MlpKind.swiglu if swiglu else MlpKind.gelu,
            norm=NormKind.rmsnorm if _given(values, "--normalization") == "RMSNorm" else NormKind.layernorm,
            position=position,
            max_positions=positions,
            # transformer_config.py:212-218: add_bias_linear (default True; --disable-bias-linear)
            # biases the qkv, output and both MLP projections; add_qkv_bias the qkv alone
            # (arguments.py:1609-1610 sets it with add_bias_linear).
            bias=not values.get("--disable-bias-linear"),
            qkv_bias=bool(values.get("--disable-bias-linear") and values.get("--add-qkv-bias")),
            # arguments.py:2460: the output layer shares the embedding unless untied.
            tied_embeddings=not values.get("--untie-embeddings-and-output-weights"),
            # megatron-core's attention computes q, k and v with one linear_qkv, and its gated MLP
            # gate and up with one linear_fc1 (models/gpt/gpt_layer_specs.py).
            fused_qkv=True,
            fused_gate_up=swiglu,
            num_experts=experts,
            # transformer_config.py:760: moe_router_topk 2; arguments.py:1650-1651: the experts
            # are ffn_hidden_size wide unless --moe-ffn-hidden-size.
            experts_per_token=_given(values, "--moe-router-topk") if experts > 1 else 1,
            moe_ffn_hidden_size=values.get("--moe-ffn-hidden-size") if experts > 1 else None,
            # transformer_config.py:188-191: hidden_dropout and attention_dropout 0.1.
            attention_dropout=_given(values, "--attention-dropout"),
            hidden_dropout=_given(values, "--hidden-dropout"),
        )
    except ZeroplanError as error:
        raise _argument_error(error) from None
    except ValidationError as error:
        raise _argument_error(first_error(error)) from None


def _argument_error(error: ZeroplanError) -> ZeroplanError:
    """A ModelSpec validation error named by the Megatron-LM argument that set the field."""
    if not error.field.startswith("model."):
        return error  # already named by its argument
    field = error.field.removeprefix("model.")
    return ZeroplanError(_ARGUMENT_OF_FIELD.get(field, f"model.{field}"), error.detail)


# arguments.py:1626-1634: --use-rotary-position-embeddings sets rope; --no-position-embedding is
# refused unless rope. yarn, mrope, relative and none are not planned.
def _position(values: dict[str, object]) -> PositionKind:
    kind = "rope" if values.get("--use-rotary-position-embeddings") else _given(values, "--position-embedding-type")
    if values.get("--no-position-embedding") and kind != "rope":
        raise ZeroplanError("--no-position-embedding", "is deprecated; Megatron-LM refuses it without rope (allowed: with "
                                                       "--position-embedding-type rope)")
    if kind not in ("learned_absolute", "rope"):
        raise ZeroplanError("--position-embedding-type", f"{kind!r} is not planned (allowed: learned_absolute, rope)")
    return PositionKind.learned if kind == "learned_absolute" else PositionKind.rope


def read_megatron_arguments_file(path: Path) -> MegatronLaunch:
    """The launch the file at ``path`` describes; its stem names the model."""
    # A pipe (<(echo $GPT_ARGS), /dev/fd/63) has no name of its own.
    return read_megatron_arguments(_text_of(path), path.stem if path.is_file() and path.stem else "megatron-args")


def megatron_arguments_path(name: str) -> Path | None:
    """The path ``name`` names where it is a file of Megatron-LM arguments (not a directory or a
    .json config; the caller has ruled out presets); None otherwise."""
    if name.endswith(".json"):
        return None
    path = Path(name)
    if not path.exists() or path.is_dir():
        return None
    return path if looks_like_megatron_arguments(_text_of(path)) else None


_TEXTS: dict[str, str] = {}
"""Each arguments file's text, read once (a pipe such as <(echo $GPT_ARGS) gives it once)."""


def _text_of(path: Path) -> str:
    key = str(path)
    if key not in _TEXTS:
        _TEXTS[key] = read_text(path)
    return _TEXTS[key]


def model_only(path: Path, command: str = "this command") -> ModelSpec:
    """The model of a Megatron-LM arguments file for a command that plans no run from it (its
    layout, batch and precision are its own flags or its search's): a run setting is refused."""
    launch = read_megatron_arguments_file(path)
    for argument in launch.given:
        if argument in RUN_ARGUMENTS:
            raise ZeroplanError(argument, f"a run setting, and {command} reads a Megatron-LM arguments file's model only "
                                          "(fit and compare plan its run settings; leave it out here)")
    return launch.model


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise ZeroplanError("model", f"cannot read {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ZeroplanError("model", f"{str(path)!r} is not UTF-8 text (byte {error.start})") from None
