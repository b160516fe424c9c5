"""Activation checkpointing policies for the layer scan (``--remat``), and FSDP's choice of
keeping or re-gathering a layer's weights for the backward pass (``--reshard-after-forward``).

``--remat`` takes a policy name, or a policy with names after a colon:

* ``none``: keep every activation the backward pass needs;
* ``full``: keep only each layer's input (and its float8 scales), recompute the layer in the
  backward pass;
* ``dots`` / ``dots_no_batch``: keep matmul outputs (those without batch dims), recompute the
  rest (``dots`` keeps a context-parallel ring's output and statistic, ``attention.RING``, in
  place of its steps' matmuls);
* ``selective``: Megatron's selective recompute -- keep everything but the attention core
  (scores, softmax, probabilities times values), which is recomputed from the saved q, k, v
  (not a ring's, which keeps no probabilities);
* ``names:qkv,attn_proj``: keep only the activations the model tags with these names
  (:data:`NAMES`), recompute the rest;
* ``offload:qkv,attn_proj``: like ``names``, but the named activations go to host memory
  (``pinned_host``) in the forward pass and come back for the backward pass.

FSDP/ZeRO-3 gathers a layer's weights where the layer uses them (``rules.for_compute`` names
the gathered copy :data:`GATHERED`). With ``reshard_after_forward`` (the default, PyTorch
FSDP's) no policy saves that copy: the backward pass gathers the layer again, so only the
layer being computed holds gathered weights. Without it, every policy saves it (one gather
per layer per step, but all layers' gathered weights alive between forward and backward).
ZeRO-2's layer weights are a copy too (their gradient is reduce-scattered where it is made),
which no policy saves: re-making it in the backward pass moves nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxshard.errors import ConfigError
from jaxshard.fp8 import SCALE
from jaxshard.parallel.attention import RING, ring_size
from jaxshard.parallel.experts import EXCHANGED
from jaxshard.parallel.grouped import GROUPED
from jaxshard.rules import GATHERED, active

# The activations the model tags (checkpoint_name), for ``names:`` and ``offload:`` policies.
NAMES = {
    "qkv": "the q, k and v projections",
    "attn_out": "the attention core's output (the output projection's input)",
    "attn_proj": "the attention output projection",
    "mlp_in": "the MLP's input projections (up, and gate for SwiGLU)",
    "mlp_hidden": "the MLP's activation output (the down projection's input)",
}
# (The MLP's own output is not among them: the next layer's input, which the scan keeps anyway,
# is the sum it feeds, and nothing in this layer's backward pass reads it.)


class Kind(StrEnum):
    NONE = "none"
    FULL = "full"
    DOTS = "dots"
    DOTS_NO_BATCH = "dots_no_batch"
    SELECTIVE = "selective"
    NAMES = "names"
    OFFLOAD = "offload"


_WITH_NAMES = (Kind.NAMES, Kind.OFFLOAD)


@dataclass(frozen=True, slots=True)
class Remat:
    """A remat policy: its kind, and for ``names``/``offload`` the tagged activations it keeps."""

    kind: Kind = Kind.NONE
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.kind in _WITH_NAMES and not self.names:
            raise ConfigError(f"--remat {self.kind} needs names, e.g. {self.kind}:qkv,attn_proj "
                              f"(known: {', '.join(NAMES)})")
        if self.kind not in _WITH_NAMES and self.names:
            raise ConfigError(f"--remat {self.kind} takes no names")
        unknown = [n for n in self.names if n not in NAMES]
        if unknown:
            raise ConfigError(f"--remat: unknown activation name {unknown[0]!r} "
                              f"(known: {', '.join(NAMES)})")

    @classmethod
    def parse(cls, text: "str | Remat | Kind") -> "Remat":
        if isinstance(text, Remat):
            return text
        kind, _, names = str(text).partition(":")
        kinds = [k.value for k in Kind]
        if kind not in kinds:
            raise ConfigError(f"--remat must be one of {', '.join(kinds)} (names: and offload: "
                              f"take names after a colon), got {text!r}")
        return cls(Kind(kind), tuple(n for n in names.split(",") if n))

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(self.names)}" if self.names else str(self.kind)

    @property
    def recomputes(self) -> bool:
        """Whether the backward pass recomputes any part of the layer."""
        return self.kind is not Kind.NONE


# The policies by their old names, so ``Remat.FULL`` etc. read as before.
Remat.NONE = Remat(Kind.NONE)
Remat.FULL = Remat(Kind.FULL)
Remat.DOTS = Remat(Kind.DOTS)
Remat.DOTS_NO_BATCH = Remat(Kind.DOTS_NO_BATCH)
Remat.SELECTIVE = Remat(Kind.SELECTIVE)
SIMPLE = (Remat.NONE, Remat.FULL, Remat.DOTS, Remat.DOTS_NO_BATCH, Remat.SELECTIVE)

_CURRENT: contextvars.ContextVar[Remat] = contextvars.ContextVar("jaxshard_remat", default=Remat.NONE)


def tag(x: jax.Array, name: str) -> jax.Array:
    """Name an activation for the ``names:``/``offload:`` policies (identity otherwise)."""
    assert name in NAMES, name
    return checkpoint_name(x, name)


def from_inputs(fn: Callable) -> Callable:
    """``fn`` whose backward pass recomputes it from its inputs: autodiff saves the inputs only,
    none of ``fn``'s intermediates. A custom VJP rather than a nested ``jax.checkpoint``: an
    enclosing checkpoint's policy (FSDP's, which must not keep gathered weights) would override
    the nested one's and save the intermediates again."""

    @jax.custom_vjp
    def f(*args):
        return fn(*args)

    def f_fwd(*args):
        return fn(*args), args

    def f_bwd(args, g):
        return jax.vjp(fn, *args)[1](g)

    f.defvjp(f_fwd, f_bwd)
    return f


