"""What each device holds, measured from the live shards of the initialised train state."""

import math

import jax
import numpy as np
import pytest

from jaxshard.analysis.inspect import bytes_per_device, max_bytes_per_device
from jaxshard.mesh import build_mesh
from jaxshard.rules import ShardingRules, StateKind, Strategy
from jaxshard.training.optim import OptimConfig
from jaxshard.training.step import StepConfig, build_program
from models import TransformerLM, get_preset

MIN_SIZE = 1024  # norm scales and biases (< 1024 elements) stay replicated


def init_state(mesh, zero=0, min_size=MIN_SIZE):
    model = TransformerLM(get_preset("llama-tiny"))
    rules = ShardingRules(build_mesh(mesh), Strategy(zero=zero, fsdp_min_size=min_size))
    program = build_program(model, rules, OptimConfig(), StepConfig())
    return model, rules, program.init(0)


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def small_params_bytes(model):
    """Bytes of the params that --fsdp-min-size keeps whole on every device."""
    return sum(4 * math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params())
               if math.prod(x.shape) < MIN_SIZE)


def test_fsdp_holds_an_eighth_of_params_and_optimizer_state():
    model, _, state = init_state("fsdp=8")
    total = nbytes(state.params) + nbytes(state.opt_state)
    small = small_params_bytes(model)
    held = bytes_per_device((state.params, state.opt_state))
    assert len(held) == 8
    # params + Adam's two moments of the small params are replicated; counts are scalars
    allowance = 3 * small + 64
    for device, b in held.items():
        assert b <= 1.1 * total / 8 + allowance, (device, b, total)
    assert max(held.values()) < total / 4  # really sharded, not merely under a loose bound


def test_zero1_shards_optimizer_state_but_not_params():
    model, _, state = init_state("data=8", zero=1)
    small = small_params_bytes(model)
    opt_total = nbytes(state.opt_state)
    assert max_bytes_per_device(state.params) == nbytes(state.params)  # every device: all params
    for device, b in bytes_per_device(state.opt_state).items():
        assert b <= 1.1 * opt_total / 8 + 2 * small + 64, (device, b, opt_total)


def test_ddp_replicates_everything():
    _, _, state = init_state("data=8", min_size=0)  # (nothing to keep whole: an error)
    total = nbytes(state.params) + nbytes(state.opt_state)
    assert set(bytes_per_device((state.params, state.opt_state)).values()) == {total}


@pytest.mark.parametrize("mesh, zero, params_div, opt_div, opt_axes", [
    ("data=2,fsdp=4", 0, 4, 4, ("fsdp",)),  # HSDP: sharded in groups of 4, replicated across 2
    ("data=2,fsdp=4", 1, 4, 8, ("fsdp", "data")),  # + ZeRO-1 over data: optimizer state 8 ways
    ("data=8", 3, 8, 8, ("data",)),  # ZeRO-3 over data = FSDP
])
def test_hybrid_and_zero3_fractions(mesh, zero, params_div, opt_div, opt_axes):
    model, rules, state = init_state(mesh, zero)
    small = small_params_bytes(model)
    assert max_bytes_per_device(state.params) <= 1.1 * nbytes(state.params) / params_div + small
    assert max_bytes_per_device(state.opt_state) <= 1.1 * nbytes(state.opt_state) / opt_div + 2 * small + 64
    assert rules.state_axes(StateKind.OPT_STATE) == opt_axes


def test_fsdp_state_is_created_in_its_shards():
    """docs/strategies.md: the state is made by ``jit(init, out_shardings=...)`` in its
    sharding, never whole on one device. The compiled init's peak per device (its outputs and
    temp, XLA's memory analysis) stays under a quarter of the whole state on fsdp=8, and every
    array it makes is laid out as the rules say."""
    model = TransformerLM(get_preset("llama-tiny"))
    rules = ShardingRules(build_mesh("fsdp=8"), Strategy(fsdp_min_size=MIN_SIZE))
    program = build_program(model, rules, OptimConfig(), StepConfig())
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(program.layout.abstract))
    memory = program.init.lower(0).compile().memory_analysis()
    assert memory.output_size_in_bytes < 1.1 * whole / 8 + 3 * small_params_bytes(model) + 64
    assert memory.output_size_in_bytes + memory.temp_size_in_bytes < whole / 4, (memory, whole)
    state = program.init(0)
    for x, want in zip(jax.tree.leaves(state), jax.tree.leaves(program.layout.shardings), strict=True):
        assert x.sharding.is_equivalent_to(want, x.ndim), (x.shape, x.sharding, want)


def test_export_gathers_and_writes_one_parameter_at_a_time(tmp_path, monkeypatch):
    """docs/hosts-and-checkpoints.md: ``--export`` gathers one parameter, writes it, then takes
    the next, so a host holds at most the largest one. Every gather is of one sharded array
    and is written before the next gather; the file holds the params."""
    from jax.experimental import multihost_utils

    from jaxshard.pytree import named_leaves
    from jaxshard.training import checkpoint

    _, _, state = init_state("fsdp=8")
    events, gather, write = [], multihost_utils.process_allgather, np.lib.format.write_array

    def gathering(x, tiled=False):
        assert isinstance(x, jax.Array), type(x)  # one array, not a tree of them
        events.append(("gather", x.shape))
        return gather(x, tiled=tiled)

    def writing(f, array, **kw):
        events.append(("write", array.shape))
        return write(f, array, **kw)

    monkeypatch.setattr(multihost_utils, "process_allgather", gathering)
    monkeypatch.setattr(np.lib.format, "write_array", writing)
    path = checkpoint.export_params(state.params, tmp_path / "p.npz")
    named = named_leaves(state.params)
    assert events == [(kind, x.shape) for _, x in named for kind in ("gather", "write")]
    assert any(not x.is_fully_replicated for _, x in named)  # (gathers that move something)
    with np.load(path) as stored:
        assert sorted(stored.files) == sorted(name for name, _ in named)
        for name, x in named:
            np.testing.assert_array_equal(stored[name], np.asarray(x))
