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

from harness import RTOL, assert_live_shardings, assert_params_close, make_program, random_batches, train
from jaxshard.analysis import accounting, inspect
from jaxshard.analysis.bubble import packed
from jaxshard.errors import ConfigError
from jaxshard.parallel import pipeline
from jaxshard.parallel.balance import Costs, assign
from jaxshard.parallel.pipeline import StageLayout, make_schedule, residual_cap
from jaxshard.training.step import StepConfig, balance_stages
from models import TransformerLM, get_preset


def check_table(schedule):
    """Every microbatch runs forward and backward once on every (virtual) stage, after what it
    needs, on the stage that holds it; returns the most inputs any stage holds at once."""
    P, V, M, T = schedule.stages, schedule.virtual, schedule.microbatches, schedule.ticks
    fwd_tick, bwd_tick, slot = {}, {}, {}
    for t in range(T):
        for s in range(P):
            for phase, ticks in (("fwd", fwd_tick), ("bwd", bwd_tick)):
                i = int(getattr(schedule, phase)[t, s])
                if i >= 0:
                    u = int(getattr(schedule, f"{phase}_chunk")[t, s]) * P + s  # the virtual stage
                    assert (i, u) not in ticks  # once each
                    ticks[i, u] = t
                    slot.setdefault((i, u), set()).add(int(getattr(schedule, f"{phase}_slot")[t, s]))
    every = {(i, u) for i in range(M) for u in range(P * V)}
    assert set(fwd_tick) == every and set(bwd_tick) == every
    for i in range(M):
        for u in range(1, P * V):
            assert fwd_tick[i, u] > fwd_tick[i, u - 1]  # the previous stage's output has arrived
            assert bwd_tick[i, u - 1] > bwd_tick[i, u]  # the next stage's gradient has arrived
        assert bwd_tick[i, P * V - 1] >= fwd_tick[i, P * V - 1]
    # The forward writes the slot the backward reads, and no two inputs held at once share one.
    assert all(len(s) == 1 for s in slot.values())
    held = 0
    for s in range(P):
        for t in range(T):
            live = [k for k in every if k[1] % P == s and fwd_tick[k] <= t <= bwd_tick[k]]
            assert len({next(iter(slot[k])) for k in live}) == len(live) <= schedule.slots
            held = max(held, len(live))
    return held


@pytest.mark.parametrize("stages", [2, 4])
def test_schedule_tables_hold_what_each_schedule_promises(stages):
    for m in (stages, 2 * stages, 4 * stages):
        assert check_table(make_schedule("gpipe", stages, m)) == m  # all of them, at the turn
        held = check_table(make_schedule("1f1b", stages, m))
        assert held <= 2 * stages - 1  # flat in M
        for v in (2, 3):
            interleaved = make_schedule("interleaved", stages, m, v)
            # (V + 1) P - 1 chunk inputs at most, whatever M is; the bubble shrinks by V.
            assert check_table(interleaved) <= (v + 1) * stages - 1
            assert interleaved.ticks == v * m + v * stages + stages - 2
            assert interleaved.bubble() == pytest.approx((stages - 1) / (v * m + stages - 1))
    assert check_table(make_schedule("naive", stages, 1)) == 1


