"""Pipeline parallelism over ``stage``: the schedules' tables, equality with one device (5 AdamW
steps, fp32, 1e-5 relative) for every schedule, both families and composed with the other axes;
each device storing only its stage's layers; and the compiled step moving activations between
stages with collective-permutes, never gathering another stage's weights."""

import functools
import math
import re

import jax
import numpy as np
import pytest

from harness import RTOL, assert_live_shardings, assert_params_close, make_program, reference, train
from jaxshard import accounting, inspect
from jaxshard.errors import ConfigError
from jaxshard.parallel.pipeline import make_schedule
from models import TransformerLM, get_preset


def check_table(schedule):
    """Every microbatch runs forward and backward once on every stage, after what it needs;
    returns the most stage inputs any stage holds at once (forward done, backward not)."""
    P, M, T = schedule.stages, schedule.microbatches, schedule.ticks
    fwd_tick = {(int(schedule.fwd[t, s]), s): t for t in range(T) for s in range(P) if schedule.fwd[t, s] >= 0}
    bwd_tick = {(int(schedule.bwd[t, s]), s): t for t in range(T) for s in range(P) if schedule.bwd[t, s] >= 0}
    every = {(i, s) for i in range(M) for s in range(P)}
    assert set(fwd_tick) == every and set(bwd_tick) == every
    assert (schedule.fwd >= 0).sum() == (schedule.bwd >= 0).sum() == M * P  # once each
    for i in range(M):
        for s in range(1, P):
            assert fwd_tick[i, s] > fwd_tick[i, s - 1]  # the previous stage's output has arrived
            assert bwd_tick[i, s - 1] > bwd_tick[i, s]  # the next stage's gradient has arrived
        assert bwd_tick[i, P - 1] >= fwd_tick[i, P - 1]
    held = max(sum(fwd_tick[i, s] <= t <= bwd_tick[i, s] for i in range(M)) for s in range(P) for t in range(T))
    # No two microbatches held at once share a slot.
    for s in range(P):
        for t in range(T):
            live = [i for i in range(M) if fwd_tick[i, s] <= t <= bwd_tick[i, s]]
            assert len({i % schedule.slots for i in live}) == len(live)
    return held


@pytest.mark.parametrize("stages", [2, 4])
def test_schedule_tables_hold_what_each_schedule_promises(stages):
    for m in (stages, 2 * stages, 4 * stages):
        assert check_table(make_schedule("gpipe", stages, m)) == m  # all of them, at the turn
        held = check_table(make_schedule("1f1b", stages, m))
        assert held <= 2 * stages - 1  # flat in M
    assert check_table(make_schedule("naive", stages, 1)) == 1


@pytest.mark.parametrize("kind, stages, microbatches, message", [
    ("1f1b", 4, 2, "1f1b needs --microbatches >= the stages (4), got 2"),
    ("naive", 2, 2, "naive runs the whole batch as one microbatch; got --microbatches 2"),
    ("gpipe", 2, 0, "--microbatches must be >= 1, got 0"),
])
def test_bad_schedules_are_one_line_errors(kind, stages, microbatches, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_schedule(kind, stages, microbatches)


@functools.cache
def deep(name: str):
    """``name`` with 4 layers (so 4 stages have one each), and its one-device run."""
    model = TransformerLM(get_preset(name).replace(n_layers=4))
    losses, state, _ = train(model, "data=1")
    return model, losses, jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])  # GPT-2 with its tied table; Llama with GQA
@pytest.mark.parametrize("mesh, schedule, microbatches, zero", [
    ("stage=2", "naive", None, 0),
    ("stage=2,data=4", "gpipe", 4, 0),
    ("stage=4,data=2", "1f1b", 8, 0),
    ("data=2,stage=2,tensor=2", "1f1b", 2, 0),
    ("fsdp=2,stage=4", "gpipe", 4, 0),
    ("stage=2,data=4", "1f1b", 2, 1),
])
def test_pipeline_matches_one_device(name, mesh, schedule, microbatches, zero):
    model, ref_losses, ref_params = deep(name)
    losses, state, program = train(model, mesh, zero=zero, pipeline_schedule=schedule,
                                   microbatches=microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, ref_params)
    assert_live_shardings(state, program)
    # Each device stores only its stage's layers: the stack's leading dim is split over stage.
    stages = program.rules.sizes["stage"]
    for leaf in jax.tree.leaves(state.params["blocks"]):
        first = leaf.sharding.spec[0]
        assert "stage" in (first if isinstance(first, tuple) else (first,)), leaf.sharding.spec
        assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // stages


