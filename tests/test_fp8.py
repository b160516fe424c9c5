"""Float8 recipes (jaxshard.fp8) against a numpy reference built on ml_dtypes' float8 types:
saturating casts, amaxes and scales, the delayed history and its recovery from an overflow, and
the scaled matmul's forward and backward passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxshard import fp8

NP = {fp8.E4M3: ml_dtypes.float8_e4m3fn, fp8.E5M2: ml_dtypes.float8_e5m2}
MAX = {fp8.E4M3: 448.0, fp8.E5M2: 57344.0}


def np_quantize(x, scale, dtype):
    return np.clip(np.asarray(x, np.float32) * scale, -MAX[dtype], MAX[dtype]).astype(NP[dtype])


def np_scale(x, dtype, axis=None):
    a = np.max(np.abs(np.asarray(x, np.float64)), axis=axis, keepdims=axis is not None)
    return np.where(a > 0, MAX[dtype] / np.where(a > 0, a, 1), 1.0).astype(np.float32)


def np_matmul(a, b, a_dtype, b_dtype, rowwise):
    """The reference: quantise each operand (rowwise along the contraction, the scales rounded
    down to powers of two), multiply exactly (float64) and divide by the scales."""
    sa = np_scale(a, a_dtype, 1 if rowwise else None)
    sb = np_scale(b, b_dtype, 0 if rowwise else None)
    if rowwise:
        sa, sb = (np.float32(2.0) ** np.floor(np.log2(s)) for s in (sa, sb))
    qa = np_quantize(a, sa, a_dtype).astype(np.float64)
    qb = np_quantize(b, sb, b_dtype).astype(np.float64)
    return (qa @ qb) / (sa.astype(np.float64) * sb.astype(np.float64))


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_the_formats_largest_values(dtype):
    assert fp8.fp8_max(dtype) == MAX[dtype] == float(ml_dtypes.finfo(NP[dtype]).max)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_saturates_and_rounds_as_the_reference(dtype):
    """Bit for bit the reference's cast, values beyond the range (a plain e4m3fn cast gives NaN)
    held at the largest finite value."""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 50
    x[:4] = [1e9, -1e9, 3e5, -7e4]
    scale = np.float32(3.0)
    got = np.asarray(fp8.quantize(jnp.asarray(x), scale, dtype))
    want = np_quantize(x, scale, dtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.isfinite(got.astype(np.float32)).all()
    assert got[0].astype(np.float32) == MAX[dtype] and got[1].astype(np.float32) == -MAX[dtype]
    back = np.asarray(fp8.dequantize(jnp.asarray(got), scale))
    inside = np.abs(x * scale) <= MAX[dtype]  # the rest saturated
    assert inside.sum() > 3000 and (~inside).sum() >= 4
    assert np.allclose(back[inside], x[inside], rtol=2 ** -(3 if dtype == fp8.E4M3 else 2), atol=1e-6)


def test_scales_from_amaxes_tensorwise_rowwise_and_the_degenerate_ones():
    x = np.random.default_rng(1).standard_normal((6, 10)).astype(np.float32)
    x[2] *= 1000  # an outlier row
    tensor = fp8.scale_from_amax(fp8.amax(jnp.asarray(x)), fp8.E4M3)
    assert np.allclose(tensor, np_scale(x, fp8.E4M3), rtol=1e-6)
    rows = fp8.scale_from_amax(fp8.amax(jnp.asarray(x), axis=1), fp8.E4M3)
    assert rows.shape == (6, 1) and np.allclose(rows, np_scale(x, fp8.E4M3, axis=1), rtol=1e-6)
    assert rows[2, 0] < rows[0, 0] / 100  # only the outlier's own row loses its range
    assert float(fp8.scale_from_amax(0.0, fp8.E4M3)) == 1.0
    assert float(fp8.scale_from_amax(jnp.inf, fp8.E4M3, fallback=7.0)) == 7.0
    assert float(fp8.scale_from_amax(jnp.nan, fp8.E5M2, fallback=2.0)) == 2.0


def test_delayed_scaling_keeps_a_history_and_recovers_from_an_overflow():
    """The history rolls (newest first); the scale comes from its largest finite amax. A step
    whose tensor outgrows the scale saturates; the next step's scale, from a history holding
    that amax, quantises the same tensor without saturating. An amax of inf (a step that
    overflowed) keeps the previous scale."""
    H = 4
    history, scale = jnp.zeros(H), jnp.float32(1.0)
    rng = np.random.default_rng(2)
    reference = np.zeros(H)
    for magnitude in (1, 3, 2, 0.5, 4, 1, 0.25):  # rising and falling: the newest is not always the largest
        x = rng.standard_normal(256).astype(np.float32) * magnitude
        scale = fp8.delayed_scale(history, scale, fp8.E4M3)  # from the steps before this one
        finite = reference[np.isfinite(reference)]
        want = MAX[fp8.E4M3] / finite.max() if finite.size and finite.max() > 0 else float(scale)
        assert float(scale) == pytest.approx(want, rel=1e-6)
        history = fp8.update_history(history, fp8.amax(jnp.asarray(x)))
        reference = np.concatenate([[np.abs(x).max()], reference[:-1]])
        assert np.allclose(history, reference, rtol=1e-6)

    # A planted overflow: the tensor jumps 1000x past what the history has seen.
    big = (rng.standard_normal(256) * 1000).astype(np.float32)
    big[0] = 5000.0
    scale = fp8.delayed_scale(history, scale, fp8.E4M3)
    q = np.asarray(fp8.quantize(jnp.asarray(big), scale, fp8.E4M3)).astype(np.float32)
    assert (np.abs(q) == MAX[fp8.E4M3]).mean() > 0.5  # this step saturates
    history = fp8.update_history(history, fp8.amax(jnp.asarray(big)))
    scale = fp8.delayed_scale(history, scale, fp8.E4M3)
    q = np.asarray(fp8.quantize(jnp.asarray(big), scale, fp8.E4M3)).astype(np.float32)
    assert (np.abs(q) == MAX[fp8.E4M3]).sum() == 1  # recovered: only the amax itself sits at the top
    assert np.allclose(np.asarray(fp8.dequantize(jnp.asarray(q).astype(fp8.E4M3), scale)), big, rtol=0.07)

    # inf in the history (a gradient that overflowed): the largest finite amax still sets it,
    # and a history of nothing finite keeps the previous scale.
    inf_history = fp8.update_history(history, jnp.inf)
    assert float(fp8.delayed_scale(inf_history, scale, fp8.E4M3)) == pytest.approx(float(scale))
    assert float(fp8.delayed_scale(jnp.full(H, jnp.inf), jnp.float32(3.0), fp8.E4M3)) == 3.0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_scaled_matmul_and_its_float8_gradients_match_the_reference(recipe):
    """Forward in e4m3 x e4m3; backward, the input gradient g w^T (e5m2 x e4m3) and the weight
    gradient x^T g (e4m3 x e5m2) -- rowwise: the gradient in e4m3, each operand quantised along
    its own contraction with a power-of-two scale: against the numpy reference to float32
    rounding."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    x[0, 3] *= 40  # an outlier token
    w = (rng.standard_normal((32, 16)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((2, 8, 16)) * 1e-3).astype(np.float32)
    rowwise = recipe == "rowwise"
    grad = fp8.E4M3 if rowwise else fp8.E5M2

    y, pull = jax.vjp(lambda a, b: fp8.fp8_matmul(a, b, recipe), jnp.asarray(x), jnp.asarray(w))
    dx, dw = pull(jnp.asarray(g))
    x2, g2 = x.reshape(-1, 32), g.reshape(-1, 16)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), np_matmul(x2, w, fp8.E4M3, fp8.E4M3, rowwise),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx).reshape(-1, 32), np_matmul(g2, w.T, grad, fp8.E4M3, rowwise),
                               rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dw), np_matmul(x2.T, g2, fp8.E4M3, grad, rowwise),
                               rtol=1e-5, atol=1e-9)
    # And close to the exact matmul: 3 mantissa bits, errors that average out over K.
    exact = x2 @ w
    assert np.linalg.norm(np.asarray(y).reshape(-1, 16) - exact) <= 0.05 * np.linalg.norm(exact)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_layer_contracting_two_dims_gets_the_reference_weight_gradient(recipe):
    """``dense`` over two contracted dims (the attention output: ``[heads, head_dim]``): its
    weight gradient, made with the weight's own dims kept (rowwise: each (head, dim) row its
    own scale), is the 2-D reference's reshaped."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 8, 4, 8)).astype(np.float32)
    x[1, 2, 3] *= 30  # one head of one token an outlier
    w = (rng.standard_normal((4, 8, 16)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((2, 8, 16)) * 1e-3).astype(np.float32)
    rowwise = recipe == "rowwise"
    grad = fp8.E4M3 if rowwise else fp8.E5M2
    _, pull = jax.vjp(lambda a, b: fp8.dense(a, b, 2, recipe), jnp.asarray(x), jnp.asarray(w))
    _, dw = pull(jnp.asarray(g))
    want = np_matmul(x.reshape(-1, 32).T, g.reshape(-1, 16), fp8.E4M3, grad, rowwise).reshape(4, 8, 16)
    np.testing.assert_allclose(np.asarray(dw), want, rtol=1e-5, atol=1e-9)


def test_rowwise_scaling_keeps_the_precision_an_outlier_takes_from_tensorwise():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[7] *= 1e6  # one token's activations a million times the others'
    w = rng.standard_normal((128, 32)).astype(np.float32)
    exact = x @ w
    error = {r: np.linalg.norm(np.delete(np.asarray(fp8.fp8_matmul(jnp.asarray(x), jnp.asarray(w), r)) - exact, 7, 0))
             for r in ("tensorwise", "rowwise")}
    assert error["rowwise"] < error["tensorwise"] / 10, error


def test_bf16_in_bf16_out_and_a_bad_recipe_is_one_line():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 2), jnp.bfloat16)
    y = fp8.fp8_matmul(x, w, "tensorwise")
    assert y.dtype == jnp.bfloat16 and np.allclose(np.asarray(y, np.float32), 8.0)
    dx, dw = jax.grad(lambda a, b: fp8.fp8_matmul(a, b, "rowwise").astype(jnp.float32).sum(), (0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16 and np.allclose(np.asarray(dw, np.float32), 4.0)
    with pytest.raises(ValueError, match="^fp8_matmul takes a dynamic recipe, tensorwise or rowwise, not 'delayed'$"):
        fp8.fp8_matmul(x, w, "delayed")


def np_delayed_step(x, w, g, meta):
    """One step of the delayed recipe in numpy: y, dx, dw with the given scales, and the next
    meta (rows x, w, g: the amax history, newest first, then the scale)."""
    def q(a, s, dtype):
        return np_quantize(a, s, dtype).astype(np.float64) / np.float64(s)

    meta = np.asarray(meta)
    xs, ws, gs = (float(s) for s in meta[:, -1])
    y = q(x, xs, fp8.E4M3) @ q(w, ws, fp8.E4M3)
    dx = q(g, gs, fp8.E5M2) @ q(w, ws, fp8.E4M3).T
    dw = q(x, xs, fp8.E4M3).T @ q(g, gs, fp8.E5M2)
    new = np.zeros_like(meta)
    for row, (a, dtype) in enumerate(((x, fp8.E4M3), (w, fp8.E4M3), (g, fp8.E5M2))):
        history = np.concatenate([[np.abs(a).max()], meta[row, :-2]])
        new[row, :-1] = history
        new[row, -1] = MAX[dtype] / history.max() if history.max() > 0 else meta[row, -1]
    return y, dx, dw, new


def test_the_delayed_matmul_quantises_with_past_scales_and_returns_the_next_meta():
    """Five steps against the numpy reference: the forward and both gradients use the scales
    of the steps before, the meta's 'gradient' is the next meta (histories rolled, scales from
    their largest amax). A planted overflow -- the input jumping 1,000x -- saturates its step;
    the same input the next step, scaled from a history that holds its amax, is accurate again."""
    rng = np.random.default_rng(5)
    meta = fp8.delayed_init(history=3)
    assert meta.shape == (3, 4) and np.all(np.asarray(meta)[:, -1] == 1) and not np.asarray(meta)[:, :-1].any()
    w = (rng.standard_normal((16, 8)) * 0.2).astype(np.float32)

    @jax.jit
    def step(x, w, m, g):
        y, pull = jax.vjp(lambda x, w, m: fp8.delayed_dense(x, w, m, 1), x, w, m)
        return y, pull(g)

    errors = []
    big = (rng.standard_normal((4, 16)) * 1000).astype(np.float32)
    for x in [(rng.standard_normal((4, 16)) * m).astype(np.float32) for m in (1.0, 0.8, 0.5)] + [big, big]:
        g = (rng.standard_normal((4, 8)) * 1e-2).astype(np.float32)
        y, (dx, dw, new) = step(jnp.asarray(x), jnp.asarray(w), meta, jnp.asarray(g))
        y_ref, dx_ref, dw_ref, new_ref = np_delayed_step(x, w, g, meta)
        np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(np.asarray(new), new_ref, rtol=1e-6)
        errors.append(np.linalg.norm(np.asarray(y) - x @ w) / np.linalg.norm(x @ w))
        meta = new
    assert max(errors[:3]) < 0.1 and errors[3] > 0.5 and errors[4] < 0.1, errors  # the overflow, then recovered
    with pytest.raises(ValueError, match="^an amax history needs at least 1 entry, got 0$"):
        fp8.delayed_init(history=0)


def test_the_float8_benchmark_runs_and_says_what_each_dot_became(tmp_path, capsys):
    """scripts/bench_fp8.py shrunk, on CPU (where XLA upcasts float8 dots: it times nothing a
    GPU would); a bad shape is one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import bench_fp8

    assert bench_fp8.main(["--shapes", "64x32x16", "--reps", "1", "--json", str(tmp_path / "f8.json")]) == 0
    runs = json.loads((tmp_path / "f8.json").read_text())["shapes"][0]["runs"]
    assert set(runs) == {"bf16", "fp8 tensorwise", "fp8 rowwise", "float8 dot alone"}
    assert all(r["fwd_s"] > 0 and r["lowered"] for r in runs.values())
    assert "| 64 x 32 x 16 | fp8 rowwise |" in capsys.readouterr().out
    done = subprocess.run([sys.executable, str(root / "scripts" / "bench_fp8.py"), "--shapes", "12x3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "--shapes takes MxKxN with positive integers, e.g. 16384x4096x14336; got 12x3")


def assert_split_equals_whole(split, recipe, x, w, g, rtol):
    """``split(x, w)`` -- ``dense`` in a manual region -- gives the output and both gradients
    (for the output gradient ``g``) of the one-device float8 matmul of ``recipe``."""
    whole = lambda x, w: fp8.dense(x, w, 1, recipe)  # noqa: E731
    got, want = (jax.jit(lambda x, w, fn=fn: jax.vjp(fn, x, w)[1](g) + (fn(x, w),))(x, w) for fn in (split, whole))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-9)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_column_parallel_float8_matmul_scales_by_the_whole_tensor(recipe):
    """``dense`` in a region manual over ``tensor`` whose two devices each hold half of w's
    columns (one half 10x the other, the output gradient's halves 100x apart): the output and
    both gradients equal the one-device float8 matmul's, because the amaxes the split cuts --
    w's and the gradient's whole-tensor ones, and the input gradient's rows along N -- are
    maxed over ``tensor``. A shard's own amax would give the small half another scale."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((16, 32)).astype(np.float32))
    w = rng.standard_normal((32, 8)).astype(np.float32)
    w[:, :4] *= 10
    g = rng.standard_normal((16, 8)).astype(np.float32) * 1e-3
    g[:, 4:] *= 100
    w, g = jnp.asarray(w), jnp.asarray(g)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))

    def split(x, w):
        # (x marked varying, as jaxshard.parallel.tensor.column_parallel does: its gradient's
        # partial sums are then all-reduced on the way out)
        local = lambda x, w: fp8.dense(jax.lax.pcast(x, ("tensor",), to="varying"), w, 1, recipe, ("tensor",))  # noqa: E731
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(P(), P(None, "tensor")), out_specs=P(None, "tensor"))(x, w)

    assert_split_equals_whole(split, recipe, x, w, g, rtol=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_row_split_float8_matmul_scales_by_the_whole_tensor(recipe):
    """``dense`` in a region manual over ``data`` whose two devices each hold half of the
    tokens (x's halves 10x apart, the output gradient's 100x), w whole on each (a pipeline's
    replicas, as the executor runs them): the output and both gradients equal the one-device
    float8 matmul's, because the amaxes the split cuts -- x's and the gradient's whole-tensor
    ones, and the weight gradient's rows along the tokens -- are maxed over ``data``."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(12)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    x[:8] *= 10
    g = rng.standard_normal((16, 8)).astype(np.float32) * 1e-3
    g[8:] *= 100
    x, g = jnp.asarray(x), jnp.asarray(g)
    w = jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32))
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def split(x, w):
        # (w marked varying: its gradient's partial sums are then all-reduced on the way out)
        local = lambda x, w: fp8.dense(x, jax.lax.pcast(w, ("data",), to="varying"), 1, recipe, rows=("data",))  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data", None), P()), out_specs=P("data", None))(x, w)

    assert_split_equals_whole(split, recipe, x, w, g, rtol=1e-5)  # (w's gradient's partial sums in another order)
