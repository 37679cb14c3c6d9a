"""The part of a ModelSpec that makes it an encoder-decoder (T5, mT5, umT5, BART): how many of its
blocks are the encoder's, and what the two stacks add to the decoder-only layout.

A ModelSpec with ``encoder_decoder`` set has ``num_layers`` = encoder blocks + decoder blocks;
blocks 0 .. encoder_layers - 1 are the encoder's (bidirectional self-attention and a
feed-forward block), the rest the decoder's (causal self-attention, cross-attention over the
encoder's output, a feed-forward block). Every width (h, a, head_dim, f) is shared by both
stacks, as in every published T5 and BART checkpoint. zeroplan.core.encoder_decoder builds the
parameters and the activations from it.
"""

# No postponed annotations: pydantic reads these fields' types as objects (zeroplan/specs/base.py).

from pydantic import Field

from zeroplan.specs.base import Frozen


class EncoderDecoderSpec(Frozen):
    """The encoder-decoder fields of a ModelSpec (zeroplan.specs.model.ModelSpec.encoder_decoder)."""

    encoder_layers: int = Field(gt=0, le=512)
    """Blocks of the encoder stack (T5's num_layers, BART's encoder_layers); the decoder has the
    ModelSpec's num_layers less these (T5's num_decoder_layers, BART's decoder_layers)."""
    relative_attention_buckets: int = Field(default=0, ge=0)
    """T5's relative position bias (Raffel et al. 2020 sec. 2.1): an embedding of buckets x heads
    in the first self-attention of each stack (transformers 4.56.2 models/t5/modeling_t5.py
    T5Attention.relative_attention_bias, has_relative_attention_bias for layer 0 only); 0: none."""
    relative_bias_every_layer: bool = False
    """Whether every self-attention has its own relative bias table (umT5: transformers 4.56.2
    models/umt5/modeling_umt5.py UMT5Attention, has_relative_attention_bias True in every layer)."""
    stack_final_norms: bool = True
    """Whether each stack ends with a norm (T5's final_layer_norm in encoder and decoder; BART's
    add_final_layer_norm, false for bart-large)."""
    post_norm: bool = False
    """Whether the blocks normalise after the residual add (BART: self_attn_layer_norm over
    residual + attention) rather than before the sub-block (T5's pre-norm)."""
    scale_tied_head_input: bool = False
    """Whether a tied head's input is first scaled by h^-1/2 (T5ForConditionalGeneration: sequence_output
    * model_dim**-0.5 when tie_word_embeddings), a new tensor the head keeps."""