def attention_core(fn: Callable) -> Callable:
    """``fn`` (the attention core: scores, softmax, probabilities times values) recomputed from
    its inputs q, k, v in the backward pass under ``selective``, as Megatron's selective
    recompute does -- but for a ring (context parallelism), which keeps no probabilities to
    free: its backward pass reads its output and each row's statistic, and makes the scores
    again itself (``attention._ring_attention``)."""
    if _CURRENT.get().kind is not Kind.SELECTIVE or ring_size() > 1:
        return fn
    return from_inputs(fn)


def keeps_activations() -> bool:
    """Whether the policy being traced keeps every activation (``none``; ``selective`` but for
    the attention core): then what a layer keeps is the layer's choice (:func:`elementwise`,
    ``parallel.tensor``'s SP inputs). The others recompute what their rule does not keep."""
    return _CURRENT.get().kind in (Kind.NONE, Kind.SELECTIVE)


def elementwise(fn: Callable) -> Callable:
    """``fn`` (a norm, an activation function: cheap, elementwise or per token) recomputed from
    its inputs in the backward pass, as Megatron's fused kernels do: a norm keeps its input, not
    its float32 centred and normalised values; GELU its input, not the pieces of its tanh.
    Korthikanti et al. 2022 count exactly these. Under the other policies the layer's
    unkept values are recomputed anyway (a second recompute would be waste)."""
    return from_inputs(fn) if keeps_activations() else fn


@contextlib.contextmanager
def _tracing(remat: Remat) -> Iterator[None]:
    token = _CURRENT.set(remat)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def default_for(backend: str) -> Remat:
    """``--remat auto``: the policy measured fastest on ``backend`` (README, "Defaults"). On CPU
    ``dots`` beat keeping everything on every mesh measured (llama-tiny, 8 devices on 2 cores:
    15-20% faster: recomputing is cheaper than the memory traffic of saving); elsewhere nothing
    has been measured yet, so no recompute, the usual fastest where memory allows."""
    return Remat.DOTS if backend == "cpu" else Remat.NONE


def is_gathered(prim: Any, params: dict) -> bool:
    """Whether a jaxpr equation makes a ZeRO-3/FSDP layer's gathered weights: the name, or the
    custom_vjp (``rules._gather``) whose primal holds it."""
    if prim.name == "name":
        return params.get("name") == GATHERED
    jaxpr = getattr(params.get("call_jaxpr"), "jaxpr", None) if prim.name == "custom_vjp_call" else None
    return jaxpr is not None and any(e.primitive.name == "name" and e.params.get("name") == GATHERED
                                     for e in jaxpr.eqns)


def _base_policy(remat: Remat):
    p = jax.checkpoint_policies
    match remat.kind:
        case Kind.NONE | Kind.SELECTIVE:
            return p.everything_saveable
        case Kind.FULL:
            return p.nothing_saveable
        case Kind.DOTS:
            return p.checkpoint_dots
        case Kind.DOTS_NO_BATCH:
            return p.dots_with_no_batch_dims_saveable
        case Kind.NAMES:
            return p.save_only_these_names(*remat.names)
        case Kind.OFFLOAD:
            return p.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=list(remat.names),
                offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"unknown remat policy {remat!r}")


def _keeping_exchanges(base, remat: Remat):
    """``base``, and keep the MoE exchanges' results (``parallel.experts.EXCHANGED``):
    recomputing them would send them again. The ``dots`` policies keep the grouped matmuls'
    outputs too (``parallel.grouped.GROUPED``: matmuls, but in a loop of the op's own, which
    ``checkpoint_dots`` does not see). Every policy, ``full`` too, keeps the float8 scales
    (``fp8.SCALE``): a scalar each, where taking it again reduces a tensor over the devices.
    (:func:`from_inputs` runs a function's forward again whatever the policy names.)"""
    if base is jax.checkpoint_policies.everything_saveable:
        return base
    kept = {Kind.FULL: (SCALE,), Kind.DOTS: (EXCHANGED, GROUPED, RING, SCALE),
            Kind.DOTS_NO_BATCH: (EXCHANGED, GROUPED, SCALE)}.get(remat.kind, (EXCHANGED, SCALE))

    def policy(prim, *avals, **params):
        return (prim.name == "name" and params.get("name") in kept) or base(prim, *avals, **params)

    return policy


def _policy(remat: Remat, gathers: bool, keep_gathered: bool):
    """The ``jax.checkpoint`` policy, or None for no checkpoint at all."""
    base = _keeping_exchanges(_base_policy(remat), remat)
    if not gathers:
        return None if base is jax.checkpoint_policies.everything_saveable else base
    if keep_gathered and base is jax.checkpoint_policies.everything_saveable:
        return None

    def policy(prim, *avals, **params):
        return keep_gathered if is_gathered(prim, params) else base(prim, *avals, **params)

    return policy


def apply(fn: Callable, remat: Remat) -> Callable:
    """``fn`` (the scan body of the layers) under ``remat``, and under the active rules' choice
    of keeping a ZeRO-3/FSDP layer's gathered weights for the backward pass or not."""
    remat = Remat.parse(remat)
    rules = active()
    gathers = rules is not None and rules.relayouts_weights
    keep = gathers and rules.gathers_params and not rules.strategy.reshard_after_forward
    policy = _policy(remat, gathers, keep)

    def traced(*args):
        with _tracing(remat):
            return fn(*args)

    return traced if policy is None else jax.checkpoint(traced, policy=policy)
