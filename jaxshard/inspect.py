"""What each device holds: live array shards and the compiled step's memory analysis."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes of ``tree``'s arrays that each device holds, measured from the live shards."""
    held: dict[int, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return dict(held)


def max_bytes_per_device(tree: Any) -> int:
    """The most any one device holds of ``tree`` (what decides whether it fits)."""
    return max(bytes_per_device(tree).values(), default=0)


def xla_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes XLA planned for the compiled step."""
    m = compiled.memory_analysis()
    if m is None:  # some backends do not report
        return {}
    return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes),
            "generated_code": int(m.generated_code_size_in_bytes)}
