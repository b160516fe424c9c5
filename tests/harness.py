"""Training runs for the equivalence tests: a strategy on 8 fake devices vs one device."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from jaxshard.data import synthetic
from jaxshard.mesh import MeshSpec, build_mesh
from jaxshard.rules import ShardingRules, Strategy, use_rules
from jaxshard.training.optim import OptimConfig
from jaxshard.training.step import StepConfig, build_program
from models import TransformerLM, get_preset

RTOL = 1e-5
STEPS, BATCH, SEQ = 5, 16, 32
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=10)


def random_batches(vocab: int, seed: int = 0):
    """STEPS random batches; each target is a fixed function of its input (something to learn)."""
    return synthetic.random_batches(vocab, STEPS, BATCH, SEQ, seed)


def make_program(model, mesh_spec: str, *, zero=0, sequence_parallel=False, accum=1,
                 dtype="float32", seed=0, devices=None, reshard_after_forward=True, offload=(),
                 context_parallel="ring", schedule=None, optim=OPTIM, **step):
    """``mesh_spec`` on the first devices it needs (all 8 unless its sizes say fewer);
    ``schedule``: a pipeline schedule's own tables (default: the one the flags ask for)."""
    rules = ShardingRules(build_mesh(mesh_spec, devices or first_devices(mesh_spec)),
                          Strategy(zero=zero, sequence_parallel=sequence_parallel,
                                   reshard_after_forward=reshard_after_forward, offload=offload,
                                   context_parallel=context_parallel))
    return build_program(model, rules, optim, StepConfig(grad_accum=accum, compute_dtype=dtype, seed=seed, **step),
                         schedule=schedule)


def first_devices(mesh_spec: str) -> list:
    """The first devices ``mesh_spec`` needs (all of them for a ``-1`` axis)."""
    sizes = [s for _, s in MeshSpec.parse(mesh_spec).axes]
    return jax.devices() if -1 in sizes else jax.devices()[:math.prod(sizes)]


def under(mesh_spec: str, fn, *args, sp=False, cp="ring"):
    """``fn(*args)`` jitted under the rules of ``mesh_spec`` (inputs laid out by the rules too)."""
    rules = ShardingRules(build_mesh(mesh_spec, first_devices(mesh_spec)),
                          Strategy(sequence_parallel=sp, context_parallel=cp))

    def run(*a):
        with use_rules(rules):
            return fn(*a)

    return jax.jit(run)(*args)


def train(model, mesh_spec: str, *, seed=0, **kwargs):
    program = make_program(model, mesh_spec, seed=seed, **kwargs)
    state = program.init(seed)
    losses = []
    for batch in random_batches(model.cfg.vocab_size, seed):
        state, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, program


@functools.cache
def reference(model_name: str, accum: int = 1, dropout: float = 0.0):
    """The one-device run every strategy is compared with."""
    model = TransformerLM(get_preset(model_name).replace(dropout=dropout))
    losses, state, _ = train(model, "data=1", accum=accum)
    return losses, jax.tree.map(np.asarray, state.params)


def assert_params_close(actual, expected, rtol=RTOL):
    """Per leaf: ||a - e|| <= rtol * ||e||. Reports the worst leaf."""
    worst = ("", 0.0)
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        err = float(np.linalg.norm(np.asarray(a) - e) / np.linalg.norm(e))
        worst = max(worst, (jax.tree_util.keystr(path), err), key=lambda t: t[1])
    assert worst[1] <= rtol, f"param {worst[0]} differs from one device by {worst[1]:.2e} relative"


def assert_live_shardings(state, program):
    """The live arrays are laid out as the rules say (the rules' values are pinned in test_rules)."""
    want = program.layout.shardings
    for name in ("params", "opt_state"):
        got_specs = jax.tree.map(lambda x: x.sharding.spec, getattr(state, name))
        want_specs = jax.tree.map(lambda s: s.spec, getattr(want, name))
        assert got_specs == want_specs, name


def assert_matches_reference(model_name, mesh_spec, *, accum=1, dropout=0.0, remat="none", **kwargs):
    ref_losses, ref_params = reference(model_name, accum, dropout)
    model = TransformerLM(get_preset(model_name).replace(dropout=dropout), remat=remat)
    losses, state, program = train(model, mesh_spec, accum=accum, **kwargs)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, ref_params)
    assert_live_shardings(state, program)
    assert losses[-1] < losses[0]  # it does learn
    return program
