"""FSDP's reshard-after-forward and the recompute policies: what the compiled step keeps for
the backward pass and what it gathers, measured from the compiled step, and the math
unchanged (equal to one device)."""

import jax
import numpy as np
import pytest

from harness import assert_matches_reference, make_program
from jaxshard.analysis import hlo, inspect
from jaxshard.remat import Remat
from models import TransformerLM, get_preset

B, L = 8, 128  # the batch the FSDP memory claims are made for


def _fsdp_step(remat="none", reshard=True):
    model = TransformerLM(get_preset("llama-tiny"), remat=remat)
    program = make_program(model, "fsdp=8", reshard_after_forward=reshard)
    return model, program, program.lower_step(B, L).compile()


def _gathered_bytes(compiled, mesh):
    return sum(c.bytes * c.executions for c in inspect.compiled_collectives(compiled, mesh)
               if c.kind == "all-gather")


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_fsdp_reshards_after_forward_by_default(remat):
    """Default: no gathered layer survives into the backward pass and every weight is gathered
    twice (forward, backward); --reshard-after-forward false keeps all layers, gathers once."""
    model, program, compiled = _fsdp_step(remat)
    param_bytes = 4 * model.n_params()
    per_layer = sum(4 * x.size // model.cfg.n_layers for x in jax.tree.leaves(model.abstract_params()["blocks"]))
    assert inspect.gathered_weights_kept(compiled, model, program.rules) <= 2 * per_layer
    assert abs(_gathered_bytes(compiled, program.rules.mesh) - 2 * param_bytes) <= 0.05 * 2 * param_bytes
    assert not inspect.verify(model, program, compiled, B, L).flags

    model, kept_program, kept = _fsdp_step(remat, reshard=False)
    kept_bytes = inspect.gathered_weights_kept(kept, model, kept_program.rules)
    assert kept_bytes >= 0.99 * model.cfg.n_layers * per_layer  # every layer, gathered
    assert abs(_gathered_bytes(kept, kept_program.rules.mesh) - param_bytes) <= 0.05 * param_bytes
    assert not inspect.verify(model, kept_program, kept, B, L).flags
    # The copies kept are real memory: XLA's temp grows by at least most of them.
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert kept.memory_analysis().temp_size_in_bytes - temp >= 0.75 * kept_bytes


def test_fsdp_reshards_the_experts_too():
    """Dropless experts on fsdp=2,expert=4, gathered over fsdp inside their shard_map: with
    reshard-after-forward no layer's gathered experts reach the backward loop (the policies
    that keep everything, none and selective, kept them all: the all-gather's output was
    saveable); without it, every layer's do."""
    def kept(reshard):
        model = TransformerLM(get_preset("moe-tiny").replace(moe_capacity_factor=0.0), remat="none")
        program = make_program(model, "fsdp=2,expert=4", reshard_after_forward=reshard)
        return inspect.gathered_weights_kept(program.lower_step(B, L).compile(), model, program.rules)

    experts = 3 * 2 * 2 * 64 * 64 * 4  # gate, up and down: 2 layers x 2 local experts x 64 x 64, float32
    assert kept(True) == 0 and kept(False) >= experts


def test_no_strategy_keeps_a_copy_of_the_weights_for_backward():
    """XLA temp, compiled: FSDP holds activations, one gathered layer with its full gradient
    and the sharded gradients. ZeRO-2 holds no more (its params are arguments, not temp), and
    DDP only its full gradients more. A stacked copy of the weights saved for the backward
    scan -- which a no-op layout constraint on each layer's weights used to cause, 1x the
    params -- breaks both."""
    model = TransformerLM(get_preset("llama-tiny"))

    def temp(mesh, zero=0):
        program = make_program(model, mesh, zero=zero)
        return program, program.lower_step(B, L).compile().memory_analysis().temp_size_in_bytes

    _, fsdp = temp("fsdp=8")
    _, zero2 = temp("data=8", zero=2)
    ddp_program, ddp = temp("data=8")
    full_grads = inspect.max_bytes_abstract(ddp_program.layout.abstract.params)  # float32, replicated
    assert zero2 <= 1.05 * fsdp, (zero2, fsdp)
    assert ddp <= 1.05 * (fsdp + full_grads * 7 / 8), (ddp, fsdp, full_grads)


def test_gathered_weights_are_found_in_a_loop_state():
    """The reader of loop states, on hand-written HLO: a [layers, 256, 1024] f32 buffer is one
    gathered w_in of llama-tiny under fsdp=8 (its at-rest shard is [4, 32, 1024])."""
    text = ("  %while.1 = (s32[], f32[4,256,1024]{2,1,0}, f32[4,32,1024]{2,1,0}) "
            "while(%tuple.1), condition=%cond, body=%body\n")
    assert hlo.loop_states(text) == [[("s32", ()), ("f32", (4, 256, 1024)), ("f32", (4, 32, 1024))]]


@pytest.mark.parametrize("mesh, remat, reshard", [
    ("fsdp=8", "none", False),
    ("fsdp=8", "selective", True),
    ("data=2,fsdp=4", "names:qkv,attn_proj", True),
    ("fsdp=8", "offload:qkv,attn_out,mlp_hidden", True),
    ("data=8", "selective", True),
])
def test_reshard_and_recompute_policies_match_one_device(mesh, remat, reshard):
    assert_matches_reference("tiny-llama", mesh, remat=remat, reshard_after_forward=reshard)


@pytest.mark.parametrize("remat", ["dots", "dots_no_batch", "selective", "full", "names:qkv,attn_proj",
                                   "names:mlp_hidden", "offload:qkv,mlp_in,attn_out"])
def test_each_policy_saves_less_than_none_per_device(remat):
    """Saved-for-backward bytes per device, from the compiled forward's residuals."""
    def saved(policy):
        model = TransformerLM(get_preset("llama-tiny"), remat=policy)
        return inspect.saved_residual_bytes(make_program(model, "fsdp=8"), B, L)

    assert saved(remat) < saved("none")


def test_bad_remat_policies_are_one_line_errors():
    from jaxshard.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown activation name 'qkvv'"):
        Remat.parse("names:qkvv")
    with pytest.raises(ConfigError, match="needs names"):
        Remat.parse("offload")
    with pytest.raises(ConfigError, match="--remat must be one of"):
        Remat.parse("sometimes")
    with pytest.raises(ConfigError, match="takes no names"):
        Remat.parse("full:qkv")


def test_remat_auto_is_the_policy_measured_fastest_on_the_backend():
    from experiments.common import build_model
    from jaxshard import cli, remat

    assert cli.parse_train([]).remat is None  # auto
    assert build_model(cli.parse_train(["--model", "tiny"])).remat == Remat.DOTS  # on CPU
    assert remat.default_for("gpu") == Remat.NONE
    assert build_model(cli.parse_train(["--model", "tiny", "--remat", "none"])).remat == Remat.NONE


def test_the_memory_benchmark_reads_the_compiled_step():
    """scripts/bench_memory.py's figures for a row of docs/memory.md's table are the compiled step's."""
    from scripts.bench_memory import keeps_row

    row = keeps_row("llama-tiny", "fsdp=8", 0, "full", False, None, B, L)
    model, program, compiled = _fsdp_step("full", reshard=False)
    assert row["temp_bytes"] == compiled.memory_analysis().temp_size_in_bytes
    assert row["allgather_bytes"] == _gathered_bytes(compiled, program.rules.mesh)
    assert row["allgather_over_params"] == row["allgather_bytes"] / (4 * model.n_params())
    assert row["gathered_kept_bytes"] == inspect.gathered_weights_kept(compiled, model, program.rules)
    assert row["gathered_layers_kept"] == model.cfg.n_layers
