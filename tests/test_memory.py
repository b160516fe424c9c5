"""What each device holds, measured from the live shards of the initialised train state."""

import math

import jax
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
