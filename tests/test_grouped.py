"""Dropless experts on their routed rows (``jaxshard.parallel.grouped``): the tiled CPU kernel
against the ``jax.lax.ragged_dot`` path the GPUs run and a numpy loop over the rows, values
and gradients (tokens, gates, weights, biases), SwiGLU and GELU with biases, empty experts and
rows past the experts' sum; the rows computed, from the loop the kernel ran; and why the
kernel exists: XLA:CPU runs ``ragged_dot`` as every row times every group's matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshard.analysis import hlo
from jaxshard.errors import ConfigError
from jaxshard.parallel import grouped
from models.moe import _gelu_act, _swiglu_act

N, D, F, G = 30, 6, 5, 4


def _case(sizes, family, seed=0, dtype=jnp.float32):
    """Tokens, rows (sorted by expert, 7 junk rows after the sizes' sum), gates, weights."""
    rng = np.random.default_rng(seed)
    R = sum(sizes) + 7
    group = np.minimum(np.repeat(np.arange(G + 1), sizes + [7]), G - 1)
    token = rng.integers(0, N, R)
    gate = np.where(np.arange(R) < sum(sizes), rng.uniform(size=R), 0)
    w = {"w_in": rng.normal(size=(G, D, F)), "w_out": rng.normal(size=(G, F, D))}
    if family == "swiglu":
        w["w_gate"] = rng.normal(size=(G, D, F))
    else:
        w |= {"b_in": rng.normal(size=(G, F)), "b_out": rng.normal(size=(G, D))}
    as_jax = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (as_jax(rng.normal(size=(N, D))), jnp.asarray(token, jnp.int32), jnp.asarray(gate, jnp.float32),
            jnp.asarray(group, jnp.int32), jnp.asarray(sizes, jnp.int32), {k: as_jax(v) for k, v in w.items()})


def _numpy(x, token, gate, group, sizes, w, family):
    out = np.zeros(x.shape)
    for r in range(int(np.sum(sizes))):
        e, xr = int(group[r]), np.asarray(x[token[r]], np.float64)
        up = xr @ np.asarray(w["w_in"][e], np.float64)
        if family == "swiglu":
            g = xr @ np.asarray(w["w_gate"][e], np.float64)
            h = g / (1 + np.exp(-g)) * up
        else:
            up = up + np.asarray(w["b_in"][e])
            h = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
        y = h @ np.asarray(w["w_out"][e], np.float64) + (np.asarray(w["b_out"][e]) if "b_out" in w else 0)
        out[token[r]] += gate[r] * y
    return out


def _run(kernel, case, family, tile):
    x, token, gate, group, sizes, w = case
    act = _swiglu_act if family == "swiglu" else _gelu_act

    def loss(x, gate, w):
        with grouped.kernel(kernel):
            out, rows = grouped.experts(x, token, gate, group, sizes, w, act, lead=jnp.float32(1), tile=tile)
        return jnp.sum(jnp.sin(out)), (out, rows)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(x, gate, w)


@pytest.mark.parametrize("sizes", [[10, 0, 17, 13], [0, 0, 0, 0], [40, 0, 0, 0], [3, 3, 3, 3]])
@pytest.mark.parametrize("family", ["swiglu", "gelu"])
def test_tiled_experts_equal_ragged_dot_and_a_numpy_loop_with_gradients(sizes, family):
    case = _case(sizes, family)
    (_, (out, rows)), grads = _run("tiled", case, family, tile=4)
    (_, (ref, _)), ref_grads = _run("ragged", case, family, tile=4)
    np.testing.assert_allclose(out, _numpy(*case, family), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        # (rounding of sums of products of about 25: absolute to the array's scale; which
        # elements land near zero, and so fail a pure relative test, varies by CPU)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    # The rows computed: each expert's in whole tiles, read from the loop's count.
    assert int(rows) == sum(-(-n // 4) * 4 for n in sizes)


def _eqns(jaxpr) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters (loop
    bodies, branches, custom rules), depth first."""
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = sub.jaxpr if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns") else sub
                if hasattr(sub, "eqns"):
                    out += _eqns(sub)
    return out


def test_bfloat16_tiles_accumulate_in_float32():
    """A tile's matmuls (forward and backward) accumulate in float32 whatever their inputs, and
    the backward loops add each tile's weight gradients into float32 accumulators. (The
    contraction here is too short for bfloat16 sums to show in the values: the jaxpr says.)"""
    case = _case([12, 9, 0, 11], "swiglu", dtype=jnp.bfloat16)
    (_, (out, _)), _ = _run("tiled", case, "swiglu", tile=4)
    assert out.dtype == jnp.bfloat16
    want = _numpy(*case, "swiglu")
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=5e-2, atol=5e-2 * np.abs(want).max())
    x, token, gate, group, sizes, w = case

    def loss(x, gate, w):
        with grouped.kernel("tiled"):
            y = grouped.experts(x, token, gate, group, sizes, w, _swiglu_act, lead=jnp.float32(1), tile=4)[0]
        return jnp.sum(y.astype(jnp.float32))

    eqns = _eqns(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, gate, w).jaxpr)
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert any(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert dots and all(e.params["preferred_element_type"] == jnp.float32 for e in dots)
    weight_sums = [v.aval for e in eqns if e.primitive.name == "while" for v in e.outvars
                   if v.aval.shape in ((G, D, F), (G, F, D))]
    assert weight_sums and all(a.dtype == jnp.float32 for a in weight_sums)


def test_the_backward_loops_run_the_tiles_the_forward_counted(monkeypatch):
    """The rows a step reports (``moe_computed``, which the waste figure scales every tile loop
    by) come from the forward's loop: each backward loop, run on its own, covers the same tiles."""
    case = _case([10, 0, 17, 13], "swiglu")
    runs, loops = [], grouped._loops

    def counted(tilings, body, init):
        carry, rows = loops(tilings, body, init)
        jax.debug.callback(lambda r: runs.append(int(r)), rows)
        return carry, rows

    monkeypatch.setattr(grouped, "_loops", counted)
    (_, (_, rows)), _ = _run("tiled", case, "swiglu", tile=4)
    jax.effects_barrier()
    assert len(runs) == 4 and set(runs) == {int(rows)}, (runs, int(rows))  # 2 forward, 2 backward


def test_tiles_are_the_largest_power_of_two_padding_at_most_a_sixteenth_of_even_groups():
    for rows in range(1, 5000):
        m = grouped.tile_rows(rows)
        assert m == max(c for c in (2, 4, 8, 16, 32, 64, 128) if c == 2 or c <= rows / 16), rows
        if m > 2:  # even groups of ``rows``: padded to whole tiles
            assert -(-rows // m) * m - rows <= rows / 16
    assert grouped.tile_rows(10**6) == 128


@pytest.mark.parametrize("sizes", [[10, 0, 17, 13], [70, 1, 0, 33], [0, 0, 0, 0], [64, 64, 64, 64]])
def test_tiles_cover_each_groups_rows_once_in_few_large_tiles(sizes):
    """Each group's rows in tiles of 8m as many as fit, then at most one of 4m and of 2m, then
    tiles of m (the last one padded): every row in one tile, tiles within their group but the
    last m-tile's padding, and as few tiles as that allows."""
    m, R = 4, sum(sizes) + 7
    tilings = grouped._tilings(jnp.asarray(sizes, jnp.int32), m, R)
    assert [t.m for t in tilings] == list(grouped.tile_sizes(m, R)) and grouped.tile_sizes(m) == (32, 16, 8, 4)
    starts = np.cumsum([0] + sizes)
    covered = np.zeros(R + m, int)
    count = 0
    for tiles in tilings:
        for t in range(int(tiles.count)):
            g, first = int(tiles.group[t]), int(tiles.first[t])
            rows = np.arange(first, first + tiles.m)
            covered[rows[rows < starts[g + 1]]] += 1
            assert first >= starts[g] and (rows[-1] < starts[g + 1] or tiles.m == m), (tiles.m, g, first)
            count += 1
    assert (covered[:sum(sizes)] == 1).all() and not covered[sum(sizes):].any()
    assert count == sum(n // 32 + (n % 32) // 16 + (n % 16) // 8 + -(-(n % 8) // 4) for n in sizes)


def test_compiled_matmul_flops_of_the_tiles_and_of_xla_cpus_ragged_dot():
    """Per loop iteration one tile's three matmuls forward, one loop a tile size (of 8 rows,
    16 and 32: no tile of 64 fits the 47 rows); XLA:CPU's ragged_dot computes each of them for
    every row and every expert."""
    x, token, gate, group, sizes, w = _case([10, 0, 17, 13], "swiglu")

    def compiled(kernel):
        def f(x, gate, sizes):
            with grouped.kernel(kernel):
                return grouped.experts(x, token, gate, group, sizes, w, _swiglu_act, lead=jnp.float32(1), tile=8)[0]
        return jax.jit(f).lower(x, gate, sizes).compile().as_text()

    ours = compiled("tiled")
    assert grouped.tile_sizes(8, token.shape[0]) == (32, 16, 8)
    assert hlo.dot_flops(ours) == 0 and hlo.loop_dot_flops(ours) == 3 * 2 * (32 + 16 + 8) * D * F
    theirs = compiled("ragged")
    assert hlo.dot_flops(theirs) == 3 * 2 * token.shape[0] * D * F * G and hlo.loop_dot_flops(theirs) == 0


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="grouped kernel must be tiled, ragged, triton or auto, got 'cuda'"):
        with grouped.kernel("cuda"):
            pass
    with pytest.raises(ConfigError, match="--moe-kernel triton runs on GPUs only, not on cpu"):
        with grouped.kernel("triton"):
            pass
