"""2-byte params with a float32 master copy, and float16 with dynamic loss scaling: against
float32 training, and what the compiled step stores and sends."""

import re

import jax
import numpy as np
import pytest

from harness import make_program
from jaxshard.analysis import inspect
from jaxshard.training.checkpoint import CheckpointConfig, Checkpointer
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


def _norms(metrics):
    return np.array([m["grad_norm"] for m in metrics])


@pytest.fixture(scope="module")
def fp32_norms():
    return _norms(_run(steps=8)[0])


@pytest.mark.parametrize("mesh, precision", [
    ("data=8", dict(dtype="float16")),
    ("fsdp=8", dict(dtype="float16", param_dtype="float16")),
])
def test_float16_gradients_are_unscaled(fp32, fp32_norms, mesh, precision):
    """The logged gradient norm is the unscaled one: within a few percent of float32's at
    every step (a scale left in would multiply it by 2^15). The losses as well, looser: Adam
    normalises a wrongly scaled gradient away, so they alone would not see it."""
    metrics, state, _ = _run(mesh, steps=8, **precision)
    assert all(m["skipped"] == 0 for m in metrics) and metrics[0]["loss_scale"] == 2.0 ** 15
    np.testing.assert_allclose(_norms(metrics), fp32_norms, rtol=3e-2)
    np.testing.assert_allclose(_losses(metrics), fp32[:8], rtol=2e-2)
    assert state.loss_scale.scale.dtype == np.float32


def test_the_scale_doubles_after_each_period_of_finite_steps(fp32_norms):
    """--loss-scale-period 3 from 2^10: three finite steps at each scale, then it doubles (the
    metrics log the scale each step ran with); the gradient norms stay float32's."""
    metrics, state, _ = _run(steps=10, dtype="float16", loss_scale=2.0 ** 10, loss_scale_period=3)
    assert all(m["skipped"] == 0 for m in metrics)
    assert [m["loss_scale"] for m in metrics] == [2.0 ** (10 + i // 3) for i in range(10)]
    assert float(state.loss_scale.scale) == 2.0 ** 13 and int(state.loss_scale.good_steps) == 1
    np.testing.assert_allclose(_norms(metrics[:8]), fp32_norms, rtol=3e-2)


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


REMATS = ["none", "full", "dots", "dots_no_batch", "selective", "names:qkv,mlp_in", "offload:qkv,mlp_in"]


def _trajectory(metrics):
    return np.array([[m["loss"], m["grad_norm"]] for m in metrics])


def _fp16_trajectory(remat, offload=()):
    """Four float16 steps of tiny on fsdp=8 under ``remat`` (and ZeRO-Offload of ``offload``)."""
    program = make_program(TransformerLM(get_preset("tiny"), remat=remat), "fsdp=8", dtype="float16", offload=offload)
    state, metrics = program.init(0), []
    for batch in _batches()[:4]:
        state, m = program.step(state, jax.device_put(batch, program.batch_sharding))
        metrics.append({k: float(v) for k, v in m.items()})
    assert all(m["skipped"] == 0 for m in metrics)
    return _trajectory(metrics)


@pytest.fixture(scope="module")
def fp16_plain():
    """The same program without recompute or offload (the same path: a differently built step
    rounds its float16 gradient norm differently on some CPUs, 2e-5 apart)."""
    return _fp16_trajectory("none")


@pytest.mark.default_emitters  # two programs fused differently round alike only with these
@pytest.mark.parametrize("remat, offload", [(r, o) for r in REMATS for o in ((), ("optimizer", "params"))
                                            if (r, o) != ("none", ())])  # that one is the reference
def test_float16_with_every_remat_policy_and_offload_equals_float16_alone(fp16_plain, remat, offload):
    """float16 with loss scaling under each recompute policy (offloaded activations included)
    and with and without ZeRO-Offload of the optimizer state and params, on fsdp=8: the losses
    and gradient norms of float16 without either (recomputing in float16 gives what the
    forward gave; offloading moves bytes, not values)."""
    got = _fp16_trajectory(remat, offload)
    np.testing.assert_allclose(got[:, 0], fp16_plain[:, 0], rtol=1e-5)  # the losses
    # The gradient norms: on a CPU with AVX512-FP16 every recompute policy's differs from no
    # recompute's by 2e-5 (all policies alike, to the bit), where other CPUs agree within 1e-5.
    np.testing.assert_allclose(got[:, 1], fp16_plain[:, 1], rtol=3e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_float16_through_a_pipeline_equals_float16_accumulation(schedule):
    """A pipeline scales each microbatch's loss by the loss scale (its seed) and the step
    unscales the accumulated gradients: float16 on stage=2,data=4 with 2 microbatches trains as
    float16 accumulating the same 2 microbatches on data=8 (and its gradient norms stay
    float32's)."""
    piped = _run("stage=2,data=4", steps=6, dtype="float16", pipeline_schedule=schedule, microbatches=2)[0]
    accumulated = _run("data=8", steps=6, dtype="float16", accum=2)[0]
    fp32 = _run("data=8", steps=6, accum=2)[0]
    assert all(m["skipped"] == 0 for m in piped) and piped[0]["loss_scale"] == 2.0 ** 15
    # (float16 sums the microbatches in another order here: a few 1e-3 of rounding by step 6)
    np.testing.assert_allclose(_trajectory(piped), _trajectory(accumulated), rtol=5e-3)
    np.testing.assert_allclose(_norms(piped), _norms(fp32), rtol=3e-2)


@pytest.mark.parametrize("preset, mesh", [("tiny", "data=1"), ("tiny-llama", "data=1"), ("tiny", "tensor=2"),
                                          ("tiny-llama", "tensor=2"), ("tiny", "data=2,tensor=2")])
def test_the_vocabulary_projection_multiplies_in_bfloat16_both_ways(preset, mesh):
    """The head's forward matmul gives float32 logits; its two backward matmuls take the
    cotangent rounded to bf16, not float32 (JAX's transpose of a dot with a float32 result
    would: on an H100 those ran as TF32, a third of a layer-cut 8B step). Read from the
    lowered step, tied (GPT-2) and untied (Llama) heads, vocab-parallel under tensor=2."""
    cfg = get_preset(preset).replace(vocab_size=300)
    vocab = {cfg.padded_vocab, cfg.padded_vocab // 2}  # whole, or a tensor=2 shard's
    assert not vocab & {cfg.d_model, cfg.d_mlp, cfg.n_heads * cfg.d_head}
    program = make_program(TransformerLM(cfg), mesh, dtype="bfloat16")
    text = program.lower_step(4, 32).as_text()
    dots = re.findall(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", text)

    def dims(t):
        return {int(d) for d in re.findall(r"(\d+)x", t)}

    head = [d for d in dots if any(dims(t) & vocab for t in d)]
    assert len(head) == 3, head  # forward, input gradient, weight gradient
    assert all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b, _ in head), head
    assert sum(out.endswith("xf32>") for *_, out in head) >= 1  # the logits (and maybe an f32-accumulated gradient)
