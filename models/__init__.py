"""Model families (flax NNX) and named presets. Models annotate dims; they know no strategy."""

from models.config import ModelConfig
from models.presets import PRESETS, get_preset
from models.transformer import TransformerLM

__all__ = ["ModelConfig", "PRESETS", "TransformerLM", "get_preset"]
