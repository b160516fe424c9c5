"""What the experiment scripts share: the model a RunConfig names (see jaxshard.train)."""

from jaxshard.train import build_model, model_config, with_moe

__all__ = ["build_model", "model_config", "with_moe"]
