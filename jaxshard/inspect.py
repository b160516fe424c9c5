"""What each device holds and sends: live array shards, the compiled step's memory analysis,
and the collectives XLA inserted into it."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import jax

from jaxshard import hlo


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


def saved_residual_bytes(program: Any, batch_size: int, seq_len: int) -> int:
    """Bytes per device that the forward pass saves for the backward pass (activations under
    the remat policy, and what else autodiff keeps), from the shardings XLA gives them."""

    def residuals(params, batch):
        return jax.vjp(lambda p: program.loss(p, batch, None)[0], params)[1]

    abstract = program.layout.abstract.params
    compiled = jax.jit(residuals, in_shardings=(program.layout.shardings.params, program.batch_sharding)) \
        .lower(abstract, program.abstract_batch(batch_size, seq_len)).compile()
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(compiled.out_info), jax.tree.leaves(compiled.output_shardings)))


def compiled_collectives(compiled: jax.stages.Compiled, mesh: jax.sharding.Mesh) -> list[hlo.Collective]:
    """The collectives of a compiled step, with the mesh axes each one spans."""
    return hlo.attribute(hlo.parse(compiled.as_text()), tuple(mesh.axis_names),
                         tuple(mesh.devices.shape))
