"""The 2022-bigscience DeepSpeed release of the megatron-deepspeed profile (zeroplan.core.deepspeed_2022)."""

import pytest

from zeroplan.core.deepspeed_2022 import partition_pieces
from zeroplan.core.profiles import check_deepspeed_release
from zeroplan.errors import ZeroplanError
from zeroplan.specs.framework import Framework
from zeroplan.specs.training import TrainingSpec


def test_unknown_release_is_refused_naming_the_allowed_ones():
    training = TrainingSpec(framework=Framework.megatron_deepspeed, deepspeed_release="0.6.0")
    with pytest.raises(ZeroplanError, match=r"deepspeed_release.*allowed: 0\.19\.8, 2022-bigscience"):
        check_deepspeed_release(training)


def test_partition_keeps_every_whole_gradient_it_overlaps():
    # Two ranks, tensors of 6, 4 and 6 elements: the flat group of 16 (aligned to 4 per rank)
    # splits at 8, so rank 0 holds the first tensor whole and half the second, rank 1 the rest:
    # each keeps two whole .grad tensors (10 and 10 elements), the largest piece 6.
    assert partition_pieces([6, 4, 6], 2) == (8, 10, 6)
    # One rank keeps everything and its partition is the padded group.
    assert partition_pieces([6, 4, 6], 1) == (16, 16, 6)
