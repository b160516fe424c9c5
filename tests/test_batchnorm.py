"""BatchNorm under data parallelism on 8 fake devices, against one device and numpy.

Synchronised statistics (SyncBatchNorm) train exactly like one device; per-device statistics
(PyTorch DDP's BatchNorm) are each device's slice's own, and so train differently.
"""

import functools
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from conftest import ROOT
from jaxshard.errors import ConfigError
from jaxshard.mechanics import batchnorm as bn
from jaxshard.mesh import build_mesh
from jaxshard.training.checkpoint import CheckpointConfig, Checkpointer, param_shapes
from models.cnn import CNN, CNNConfig, SyntheticImages

RTOL = 1e-5
STEPS, BATCH, N = 3, 32, 8
TX = optax.sgd(0.1, momentum=0.9)
DATA = SyntheticImages(0)


def model(sync: bn.Sync) -> CNN:
    return CNN(CNNConfig(bn=bn.BatchNormConfig(sync=sync)))


@functools.cache
def mesh(n: int):
    return build_mesh(f"data={n}", jax.devices()[:n])


def init(sync: bn.Sync):
    return model(sync).init(jax.random.key(0))


@functools.cache
def run(n: int, sync: bn.Sync):
    """STEPS steps on ``n`` devices: the losses and the final state, on the host."""
    losses, state = bn.train(model(sync).loss, *init(sync), TX, mesh(n), DATA.batches(STEPS, BATCH))
    return losses, jax.device_get(state)


def forward(n: int, sync: bn.Sync, params, stats, images, train: bool):
    """Logits and the statistics after the batch, the batch split over ``n`` devices."""
    m = model(sync)
    fn = bn.over_batch(lambda shared, x: m.apply(*shared, x, train=train), mesh(n))
    logits, stats = jax.jit(fn)((params, stats), images)
    return np.asarray(logits), jax.device_get(stats)


def max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_trees_close(actual, expected, rtol=RTOL, atol=1e-6):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_images_are_a_function_of_the_seed():
    a, b = SyntheticImages(0).batch(3, 8), SyntheticImages(0).batch(3, 8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.allclose(SyntheticImages(1).batch(3, 8)["images"], a["images"])
    assert not np.allclose(SyntheticImages(0).batch(4, 8)["images"], a["images"])
    held_out = SyntheticImages(0).held_out(8)
    assert held_out["images"].shape == (8, 16, 16, 3) and held_out["labels"].dtype == np.int32
    assert not np.allclose(held_out["images"], a["images"])


# ---- the statistics kernel --------------------------------------------------------------------
def test_moments_per_device_and_global_match_numpy():
    """Per slice for DEVICE, of the whole batch for GLOBAL, in float64 -- with the values offset
    by 1000 from a unit spread, where a one-pass E[x^2] - mean^2 in float32 is off by percents."""
    rng = np.random.default_rng(0)
    x = (1000 + rng.standard_normal((N * 4, 3, 3, 5)) * rng.uniform(0.5, 2, 5)).astype(np.float32)

    def stats(sync):
        def per_shard(_, rows):
            m = bn.moments(rows, sync)
            return (m.mean[None], m.var[None]), (m.count,) if sync is bn.Sync.GLOBAL else ()
        return jax.jit(bn.over_batch(per_shard, mesh(N)))((), x)

    slices = x.astype(np.float64).reshape(N, -1, 5)
    (mean_dev, var_dev), _ = stats(bn.Sync.DEVICE)
    np.testing.assert_allclose(mean_dev, slices.mean(1), rtol=1e-6)
    np.testing.assert_allclose(var_dev, slices.var(1), rtol=1e-3)
    (mean_glob, var_glob), (count,) = stats(bn.Sync.GLOBAL)
    whole = slices.reshape(-1, 5)
    assert int(count) == whole.shape[0]
    for k in range(N):  # every device holds the whole batch's statistics
        np.testing.assert_allclose(mean_glob[k], whole.mean(0), rtol=1e-6)
        np.testing.assert_allclose(var_glob[k], whole.var(0), rtol=1e-3)
    # the slices' statistics really differ from the whole batch's, beyond the tolerances above
    assert np.abs(slices.var(1) / whole.var(0) - 1).max() > 1e-2
    one_pass = (np.square(x).reshape(-1, 5).sum(0, dtype=np.float32) / whole.shape[0]
                - np.square(whole.mean(0).astype(np.float32)))
    assert np.abs(one_pass / whole.var(0) - 1).max() > 1e-2  # what the two passes avoid
    # outside a region: the plain statistics, in either mode
    for sync in bn.Sync:
        m = jax.jit(lambda v: bn.moments(v, sync))(x)
        np.testing.assert_allclose(m.var, whole.var(0), rtol=1e-3)
        assert m.count == whole.shape[0]


def test_config_is_validated():
    with pytest.raises(ConfigError, match="sync must be one of device, global"):
        bn.BatchNormConfig(sync="local")
    with pytest.raises(ConfigError, match="momentum must be in"):
        bn.BatchNormConfig(momentum=1.5)
    with pytest.raises(ConfigError, match="not divisible by the batch axes"):
        bn.check_batch(mesh(N), 12)


# ---- synchronised: one device's numbers ---------------------------------------------------------
def test_sync_forward_matches_one_device():
    params, stats = init(bn.Sync.GLOBAL)
    images = DATA.batch(0, BATCH)["images"]
    logits, new_stats = forward(N, bn.Sync.GLOBAL, params, stats, images, train=True)
    ref_logits, ref_stats = forward(1, bn.Sync.GLOBAL, params, stats, images, train=True)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=1e-6)
    assert_trees_close(new_stats, ref_stats)
    assert max_diff(new_stats, stats) > 1e-2  # the running statistics moved


