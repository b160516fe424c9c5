"""What a language model gives the library: its loss as token sums (:class:`LanguageModel`), and
the pieces a pipeline stages -- the embedding, the layers of its stack, the head
(:class:`Stageable`).

Model code (``models/``) implements both; strategies take it from outside:
the pipeline adapter (:mod:`jaxshard.parallel.staged`) splits its layer stack into stages from
these pieces, so a model knows no schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

from jaxshard.errors import ConfigError
from jaxshard.fp8 import RECIPES
from jaxshard.options import flag, option, section

Params = dict[str, Any]

# The routing statistics of a model with MoE layers, in the order a layer reports them; the
# last is the expert rows the step computed per routed choice (1 is exact; a capacity's empty
# slots and a grouped matmul's tile padding are above it), read from the program.
MOE_METRICS = ("moe_load_balance", "moe_z_loss", "moe_dropped", "moe_computed", "moe_max_violation")


class Loss(NamedTuple):
    """A batch's loss as sums over its tokens: callers divide each by ``tokens`` once globally,
    so microbatches and shards add up to the full-batch means exactly."""

    total: jax.Array  # what is differentiated: nll + tokens x the weighted auxiliary losses
    tokens: jax.Array
    nll: jax.Array  # the token cross-entropies' sum
    # MoE models: tokens x each routing statistic (MOE_METRICS), averaged over the MoE layers;
    # empty for a dense model.
    moe: dict[str, jax.Array]


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder-only language model as functions of (params, inputs).

    Params are a nested dict; the layers' params are stacked on a leading ``layers`` dim under
    one of :attr:`stacks` (a pipeline splits :attr:`stack`); the rest are the outer params
    (embedding, final norm, head). The training step casts the outer params to the compute
    dtype; :meth:`loss` casts each layer's to its input's dtype inside the layer loop, so no
    compute-dtype copy of the whole stack is ever made."""

    cfg: Any  # the family's config (models.config.ModelConfig): shapes, dropout, MoE settings
    remat: Any  # the layer scan's recompute policy (jaxshard.remat.Remat)
    unroll: bool  # the layer scan unrolled (XLA's cost analysis then counts every layer)
    moe_layers: tuple[int, ...]  # indices of the MoE layers (empty: a dense model)
    stacks: tuple[str, ...]  # keys of the params that hold stacked layers
    stage_layout: Any  # None: the layer stack is stored in model order

    @property
    def stack(self) -> str: ...  # the stack a pipeline splits (all layers of one kind)

    def init(self, key: jax.Array) -> Params: ...
    def abstract_params(self) -> Params: ...
    def param_axes(self) -> dict: ...  # logical dims of every param, the params' structure
    def n_params(self) -> int: ...
    def n_active_params(self) -> int: ...
    def loss(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array, *,
             key: jax.Array | None = None) -> Loss: ...



@runtime_checkable
class Stageable(LanguageModel, Protocol):
    """A model whose pieces a pipeline can stage (:mod:`jaxshard.parallel.staged`)."""

    def embed(self, params: Params, tokens_BL: jax.Array, *, key: jax.Array | None = None) -> jax.Array: ...
    def blocks(self, params: Params, x_BLD: jax.Array, *, key: jax.Array | None = None,
               layer_keys: jax.Array | None = None, present: jax.Array | None = None) -> jax.Array: ...
    def moe_block(self, layer_params: Params, x_BLD: jax.Array, *,
                  key: jax.Array | None = None) -> tuple[jax.Array, Any]: ...
    def head(self, params: Params, x_BLD: jax.Array) -> jax.Array: ...
    def aux_loss(self, load_balance: jax.Array, z_loss: jax.Array) -> jax.Array: ...
    def check_seq_len(self, inputs_BL: jax.Array) -> None: ...


# ---- which model a run trains --------------------------------------------------------------

PRESET = "tiny"  # the preset a run trains without --model or --init-from
_PRESETS = "the preset's"


class _Overrides:
    """Fields of the model family's config that a run sets (None: the preset's)."""

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def flags(self) -> str:
        return ", ".join(flag(type(self), name) for name in self.given())


@dataclass(frozen=True, slots=True)
class Shape(_Overrides):
    """The shape fields of the model's config that the flags override."""

    n_layers: int | None = option(None, "layers", default_text=_PRESETS)
    d_model: int | None = option(None, "width of the residual stream", default_text=_PRESETS)
    n_heads: int | None = option(None, "attention heads", default_text=_PRESETS)
    n_kv_heads: int | None = option(None, "key/value heads (fewer than --n-heads: grouped-query attention)",
                                    default_text=_PRESETS)
    d_head: int | None = option(None, "width of a head", default_text="d_model / n_heads")
    d_mlp: int | None = option(None, "hidden width of the MLP", default_text=_PRESETS)
    vocab_size: int | None = option(None, "vocabulary", default_text="the preset's, or a trained tokenizer's")
    max_seq_len: int | None = option(None, "longest sequence (GPT-2: rows of the position table)",
                                     default_text=_PRESETS)
    rope_theta: float | None = option(None, "rotary embedding base (Llama family)", default_text=_PRESETS)