@pytest.mark.parametrize("kind, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_the_logged_bubble_formula_gives_the_bubble(kind, virtual):
    """The formula a run logs beside the bubble is the one it computed: evaluated at the
    schedule's P, M and V, it gives :meth:`Schedule.bubble`."""
    schedule = make_schedule(kind, 4, 8, virtual)
    formula = schedule.bubble_formula
    at = {"P": schedule.stages, "M": schedule.microbatches, "V": schedule.virtual}
    product = re.sub(r"(?<=[\dPMV])(?=[PMV])", "*", formula)  # 3M: 3*M, VM: V*M
    value = eval(re.sub(r"[PMV]", lambda m: str(at[m[0]]), product))  # noqa: S307
    assert value == pytest.approx(schedule.bubble()), (formula, value, schedule.bubble())


@pytest.mark.parametrize("kind, stages, microbatches, cap", [
    ("1f1b", 2, 8, None), ("1f1b", 4, 6, None), ("gpipe", 3, 4, None), ("zb-h1", 2, 8, None), ("zb-h1", 4, 8, None),
    ("zb-h1", 3, 5, (3, 2, 1))])
def test_the_tables_priced_at_one_unit_an_op_idle_as_the_tables_say(kind, stages, microbatches, cap):
    """bench_zero_bubble.py prices the tables at each op's traced cost (``priced_step``). At a
    unit an op (1F1B's backward two, its last chunk's forward and backward three) the priced
    step is the length the tables' idle fraction is counted against; each tick's own work adds
    its cost once a tick, the step around the loop its slowest stage's."""
    from jaxshard.analysis.bubble import priced_step

    schedule = make_schedule(kind, stages, microbatches, residual_cap=cap)
    M = microbatches
    units = {str(s): ({"F": M, "B": M, "W": M} if schedule.split else
                      {"last": 3 * M} if s == stages - 1 else {"F": M, "B": 2 * M}) for s in range(stages)}
    work = 3 * M * stages
    priced = priced_step(schedule, units)
    assert 1 - work / (stages * priced) == pytest.approx(schedule.idle())
    for parts in units.values():
        parts["tick"] = 0.5 * schedule.ticks
    units["0"]["outside"], units[str(stages - 1)]["xla"] = 3.0, 2.0
    assert priced_step(schedule, units) == pytest.approx(priced + 0.5 * schedule.ticks + 3.0)
    units[str(stages - 1)]["xla"] = 4.0  # (the slowest stage's, wherever it is)
    assert priced_step(schedule, units) == pytest.approx(priced + 0.5 * schedule.ticks + 4.0)
    with pytest.raises(ValueError, match="one chunk a stage"):
        priced_step(make_schedule("interleaved", 2, 4, 2), units)


@pytest.mark.parametrize("kind, virtual", [("interleaved", 2), ("zb-h1", 1)])
def test_packed_tables_give_one_stage_all_its_slots_and_no_waiting(kind, virtual):
    """What --measure-bubble times as a stage's own work: each of its M V forward and backward
    slots once (a zero-bubble schedule's B and W both, in the same tick), one per tick, and
    nothing on the other stages; nothing waits in an inbox."""
    schedule = make_schedule(kind, 2, 4, virtual)
    phases = ("fwd", "bwd", "wgt") if schedule.split else ("fwd", "bwd")
    for stage in (None, 0, 1, "all"):
        table = packed(schedule, stage)
        assert table.ticks == schedule.virtual * schedule.microbatches
        for s in range(schedule.stages):
            works = stage == "all" or stage == s
            for phase in phases:
                ids, chunks = getattr(table, phase)[:, s], getattr(table, f"{phase}_chunk")[:, s]
                assert ids.shape == (table.ticks,)
                if works:
                    assert sorted(zip(ids, chunks)) == [(i, v) for i in range(4) for v in range(virtual)]
                else:
                    assert (ids == -1).all()
        if schedule.split:
            assert (table.wgt == table.bwd).all() and (table.fwgt == -1).all()
            assert (table.fwd_in == -1).all() and (table.bwd_in == -1).all() and table.in_slots == 0
    if schedule.split:  # the executor runs it (every stage busy: the timing's widest table)
        model = TransformerLM(get_preset("tiny").replace(n_layers=4))
        flags = dict(pipeline_schedule=kind, microbatches=4)
        real = make_program(model, "stage=2,data=4", **flags).schedule
        program = make_program(model, "stage=2,data=4", schedule=packed(real, "all"), **flags)
        batch = jax.device_put(random_batches(model.cfg.vocab_size)[0], program.batch_sharding)
        _, metrics = program.step(program.init(0), batch)
        assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("kind, stages, microbatches, virtual, message", [
    ("1f1b", 4, 2, 1, "1f1b needs --microbatches >= the stages (4), got 2"),
    ("interleaved", 4, 2, 2, "interleaved needs --microbatches >= the stages (4), got 2"),
    ("interleaved", 2, 3, 2, "--microbatches 3 is not a multiple of the stages (2)"),
    ("interleaved", 2, 2, 1, "interleaved needs --virtual-stages >= 2, got 1"),
    ("gpipe", 2, 2, 2, "--virtual-stages needs --pipeline-schedule interleaved, got gpipe"),
    ("naive", 2, 2, 1, "naive runs the whole batch as one microbatch; got --microbatches 2"),
    ("gpipe", 2, 0, 1, "--microbatches must be >= 1, got 0"),
])
def test_bad_schedules_are_one_line_errors(kind, stages, microbatches, virtual, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_schedule(kind, stages, microbatches, virtual)


@pytest.mark.parametrize("kind, cap", [("1f1b", 2), ("gpipe", 2), ("interleaved", 2), ("naive", 2), ("zb-h1", 0),
                                       ("zb-h1", (2, 0)), ("zb-h1", (3, 2, 1))])
def test_a_residual_cap_is_zero_bubbles_alone_and_at_least_one(kind, cap):
    with pytest.raises(ConfigError, match=re.escape(f"one or one per stage; got {cap} for {kind} on 2 stages")):
        make_schedule(kind, 2, 2, residual_cap=cap)


def test_a_stage_layout_stores_each_device_its_chunks():
    layout = StageLayout.make(7, 2, 2, (2, 2, 2, 1))  # virtual stages 0..3: layers 0-1, 2-3, 4-5, 6
    assert layout.describe() == "stage 0: 0-1, 4-5 | stage 1: 2-3, 6"
    stack = np.arange(7, dtype=np.float32)
    stored = np.asarray(layout.to_stored(stack))
    # Device-major, two slots per chunk; stage 1's second chunk has an empty slot.
    np.testing.assert_array_equal(stored, [0, 1, 4, 5, 2, 3, 6, 0])
    np.testing.assert_array_equal(np.asarray(layout.to_model(stored)), stack)
    assert StageLayout.make(8, 4).trivial and not layout.trivial


@pytest.mark.parametrize("layers, stages, virtual, counts, message", [
    (6, 4, 1, None, "6 layers are not divisible by stage=4; give --stage-layers or --balance"),
    (4, 2, 4, None, "4 layers are not divisible by stage=2 x --virtual-stages 4"),
    (4, 2, 1, (3, 2), "--stage-layers 3,2 must be counts >= 1 that sum to the model's 4 layers"),
    (4, 2, 1, (4, 0), "--stage-layers 4,0 must be counts >= 1"),
    (4, 2, 2, (2, 2), "--stage-layers needs 4 counts (stage=2 x --virtual-stages 2), got 2"),
])
def test_bad_stage_layouts_are_one_line_errors(layers, stages, virtual, counts, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        StageLayout.make(layers, stages, virtual, counts)


def check_zero_bubble_table(schedule):
    """ZB-H1's tables: every microbatch's F, B and W once on every stage; a tick's slots run in
    turn (forward slot: an F or a W; backward slot: a B; weight slot: a W); F after the
    previous stage's F, B after the next stage's B (the last stage's after its own F, in the
    same tick or before), W after its own B (in a later slot); and no slot -- residuals from F
    to W, what B keeps for W from B to W, an arrival in the inbox until its F or B takes it --
    held by two at once."""
    P, M, T = schedule.stages, schedule.microbatches, schedule.ticks
    at, order = {}, {"fwd": 0, "fwgt": 0, "bwd": 1, "wgt": 2}  # (tick, slot) of each op
    for t in range(T):
        for s in range(P):
            assert schedule.fwd[t, s] < 0 or schedule.fwgt[t, s] < 0  # one op a slot
            for phase, slot in order.items():
                i = int(getattr(schedule, phase)[t, s])
                if i >= 0:
                    name = "wgt" if phase == "fwgt" else phase
                    assert (name, i, s) not in at
                    at[name, i, s] = (t, slot, phase)
    assert len(at) == 3 * M * P
    for i in range(M):
        for s in range(P):
            if s:
                assert at["fwd", i, s][0] > at["fwd", i, s - 1][0]
            if s < P - 1:
                assert at["bwd", i, s][0] > at["bwd", i, s + 1][0]
            else:
                assert at["bwd", i, s][:2] > at["fwd", i, s][:2]
            assert at["wgt", i, s][:2] > at["bwd", i, s][:2]
    spans = {"res": ("fwd", "fwd_slot", "wgt_slot"), "kept": ("bwd", "bwd_wslot", "wgt_wslot")}
    for s in range(P):
        for first, first_slot, last_slot in spans.values():
            held = {}
            for i in range(M):
                a, (b, _, phase) = at[first, i, s][0], at["wgt", i, s]
                slot = int(getattr(schedule, first_slot)[a, s])
                assert slot == int(getattr(schedule, last_slot.replace("wgt", phase))[b, s]) >= 0
                held[i] = (a, b, slot)
            for i, (a, b, slot) in held.items():
                assert not any(o != i and sl == slot and a <= b2 and a2 <= b for o, (a2, b2, sl) in held.items())
        for phase, sender in (("fwd", s - 1), ("bwd", s + 1)):
            if 0 <= sender < P:
                waits = [(at[phase, i, sender][0] + 1, at[phase, i, s][0],
                          int(getattr(schedule, f"{phase}_from")[at[phase, i, s][0], s])) for i in range(M)]
                for a, b, slot in waits:  # (no slot: taken in the tick it lands)
                    assert int(getattr(schedule, f"{phase}_in")[a, s]) == slot
                    assert (slot < 0) == (a == b)
                    assert slot < 0 or sum(1 for a2, b2, sl in waits if sl == slot and a <= b2 and a2 <= b) == 1


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_zero_bubble_tables_and_their_bubble(stages):
    """ZB-H1's tables run several ops a stage a tick: fewer ticks than the one-op-a-tick
    theory's 3M + P - 1 and than its units (F, B and W one unit, a tick as long as its busiest
    stage), never under the theory. With the default residual cap (1F1B's 2P - 1) a stage
    holds as many microbatches' residuals as 1F1B, no arrival waits in an inbox, the idle is
    below 1F1B's at M = P, 2P and 4P and meets the theory exactly at 2P and 4P. With P - s on stage s
    (the cap where a hand-over cannot share its microbatch's slot): at most P microbatches,
    one B's hand-over to W and one F in the inbox; idle below 1F1B's at M = P only."""
    for m in (stages, 2 * stages, 4 * stages):
        zb, one = make_schedule("zb-h1", stages, m), make_schedule("1f1b", stages, m)
        check_zero_bubble_table(zb)
        assert one.idle() == pytest.approx(one.bubble())
        units = 3 * m / (1 - zb.idle())
        assert zb.ticks < units and units >= 3 * m + stages - 1 - 1e-9
        assert zb.slots == one.slots and zb.in_slots == 0 and zb.bwd_in_slots == 0
        assert zb.idle() < one.idle()
        if m >= 2 * stages:
            assert zb.idle() == pytest.approx(zb.bubble())
        narrow = make_schedule("zb-h1", stages, m, residual_cap=tuple(stages - s for s in range(stages)))
        check_zero_bubble_table(narrow)
        assert narrow.slots == stages and narrow.w_slots == 1 and narrow.in_slots == 1 and narrow.bwd_in_slots == 0
        if m == stages:
            assert narrow.idle() < one.idle()


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_zero_bubble_runs_each_f_and_b_in_1f1bs_tick(stages):
    """Under the cap 2P - 1, ZB-H1's tables run every F and B in the tick 1F1B runs it (F of
    microbatch i on stage s at tick i + s, B at i + 2P - 2 - s; up to M = 6P, the tables
    idling the theory's units from M = 2P): a stage whose cap would stop
    its next F runs a waiting W in the weight slot of its B's tick, so in the steady state each
    stage runs an F, a B and a W a tick (ZB-H1's 1F-1B-1W), and the Ws go where 1F1B's stages
    idle. Priced with B twice W's time, as traced on CPU (bench_zero_bubble.py before this
    rule, zero_bubble_2026-12-06b.json: F 75, B 82, W 39 ms a microbatch), the tables take no
    longer than 1F1B's, whose backward slot runs B
    and W together (before, Ws left for the next tick's forward slot stalled its F: 1.09x
    1F1B's at P = 2, M = 8; 0.96x now)."""
    from jaxshard.analysis.bubble import priced_step

    for m in range(stages, 6 * stages + 1):
        zb, one = make_schedule("zb-h1", stages, m), make_schedule("1f1b", stages, m)
        check_zero_bubble_table(zb)
        for phase in ("fwd", "bwd"):
            ticks = [{int(i): t for t, i in enumerate(getattr(table, phase)[:, s]) if i >= 0} for table in (zb, one)
                     for s in range(stages)]
            assert ticks[:stages] == ticks[stages:], (m, phase)
        assert one.fwd[m - 1 + stages - 1, stages - 1] == m - 1  # (1F1B: F of i on stage s at tick i + s)
        if m >= 2 * stages:  # and the theory's units, at every M (before: not at P = 2, M = 5, 9)
            assert zb.idle() == pytest.approx(zb.bubble()), m
        if m in (2 * stages, 4 * stages):
            f, b, w = 75 * m, 82 * m, 39 * m
            split = {str(s): {"F": f, "B": b, "W": w} for s in range(stages)}
            whole = {str(s): {"F": f, "B": b + w} if s < stages - 1 else {"last": f + b + w} for s in range(stages)}
            assert priced_step(zb, split) <= priced_step(one, whole), (m, priced_step(zb, split), priced_step(one, whole))


@pytest.mark.parametrize("mesh, microbatches, remat", [("stage=2,data=4", 4, "full"), ("stage=4,data=2", 8, "none"),
                                                       ("stage=4,data=2", 4, "full")])
def test_zero_bubble_tables_with_one_hand_over_match_one_device(mesh, microbatches, remat):
    """The cap at P - s on stage s: an F waits in the inbox, and Ws run in the forward slot
    as well as the weight slot. Under ``full`` (the step's cap for it: on 4 stages P - 1 on
    stage 0) B's hand-overs are larger than the residuals B alone reads and go to a slot of
    their own; without remat they overwrite those residuals (``pipeline.Handover``)."""
    _, ref_losses, ref_params = deep("tiny-llama")
    model = TransformerLM(get_preset("tiny-llama").replace(n_layers=4), remat=remat)
    stages = int(mesh.split(",")[0].split("=")[1])
    cap = tuple(stages - s for s in range(stages))
    narrow = make_schedule("zb-h1", stages, microbatches, layout=StageLayout.make(4, stages), residual_cap=cap)
    assert narrow.in_slots and (narrow.fwgt >= 0).any()
    losses, state, program = train(model, mesh, pipeline_schedule="zb-h1", microbatches=microbatches,
                                   schedule=None if remat == "full" else narrow)
    ran = program.schedule  # the step's: under full the cap's own, lowered on 4 stages at M = P
    assert ran.slots == (stages - 1 if remat == "full" and stages > 2 else stages)
    assert ran.in_slots and (ran.fwgt >= 0).any()
    step_cap = residual_cap(stages, remat, "flat", microbatches) if remat == "full" else cap
    assert ran.fwd.tolist() == make_schedule("zb-h1", stages, microbatches, residual_cap=step_cap).fwd.tolist()
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(program.saved(state).params, ref_params)


@pytest.mark.parametrize("name, mesh, microbatches, remat", [
    ("tiny-llama", "stage=2,data=4", 2, "none"), ("tiny-llama", "stage=2,data=4", 4, "none"),
    ("tiny-llama", "stage=2,data=4", 2, "dots"), ("tiny-llama", "stage=2,data=4", 4, "dots"),
    ("tiny", "stage=2,data=4", 4, "selective"), ("tiny-llama", "stage=4,data=2", 4, "none"),
    ("tiny-llama", "stage=4,data=2", 8, "none"), ("tiny-llama", "stage=4,data=2", 4, "dots"),
    ("tiny-llama", "stage=4,data=2", 8, "dots"), ("tiny", "stage=2,data=4", 2, "none"),
    ("tiny", "stage=2,data=4", 4, "dots"), ("tiny-llama", "data=2,stage=2,tensor=2", 4, "dots"),
    ("tiny", "data=2,stage=2,tensor=2", 4, "dots"), ("tiny-llama", "data=2,stage=2,tensor=2", 2, "none"),
    ("tiny", "data=2,stage=2,tensor=2", 2, "none"), ("tiny", "stage=2,fsdp=4", 4, "dots"),
    ("tiny-llama", "stage=2,fsdp=4", 2, "dots"), ("tiny", "stage=2,fsdp=4", 2, "dots"),
    ("tiny-llama", "stage=2,data=4", 4, "dots_no_batch"), ("tiny", "stage=2,data=4", 4, "names:qkv,attn_proj,mlp_in"),
    ("tiny-llama", "data=2,stage=2,tensor=2", 2, "selective"), ("moe-tiny", "data=2,stage=2,tensor=2", 4, "none"),
    ("tiny-llama", "data=2,stage=2,tensor=2", 2, "dots"),
    ("tiny-llama", "data=2,stage=2,tensor=2", 4, "dots_no_batch"), ("tiny-llama", "stage=2,data=4", 2, "dots_no_batch")])
def test_zero_bubble_keeps_no_more_than_1f1b(name, mesh, microbatches, remat):
    """Compiled temp bytes per device, at M = P and 2P: ZB-H1 keeps as many microbatches'
    residuals as 1F1B, each until its W, and B's hand-over to W over the residuals B alone
    read (the policies of ``pipeline.HANDOVER_FITS``: its norms and activations W runs again
    rather than keep, its norms' gradients B makes whole): no more than 1F1B's (under
    ``selective`` GPT-2's tiny was 1.04x at M = 2P before B made a LayerNorm's scale and bias
    together). (Under ``full``, whose W must be handed the matmul inputs B recomputed, it is
    more: docs/pipelines.md.) With a tensor or fsdp axis the hand-over is placed leaf by leaf
    over B-only residuals laid out alike, the rest in a slot of its own; under ``dots`` for a
    dense model (and for MoE layers under every policy) the cap is P - s: at M =
    2P, P microbatches and one hand-over against 1F1B's 2P - 1, no more under ``dots`` only
    where W makes again what the column
    projections' regions recompute (tensor) and what the gathered biases and norm scales make
    (fsdp; B hands W those weights). Without remat and under ``selective`` the cap is 2P - 1
    there too: at M = P, two microbatches and their hand-overs against two, no more with
    ``tensor=2`` only where the hand-over's leaves laid out as B-only residuals take their place (the
    gradients of the queries, keys and values, and on tiny-llama two of model width) and, on
    GPT-2, where B makes each LayerNorm's scale and bias together (either alone leaves W the
    cotangent both reduce); on ``fsdp=4`` under ``dots`` where the gradients of the MLP and
    the attention output are packed into the probabilities' rows (GPT-2's was 1.017x before
    B handed W the fewest bytes, ``split_backward._fewer_bytes``) and without remat, the FSDP
    placement test
    (``test_zero_bubble_with_split_gradients_places_the_hand_over_and_fetches_nothing_for_it``).
    Under ``dots_no_batch`` and ``names`` at M = 2P, whose hand-over keeps a slot of its own:
    no more now that B runs the attention's output again and hands it W rather than the
    probabilities (``split_backward._b_runs_it``; 1.11x on GPT-2's tiny before) and W makes a
    SwiGLU's gates' gradients from their product's (tiny-llama under names: 1.001x with the first
    alone, under dots_no_batch 0.995x). With ``tensor=2`` under ``selective`` at M = P where B
    hands W the gates' gradients outside the column projections' region, laid out as the gates
    B read there, whose place they take (1.001x handed out of the region per device). With
    ``tensor=2`` under ``dots`` at M = P and ``dots_no_batch`` at 2P where B writes its
    hand-over in its own branch, two layers a stage (1.031x and 1.003x written after B's
    conditional); on 4 stages of one layer each where it is written after (1.18-1.44x in B's
    branch). Under ``dots_no_batch`` at M = P on a flat mesh, where the hand-over is placed
    leaf by leaf as on a partitioned one (1.037x with all of it in a slot of its own)."""
    model = TransformerLM(get_preset(name).replace(n_layers=4), remat=remat)
    temp = {}
    for kind in ("1f1b", "zb-h1"):
        program = make_program(model, mesh, pipeline_schedule=kind, microbatches=microbatches)
        temp[kind] = program.lower_step(microbatches * 4, 64).compile().memory_analysis().temp_size_in_bytes
    assert temp["zb-h1"] <= temp["1f1b"], temp


@pytest.mark.parametrize("name, mesh, remat, layers", [
    ("tiny", "data=2,stage=2,tensor=2", "none", 4), ("tiny-llama", "stage=2,fsdp=4", "selective", 4),
    ("tiny-llama", "stage=4,tensor=2", "none", 8)])
def test_zero_bubble_with_a_partitioned_axis_idles_less_than_1f1b_in_no_more_memory(name, mesh, remat, layers):
    """Without remat and under ``selective``, a dense model's hand-over takes the B-only
    residuals' place leaf by leaf on a partitioned mesh (``Handover``), so the tables take
    1F1B's cap of 2P - 1 and idle less than 1F1B at M = 2P (P = 2: 0.077 against 0.200; the
    cap P - s idled 0.250, more than 1F1B) in no more compiled temp per device (0.95-0.99x
    1F1B's; P - s kept 0.66-0.80x)."""
    model = TransformerLM(get_preset(name).replace(n_layers=layers), remat=remat)
    stages = int(dict(a.split("=") for a in mesh.split(","))["stage"])
    temp, tables = {}, {}
    for kind in ("1f1b", "zb-h1"):
        program = make_program(model, mesh, pipeline_schedule=kind, microbatches=2 * stages)
        temp[kind] = program.lower_step(8 * stages, 64).compile().memory_analysis().temp_size_in_bytes
        tables[kind] = program.schedule
    assert tables["zb-h1"].slots == tables["1f1b"].slots == 2 * stages - 1
    assert tables["zb-h1"].idle() < tables["1f1b"].idle(), (tables["zb-h1"].idle(), tables["1f1b"].idle())
    assert temp["zb-h1"] <= temp["1f1b"], temp


@pytest.mark.parametrize("name, mesh, remat", [
    ("tiny-llama", "stage=4,tensor=2", "dots"), ("tiny", "stage=4,fsdp=2", "dots"),
    ("tiny-llama", "stage=4,fsdp=2", "dots"), ("tiny", "stage=4,tensor=2", "dots")])
def test_zero_bubble_on_4_stages_keeps_no_more_than_1f1b_at_m_equal_p(name, mesh, remat):
    """Where the hand-over keeps a slot of its own (``dots`` with a partitioned axis) on 4
    stages, the cap holds 3 microbatches on stage 0, not 4, for the same tables' idle: 3
    microbatches' residuals and one hand-over in a slot of its own, against 1F1B's 4 at M = P.
    Compiled temp per device, two layers a stage: no more than 1F1B's (1.10-1.17x with 4 on
    stage 0, measured before the leaf-by-leaf placement)."""
    model = TransformerLM(get_preset(name).replace(n_layers=8), remat=remat)
    temp = {}
    for kind in ("1f1b", "zb-h1"):
        program = make_program(model, mesh, pipeline_schedule=kind, microbatches=4)
        temp[kind] = program.lower_step(16, 64).compile().memory_analysis().temp_size_in_bytes
    assert program.schedule.slots == 3 and program.schedule.w_slots == 1
    assert temp["zb-h1"] <= temp["1f1b"], temp


def record_handovers(monkeypatch) -> list:
    """The ``pipeline.Handover`` of every zero-bubble program made from here on, in order."""
    from jaxshard.parallel import pipeline

    made, init = [], pipeline.Handover.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(pipeline.Handover, "__init__", record)
    return made


@pytest.mark.parametrize("name, mesh, zero, remat", [
    ("tiny", "stage=2,fsdp=4", 0, "none"), ("tiny", "stage=2,fsdp=4", 0, "dots"), ("tiny", "stage=2,data=4", 2, "none"),
    ("moe-tiny", "stage=2,fsdp=4", 0, "none")])
def test_zero_bubble_with_split_gradients_places_the_hand_over_and_fetches_nothing_for_it(
        monkeypatch, name, mesh, zero, remat):
    """Under FSDP and ZeRO-2/3, where every gradient is split, a hand-over leaf takes the
    place of a B-only residual laid out alike as with a tensor axis (``Handover``'s
    leaf-by-leaf placement), its write ordered after the tick's W by each device's own shard of
    the smallest gradient: the compiled step holds the same collectives as with the hand-over
    apart (the weights' gathers for compute; taking the gradient's first element would fetch
    it every tick), in less temp; at M = P without remat under 1F1B's (GPT-2's tiny on
    ``fsdp=4``: 0.957x; 0.943x under the cap P - s, apart 1.028x). The values are split by
    rows alone there, so the leaves shaped as no B-only residual (under ``dots`` the MLP's and the attention output's
    gradients) are packed into the rows of one (the attention's probabilities): all that stays
    apart is the weight gradients B makes whole. An MoE layer's expert buffers, laid out by
    rows with the experts first, are packed too (moe-tiny without remat)."""
    from jaxshard.parallel import pipeline

    model = TransformerLM(get_preset(name).replace(n_layers=4), remat=remat)

    def compiled(kind="zb-h1"):
        program = make_program(model, mesh, zero=zero, pipeline_schedule=kind, microbatches=2)
        c = program.lower_step(8, 64).compile()
        found = inspect.compiled_collectives(c, program.rules.mesh)
        return c.memory_analysis().temp_size_in_bytes, sorted((x.kind, x.bytes, x.executions) for x in found)

    init = pipeline.Handover.__init__
    made = record_handovers(monkeypatch)
    placed, sent = compiled()
    handover = made[-1]
    assert handover.into and {i for i, x in enumerate(handover.handed) if len(x.shape) >= 3} <= {
        *handover.into, *handover.packed}, (handover.into, handover.packed)
    assert bool(handover.packed) == (remat == "dots" or name == "moe-tiny")
    monkeypatch.setattr(pipeline.Handover, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "leafwise": False}))
    apart, sent_apart = compiled()
    assert sent == sent_apart
    assert placed < apart, (placed, apart)
    if mesh == "stage=2,fsdp=4" and remat == "none":
        assert placed <= compiled("1f1b")[0], placed


def test_zero_bubbles_cap_widens_only_where_a_hand_over_can_take_its_residuals_place():
    """1F1B's 2P - 1 where the policy's hand-over fits in the B-only residuals and no axis but
    stage and the executor's replicas splits a stage's values (a flat slot would gather them),
    and without remat or under ``selective`` on any mesh (placed leaf by leaf) where the model
    has no MoE layers; else P - s on stage s. The step's tables are the rule's:
    the narrow ones under ``dots`` with a tensor axis (an F waits in the inbox), the wide ones
    without remat there."""
    from jaxshard.parallel.pipeline import flat_slots, slot_layout

    assert flat_slots({"stage": 2, "data": 4, "tensor": 1}, ("data",))
    for sizes, replicas in (({"stage": 2, "data": 2, "tensor": 2}, ("data",)), ({"stage": 2, "data": 4}, ())):
        assert not flat_slots(sizes, replicas)
    assert slot_layout({"stage": 2, "data": 4}, ("data",)) == "flat"
    assert slot_layout({"stage": 2, "data": 4}, ()) == slot_layout({"stage": 2, "fsdp": 4}, ()) == "rows"
    assert slot_layout({"stage": 2, "data": 2, "tensor": 2}, ("data",)) == "split"
    assert slot_layout({"stage": 2, "fsdp": 2, "expert": 2}, ()) == "split"
    assert residual_cap(4, "none") == residual_cap(4, "dots") == residual_cap(4, "dots", "flat", 4) == 7
    assert residual_cap(4, "selective") == residual_cap(4, "selective", "split", 4) == 7
    for layout in ("rows", "split"):
        assert residual_cap(4, "none", layout) == residual_cap(4, "none", layout, 16) == 7
    # MoE layers: a flat slot only.
    assert residual_cap(4, "selective", "flat", 4, experts=True) == 7
    for remat, layout in (("none", "rows"), ("dots", "rows"), ("selective", "rows"), ("none", "split"),
                          ("selective", "split")):
        assert residual_cap(4, remat, layout, 4, experts=True) == (3, 3, 2, 1)
    for remat, layout in (("full", "flat"), ("dots", "split"), ("dots", "rows"), ("dots_no_batch", "flat"),
                          ("full", "rows"), ("names:qkv", "flat"), ("offload:qkv", "flat")):
        assert residual_cap(4, remat, layout) == (4, 3, 2, 1)
        assert residual_cap(4, remat, layout, 4) == (3, 3, 2, 1)
        assert residual_cap(4, remat, layout, 5) == residual_cap(4, remat, layout, 16) == (4, 3, 2, 1)
    for remat, narrow in (("dots", True), ("none", False)):
        model = TransformerLM(get_preset("tiny").replace(n_layers=4), remat=remat)
        schedule = make_program(model, "data=2,stage=2,tensor=2", pipeline_schedule="zb-h1", microbatches=4).schedule
        assert (schedule.slots, schedule.in_slots) == ((2, 1) if narrow else (3, 0)), remat
        assert schedule.handover_apart == narrow


def test_zero_bubble_tables_that_idle_more_than_1f1b_say_so():
    """The narrow cap's tables idle more than 1F1B's from M = P + 2; the run's log says so
    and by how much, from the tables (a quarter of the units against 1F1B's fifth at P = 2,
    M = 4). Where they idle less or the same (M = P + 1), and for 1F1B itself, nothing."""
    def narrow(stages, m):
        return make_schedule("zb-h1", stages, m, residual_cap=residual_cap(stages, "full", "flat", m))

    note = narrow(2, 4).idle_note()
    assert note.startswith("zb-h1's tables idle 25% here") and "1f1b's would 20%" in note
    assert "at most 2 microbatches" in note and note.endswith("--pipeline-schedule 1f1b may be faster")
    assert "idle 36% here" in narrow(4, 6).idle_note() and "1f1b's would 33%" in narrow(4, 6).idle_note()
    for quiet in (narrow(2, 2), narrow(2, 3), narrow(4, 4), narrow(4, 5), make_schedule("zb-h1", 2, 8),
                  make_schedule("1f1b", 2, 8)):
        assert quiet.idle_note() is None


def test_zero_bubble_runs_that_keep_more_than_1f1b_say_so():
    """Where B's hand-over surely keeps a slot of its own (full, dots_no_batch, names; a
    partitioned axis where the cap is P - s), the run's log says when the tables keep more than
    1F1B would: on 2 stages at M = P, two microbatches' residuals and a hand-over against two
    (the compiled temp there: 0.96-1.06x 1F1B's outside full, docs/pipelines.md); under full at
    any M (1.22-1.61x), and under names at any M (names:qkv,attn_proj 1.12-1.14x at M = 2P on a
    flat mesh). Where a stage keeps no more under dots (2 stages at M = 2P, 4 stages at
    M = P), under dots_no_batch at M = 2P on any mesh (0.76-0.97x; with a partitioned
    axis 0.95-1.003x before B wrote its hand-over in its own branch, when the line said so),
    where the hand-over takes the residuals' place (none, dots and selective on a flat mesh;
    none and selective with a partitioned axis), and for 1F1B, nothing. The note is the model's
    policy's, as the log gives it."""
    def note(mesh, remat, microbatches, layers=4):
        model = TransformerLM(get_preset("tiny").replace(n_layers=layers), remat=remat)
        schedule = make_program(model, mesh, pipeline_schedule="zb-h1", microbatches=microbatches).schedule
        return schedule.handover_apart, schedule.memory_note(model.remat)

    apart, line = note("data=2,stage=2,tensor=2", "dots", 2)
    assert apart and line.startswith("zb-h1 keeps up to 2 microbatches' residuals and 1 B-to-W hand-over a stage")
    assert "1f1b would keep 2 microbatches' residuals" in line and "more memory than 1f1b" in line
    assert "1f1b would keep 2" in note("stage=2,data=4", "full", 2)[1]
    for m in (4, 8):
        assert "under --remat full a hand-over holds every weight matmul's output gradient" in \
            note("stage=2,data=4", "full", m)[1]
    for remat in ("dots_no_batch", "names:qkv,attn_proj,mlp_in"):
        assert "1f1b would keep 2" in note("stage=2,data=4", remat, 2)[1]
    assert note("stage=2,data=4", "dots_no_batch", 4) == (True, None)
    assert note("data=2,stage=2,tensor=2", "dots_no_batch", 4) == note("stage=2,fsdp=4", "dots_no_batch", 4) \
        == (True, None)
    for mesh in ("stage=2,data=4", "data=2,stage=2,tensor=2"):
        assert "under --remat names a hand-over holds the matmul inputs that the names leave out" in \
            note(mesh, "names:qkv,attn_proj", 4)[1]
    assert note("data=2,stage=2,tensor=2", "dots", 4) == (True, None)
    assert note("data=2,stage=2,tensor=2", "none", 2) == (False, None)  # placed leaf by leaf, 1F1B's cap
    assert note("stage=2,data=4", "selective", 4) == (False, None)
    assert note("stage=2,data=4", "selective", 2) == (False, None)
    assert note("stage=2,data=4", "dots", 2) == (False, None)
    assert note("stage=4,tensor=2", "dots", 4) == (True, None)  # 3 microbatches and a hand-over against 4
    assert make_schedule("1f1b", 2, 2).memory_note("full") is None


def test_under_full_remat_zero_bubbles_excess_over_1f1b_is_its_hand_over(monkeypatch):
    """Under ``full`` a microbatch's hand-over from B to W (every weight matmul's output
    gradient and the matmul inputs B made again) is many times what 1F1B keeps of it, its
    layer inputs, and nothing takes its place: ZB-H1's compiled temp exceeds 1F1B's by at least
    that hand-over (tiny-llama on stage=2,data=4 at M = 2, as docs/pipelines.md gives it)."""
    model = TransformerLM(get_preset("tiny-llama").replace(n_layers=4), remat="full")
    made = record_handovers(monkeypatch)
    temp = {}
    for kind in ("1f1b", "zb-h1"):
        program = make_program(model, "stage=2,data=4", pipeline_schedule=kind, microbatches=2)
        temp[kind] = program.lower_step(8, 64).compile().memory_analysis().temp_size_in_bytes
    handover = made[-1]
    assert not handover.b_only and not handover.shared and not handover.into and not handover.packed
    handed = handover.w_slots * sum(x.size * x.dtype.itemsize for x in handover.handed)  # per device
    layers, rows, d = 2, 1, model.cfg.d_model  # a stage's layers; one row a microbatch a device
    kept_by_1f1b = layers * rows * 64 * d * 4  # its layer inputs, float32
    assert handed > 2 * 7 * kept_by_1f1b, (handed, kept_by_1f1b)  # 1F1B's whole store 7 times over (7.3x)
    assert temp["zb-h1"] - temp["1f1b"] >= handed, (temp, handed)


def test_the_narrow_cap_keeps_fewer_residuals_for_nothing():
    """Where a hand-over needs a slot of its own, the cap P - s is lowered where that costs
    nothing: the tables idle no more, keep no more hand-overs and waiting arrivals, and take
    at most one tick more. From 3 stages at M = P a stage holds P - 1 microbatches; on 2
    stages it cannot (1 microbatch idles more); at M > P the ticks would grow by up to a
    third (3 and 4 stages) and the hand-overs double (from 5)."""
    for stages in range(2, 7):
        narrow = tuple(stages - s for s in range(stages))
        for m in range(stages, 3 * stages + 1):
            wide = make_schedule("zb-h1", stages, m, residual_cap=narrow)
            tables = make_schedule("zb-h1", stages, m, residual_cap=residual_cap(stages, "full", "flat", m))
            check_zero_bubble_table(tables)
            assert tables.idle() <= wide.idle() + 1e-9 and tables.w_slots <= wide.w_slots
            assert tables.in_slots + tables.bwd_in_slots <= wide.in_slots + wide.bwd_in_slots
            assert tables.ticks <= wide.ticks + 1
            fewer = stages > 2 and m == stages
            assert tables.slots == (stages - 1 if fewer else stages), (stages, m)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_ticks_sends_come_after_all_its_work(schedule):
    """A send is a rendezvous of the stages: in the compiled (scheduled) tick, both sends come
    after every slot's conditional, so that a tick lasts as long as its slower stage's work
    (the tables' count), not the slower stage's before a send plus the slower's after it."""
    model, _, _ = deep("tiny-llama")
    program = make_program(model, "stage=2,data=4", pipeline_schedule=schedule, microbatches=4)
    text = program.lower_step(16, 64).compile().as_text()
    ticks = [body for body in re.split(r"\n(?=\S)", text) if "collective-permute(" in body and "conditional(" in body]
    assert ticks, "no computation with both the sends and the slots"
    for body in ticks:
        lines = body.splitlines()
        sends = [n for n, line in enumerate(lines) if " collective-permute(" in line]
        slots = [n for n, line in enumerate(lines) if " conditional(" in line]
        assert len(sends) == 2 and len(slots) >= 2 and max(slots) < min(sends), (slots, sends)


def test_a_hand_over_is_packed_into_a_residual_only_where_that_frees_what_the_residual_holds_longer():
    """A B-only leaf that takes packed hand-over leaves is held from F to W (``slots`` rows
    where it had ``b_slots``): ``Handover`` packs into it only where that frees at least as
    much of the hand-over's own slots (``w_slots``)."""
    from types import SimpleNamespace

    import jax.numpy as jnp
    from jaxshard.parallel.pipeline import Handover

    table = SimpleNamespace(slots=3, b_slots=2, w_slots=1)  # a row held one slot longer
    f32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)  # noqa: E731
    host = [f32(2, 4, 6, 2)]  # 96 elements a slot, 12 a row of 4 rows (2 tokens each)
    assert Handover(host, [f32(2, 8, 3)], table, False, leafwise=True, rows=(4, 2)).packed == {}  # 48 < 96
    both = Handover(host, [f32(2, 8, 3), f32(2, 4, 2, 3)], table, False, leafwise=True, rows=(4, 2))
    assert both.packed == {0: (0, 0), 1: (0, 6)} and both.hosts == {0}


