"""What the experiment scripts share: the model a TrainConfig names."""

from __future__ import annotations

import jax

from jaxshard.cli import TrainConfig
from jaxshard.errors import ConfigError
from jaxshard.remat import default_for
from models import ModelConfig, TransformerLM, get_preset


def with_moe(model_cfg: ModelConfig, moe: dict[str, object]) -> ModelConfig:
    """``model_cfg`` with the --moe-* flags given; one of them on a dense model without
    --moe-experts is an error (it would do nothing)."""
    if not moe.get("moe_experts", model_cfg.moe_experts) and any(k != "moe_experts" for k in moe):
        flags = ", ".join("--" + k.replace("_", "-") for k in moe if k != "moe_experts")
        raise ConfigError(f"{flags}: model {model_cfg.name} has no MoE layers; add --moe-experts E")
    return model_cfg.replace(**moe) if moe else model_cfg


def build_model(cfg: TrainConfig, unroll: bool = False) -> TransformerLM:
    model_cfg = get_preset(cfg.model)
    if cfg.dropout is not None:
        model_cfg = model_cfg.replace(dropout=cfg.dropout)
    if cfg.vocab_multiple is not None:
        model_cfg = model_cfg.replace(vocab_multiple=cfg.vocab_multiple)
    model_cfg = with_moe(model_cfg, dict(cfg.moe))
    remat = cfg.remat if cfg.remat is not None else default_for(jax.default_backend())
    return TransformerLM(model_cfg, remat=remat, unroll=unroll)