@dataclass(frozen=True, slots=True)
class Moe(_Overrides):
    """The mixture-of-experts fields of the model's config that the flags override."""

    moe_experts: int | None = option(None, "experts per MoE layer (0: a dense model); the expert axis "
                                           "splits them", default_text=_PRESETS)
    moe_top_k: int | None = option(None, "experts per token: 1 is the hard (Switch) gate, >= 2 the "
                                         "sparse gate", default_text=_PRESETS)
    moe_every: int | None = option(None, "every n-th layer is an MoE layer (the scan steps over groups "
                                         "of n)", default_text=_PRESETS)
    moe_capacity_factor: float | None = option(
        None, "each expert takes at most ceil(c k S / E) of a sequence's S tokens' k choices, the rest "
              "dropped (their residual passes through); 0: dropless", default_text=_PRESETS)
    moe_d_mlp: int | None = option(None, "an expert's hidden size (smaller than d_mlp: fine-grained)",
                                   default_text="the model's d_mlp")
    moe_shared_experts: int | None = option(None, "experts every token passes through besides its "
                                                  "routed ones", default_text=_PRESETS)
    moe_aux_coef: float | None = option(None, "weight of the load-balancing loss E sum_e f_e P_e "
                                              "(logged as moe_load_balance)", default_text=_PRESETS)
    moe_z_coef: float | None = option(None, "weight of the router z-loss mean logsumexp^2 (logged as "
                                            "moe_z_loss)", default_text=_PRESETS)
    moe_balance: str | None = option(
        None, "aux: the load-balancing loss; bias: DeepSeek-V3's auxiliary-loss-free balancing (a "
              "per-expert routing bias moved each step towards the mean load, outside the gradient); "
              "both", choices=("aux", "bias", "both"), default_text="aux")
    moe_bias_rate: float | None = option(None, "--moe-balance bias|both: the bias's step per "
                                               "optimizer step (DeepSeek-V3's gamma)", default_text="0.001")
    moe_kernel: str | None = option(
        None, "dropless experts' grouped matmuls: tiled (a loop over each expert's rows in tiles), "
              "ragged (jax.lax.ragged_dot as XLA lowers it), triton (ragged_dot by JAX's Pallas Triton "
              "kernel; GPUs only); auto: tiled on CPU, ragged elsewhere",
        choices=("auto", "tiled", "ragged", "triton"), default_text="auto")

    def __post_init__(self) -> None:
        if self.moe_balance == "bias" and self.moe_aux_coef is not None:
            raise ConfigError("--moe-aux-coef weights the load-balancing loss, which --moe-balance bias "
                              "leaves out (use --moe-balance both)")
        if self.moe_bias_rate is not None and self.moe_balance in (None, "aux"):
            raise ConfigError("--moe-bias-rate needs --moe-balance bias or both")


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model a run trains: a preset or a Hugging Face folder, and the fields it overrides.
    The command that knows the model families (``jaxshard.train``) turns it into a model."""

    preset: str | None = option(None, "preset name (see models/presets.py)", flag="--model",
                                default_text=f"{PRESET}, or --init-from's")
    init_from: str | None = option(
        None, "start from a local Hugging Face GPT-2 or Llama folder (config.json + *.safetensors): "
              "its shape, its weights read straight into their shardings", metavar="HF_DIR")
    dropout: float | None = option(None, "override the preset's dropout", default_text=_PRESETS)
    vocab_multiple: int | None = option(
        None, "pad the vocab to a multiple of N (e.g. so tensor divides it); padding logits are "
              "masked out of the loss", default_text=_PRESETS)
    fp8: str | None = option(
        None, "the blocks' linear layers (attention projections, MLP; not the embedding, head or "
              "router) in float8: inputs and weights e4m3, output gradients e5m2, scaled per tensor "
              "from this step's amaxes (tensorwise), per row of the contraction (rowwise: gradients "
              "e4m3 too), or per tensor from the last 16 steps' amaxes, kept with the params (delayed)",
        choices=RECIPES, default_text="off", group="precision")
    shape: Shape = section(Shape, "model shape (override the preset's fields)")
    moe: Moe = section(Moe, "mixture of experts (override the preset's; see models/moe.py)")

    def __post_init__(self) -> None:
        if self.init_from and self.preset:
            raise ConfigError(f"{flag(ModelChoice, 'preset')} and {flag(ModelChoice, 'init_from')} both "
                              "name the model: give one")
        if self.init_from and self.shape.given():
            raise ConfigError(f"{self.shape.flags()}: the shape of an {flag(ModelChoice, 'init_from')} "
                              "model is its checkpoint's")
        if self.init_from and self.moe.given():
            raise ConfigError("--moe-* flags: Hugging Face import covers dense GPT-2 and Llama models")

    @property
    def name(self) -> str:
        return self.preset or PRESET