@pytest.mark.parametrize("cap, b_only, handed, flat, shared, into, rows, packed", [
    # B-only residuals and hand-over share a slot
    (None, [(4, 3), (2,), (5,)], [(5,), (3, 2), (2, 2)], True, True, {}, None, {}),
    ((2, 1), [], [(6,), (2, 2), (3,)], True, False, {}, None, {}),  # none B-only (``full``): the hand-over's own slot
    # Split values, leaf by leaf: a hand-over leaf over the B-only leaf of its layout (rows of 4
    # split in two, the same shape), the one without in a slot of its own.
    ((2, 1), [(4, 3), (2, 6), (5,)], [(2, 2, 3), (7,), (5,)], False, False, {0: 0, 2: 2}, None, {}),
    # Split by rows alone (2 layers, 4 rows of 2 tokens): leaves laid out by rows packed into a
    # B-only leaf's rows, [layers, tokens, ...] at 0 and [layers, rows, tokens, ...] at 6 of its 12
    # a row; the rest as above.
    ((2, 1), [(2, 4, 6, 2), (5,)], [(2, 8, 3), (5,), (2, 4, 2, 2), (2, 3, 3)], False, False, {1: 1}, (4, 2),
     {0: (0, 0), 2: (0, 6)}),
])
def test_a_hand_over_store_gives_back_what_each_microbatch_left_in_it(cap, b_only, handed, flat, shared, into,
                                                                     rows, packed):
    """``pipeline.Handover``: in its one slot per microbatch, or apart, each microbatch's B-only
    residuals (float32 and bfloat16) come back at its B and its hand-over at its W, whatever
    the others wrote meanwhile; a tick without B writes back what the slot held."""
    import jax.numpy as jnp
    from jaxshard.parallel.pipeline import Handover

    table = make_schedule("zb-h1", 2, 4, residual_cap=cap)
    dtypes = (jnp.float32, jnp.bfloat16)
    shapes = lambda dims: [jax.ShapeDtypeStruct(d, dtypes[n % 2]) for n, d in enumerate(dims)]  # noqa: E731
    store_of = Handover(shapes(b_only), shapes(handed), table, flat, leafwise=True, rows=rows)
    assert store_of.shared is shared and store_of.into == into and store_of.packed == packed
    values = lambda dims, seed: [jax.random.normal(jax.random.key(seed + n), d).astype(dtypes[n % 2])  # noqa: E731
                                 for n, d in enumerate(dims)]
    w_slot = lambda i: i if shared else i % table.w_slots  # noqa: E731
    store = store_of.zeros()
    for i in range(2):  # microbatch i in slot i (its B-only slot too, apart)
        store = store_of.keep_res(store, values(b_only, 10 * i), i, i)
    # A tick without B over microbatch 1's slot, whose B-only residuals wait for their B.
    store = store_of.keep_handed(store, store_of.handed_to_w(store, 1, w_slot(1)), 1, w_slot(1))
    # Each B in turn, then its W: apart, the hand-over slot is microbatch i's modulo w_slots
    # (the narrow table holds one), so the second B overwrites the first's slot of its own.
    for i in range(2):
        for got, want in zip(store_of.res(store, i, i), values(b_only, 10 * i)):
            np.testing.assert_array_equal(got, want)
        store = store_of.keep_handed(store, values(handed, 100 + i), i, w_slot(i))
        idle = store_of.keep_handed(store, store_of.handed_to_w(store, 0, w_slot(0)), 0, w_slot(0))
        for got, want, again in zip(store_of.handed_to_w(store, i, w_slot(i)), values(handed, 100 + i),
                                    store_of.handed_to_w(idle, i, w_slot(i))):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(again, want)
    # Both hand-overs held at once: all of them shared, the leaves placed or packed apart (each
    # microbatch's in its own slot; the rest share the one slot of their own).
    held = [i for i in range(len(handed)) if shared or i in store_of.into or i in store_of.packed]
    got = store_of.handed_to_w(store, 0, w_slot(0))
    for i in held:
        np.testing.assert_array_equal(got[i], values(handed, 100)[i])


