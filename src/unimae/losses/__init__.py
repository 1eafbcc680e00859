"""Training objectives. Each loss is an nn.Module that owns its auxiliary heads."""

from unimae.losses.cross_entropy import chunked_cross_entropy, per_example_mean
from unimae.losses.mrc import MRCLoss, TinyDecoder
from unimae.losses.next_token import NextTokenLoss
from unimae.losses.unimae import UniMAEObjective

__all__ = ["MRCLoss", "NextTokenLoss", "TinyDecoder", "UniMAEObjective", "chunked_cross_entropy", "per_example_mean"]
