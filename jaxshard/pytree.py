"""Names for the leaves of a params tree: 'blocks/attn/wq' (tables, checkpoints, exports)."""

from __future__ import annotations

from typing import Any

import jax


def named_leaves(tree: Any, is_leaf=None) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), x) for path, x in flat]