def test_a_hand_over_leaf_takes_a_b_only_leafs_place_only_laid_out_alike():
    """``pipeline.same_layout``: the same shape; or, but for exact matches only, one dim other
    than the last split in two (tokens into rows, heads into groups of a shared key) or a dim
    of 1 added. A model-width feature dim split into heads, or dims regrouped, are not alike."""
    from jaxshard.parallel.pipeline import same_layout

    assert same_layout((2, 4, 64, 8), (2, 4, 64, 8))
    assert not same_layout((2, 256, 64), (2, 4, 64, 64))  # exact only
    for a, b in [((2, 256, 64), (2, 4, 64, 64)), ((2, 4, 64, 8, 8), (2, 4, 64, 2, 4, 8)),
                 ((2, 4, 64, 8, 8), (2, 4, 64, 8, 1, 8))]:
        assert same_layout(a, b, exact=False) and same_layout(b, a, exact=False), (a, b)
    for a, b in [((2, 4, 64, 64), (2, 4, 64, 8, 8)), ((2, 4, 64, 64), (2, 4, 64, 8, 1, 8)),
                 ((2, 2, 256, 128), (2, 4, 64, 256)), ((2, 4, 64), (2, 4, 8, 8, 1)), ((4, 3), (3, 4))]:
        assert not same_layout(a, b, exact=False), (a, b)


