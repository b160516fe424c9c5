"""2-byte params with a float32 master copy, and float16 with dynamic loss scaling: against
float32 training, and what the compiled step stores and sends."""

import jax
import numpy as np
import pytest

from harness import make_program
from jaxshard import inspect
from jaxshard.checkpoint import CheckpointConfig, Checkpointer
from models import TransformerLM, get_preset

STEPS = 20


def _batches(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        x = rng.integers(0, 256, (16, 32), dtype=np.int32)
        out.append({"inputs": x, "targets": (x * 7 + 3) % 256})
    return out


def _run(mesh="data=8", steps=STEPS, **kwargs):
    program = make_program(TransformerLM(get_preset("tiny")), mesh, **kwargs)
    state, metrics = program.init(0), []
    for batch in _batches()[:steps]:
        state, m = program.step(state, jax.device_put(batch, program.batch_sharding))
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics, state, program


def _losses(metrics):
    return np.array([m["loss"] for m in metrics])


@pytest.fixture(scope="module")
def fp32():
    return _losses(_run()[0])


def test_float16_with_loss_scaling_tracks_float32(fp32):
    metrics, state, _ = _run(dtype="float16")
    np.testing.assert_allclose(_losses(metrics), fp32, rtol=2e-2)
    assert all(m["skipped"] == 0 for m in metrics)
    assert state.loss_scale.scale.dtype == np.float32


def test_an_overflowing_step_is_skipped_and_the_scale_halves():
    """A planted overflow: an initial scale of 2^24 makes float16 gradients infinite. Those
    steps change nothing, the scale halves each time, then training goes on."""
    program = make_program(TransformerLM(get_preset("tiny")), "fsdp=8", dtype="float16",
                           param_dtype="float16", loss_scale=2.0 ** 24)
    state = program.init(0)
    before = jax.tree.map(np.asarray, state.params)
    metrics = []
    for batch in _batches():
        state, m = program.step(state, jax.device_put(batch, program.batch_sharding))
        metrics.append({k: float(v) for k, v in m.items()})
        if len(metrics) == 1:  # the first step overflowed: params and moments untouched
            assert m["skipped"] == 1
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
                np.testing.assert_array_equal(np.asarray(a), b)
    skipped = [int(m["skipped"]) for m in metrics]
    n = skipped.index(0)  # the first step that was not skipped
    assert n >= 1 and sum(skipped) < STEPS // 2
    assert [m["loss_scale"] for m in metrics[:n + 1]] == [2.0 ** (24 - i) for i in range(n + 1)]
    assert metrics[-1]["skipped_steps"] == sum(skipped)
    assert metrics[-1]["loss"] < metrics[n]["loss"]  # it trains after the skips


def test_loss_scale_is_checkpointed_and_restored(tmp_path):
    _, state, program = _run(steps=3, dtype="float16", loss_scale=2.0 ** 20)
    assert int(state.loss_scale.skipped) > 0  # something worth restoring
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path)))
    ckpt.save(3, state, {"step": 3})
    ckpt.close()
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path), resume=True))
    restored, _ = ckpt.restore(program.layout.abstract, None)
    ckpt.close()
    for a, b in zip(restored.loss_scale, state.loss_scale):
        assert a == b


def test_bfloat16_params_halve_storage_and_keep_a_float32_master(fp32):
    """(That the gradient collectives halve too cannot be seen on CPU: XLA:CPU runs every bf16
    collective in float32, so the compiled bytes are those of float32.)"""
    metrics, state, program = _run(dtype="bfloat16", param_dtype="bfloat16")
    np.testing.assert_allclose(_losses(metrics), fp32, rtol=2e-2)
    _, state32, program32 = _run(steps=1)
    assert inspect.max_bytes_per_device(state.params) * 2 == inspect.max_bytes_per_device(state32.params)
    assert jax.tree.leaves(state.opt_state.master)[0].dtype == np.float32  # the master copy