def test_sync_training_matches_one_device():
    ref_losses, ref_state = run(1, bn.Sync.GLOBAL)
    losses, state = run(N, bn.Sync.GLOBAL)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_trees_close(state.params, ref_state.params)
    assert_trees_close(state.stats, ref_state.stats)
    assert int(state.step) == STEPS
    assert max_diff(state.params, init(bn.Sync.GLOBAL)[0]) > 1e-2  # it trained


# ---- per device: each device's own rows -----------------------------------------------------------
def test_per_device_forward_is_each_slice_on_its_own():
    params, stats = init(bn.Sync.DEVICE)
    images = DATA.batch(0, BATCH)["images"]
    logits, new_stats = forward(N, bn.Sync.DEVICE, params, stats, images, train=True)
    rows = BATCH // N
    for k in range(N):
        rows_k = images[k * rows:(k + 1) * rows]
        alone, alone_stats = forward(1, bn.Sync.DEVICE, params, stats, rows_k, train=True)
        np.testing.assert_allclose(logits[k * rows:(k + 1) * rows], alone, rtol=RTOL, atol=1e-6)
        if k == 0:  # the running statistics are the first shard's (DDP broadcasts rank 0's buffers)
            assert_trees_close(new_stats, alone_stats)
    # ... which for the first layer are numpy's of the first slice's convolution, the variance
    # unbiased (PyTorch's running_var), with momentum 0.1 from mean 0 and variance 1
    conv = np.asarray(jax.lax.conv_general_dilated(
        images[:rows], params["conv0"]["w_HWIO"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=jax.lax.Precision.HIGHEST), np.float64).reshape(-1, params["conv0"]["w_HWIO"].shape[-1])
    np.testing.assert_allclose(new_stats["conv0"]["mean"], 0.1 * conv.mean(0), rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(new_stats["conv0"]["var"], 0.9 + 0.1 * conv.var(0, ddof=1), rtol=RTOL)
    whole, whole_stats = forward(1, bn.Sync.GLOBAL, params, stats, images, train=True)
    threshold = 100 * RTOL * np.abs(whole).max()
    assert np.abs(logits - whole).max() > threshold, (np.abs(logits - whole).max(), threshold)
    assert max_diff(new_stats, whole_stats) > 1e-3


def test_per_device_training_differs_from_one_device():
    ref_losses, ref_state = run(1, bn.Sync.GLOBAL)
    losses, state = run(N, bn.Sync.DEVICE)
    # The first loss is of the same params on the same batch: only the statistics differ.
    first = abs(losses[0] - ref_losses[0]) / ref_losses[0]
    assert first > 1e-3, first
    assert np.abs(losses - ref_losses).max() > 100 * RTOL * ref_losses.max()
    assert max_diff(state.params, ref_state.params) > 1e-3
    # on one device the mode makes no difference
    one_losses, one_state = run(1, bn.Sync.DEVICE)
    np.testing.assert_allclose(one_losses, ref_losses, rtol=RTOL)
    assert_trees_close(one_state.params, ref_state.params)


# ---- evaluation and checkpoints -------------------------------------------------------------------
def test_eval_uses_the_running_statistics():
    _, ref_state = run(1, bn.Sync.GLOBAL)
    _, state = run(N, bn.Sync.GLOBAL)
    images = DATA.held_out(BATCH)["images"]
    logits, kept = forward(N, bn.Sync.GLOBAL, state.params, state.stats, images, train=False)
    ref_logits, _ = forward(1, bn.Sync.GLOBAL, ref_state.params, ref_state.stats, images, train=False)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=1e-6)
    assert max_diff(kept, state.stats) == 0  # evaluating does not update them
    # No batch statistics: an image's logits do not depend on the rest of the batch ...
    alone, _ = forward(1, bn.Sync.GLOBAL, state.params, state.stats, images[:1], train=False)
    np.testing.assert_allclose(alone, logits[:1], rtol=RTOL, atol=1e-6)
    # ... and the running statistics are what normalises: other ones give other logits.
    fresh = init(bn.Sync.GLOBAL)[1]
    other, _ = forward(1, bn.Sync.GLOBAL, state.params, fresh, images, train=False)
    assert np.abs(other - logits).max() > 1e-2
    batch_stats, _ = forward(1, bn.Sync.GLOBAL, state.params, state.stats, images, train=True)
    assert np.abs(batch_stats - logits).max() > 1e-3


def test_running_statistics_survive_a_checkpoint(tmp_path):
    _, state = run(N, bn.Sync.GLOBAL)
    live = bn.init_state(state.params, state.stats, TX, mesh(N))._replace(step=state.step)
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path)))
    ckpt.save(STEPS, live, {"param_shapes": param_shapes(state.params)})
    ckpt.close()
    # restored onto one device: the state's layout is the reader's choice
    target = jax.sharding.NamedSharding(mesh(1), jax.sharding.PartitionSpec())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target), live)
    reader = Checkpointer(CheckpointConfig(directory=str(tmp_path)))
    restored, meta = reader.restore(abstract, param_shapes(state.params))
    reader.close()
    assert int(restored.step) == STEPS and meta["param_shapes"] == param_shapes(state.params)
    assert jax.tree.structure(restored.stats) == jax.tree.structure(state.stats)
    assert max_diff(restored.stats, state.stats) == 0
    assert max_diff(restored.stats, init(bn.Sync.GLOBAL)[1]) > 1e-2  # trained statistics, not fresh ones
    images = DATA.held_out(BATCH)["images"]
    before, _ = forward(N, bn.Sync.GLOBAL, state.params, state.stats, images, train=False)
    after, _ = forward(1, bn.Sync.GLOBAL, restored.params, restored.stats, images, train=False)
    np.testing.assert_allclose(after, before, rtol=RTOL, atol=1e-6)


# ---- the demo script ------------------------------------------------------------------------------
def _demo(*flags):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "batchnorm_demo.py"), *flags],
                          capture_output=True, text=True, timeout=120)


def test_demo_prints_the_three_runs():
    result = _demo("--cpu-devices", "8", "--steps", "2", "--batch-size", "16", "--eval-size", "32")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("step"))
    assert "1 device" in header and "8 dev, sync" in header and "8 dev, per device" in header
    params = next(line for line in lines if line.startswith("max |param - 1 device| after step 2")).split()
    sync, per_device = float(params[-2]), float(params[-1])
    assert sync < 1e-5 < per_device, params


def test_demo_help_and_bad_flags():
    assert _demo("--help").returncode == 0
    for flags, message in [(("--bogus",), "unrecognized arguments: --bogus"),
                           (("--steps", "x"), "invalid int value: 'x'"),
                           (("--steps", "0"), "must be >= 1")]:
        result = _demo(*flags)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ") and message in lines[0], lines[0]