@functools.cache
def deep(name: str, layers: int = 4):
    """``name`` with 4 layers (so 4 stages have one each), or ``layers``, and its one-device run."""
    model = TransformerLM(get_preset(name).replace(n_layers=layers))
    losses, state, _ = train(model, "data=1")
    return model, losses, jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])  # GPT-2 with its tied table; Llama with GQA
@pytest.mark.parametrize("mesh, schedule, microbatches, zero, layers, pipeline", [
    ("stage=2", "naive", None, 0, 4, {}),
    ("stage=2,data=4", "gpipe", 4, 0, 4, {}),
    ("stage=4,data=2", "1f1b", 8, 0, 4, {}),
    ("stage=2,data=4", "interleaved", 2, 0, 4, {}),  # one layer per chunk
    ("stage=4,data=2", "interleaved", 4, 0, 8, {}),
    ("data=2,stage=2,tensor=2", "1f1b", 2, 0, 4, {}),
    ("data=2,stage=2,tensor=2", "interleaved", 4, 0, 8, dict(virtual_stages=2, stage_layers=(3, 2, 2, 1))),
    ("fsdp=2,stage=4", "gpipe", 4, 0, 4, {}),
    ("stage=2,data=4", "1f1b", 2, 1, 4, {}),
    ("stage=2,data=4", "1f1b", 4, 0, 4, dict(stage_layers=(3, 1))),  # uneven: stage 1 has an empty slot
    ("stage=2,data=4", "zb-h1", 4, 0, 4, {}),
    ("stage=4,data=2", "zb-h1", 4, 0, 4, {}),
    ("data=2,stage=2,tensor=2", "zb-h1", 4, 0, 4, {}),  # B and W of the column projections' regions
    ("stage=2,fsdp=4", "zb-h1", 2, 0, 4, {}),  # the hand-over placed leaf by leaf, params split
    ("stage=2,data=4", "zb-h1", 2, 3, 4, {}),  # ZeRO-3: the same placement, over data
])
def test_pipeline_matches_one_device(name, mesh, schedule, microbatches, zero, layers, pipeline):
    model, ref_losses, ref_params = deep(name, layers)
    losses, state, program = train(model, mesh, zero=zero, pipeline_schedule=schedule,
                                   microbatches=microbatches, **pipeline)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    # Compared in model layer order (a layout with chunks or empty slots stores it otherwise).
    assert_params_close(program.saved(state).params, ref_params)
    assert_live_shardings(state, program)
    # Each device stores only its stage's layers: the stack's leading dim is split over stage.
    stages = program.rules.sizes["stage"]
    for leaf in jax.tree.leaves(state.params["blocks"]):
        first = leaf.sharding.spec[0]
        assert "stage" in (first if isinstance(first, tuple) else (first,)), leaf.sharding.spec
        assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // stages


