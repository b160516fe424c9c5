"""Data parallelism by hand: DDP's Reducer as an explicit ``shard_map`` (``--strategy explicit``).

GSPMD DDP leaves the gradient all-reduce to the partitioner. Here every device computes the
gradients of its own rows in a region manual over ``data``, and reduces them itself, as
PyTorch DDP's Reducer does: the gradients are laid out in **buckets** of at most
``--bucket-mb`` MB, filled in reverse registration order -- the stacked layers from the last
to the first (within a layer, its params in reverse order), then the params outside the layer
stack -- and each bucket is one collective on one flat buffer:

* an **all-reduce** (DDP, ``--zero 0``), or
* a **reduce-scatter** (explicit ZeRO-2, ``--zero 1|2``): each param whose optimizer state is
  sharded contributes its ``N`` shards side by side (``[N, size / N]``), so the bucket's
  reduce-scatter leaves every device exactly its shards of the bucket's params, in the layout
  the update uses. Params kept whole (too small or not divisible) go in all-reduce buckets.

A param larger than a bucket is a bucket of its own, as in DDP. The buckets' collectives depend
only on their own gradients, so a bucket may be issued as soon as it is complete (the step
compiles without XLA's all-reduce combiner, :data:`COMPILER_OPTIONS`, which would merge the
buckets back into one all-reduce at the end); with the layer scan, though, every layer's gradients leave the backward loop together at its
end (DDP's hooks fire inside the loop), so here only the buckets of params used after the
layers overlap the layers' backward pass. :func:`plan` is also what the verifier compares the
compiled step with: one collective per bucket, of the bucket's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxshard.axes import Dim, MeshAxis
from jaxshard.errors import ConfigError
from jaxshard.model import LanguageModel
from jaxshard.pytree import named_leaves

DATA = str(MeshAxis.DATA)
REDUCERS = ("gspmd", "explicit")
# XLA merges independent all-reduces into one (its combiner): buckets exist to stay apart.
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "all-reduce-combiner,cpu-all-reduce-combiner"}


@dataclass(frozen=True)
class Piece:
    """One param's gradient, or one layer's slice of a stacked one, in a bucket."""

    name: str  # the param's '/'-joined name
    layer: int | None  # the layer of a stacked param (None: the whole param)
    shape: tuple[int, ...]
    split: int | None  # the dim the reduce-scatter splits over data (None: all-reduced whole)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class Bucket:
    kind: str  # 'all-reduce' or 'reduce-scatter'
    pieces: list[Piece] = field(default_factory=list)
    itemsize: int = 4

    @property
    def bytes(self) -> int:
        """Bytes of the bucket's buffer (what a device puts into its collective)."""
        return sum(p.size for p in self.pieces) * self.itemsize


def check(rules: Any, model: LanguageModel, grad_accum: int, schedule: Any) -> None:
    """One-line errors for what ``--strategy explicit`` does not cover."""
    others = {a: n for a, n in rules.mesh.shape.items() if a != DATA and n > 1}
    if others:
        raise ConfigError(f"--strategy explicit reduces over data only; the mesh also has "
                          f"{', '.join(f'{a}={n}' for a, n in others.items())} (use --strategy gspmd)")
    if rules.strategy.zero == 3 or rules.strategy.offload:
        raise ConfigError("--strategy explicit covers DDP and ZeRO-1/2 (--zero 0, 1, 2) without --offload")
    if grad_accum > 1 or schedule is not None:
        raise ConfigError("--strategy explicit reduces once per step: not with --grad-accum > 1 or a pipeline")
    if model.moe_layers:
        raise ConfigError("--strategy explicit covers dense models (MoE layers: use --strategy gspmd)")


def plan(abstract_params: Any, axes: Any, reduce_shardings: Any, bucket_mb: float) -> list[Bucket]:
    """The buckets, in the order they are filled (reverse registration order)."""
    limit = bucket_mb * 2 ** 20  # (StepConfig checked it is > 0)
    specs = dict(named_leaves(reduce_shardings))
    dims = dict(named_leaves(axes, is_leaf=lambda x: isinstance(x, tuple)))
    stacked, outer = [], []
    for name, x in named_leaves(abstract_params):
        split = next((d for d, a in enumerate(specs[name].spec) if a is not None), None)
        layered = bool(dims[name]) and dims[name][0] == Dim.LAYERS and split != 0
        (stacked if layered else outer).append((name, x, split, layered))
    order = []
    n_layers = max((x.shape[0] for _, x, _, _ in stacked), default=0)
    for layer in reversed(range(n_layers)):
        for name, x, split, _ in reversed(stacked):
            if layer < x.shape[0]:
                order.append(Piece(name, layer, x.shape[1:], None if split is None else split - 1))
    order += [Piece(name, None, x.shape, split) for name, x, split, _ in reversed(outer)]
    itemsize = jnp.dtype(jax.tree.leaves(abstract_params)[0].dtype).itemsize
    buckets: list[Bucket] = []
    open_ = {}  # kind -> the bucket being filled
    for piece in order:
        kind = "all-reduce" if piece.split is None else "reduce-scatter"
        bucket = open_.get(kind)
        if bucket is None or bucket.pieces and bucket.bytes + piece.size * itemsize > limit:
            bucket = open_[kind] = Bucket(kind, itemsize=itemsize)
            buckets.append(bucket)
        bucket.pieces.append(piece)
    return buckets


def reduce(grads: Any, buckets: list[Bucket], n: int) -> Any:
    """Inside a region manual over ``data`` (``n`` devices): this device's gradients summed over
    ``data`` bucket by bucket; a reduce-scatter bucket's params come back as this device's
    shards (``split`` dim divided by ``n``)."""
    flat = dict(named_leaves(grads))
    out: dict[str, dict[int | None, jax.Array]] = {}
    for bucket in buckets:
        parts = [_piece(flat, p) for p in bucket.pieces]
        if bucket.kind == "all-reduce":
            summed = jax.lax.psum(jnp.concatenate([x.ravel() for x in parts]), DATA)
            sizes = [p.size for p in bucket.pieces]
            for p, x in zip(bucket.pieces, jnp.split(summed, np.cumsum(sizes)[:-1])):
                out.setdefault(p.name, {})[p.layer] = x.reshape(p.shape)
        else:
            # [n, size / n] per piece: shard i of the piece in row i.
            rows = [jnp.moveaxis(x, p.split, 0).reshape(n, -1) for p, x in zip(bucket.pieces, parts)]
            mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), DATA, scatter_dimension=0,
                                               tiled=True)[0]
            sizes = [p.size // n for p in bucket.pieces]
            for p, x in zip(bucket.pieces, jnp.split(mine, np.cumsum(sizes)[:-1])):
                moved = (p.shape[p.split] // n, *p.shape[:p.split], *p.shape[p.split + 1:])
                out.setdefault(p.name, {})[p.layer] = jnp.moveaxis(x.reshape(moved), 0, p.split)
    leaves = []
    for name, _ in named_leaves(grads):
        got = out[name]
        leaves.append(got[None] if None in got else jnp.stack([got[i] for i in range(len(got))]))
    return jax.tree.unflatten(jax.tree.structure(grads), leaves)


def _piece(flat: dict[str, jax.Array], p: Piece) -> jax.Array:
    return flat[p.name] if p.layer is None else flat[p.name][p.layer]
