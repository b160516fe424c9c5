"""Leaves of a params tree: their names ('blocks/attn/wq', for tables, checkpoints, exports) and
their dtypes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def named_leaves(tree: Any, is_leaf=None, sep: str = "/") -> list[tuple[str, Any]]:
    """Each leaf with its path's keys, indices and attribute names joined by ``sep`` (orbax
    names a stored array by its path joined by ".")."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [(sep.join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path), x)
            for path, x in flat]


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Floating-point leaves (arrays or ShapeDtypeStructs) in ``dtype``; the rest unchanged."""
    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(x.shape, dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype)
    return jax.tree.map(cast, tree)