@pytest.mark.parametrize("mesh, schedule, microbatches, sp", [
    ("stage=4,data=2", "1f1b", 4, False), ("stage=2,data=4", "gpipe", 2, False),
    ("data=2,stage=2,tensor=2", "1f1b", 4, True), ("stage=2,data=4", "interleaved", 4, False)])
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


@pytest.mark.parametrize("name, mesh, step, strategy", [
    ("tiny-llama", "stage=2,data=4", dict(pipeline_schedule="gpipe", microbatches=2), {}),
    ("tiny", "stage=2,data=4", dict(pipeline_schedule="1f1b", microbatches=4), dict(zero=1)),
    ("tiny", "data=2,stage=2,tensor=2", dict(pipeline_schedule="1f1b", microbatches=4),
     dict(sequence_parallel=True)),
    ("tiny", "fsdp=2,stage=4", dict(pipeline_schedule="gpipe", microbatches=4), {}),
    ("tiny-llama", "stage=2,data=4", dict(pipeline_schedule="interleaved", microbatches=4,
                                          stage_layers=(1, 2, 1, 1)), {}),
    ("tiny", "data=2,stage=2,tensor=2", dict(pipeline_schedule="zb-h1", microbatches=4), {}),
])
def test_the_verifier_predicts_a_pipelined_step(name, mesh, step, strategy):
    """``experiments/inspect.py`` on a pipelined step: every collective outside the schedule's
    slots (stage sends, the once-a-step gradient reductions, ZeRO-1's gather, the position
    rows' gradient under SP) is the compiled step's within 1%, kind by kind and axis by axis,
    the argument bytes are the stage's share, and what runs inside the slots is listed apart."""
    model = TransformerLM(get_preset(name).replace(n_layers=sum(step.get("stage_layers", ())) or 4))
    program = make_program(model, mesh, **strategy, **step)
    compiled = program.lower_step(16, 32).compile()
    v = inspect.verify(model, program, compiled, 16, 32)
    assert not v.flags, v.flags
    for kind, axes, predicted, found in v.collectives:
        assert abs(found - predicted) <= 0.01 * predicted + 8, (kind, axes, predicted, found)
    assert {kind for kind, _, _, found in v.collectives if found} >= {"collective-permute", "all-reduce"}
    text = inspect.format_verification(v)
    if "fsdp" in mesh or "tensor" in mesh:
        assert v.in_slots and "in the pipeline's slots" in text
    # The params each device stores: its stage's chunks, from the live layout.
    stored = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                 for x in jax.tree.leaves(program.layout.abstract.params))
    assert dict((m[0], m[1]) for m in v.memory)["params"] == pytest.approx(stored, rel=0.01)


