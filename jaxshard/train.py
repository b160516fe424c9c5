"""The training command: ``jaxshard-train`` once installed, ``python -m jaxshard.train``, or
``experiments/train.py`` in a checkout -- the same flags (``--help``) from any folder."""

from __future__ import annotations

import sys

from jaxshard import cli, distributed, runtime
from jaxshard.errors import ConfigError


def with_moe(model_cfg, moe: dict[str, object]):
    """``model_cfg`` with the --moe-* flags given; one of them on a dense model without
    --moe-experts is an error (it would do nothing)."""
    if not moe.get("moe_experts", model_cfg.moe_experts) and any(k != "moe_experts" for k in moe):
        flags = ", ".join("--" + k.replace("_", "-") for k in moe if k != "moe_experts")
        raise ConfigError(f"{flags}: model {model_cfg.name} has no MoE layers; add --moe-experts E")
    return model_cfg.replace(**moe) if moe else model_cfg


def model_config(cfg: cli.TrainConfig, tokenizer_vocab: int | None = None):
    """The ModelConfig a TrainConfig names: a preset or an --init-from folder's, with the flags'
    overrides. ``tokenizer_vocab``: a text tokenizer's vocabulary, which a preset's model takes
    unless --vocab-size says otherwise (an imported model keeps its own)."""
    from models import get_preset

    if cfg.init_from:
        from jaxshard import hf

        model_cfg = hf.read_config(cfg.init_from)
    else:
        model_cfg = get_preset(cfg.model_name)
    shape = dict(cfg.shape)
    if tokenizer_vocab is not None and not cfg.init_from:
        shape.setdefault("vocab_size", tokenizer_vocab)
    if shape:
        if "d_model" in shape or "n_heads" in shape:  # d_head follows them unless given
            shape.setdefault("d_head", None)
        if "n_heads" in shape and model_cfg.n_kv_heads == model_cfg.n_heads:
            shape.setdefault("n_kv_heads", None)  # multi-head attention stays so
        model_cfg = model_cfg.replace(**shape)
    if cfg.dropout is not None:
        model_cfg = model_cfg.replace(dropout=cfg.dropout)
    if cfg.vocab_multiple is not None:
        model_cfg = model_cfg.replace(vocab_multiple=cfg.vocab_multiple)
    return with_moe(model_cfg, dict(cfg.moe))


def build_model(cfg: cli.TrainConfig, unroll: bool = False, tokenizer_vocab: int | None = None):
    import jax

    from jaxshard.remat import default_for
    from models import TransformerLM

    remat = cfg.remat if cfg.remat is not None else default_for(jax.default_backend())
    return TransformerLM(model_config(cfg, tokenizer_vocab), remat=remat, unroll=unroll)


def main(argv: list[str] | None = None) -> int:
    with cli.one_line_errors():
        cfg = cli.parse_train(argv)
        runtime.configure(cfg.runtime)  # before anything touches a device
        distributed.initialize(cfg.distributed, cfg.runtime.platform)

        from jaxshard import loop

        try:
            loop.train(cfg)
        except loop.Preempted as e:
            print(e, file=sys.stderr, flush=True)
            return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
