"""The training command: ``jaxshard-train`` once installed, ``python -m jaxshard.train``, or
``experiments/train.py`` in a checkout -- the same flags (``--help``) from any folder.

The composition root: the one module of the library that imports ``models/`` (lazily), to pair
the strategies with this project's model families -- as the experiment scripts do."""

from __future__ import annotations

import sys
import time
import traceback

from jaxshard import cli, distributed, runtime
from jaxshard.errors import ConfigError
from jaxshard.run import RunConfig


def with_moe(model_cfg, moe: dict[str, object]):
    """``model_cfg`` with the --moe-* flags given; one of them on a dense model without
    --moe-experts is an error (it would do nothing)."""
    if not moe.get("moe_experts", model_cfg.moe_experts) and any(k != "moe_experts" for k in moe):
        flags = ", ".join("--" + k.replace("_", "-") for k in moe if k != "moe_experts")
        raise ConfigError(f"{flags}: model {model_cfg.name} has no MoE layers; add --moe-experts E")
    return model_cfg.replace(**moe) if moe else model_cfg


def model_config(cfg: RunConfig, tokenizer_vocab: int | None = None):
    """The ModelConfig a RunConfig names: a preset or an --init-from folder's, with the flags'
    overrides. ``tokenizer_vocab``: a text tokenizer's vocabulary, which a preset's model takes
    unless --vocab-size says otherwise (an imported model keeps its own)."""
    from models import get_preset

    choice = cfg.model
    if choice.init_from:
        from models import hf

        model_cfg = hf.read_config(choice.init_from)
    else:
        model_cfg = get_preset(choice.name)
    shape = choice.shape.given()
    if "rope_theta" in shape and model_cfg.positions.value != "rope":
        raise ConfigError(f"--rope-theta sets the base of rotary embeddings; model {model_cfg.name} "
                          f"has {model_cfg.positions.value} positions")
    if tokenizer_vocab is not None and not choice.init_from:
        shape.setdefault("vocab_size", tokenizer_vocab)
    if shape:
        model_cfg = model_cfg.with_shape(**shape)
    if choice.dropout is not None:
        model_cfg = model_cfg.replace(dropout=choice.dropout)
    if choice.vocab_multiple is not None:
        model_cfg = model_cfg.replace(vocab_multiple=choice.vocab_multiple)
    model_cfg = with_moe(model_cfg, choice.moe.given())
    return model_cfg.replace(fp8=choice.fp8) if choice.fp8 is not None else model_cfg


def build_model(cfg: RunConfig, unroll: bool = False, tokenizer_vocab: int | None = None,
                documents_eot: int | None = None):
    """``documents_eot``: pack documents ended by this id (``--packing``; None: one sequence)."""
    import jax

    from jaxshard.remat import default_for
    from models import TransformerLM

    remat = cfg.remat if cfg.remat is not None else default_for(jax.default_backend())
    model_cfg = model_config(cfg, tokenizer_vocab)
    if documents_eot is not None:
        model_cfg = model_cfg.replace(documents_eot=documents_eot)
    return TransformerLM(model_cfg, remat=remat, unroll=unroll)


def family():
    """The model families' services the training loop uses (Hugging Face weights, generation)."""
    from jaxshard.loop import Family
    from models import generate, hf

    return Family(build=build_model, load_weights=hf.load_params, check_export=hf.check_export,
                  export=hf.export, generate=generate.generate)


def restore_model(directory: str, rules, step: int | None = None):
    """(model, params, tokenizer or None, step) of a training checkpoint: the model its record
    describes, only its params (no optimizer state) read in ``rules``' param shardings (a
    local-SGD run's: the replicas' average)."""
    import jax

    from jaxshard.data import tokenizer as tok
    from jaxshard.rules import StateKind
    from jaxshard.training import local_sgd
    from jaxshard.training.checkpoint import CheckpointConfig, Checkpointer, param_shapes
    from models import ModelConfig, TransformerLM

    ckpt = Checkpointer(CheckpointConfig(directory=directory))
    try:
        meta = ckpt.meta(step)
        if "model_config" not in meta:
            raise ConfigError(f"checkpoint {directory}: its record has no model config (written by an "
                              "older jaxshard)")
        model = TransformerLM(ModelConfig.from_dict(meta["model_config"]))
        shardings = rules.param_shardings(model.param_axes(), model.abstract_params(), StateKind.PARAMS)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                model.abstract_params(), shardings)
        replicas = local_sgd.saved_replicas(meta)  # --sync-every: every replica's params, averaged
        if replicas:
            abstract = local_sgd.stacked_abstract(abstract, replicas)
        params, _ = ckpt.restore_params(abstract, param_shapes(model.abstract_params()), meta["step"])
        if replicas:
            params = local_sgd.average(params, shardings)
    finally:
        ckpt.close()
    saved = meta.get("tokenizer")
    spec = meta.get("tokenizer_spec")
    tokenizer = tok.HFTokenizer.from_json(saved, spec) if saved else tok.ByteTokenizer() if spec == "bytes" else None
    return model, params, tokenizer, meta["step"]


def main(argv: list[str] | None = None) -> int:
    """Train as the flags say; the exit status. A process of a multi-process job that fails
    with an error (a collective that lost its peer, a crash) ends at once with status 1
    (:func:`jaxshard.distributed.exit_failed`) rather than wait for its peers, which may be
    dead, in JAX's shutdown. Bad input (a one-line error, status 2) and an interrupt exit
    through the shutdown: every process meets them alike, and leaving together is what keeps
    the peers of the coordinating process from aborting when it is gone."""
    try:
        return _main(argv)
    except Exception:
        if distributed.joined():
            traceback.print_exc()
            distributed.exit_failed(1)
        raise


def _main(argv: list[str] | None) -> int:
    started = time.perf_counter()  # goodput's wall time starts here
    with cli.one_line_errors():
        cfg = cli.parse_train(argv)
        runtime.configure(cfg.runtime)  # before anything touches a device
        distributed.initialize(cfg.distributed, cfg.runtime.platform)

        from jaxshard import loop

        try:
            loop.train(cfg, family(), started=started)
        except loop.Preempted as e:
            print(e, file=sys.stderr, flush=True)
            return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