@pytest.mark.parametrize("mesh, zero", [("stage=2,data=4", 0), ("stage=2,data=4", 1), ("data=2,stage=2,tensor=2", 0)])
def test_data_parallel_gradients_are_reduced_once_per_step_not_per_microbatch(mesh, zero):
    """DDP (and ZeRO-1) across stage replicas: each device accumulates its rows' gradients over
    the microbatches, and the compiled step reduces them over ``data`` once -- the stage's
    layers and the outer params, whatever M is, and nothing inside the schedule's loop."""
    model, _, _ = deep("tiny-llama")
    for m in (2, 4, 8):
        program = make_program(model, mesh, zero=zero, pipeline_schedule="gpipe", microbatches=m)
        compiled = program.lower_step(32, 32).compile()
        found = [c for c in inspect.compiled_collectives(compiled, program.rules.mesh) if "data" in c.axes]
        assert found and not [c for c in found if c.executions > 1 or c.conditional], found
        reduced = sum(c.bytes for c in found if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 4)
        # One float32 gradient of every param a device holds (its stage's layers and the outer
        # params), read from the live layout's abstract shapes, not from the accounting.
        stage_params = sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(
            program.layout.abstract.params))
        assert abs(reduced - 4 * stage_params) <= 0.01 * reduced, (m, reduced, 4 * stage_params)


@pytest.mark.parametrize("mesh, schedule, microbatches, layout", [
    ("stage=2,data=4", "1f1b", 4, {}), ("data=2,stage=2,tensor=2", "gpipe", 2, {}),
    ("stage=2,data=4", "interleaved", 4, dict(stage_layers=(1, 2, 1, 1))),
    ("stage=2,data=4", "zb-h1", 4, {}),
    # (a neighbour's output waits in the inbox for its forward)
    ("stage=2,data=4", "zb-h1", 4, dict(schedule=make_schedule("zb-h1", 2, 4, layout=StageLayout.make(4, 2),
                                                                residual_cap=(2, 1))))])
def test_evaluation_runs_the_pipeline_and_gathers_no_stage(mesh, schedule, microbatches, layout):
    """The validation loss of a pipelined run comes from the stages' forward slots: the one
    device's loss, with no layer weight gathered across stages (a plain layer scan would
    all-gather every stage's layers onto every device)."""
    layers = sum(layout.get("stage_layers", ())) or 4
    model, _, _ = deep("tiny-llama", layers)
    reference = make_program(model, "data=1")
    program = make_program(model, mesh, pipeline_schedule=schedule, microbatches=microbatches, **layout)
    batch = random_batches(model.cfg.vocab_size, seed=3)[0]
    want = float(reference.eval(reference.init(0).params, jax.device_put(batch, reference.batch_sharding)))
    got = float(program.eval(program.init(0).params, jax.device_put(batch, program.batch_sharding)))
    assert abs(got - want) <= RTOL * want, (got, want)
    compiled = program.eval.lower(program.layout.abstract.params, program.abstract_batch(16, 32)).compile()
    found = inspect.compiled_collectives(compiled, program.rules.mesh)
    assert not [c for c in found if c.kind == "all-gather" and "stage" in c.axes], found
    assert [c for c in found if c.kind == "collective-permute" and "stage" in c.axes]


def test_each_device_holds_its_stage_of_the_layer_stack():
    model, _, _ = deep("tiny-llama")
    _, state, program = train(model, "stage=4,data=2", pipeline_schedule="1f1b", microbatches=4)
    # Per device: about a quarter of the layer stack (plus the replicated embedding ends).
    stack = sum(x.nbytes for x in jax.tree.leaves(state.params["blocks"]))
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params["blocks"]))
    assert math.isclose(held, stack / 4)


@pytest.mark.parametrize("mesh, schedule, microbatches, remat", [
    ("stage=2,data=4", "1f1b", 4, "dots"),  # the CPU default: matmul outputs kept, the rest recomputed
    ("fsdp=2,stage=4", "gpipe", 4, "full"),  # each layer's input kept; gathered weights never
    ("stage=2,data=4", "interleaved", 2, "selective"),
    ("stage=2,data=4", "zb-h1", 4, "selective"),  # the hand-over over the B-only residuals, cap 2P - 1
    ("stage=2,fsdp=4", "zb-h1", 2, "dots"),  # hand-over leaves packed into the B-only residuals' rows
    ("stage=2,data=4", "zb-h1", 4, "dots_no_batch"),  # B runs the attention's output matmul, W the gates'
    ("data=2,stage=2,tensor=2", "zb-h1", 2, "dots"),  # W makes the gates' gradients outside their region
])
def test_pipeline_keeps_what_the_remat_policy_keeps_and_matches_one_device(mesh, schedule, microbatches, remat):
    """A stage keeps its pullback's residuals between a microbatch's forward and backward slots:
    what the model's recompute policy saves; the backward slot recomputes the rest."""
    model, ref_losses, ref_params = deep("tiny-llama")
    model = TransformerLM(model.cfg, remat=remat)
    losses, state, program = train(model, mesh, pipeline_schedule=schedule, microbatches=microbatches)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(program.saved(state).params, ref_params)


@pytest.mark.parametrize("flags, message", [
    (dict(pipeline_schedule="gpipe"), "--pipeline-schedule needs a stage axis of size > 1 in --mesh"),
    (dict(microbatches=2), "--microbatches needs a stage axis of size > 1 in --mesh"),
])
def test_pipeline_flags_without_a_stage_axis_are_errors(flags, message):
    model, _, _ = deep("tiny")
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(model, "data=8", **flags)


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_the_accounting_predicts_what_a_kept_microbatch_costs(remat):
    """GPipe's compiled temp grows by one kept microbatch per microbatch: the residuals of a
    stage's layers and its input. The accounting's figure for it (``pipeline_memory``, the
    difference one more kept microbatch makes) is that growth within 10%, per remat policy."""
    model = TransformerLM(get_preset("tiny-llama").replace(n_layers=4), remat=remat)
    stages, rows, seq = 4, 2, 64  # rows per microbatch per device (data=2)

    def program(m):
        return make_program(model, "stage=4,data=2", pipeline_schedule="gpipe", microbatches=m)

    def temp(m):
        return program(m).lower_step(m * rows * 2, seq).compile().memory_analysis().temp_size_in_bytes

    grown = (temp(4 * stages) - temp(2 * stages)) / (2 * stages)
    predicted = [accounting.pipeline_memory(model, p.rules, p.schedule, m * rows * 2, seq, remat=model.remat)
                 for m in (4 * stages, 4 * stages - 1) for p in [program(m)]]
    kept = predicted[0].activations - predicted[1].activations
    assert abs(kept - grown) <= 0.1 * grown, (remat, kept, grown)


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_1f1b_keeps_a_microbatchs_residuals_and_not_its_input_again(remat):
    """1F1B's last stage runs a microbatch's forward and backward in one tick, so no stage keeps
    its inputs beside the residuals (which hold them where the backward pass needs them). From
    M = P to 2P a stage keeps P - 1 more microbatches: the compiled temp grows by what the
    accounting says P - 1 microbatches' residuals are, within 10%; under ``full`` (one layer a
    stage, whose residual is its input) by one stage input each, not two."""
    model = TransformerLM(get_preset("tiny-llama").replace(n_layers=4), remat=remat)
    stages, rows, seq = 4, 2, 64  # rows per microbatch per device (data=2)
    programs = {m: make_program(model, "stage=4,data=2", pipeline_schedule="1f1b", microbatches=m)
                for m in (stages, 2 * stages)}
    assert not any(p.schedule.keeps_inputs for p in programs.values())
    assert [p.schedule.slots for p in programs.values()] == [stages, 2 * stages - 1]
    temp = {m: p.lower_step(m * rows * 2, seq).compile().memory_analysis().temp_size_in_bytes
            for m, p in programs.items()}
    kept = {m: accounting.pipeline_memory(model, p.rules, p.schedule, m * rows * 2, seq,
                                          remat=model.remat).activations for m, p in programs.items()}
    grown, predicted = temp[2 * stages] - temp[stages], kept[2 * stages] - kept[stages]
    assert abs(predicted - grown) <= 0.1 * grown, (remat, predicted, grown)
    if remat == "full":
        one_input = rows * seq * model.cfg.d_model * 4  # float32
        assert grown / (stages - 1) < 1.5 * one_input, (grown, one_input)


