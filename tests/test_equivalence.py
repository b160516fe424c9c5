"""Every data-parallel strategy trains exactly like one device (fp32, 1e-5 relative).

Five AdamW steps of the tiny GPT-2 and Llama models on fresh random tokens, on 8 fake CPU
devices, against the same steps on one device; with and without gradient accumulation. The
live arrays' shardings are checked against the rules' (whose golden values test_rules pins).
"""

import functools

import jax
import numpy as np
import pytest

from jaxshard.mesh import build_mesh
from jaxshard.optim import OptimConfig
from jaxshard.rules import ShardingRules, Strategy
from jaxshard.train_step import StepConfig, build_program
from models import ModelConfig, TransformerLM, get_preset

RTOL = 1e-5
STEPS, BATCH, SEQ = 5, 16, 32
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=10)

STRATEGIES = {
    "ddp": ("data=8", 0),
    "zero1": ("data=8", 1),
    "zero2": ("data=8", 2),
    "fsdp": ("fsdp=8", 0),
    "hsdp": ("data=2,fsdp=4", 0),
}


def random_batches(vocab: int, seed: int = 0):
    """Random tokens; each target is a fixed function of its input, so there is something to learn."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(STEPS):
        inputs = rng.integers(0, vocab, (BATCH, SEQ), dtype=np.int32)
        batches.append({"inputs": inputs, "targets": (inputs * 7 + 3) % vocab})
    return batches


def train(model, mesh_spec, *, zero=0, accum=1, devices=None, dtype="float32", seed=0):
    rules = ShardingRules(build_mesh(mesh_spec, devices), Strategy(zero=zero))
    program = build_program(model, rules, OPTIM, StepConfig(grad_accum=accum, compute_dtype=dtype, seed=seed))
    state = program.init(seed)
    losses = []
    for batch in random_batches(model.cfg.vocab_size, seed):
        state, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, program


@functools.cache
def reference(model_name: str, accum: int, dropout: float = 0.0):
    model = TransformerLM(get_preset(model_name).replace(dropout=dropout))
    losses, state, _ = train(model, "data=1", accum=accum, devices=jax.devices()[:1])
    return losses, jax.tree.map(np.asarray, state.params)


def assert_params_close(actual, expected, rtol=RTOL):
    """Per leaf: ||a - e|| <= rtol * ||e||. Reports the worst leaf."""
    worst = ("", 0.0)
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        err = float(np.linalg.norm(np.asarray(a) - e) / np.linalg.norm(e))
        worst = max(worst, (jax.tree_util.keystr(path), err), key=lambda t: t[1])
    assert worst[1] <= rtol, f"param {worst[0]} differs from one device by {worst[1]:.2e} relative"


def assert_live_shardings(state, program):
    want = program.layout.shardings
    for name in ("params", "opt_state"):
        got_specs = jax.tree.map(lambda x: x.sharding.spec, getattr(state, name))
        want_specs = jax.tree.map(lambda s: s.spec, getattr(want, name))
        assert got_specs == want_specs, name


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_strategy_matches_one_device(model_name, strategy, accum):
    ref_losses, ref_params = reference(model_name, accum)
    mesh_spec, zero = STRATEGIES[strategy]
    losses, state, program = train(TransformerLM(get_preset(model_name)), mesh_spec, zero=zero, accum=accum)
    assert program.rules.name == strategy
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, ref_params)
    assert_live_shardings(state, program)
    assert losses[-1] < losses[0]  # it does learn


def test_gradient_accumulation_equals_the_full_batch():
    for name in ("tiny", "tiny-llama"):
        full, accumulated = reference(name, 1), reference(name, 2)
        np.testing.assert_allclose(accumulated[0], full[0], rtol=RTOL)
        assert_params_close(accumulated[1], full[1])


def test_dropout_is_sharding_invariant():
    ref_losses, ref_params = reference("tiny", 1, dropout=0.1)
    no_dropout_losses, _ = reference("tiny", 1)
    assert np.abs(ref_losses - no_dropout_losses).max() > 1e-3  # dropout is really on
    model = TransformerLM(get_preset("tiny").replace(dropout=0.1))
    losses, state, _ = train(model, "data=2,fsdp=4", accum=1)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, ref_params)


def test_uneven_dims_train_like_one_device():
    """d_model 36 and 4 heads do not divide by 8: FSDP picks other dims instead of failing."""
    cfg = ModelConfig(name="odd", n_layers=2, d_model=36, n_heads=4, d_mlp=144, vocab_size=256,
                      max_seq_len=64)
    model = TransformerLM(cfg)
    ref_losses, ref_state, _ = train(model, "data=1", devices=jax.devices()[:1])
    losses, state, program = train(model, "fsdp=8")
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, jax.tree.map(np.asarray, ref_state.params))
    assert state.params["blocks"]["ffn"]["w_in"].sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp")


def test_bfloat16_compute_keeps_float32_master_params():
    model = TransformerLM(get_preset("tiny"))
    ref_losses, _ = reference("tiny", 1)
    losses, state, _ = train(model, "fsdp=8", dtype="bfloat16")
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype in (np.float32, np.int32) for x in jax.tree.leaves(state.opt_state))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)  # bf16 rounding, not a different model
    assert not np.allclose(losses, ref_losses, rtol=1e-6)  # the matmuls really ran in bf16