@pytest.mark.parametrize("mesh, schedule, microbatches, sp", [
    ("stage=4,data=2", "1f1b", 4, False), ("stage=2,data=4", "gpipe", 2, False),
    ("data=2,stage=2,tensor=2", "1f1b", 4, True)])
def test_stage_sends_match_the_prediction_and_no_weights_cross_stages(mesh, schedule, microbatches, sp):
    model, _, _ = deep("tiny-llama")
    program = make_program(model, mesh, pipeline_schedule=schedule, microbatches=microbatches,
                           sequence_parallel=sp)
    compiled = program.lower_step(16, 32).compile()
    found = inspect.compiled_collectives(compiled, program.rules.mesh)
    on_stage = [c for c in found if "stage" in c.axes]
    sent = sum(c.bytes * c.executions for c in on_stage if c.kind == "collective-permute")
    predicted = sum(t.total for t in accounting.pipeline_transfers(model, program.rules, program.schedule, 16, 32))
    assert sent and abs(sent - predicted) <= 0.05 * predicted, (sent, predicted)
    # Across stages only activations, their gradients, the outer params' gradient sum and the
    # loss move: nothing is gathered, and no all-reduce is the size of a layer's weights.
    assert not [c for c in on_stage if c.kind == "all-gather"], on_stage
    layer = {tuple(x.shape[1:]) for x in jax.tree.leaves(model.abstract_params()["blocks"]) if x.ndim > 2}
    assert not [c for c in on_stage if c.kind == "all-reduce" and set(c.shapes) & layer], on_stage


def test_each_device_holds_its_stage_of_the_layer_stack():
    model, _, _ = deep("tiny-llama")
    _, state, program = train(model, "stage=4,data=2", pipeline_schedule="1f1b", microbatches=4)
    # Per device: about a quarter of the layer stack (plus the replicated embedding ends).
    stack = sum(x.nbytes for x in jax.tree.leaves(state.params["blocks"]))
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params["blocks"]))
    assert math.isclose(held, stack / 4)


@pytest.mark.parametrize("flags, message", [
    (dict(pipeline_schedule="gpipe"), "--pipeline-schedule needs a stage axis of size > 1 in --mesh"),
    (dict(microbatches=2), "--microbatches needs a stage axis of size > 1 in --mesh"),
])
def test_pipeline_flags_without_a_stage_axis_are_errors(flags, message):
    model, _, _ = deep("tiny")
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(model, "data=8", **flags)


def test_1f1b_keeps_activations_flat_in_microbatches_where_gpipe_grows():
    """Compiled temp bytes per device as M grows from P to 4P at a fixed microbatch size: GPipe
    keeps every microbatch's stage input until the backward turn, 1F1B at most 2P - 1."""
    model, _, _ = deep("tiny-llama")
    stages, rows, seq = 4, 2, 64  # rows per microbatch per device (data=2)
    one_input = rows * seq * model.cfg.d_model * 4  # a stage input, float32

    def temp(kind, m):
        program = make_program(model, "stage=4,data=2", pipeline_schedule=kind, microbatches=m)
        return program.lower_step(m * rows * 2, seq).compile().memory_analysis().temp_size_in_bytes

    gpipe = [temp("gpipe", m) for m in (stages, 4 * stages)]
    ones = [temp("1f1b", m) for m in (stages, 2 * stages, 4 * stages)]
    assert gpipe[1] - gpipe[0] >= 0.9 * 3 * stages * one_input  # + 3P inputs
    assert ones[2] - ones[1] < one_input  # flat once M > 2P - 1
    # From P to 2P - 1 kept inputs (and the larger batch's token copies, a fraction of one).
    assert ones[2] - ones[0] <= (stages - 1 + 0.5) * one_input


@pytest.mark.parametrize("mesh, schedule, microbatches", [("stage=2,data=4", "1f1b", 4),
                                                          ("data=2,stage=2,tensor=2", "gpipe", 2)])
def test_dropout_under_a_pipeline_drops_what_one_device_drops(mesh, schedule, microbatches):
    ref_losses, ref_params = reference("tiny", 1, 0.1)
    model = TransformerLM(get_preset("tiny").replace(dropout=0.1))
    losses, state, _ = train(model, mesh, pipeline_schedule=schedule, microbatches=microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, ref_params)
