"""unimae: one decoder-only LLM for generation and sentence embeddings (UniMAE, ACL 2025)."""

from unimae.config import TrainConfig
from unimae.encoder import Encoder

__all__ = ["Encoder", "TrainConfig", "train"]
__version__ = "0.1.0"


def train(config: TrainConfig, resume: bool = False):
    """Train as configured (see ``unimae.trainer.train``)."""
    from unimae.trainer import train as _train

    return _train(config, resume=resume)
