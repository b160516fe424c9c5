"""The grouped matmul of dropless experts (``jaxshard.parallel.grouped``) against
``jax.lax.ragged_dot`` on random rows and group sizes (empty groups, rows past the groups),
values and gradients; the rows it computes, from the loop it ran; and why it exists: XLA:CPU
runs ``jax.lax.ragged_dot`` as every row times every group's matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshard.analysis import hlo
from jaxshard.parallel import grouped

R, D, F, G = 50, 6, 5, 4


def _inputs(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(R, D)), dtype)
    w = jnp.asarray(rng.normal(size=(G, D, F)), dtype)
    return x, w


@pytest.mark.parametrize("sizes", [[10, 0, 17, 13], [0, 0, 0, 0], [50, 0, 0, 0], [3, 3, 3, 3], [12, 12, 13, 13]])
@pytest.mark.parametrize("tile", [2, 8])
def test_grouped_matmul_equals_ragged_dot_with_gradients(sizes, tile):
    x, w = _inputs(sum(sizes) + tile)
    s = jnp.asarray(sizes, jnp.int32)
    y, rows = jax.jit(lambda x, w: grouped.matmul(x, w, s, tile=tile))(x, w)
    np.testing.assert_allclose(y, jax.lax.ragged_dot(x, w, s), rtol=1e-5, atol=1e-5)
    # The rows computed: each group's in whole tiles, read from the loop's count.
    assert int(rows) == sum(-(-n // tile) * tile for n in sizes)
    probe = jnp.asarray(np.random.default_rng(1).normal(size=(R, F)), jnp.float32)
    ours = jax.jit(jax.grad(lambda x, w: jnp.sum(probe * grouped.matmul(x, w, s, tile=tile)[0]), (0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(probe * jax.lax.ragged_dot(x, w, s)), (0, 1))(x, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bfloat16_rows_accumulate_in_float32():
    x, w = _inputs(0, jnp.bfloat16)
    s = jnp.asarray([20, 10, 0, 20], jnp.int32)
    y, _ = grouped.matmul(x, w, s, tile=4)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), s)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2)


def test_tiles_pad_at_most_a_sixteenth_of_even_groups():
    for rows in (16, 100, 512, 5000):
        m = grouped.tile_rows(rows)
        assert 2 <= m <= 128 and (m == 2 or m <= rows / 16)
    assert grouped.tile_rows(10**6) == 128


def test_compiled_matmul_flops_of_the_tiles_and_of_xla_cpus_ragged_dot():
    """Per loop iteration one tile's matmul (the sizes an argument: with constant ones XLA
    knows the trip count, and counts the loop as any other); XLA:CPU's ragged_dot: G times
    the dense matmul."""
    x, w = _inputs(0)
    s = jnp.asarray([10, 0, 17, 13], jnp.int32)
    ours = jax.jit(lambda x, w, s: grouped.matmul(x, w, s, tile=8)[0]).lower(x, w, s).compile().as_text()
    assert hlo.dot_flops(ours) == 0 and hlo.loop_dot_flops(ours) == 2 * 8 * D * F
    known = jax.jit(lambda x, w: grouped.matmul(x, w, s, tile=8)[0]).lower(x, w).compile().as_text()
    assert hlo.dot_flops(known) == 2 * 8 * D * F * (2 + 3 + 2) and hlo.loop_dot_flops(known) == 0
    theirs = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)).lower(x, w, s).compile().as_text()
    assert hlo.dot_flops(theirs) == 2 * R * D * F * G and hlo.loop_dot_flops(theirs) == 0
