"""What one device holds of a parameter or of the tokens, from the shapes and the sharding rules.

The shared measure of the accounting (``accounting``: memory, FLOPs) and of each strategy's
collectives (``traffic``): a leaf's elements per device under a PartitionSpec, every
parameter's specs at rest and in compute (:class:`ParamInfo`), a device's tokens, and the
slots an MoE layer runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec

from jaxshard.axes import Dim
from jaxshard.model import LanguageModel
from jaxshard.pytree import named_leaves
from jaxshard.rules import ShardingRules, StateKind

F32 = 4


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def shard_elems(shape: tuple[int, ...], spec: PartitionSpec, sizes: dict[str, int]) -> int:
    n = 1
    for i, d in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= d // math.prod(sizes[a] for a in axes)
    return n


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: its logical dims and where each state of it lives."""

    path: str
    axes: tuple
    shape: tuple[int, ...]
    params: PartitionSpec  # at rest
    grads: PartitionSpec  # at rest, after reduction
    opt_state: PartitionSpec  # each Adam moment
    reduced: PartitionSpec  # where the step reduces the gradient into (ZeRO-1: opt_state's)
    compute: PartitionSpec  # as a layer uses it

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def in_layers(self) -> bool:
        return bool(self.axes) and self.axes[0] == Dim.LAYERS


def param_infos(model: LanguageModel, rules: ShardingRules) -> list[ParamInfo]:
    named_axes = named_leaves(model.param_axes(), is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(model.abstract_params())
    out = []
    for (path, ax), x in zip(named_axes, shapes):
        shape = tuple(x.shape)
        out.append(ParamInfo(
            path=path, axes=ax, shape=shape,
            params=rules.param_spec(ax, shape, StateKind.PARAMS),
            grads=rules.param_spec(ax, shape, StateKind.GRADS),
            opt_state=rules.param_spec(ax, shape, StateKind.OPT_STATE),
            reduced=rules.param_spec(ax, shape, rules.reduced_into),
            compute=rules.compute_param_spec(ax, shape)))
    return out


def local_tokens(rules: ShardingRules, batch_size: int, seq_len: int) -> int:
    return (batch_size // rules.size(rules.batch_axes)) * (seq_len // seq_split(rules))


def seq_split(rules: ShardingRules) -> int:
    """How many shards context parallelism splits the sequence into."""
    return rules.size(rules.activation_mesh_axes(Dim.LENGTH))
