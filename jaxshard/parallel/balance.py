"""Stage balancing: how many layers each pipeline stage runs so the slowest stage is fastest.

A pipeline's tick takes as long as its slowest stage, so the assignment to pick is the one whose
most loaded (virtual) stage is least loaded. What loads a stage, per microbatch:

* each of its layers: forward in the forward slot and backward in the backward slot (from the
  residuals kept in between), the last stage both in its backward slot, with the head;
* stage 0: the embedding, forward and backward;
* the last stage: the head and the loss, forward and backward -- with a large vocabulary worth
  several layers, so that stage should run fewer layers.

The costs come from the FLOPs model (``flops``, no running) or from timing each piece on one of
this machine's devices with a microbatch's shape (``profile``). :func:`assign` then finds the
best contiguous split exactly (a small dynamic programme over layer counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxshard.errors import ConfigError
from jaxshard.model import Stageable

HOW = ("flops", "profile")


@dataclass(frozen=True)
class Costs:
    """Per microbatch, in ``unit``: a layer (forward + backward), the embedding (stage 0) and
    the head + loss (last stage)."""

    layer: float
    embed: float
    head: float
    unit: str  # "s" (profiled) or "FLOP"

    def stage(self, u: int, parts: int, layers: int) -> float:
        """Virtual stage ``u`` of ``parts`` running ``layers`` layers."""
        return layers * self.layer + (self.embed if u == 0 else 0.0) + (self.head if u == parts - 1 else 0.0)

    def format(self, value: float) -> str:
        return f"{value * 1e3:.2f} ms" if self.unit == "s" else f"{value / 1e9:.2f} GFLOP"


def assign(n_layers: int, parts: int, costs: Costs) -> tuple[int, ...]:
    """Layers per virtual stage (each >= 1, summing to ``n_layers``) minimising the most
    loaded stage; among equal maxima the one with the least total spread."""
    if n_layers < parts:
        raise ConfigError(f"{n_layers} layers cannot fill {parts} (virtual) stages")
    inf = float("inf")
    # best[k][n]: (max load, sum of squared loads) of the first k stages running n layers.
    best = [[(inf, inf)] * (n_layers + 1) for _ in range(parts + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, parts + 1):
        for n in range(k, n_layers - (parts - k) + 1):
            for m in range(1, n - (k - 1) + 1):
                prev = best[k - 1][n - m]
                if prev[0] == inf:
                    continue
                load = costs.stage(k - 1, parts, m)
                cand = (max(prev[0], load), prev[1] + load * load)
                if cand < best[k][n]:
                    best[k][n], choice[k][n] = cand, m
    counts, n = [], n_layers
    for k in range(parts, 0, -1):
        counts.append(choice[k][n])
        n -= choice[k][n]
    return tuple(reversed(counts))


def flop_costs(cfg: Any, rows: int, seq_len: int) -> Costs:
    """From the model's shapes: matmul FLOPs (forward 2 per weight per token, backward twice
    that) and attention's, per microbatch of ``rows`` sequences of ``seq_len``."""
    D, N, K, H, F, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, seq_len
    tokens = rows * seq_len
    mlp_mats = cfg.mlp_in + 1
    forward = tokens * (2 * (D * (N + 2 * K) * H + N * H * D + mlp_mats * D * F) + 4 * L * N * H)
    head = tokens * 2 * D * cfg.padded_vocab
    return Costs(layer=3 * forward, embed=0.0, head=3 * head, unit="FLOP")


def profile_costs(model: Stageable, rows: int, seq_len: int, compute_dtype: str, repeats: int = 5,
                  depth: int = 2) -> Costs:
    """Timed on one device at the microbatch's shape (``rows`` per device), as the pipeline runs
    them: ``depth`` layers' scan (the model's remat policy included) forward and backward under
    ``jax.vjp`` (a forward and a backward slot), per layer; the embedding's and the head +
    loss's forward + backward. The median of ``repeats`` runs each, after a compile run."""
    from jaxshard.parallel.vocab import cross_entropy
    from jaxshard.pytree import cast_floats

    device = jax.local_devices()[0]
    dtype = jnp.dtype(compute_dtype)
    with jax.default_device(device):
        # Random values of the right shapes for a few layers and the two ends only: the whole
        # model need not fit one device.
        shapes = model.abstract_params()
        stack = _random(jax.tree.map(lambda x: jax.ShapeDtypeStruct((depth, *x.shape[1:]), dtype),
                                     shapes["blocks"]))
        outer = _random(cast_floats({k: v for k, v in shapes.items() if k != "blocks"}, dtype))
        tokens = jnp.zeros((rows, seq_len), jnp.int32)
        x = model.embed(outer, tokens).astype(dtype)

        def forward(stack, x):
            return model.blocks({"blocks": stack}, x)

        def both_slots(stack, x, g):
            return jax.vjp(forward, stack, x)[1](g)

        def embed_slots(o, g):
            return jax.vjp(lambda o: model.embed(o, tokens), o)[1](g)

        def head_loss(o, x):
            return cross_entropy(model.head(o, x), tokens, model.cfg.vocab_size).sum()

        layer = _timed(jax.jit(both_slots), stack, x, x, repeats=repeats) / depth
        embed = _timed(jax.jit(embed_slots), outer, x, repeats=repeats)
        head = _timed(jax.jit(jax.grad(head_loss, argnums=(0, 1))), outer, x, repeats=repeats)
    return Costs(layer=layer, embed=embed, head=head, unit="s")


def _random(shapes: Any) -> Any:
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return tree.unflatten([0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _timed(fn: Callable, *args: Any, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]
