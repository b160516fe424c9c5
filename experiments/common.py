"""What the experiment scripts share: the model a TrainConfig names."""

from __future__ import annotations

import jax

from jaxshard.cli import TrainConfig
from jaxshard.remat import default_for
from models import TransformerLM, get_preset


def build_model(cfg: TrainConfig, unroll: bool = False) -> TransformerLM:
    model_cfg = get_preset(cfg.model)
    if cfg.dropout is not None:
        model_cfg = model_cfg.replace(dropout=cfg.dropout)
    if cfg.vocab_multiple is not None:
        model_cfg = model_cfg.replace(vocab_multiple=cfg.vocab_multiple)
    remat = cfg.remat if cfg.remat is not None else default_for(jax.default_backend())
    return TransformerLM(model_cfg, remat=remat, unroll=unroll)