def test_1f1b_keeps_activations_flat_in_microbatches_where_gpipe_grows():
    """Compiled temp bytes per device as M grows from P to 4P at a fixed microbatch size: GPipe
    keeps every microbatch's activations (a stage's residuals) until its backward turn, so its
    temp grows by the same amount per microbatch; 1F1B keeps at most 2P - 1 microbatches'."""
    model, _, _ = deep("tiny-llama")
    stages, rows, seq = 4, 2, 64  # rows per microbatch per device (data=2)
    one_input = rows * seq * model.cfg.d_model * 4  # a stage input, float32

    def temp(kind, m):
        program = make_program(model, "stage=4,data=2", pipeline_schedule=kind, microbatches=m)
        return program.lower_step(m * rows * 2, seq).compile().memory_analysis().temp_size_in_bytes

    gpipe = [temp("gpipe", m) for m in (stages, 2 * stages, 4 * stages)]
    ones = [temp("1f1b", m) for m in (stages, 2 * stages, 4 * stages)]
    # GPipe: linear in M, each microbatch keeping at least its stage input.
    per_micro = (gpipe[2] - gpipe[1]) / (2 * stages)
    assert per_micro >= one_input
    assert abs((gpipe[1] - gpipe[0]) / stages - per_micro) <= 0.1 * per_micro, gpipe
    assert ones[2] - ones[1] < 0.5 * per_micro, ones  # flat once M > 2P - 1
    # From P to 2P - 1 microbatches kept (and the larger batch's token copies).
    assert ones[2] - ones[0] <= (stages - 1 + 0.5) * per_micro, ones


@pytest.mark.parametrize("mesh, schedule, microbatches, layout", [
    ("stage=2,data=4", "1f1b", 4, {}), ("data=2,stage=2,tensor=2", "gpipe", 2, {}),
    ("data=2,stage=2,tensor=2", "zb-h1", 2, {}),
    ("stage=2,data=4", "interleaved", 2, dict(stage_layers=(1, 2, 1, 1)))])  # chunks, empty slots
def test_dropout_under_a_pipeline_drops_what_one_device_drops(mesh, schedule, microbatches, layout):
    layers = sum(layout.get("stage_layers", ())) or get_preset("tiny").n_layers
    model = TransformerLM(get_preset("tiny").replace(dropout=0.1, n_layers=layers))
    ref_losses, ref_state, _ = train(model, "data=1")
    losses, state, program = train(model, mesh, pipeline_schedule=schedule, microbatches=microbatches, **layout)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(program.saved(state).params, jax.tree.map(np.asarray, ref_state.params))


def test_interleaved_keeps_activations_flat_in_microbatches():
    """As 1F1B: from M = 2P on, the compiled temp bytes do not grow with M (at most (V + 1) P
    - 1 chunk inputs kept)."""
    model, _, _ = deep("tiny-llama")
    rows, seq = 2, 64  # per microbatch per device (data=4)
    one_input = rows * seq * model.cfg.d_model * 4

    def temp(m):
        program = make_program(model, "stage=2,data=4", pipeline_schedule="interleaved", microbatches=m)
        return program.lower_step(m * rows * 4, seq).compile().memory_analysis().temp_size_in_bytes

    flat = [temp(m) for m in (4, 8, 16)]
    assert max(flat) - min(flat) < one_input, flat


def test_assign_gives_the_stage_with_the_head_fewer_layers():
    costs = Costs(layer=1.0, embed=0.0, head=3.0, unit="s")
    layers = assign(8, 2, costs)
    assert sum(layers) == 8 and layers[1] < layers[0]
    assert max(costs.stage(u, 2, n) for u, n in enumerate(layers)) == 6.0  # the even split's is 7
    assert assign(8, 4, Costs(1.0, 0.0, 0.0, "s")) == (2, 2, 2, 2)
    assert assign(12, 4, Costs(1.0, 2.0, 4.0, "s")) == (3, 4, 4, 1)  # ends: 5, 4, 4, 5
    with pytest.raises(ConfigError, match="3 layers cannot fill 4"):
        assign(3, 4, costs)


@pytest.mark.parametrize("how", ["flops", "profile"])
def test_balance_gives_a_heavy_head_fewer_layers(how):
    """A large vocabulary makes the last stage's head worth several layers: both cost models
    see it (the profile by timing it on this machine) and give that stage fewer layers."""
    model = TransformerLM(get_preset("tiny-llama").replace(n_layers=8, vocab_size=16384))
    rules = make_program(deep("tiny-llama")[0], "stage=2,data=4").rules
    cfg, line = balance_stages(model, rules, StepConfig(pipeline_schedule="1f1b", microbatches=2,
                                                        balance=how), 16, 64)
    first, last = cfg.stage_layers
    assert first + last == 8 and last < first, line
    assert line.startswith(f"--balance {how}: --stage-layers {first},{last}")


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _unordered(hlo: str) -> list[tuple[str, str]]:
    """(collective, region) for each collective that shares a computation with a loop or a
    conditional holding collectives (in its body or branches, or what they call) and is
    neither an operand of it, transitively, nor made from its result: nothing but XLA:CPU's
    runtime orders the two."""
    comps, calls, where = {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            where = head.group(1)
            comps[where], calls[where] = {}, set()
            continue
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)", line)
        if m and where:
            name, op, rest = m.groups()
            called = set(re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", rest))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
                called |= set(re.findall(r"%([\w.\-]+)", group))
            comps[where][name] = (op, set(re.findall(r"%([\w.\-]+)", rest)), called)
            calls[where] |= called

    @functools.cache
    def communicates(comp: str) -> bool:
        return any(op in _COLLECTIVES for op, _, _ in comps[comp].values()) or any(map(communicates, calls[comp]))

    found = []
    for instrs in comps.values():
        def ancestors(name):
            seen, todo = set(), [name]
            while todo:
                for a in instrs[todo.pop()][1]:
                    if a in instrs and a not in seen:
                        seen.add(a)
                        todo.append(a)
            return seen

        regions = [n for n, (op, _, called) in instrs.items()
                   if op in ("while", "conditional") and any(map(communicates, called))]
        collectives = [n for n, (op, _, _) in instrs.items() if op in _COLLECTIVES]
        found += [(c, r) for r in regions for c in collectives if c not in ancestors(r) and r not in ancestors(c)]
    return found


@pytest.mark.parametrize("name, mesh, schedule, left", [
    ("tiny-llama", "stage=2,fsdp=4", "1f1b", []), ("moe-tiny", "fsdp=2,stage=2,expert=2", "1f1b", ["loss"]),
    ("tiny-llama", "data=2,stage=2,tensor=2", "1f1b", []), ("tiny-llama", "stage=2,fsdp=4", "zb-h1", []),
    ("tiny", "fsdp=2,stage=2,tensor=2", "1f1b", [])])
def test_every_collective_is_ordered_by_data_against_the_ticks_branches_and_loops(name, mesh, schedule, left,
                                                                                  monkeypatch):
    """XLA:CPU runs a computation's independent ops in whatever order they become ready, so
    the fake devices may take a collective and a loop or branch holding collectives in
    different orders and wait in each for the other. The MoE pipeline test hung so under load:
    one device gathering the head's params (FSDP) beside the last stage's layers' loop, the
    other in the loop. On CPU the last stage gathers what its head reads before its layers and
    reduces the head's gradients before its backward loop, each made an input of the loop
    (``StagedModel``'s ``gathered_first``), and a tick's sends wait for its last op on every
    mesh: in the compiled step no collective beside such a region is left unordered by data
    (each case failed before: the head's gathers, its gradients' reductions, or a send beside
    the backward slot's branch) but, with MoE layers on fsdp, the loss's sum over the stage's
    rows beside the backward loop (``left``; ordering it would add that all-reduce where the
    sum is otherwise left to the step's end; it has not hung). The ordering adds no
    collective: the step compiled without the CPU's ordering of the head's params holds the
    same ones, kind and shape (each device reads its own shard; read whole, the vocabulary-split
    head on ``tensor=2`` was gathered once more)."""
    model = TransformerLM(get_preset(name).replace(n_layers=4))

    def compiled():
        program = make_program(model, mesh, microbatches=2, pipeline_schedule=schedule)
        return program.lower_step(8, 64).compile().as_text()

    def collectives(text):
        return sorted(re.findall(r"= (\S+) (" + "|".join(_COLLECTIVES) + r")\(", text))

    hlo = compiled()
    monkeypatch.setattr(pipeline, "orders_by_data", lambda: False)
    assert collectives(hlo) == collectives(compiled())
    assert "while(" in hlo and "conditional(" in hlo
    lines = {m.group(1): m.group(0) for m in re.finditer(r"%([\w.\-]+) = [^\n]*", hlo)}
    found = ["loss" if "pipeline_tick_last/jvp()/reduce_sum" in lines[c] and " f32[] all-reduce(" in lines[c]
             else lines[c][:200] for c, _ in _unordered(hlo)]
    assert found == left
