"""unimae: one decoder-only LLM for generation and sentence embeddings (UniMAE, ACL 2025)."""

from unimae.runtime.threads import default_spin

default_spin()  # before anything imports torch: see unimae.runtime.threads

from unimae.encoder import Encoder  # noqa: E402
from unimae.training.config import TrainConfig  # noqa: E402
from unimae.training.trainer import train as _train  # noqa: E402

__all__ = ["Encoder", "TrainConfig", "train"]
__version__ = "0.1.0"


def train(config: TrainConfig, resume: bool = False):
    """Train as configured (see ``unimae.training.trainer.train``)."""
    return _train(config, resume=resume)
