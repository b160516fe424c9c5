"""Local SGD (``--sync-every H``): H = 1 trains as DDP and one device; with H > 1 the local
steps are one device's steps on a replica's rows, the synchronising steps DDP's step from the
replicas' average, and a checkpoint of diverged replicas resumes exactly."""

import functools
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from harness import BATCH, OPTIM, SEQ, assert_params_close, make_program, reference
from jaxshard.analysis import inspect
from jaxshard.analysis.inspect import compiled_collectives
from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.rules import ShardingRules, Strategy
from jaxshard.training import local_sgd
from jaxshard.training.checkpoint import CheckpointConfig, CheckpointError, Checkpointer, param_shapes
from jaxshard.training.state import TrainState
from jaxshard.training.step import StepConfig
from models import TransformerLM, get_preset

MODEL = TransformerLM(get_preset("tiny"))
H = 4
STEPS = 9  # two synchronisations (steps 4 and 8) and the steps after them


def batches(steps: int = STEPS, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The harness's random batches (its first 5 are these), as many as asked."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        inputs = rng.integers(0, MODEL.cfg.vocab_size, (BATCH, SEQ), dtype=np.int32)
        out.append({"inputs": inputs, "targets": (inputs * 7 + 3) % MODEL.cfg.vocab_size})
    return out


def rules(mesh_spec: str, n: int, **strategy) -> ShardingRules:
    return ShardingRules(build_mesh(mesh_spec, jax.devices()[:n]), Strategy(**strategy))


@functools.cache
def program(n: int, sync_every: int, measure_spread: bool = True) -> local_sgd.LocalSGDProgram:
    return local_sgd.build_local_sgd_program(MODEL, rules(f"data={n}", n), OPTIM, StepConfig(), sync_every,
                                             measure_spread=measure_spread)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def run(prog, state, data):
    """``state`` after ``data``'s steps; every step's metrics and (host copies of) states."""
    metrics, states = [], []
    for batch in data:
        state, m = prog.step(state, jax.device_put(batch, prog.batch_sharding))
        metrics.append({k: float(v) for k, v in m.items()})
        states.append(host(state))
    return state, metrics, states


@functools.cache
def ddp_run(n: int, steps: int = STEPS):
    prog = make_program(MODEL, f"data={n}")
    _, metrics, states = run(prog, prog.init(0), batches(steps))
    return metrics, states


@functools.cache
def local_run(n: int, sync_every: int, steps: int = STEPS):
    prog = program(n, sync_every)
    _, metrics, states = run(prog, prog.init(0), batches(steps))
    return metrics, states


def relative(a, b) -> float:
    """||a - b|| / ||b|| over all leaves together."""
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return float(math.sqrt(sum(np.sum((x - y) ** 2.0) for x, y in zip(a, b))) /
                 math.sqrt(sum(np.sum(y ** 2.0) for y in b)))


def replicas_equal(params) -> bool:
    return all(np.array_equal(x, x[:1].repeat(len(x), 0)) for x in jax.tree.leaves(params))


@pytest.mark.parametrize("n", [8, 4])
def test_h1_trains_as_ddp(n):
    ddp_metrics, ddp_states = ddp_run(n, 5)
    metrics, states = local_run(n, 1, 5)
    for key in ("loss", "grad_norm", "lr"):  # a wrongly scaled gradient shows in its norm
        np.testing.assert_allclose([m[key] for m in metrics], [m[key] for m in ddp_metrics], rtol=1e-6)
    assert [m["replica_spread"] for m in metrics] == [0.0] * 5
    assert [m["synced"] for m in metrics] == [1.0] * 5
    assert all(replicas_equal(s.params) for s in states)  # never diverge: no averaging needed
    params = host(local_sgd.consensus(jax.tree.map(jax.numpy.asarray, states[-1].params)))
    assert_params_close(params, ddp_states[-1].params, rtol=1e-6)
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, ddp_states[-1].params)
    if n == 8:  # and one device, as every strategy
        ref_losses, ref_params = reference("tiny")
        np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=1e-5)
        assert_params_close(params, ref_params, rtol=1e-5)
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_one_replica_is_one_device_whatever_h():
    """With one replica, local and synchronising steps are the same step (a scaling error in
    either path would show)."""
    metrics, states = local_run(1, H, 5)
    ref_losses, ref_params = reference("tiny")
    np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=1e-6)
    assert [int(m["synced"]) for m in metrics] == [0, 0, 0, 1, 0]
    assert_params_close(jax.tree.map(lambda x: x[0], states[-1].params), ref_params, rtol=1e-6)


def test_h1_eval_is_ddps_eval():
    prog, ddp = program(8, 1), make_program(MODEL, "data=8")
    state, d = prog.init(0), ddp.init(0)
    batch = batches(1)[0]
    state, _ = prog.step(state, jax.device_put(batch, prog.batch_sharding))
    d, _ = ddp.step(d, jax.device_put(batch, ddp.batch_sharding))
    mine = float(prog.eval(state.params, jax.device_put(batch, prog.batch_sharding)))
    theirs = float(ddp.eval(d.params, jax.device_put(batch, ddp.batch_sharding)))
    assert abs(mine - theirs) <= 1e-6 * theirs


def test_state_is_one_full_replica_per_device():
    prog = program(8, H)
    state = prog.init(0)
    for x, want in zip(jax.tree.leaves(state), jax.tree.leaves(prog.layout.abstract)):
        assert x.shape == want.shape and x.sharding.spec == want.sharding.spec
    for x, one in zip(jax.tree.leaves(state.params), jax.tree.leaves(MODEL.abstract_params())):
        assert x.shape == (8, *one.shape)
        assert [s.data.shape for s in x.addressable_shards] == [(1, *one.shape)] * 8
    assert replicas_equal(host(state.params))
    # What tools measure from the layout: params, both moments and the gradients, one replica's
    # each, per device (and the two step counts).
    params_bytes = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(MODEL.abstract_params()))
    assert inspect.max_bytes_per_device(state.params) == params_bytes
    assert inspect.stored_bytes(prog, state) == (4 * params_bytes + 8, 0)


def test_loss_sums_each_replicas_rows_at_its_params():
    prog = program(8, H)
    _, states = local_run(8, H)
    params = jax.device_put(states[2].params, prog.layout.shardings.params)  # diverged replicas
    batch = batches(1)[0]
    sums = prog.loss(params, jax.device_put(batch, prog.batch_sharding), None)
    one = make_program(MODEL, "data=1")
    want = sum(float(one.loss(jax.tree.map(lambda x: x[r], states[2].params),
                              {k: v[2 * r:2 * r + 2] for k, v in batch.items()}, None).nll) for r in range(8))
    assert float(sums.nll) == pytest.approx(want, rel=1e-6) and float(sums.tokens) == BATCH * SEQ


def test_h4_diverges_between_synchronisations():
    metrics, states = local_run(8, H)
    ddp_metrics, ddp_states = ddp_run(8)
    assert [int(m["synced"]) for m in metrics] == [0, 0, 0, 1, 0, 0, 0, 1, 0]
    spread = [m["replica_spread"] for m in metrics]  # of the params each step starts from
    # Step 1's learning rate is 0 (warm-up), so the replicas first differ after step 2.
    assert spread[0] == spread[1] == 0
    assert min(spread[2], spread[3], spread[5], spread[6], spread[7]) > 1e-4, spread
    assert spread[4] == spread[8] == 0  # right after the synchronising steps 4 and 8
    assert not replicas_equal(states[2].params)
    assert replicas_equal(states[3].params) and replicas_equal(states[7].params)
    assert replicas_equal(states[3].opt_state)
    # Another trajectory than DDP's, by a measured amount after a local step.
    consensus = jax.tree.map(lambda x: x.mean(0), states[2].params)
    assert relative(consensus, ddp_states[2].params) > 1e-4
    assert relative(jax.tree.map(lambda x: x[0], states[3].params), ddp_states[3].params) > 1e-4
    assert abs(metrics[2]["grad_norm"] - ddp_metrics[2]["grad_norm"]) > 1e-3 * ddp_metrics[2]["grad_norm"]
    # The loss is of the whole batch: before any update it is DDP's.
    assert metrics[0]["loss"] == pytest.approx(ddp_metrics[0]["loss"], rel=1e-6)


@pytest.mark.parametrize("replica", [0, 5])
def test_local_steps_are_one_devices_steps_on_the_replicas_rows(replica):
    """Steps 1-3 of replica r: one device training on rows 2r, 2r + 1 (batch 16 over 8)."""
    one = make_program(MODEL, "data=1")
    state = one.init(0)
    rows = slice(2 * replica, 2 * replica + 2)
    for batch in batches(H - 1):
        state, _ = one.step(state, jax.device_put({k: v[rows] for k, v in batch.items()}, one.batch_sharding))
    _, states = local_run(8, H)
    assert_params_close(jax.tree.map(lambda x: x[replica], states[H - 2].params), host(state.params), rtol=1e-5)
    assert_params_close(jax.tree.map(lambda x: x[replica], states[H - 2].opt_state[0].nu),
                        host(state.opt_state[0].nu), rtol=1e-5)


def test_local_grad_norm_is_the_replicas_mean():
    metrics, _ = local_run(8, H)
    one = make_program(MODEL, "data=1")
    batch = batches(1)[0]
    norms = []
    for r in range(8):
        _, m = one.step(one.init(0), jax.device_put({k: v[2 * r:2 * r + 2] for k, v in batch.items()},
                                                    one.batch_sharding))
        norms.append(float(m["grad_norm"]))
    assert metrics[0]["grad_norm"] == pytest.approx(np.mean(norms), rel=1e-5)
    assert np.std(norms) > 1e-3 * np.mean(norms)  # the replicas' norms differ: the mean is a choice


def test_synchronising_step_is_ddps_step_from_the_average():
    """Step 4: average the replicas' params and moments (in float64 here), then DDP's step."""
    _, states = local_run(8, H)
    before, after = states[H - 2], states[H - 1]
    average = lambda x: (x.astype(np.float64).mean(0).astype(x.dtype)  # noqa: E731
                         if np.issubdtype(x.dtype, np.floating) else x[0])
    ddp = make_program(MODEL, "data=8")
    start = TrainState(np.int32(H - 1), jax.tree.map(average, before.params),
                       jax.tree.map(average, before.opt_state), None)
    start = jax.device_put(start, ddp.layout.shardings)
    end, _ = ddp.step(start, jax.device_put(batches(H)[H - 1], ddp.batch_sharding))
    for r in (0, 7):
        assert_params_close(jax.tree.map(lambda x: x[r], after.params), host(end.params), rtol=1e-5)
        assert_params_close(jax.tree.map(lambda x: x[r], after.opt_state[0].mu),
                            host(end.opt_state[0].mu), rtol=1e-5)


def test_checkpoint_of_diverged_replicas_resumes_exactly(tmp_path):
    prog = program(8, H)
    data = [jax.device_put(b, prog.batch_sharding) for b in batches(6)]
    state = prog.init(0)
    for b in data[:2]:
        state, _ = prog.step(state, b)
    assert not replicas_equal(host(state.params))  # something only a per-replica state keeps
    shapes = param_shapes(MODEL.abstract_params())
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path)))
    ckpt.save(2, prog.saved(state), {"step": 2, "param_shapes": shapes, "mesh": {"data": 8}})
    ckpt.close()

    def finish(state):
        losses = []
        for b in data[2:]:
            state, m = prog.step(state, b)
            losses.append(float(m["loss"]))
        return losses, host(state)

    losses, straight = finish(state)
    reader = Checkpointer(CheckpointConfig(directory=str(tmp_path), resume=True))
    restored, meta = reader.restore(prog.saved_abstract, shapes)
    local_sgd.check_restore(meta, prog.replicas)
    resumed_losses, resumed = finish(prog.unsaved(restored))
    assert resumed_losses == losses
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(a, b)
    # Another data size: one line, before orbax's own error.
    with pytest.raises(ConfigError, match=r"^--sync-every: the checkpoint holds 8 replicas \(data=8\)"):
        local_sgd.check_restore(meta, program(4, H).replicas)
    # Checked against the stored arrays' shapes before any read starts (none is left behind).
    with pytest.raises(CheckpointError, match=r"holds params\.\S+ of shape \(8, .*this run's is \(4, ") as e:
        reader.restore(program(4, H).saved_abstract, shapes)
    assert "\n" not in str(e.value)
    reader.close()


def test_h1_restore_makes_diverged_replicas_equal_and_equal_ones_stay_exact():
    _, states = local_run(8, H)
    diverged = jax.device_put(TrainState(np.int32(3), states[2].params, states[2].opt_state, None),
                              program(8, 1).layout.shardings)
    equalised = host(program(8, 1).unsaved(diverged))
    assert replicas_equal(equalised.params) and replicas_equal(equalised.opt_state)
    mean = jax.tree.map(lambda x: x.astype(np.float64).mean(0), states[2].params)
    assert_params_close(jax.tree.map(lambda x: x[0], equalised.params), mean, rtol=1e-6)
    same = jax.device_put(TrainState(np.int32(4), states[3].params, states[3].opt_state, None),
                          program(8, 1).layout.shardings)
    for a, b in zip(jax.tree.leaves(host(program(8, 1).unsaved(same))), jax.tree.leaves(states[3])):
        np.testing.assert_array_equal(a, b)


def test_from_params_and_consensus():
    prog = program(8, H)
    params = MODEL.init(jax.random.key(3))
    state = prog.from_params(params)
    assert int(state.step) == 0 and replicas_equal(host(state.params))
    for a, b in zip(jax.tree.leaves(host(local_sgd.consensus(state.params))), jax.tree.leaves(host(params))):
        np.testing.assert_array_equal(a, b)  # equal replicas: exactly their value
    # Weights to load go where model-shaped params do: no replica dim (a plain program's: its
    # saved params' shardings).
    plain = make_program(MODEL, "data=8")
    assert jax.tree.map(lambda s: s.spec, prog.weight_shardings()) == \
        jax.tree.map(lambda x: x.sharding.spec, plain.saved_abstract.params) == \
        jax.tree.map(lambda s: s.spec, plain.weight_shardings())
    fresh = host(plain.from_params(params))
    for a, b in zip(jax.tree.leaves(host(state.opt_state)), jax.tree.leaves(fresh.opt_state)):
        np.testing.assert_array_equal(a, np.broadcast_to(b, a.shape))
    _, states = local_run(8, H)
    stacked = jax.device_put(states[2].params, prog.layout.shardings.params)
    got = local_sgd.consensus(stacked)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(got))
    assert_params_close(host(got), jax.tree.map(lambda x: x.astype(np.float64).mean(0), states[2].params),
                        rtol=1e-6)


def _bytes(prog, seq: int = SEQ, conditional: bool | None = None) -> int:
    """Collective bytes per device of the compiled step (all, or those in / outside a branch)."""
    found = compiled_collectives(prog.lower_step(BATCH, seq).compile(), prog.rules.mesh)
    return sum(c.bytes * c.executions for c in found if conditional in (None, c.conditional))


def test_collectives_only_on_synchronising_steps():
    """Compiled: H = 1 all-reduces the gradients every step (DDP's bytes); H = 4 has nothing
    but scalars outside the synchronisation, and inside it params, both moments and gradients.
    At the model's full sequence length every param gets a gradient (at a shorter one DDP's
    partitioner reduces only the position rows used)."""
    params_bytes = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(MODEL.abstract_params()))
    full = MODEL.cfg.max_seq_len
    ddp_bytes = _bytes(make_program(MODEL, "data=8"), full)
    assert abs(ddp_bytes - params_bytes) <= 64
    h1 = program(8, 1, measure_spread=False)
    assert _bytes(h1, full, conditional=True) == 0
    assert abs(_bytes(h1, full, conditional=False) - ddp_bytes) <= 64
    h4 = program(8, H, measure_spread=False)
    assert _bytes(h4, conditional=False) <= 64  # the loss's sums
    assert abs(_bytes(h4, conditional=True) - 4 * params_bytes) <= 64
    # Measuring the spread: an all-reduce (max) of the params and their negatives, every step.
    assert abs(_bytes(program(8, H), conditional=False) - 2 * params_bytes) <= 64


def build(sync_every=4, mesh="data=8", model=MODEL, strategy=None, **step):
    return local_sgd.build_local_sgd_program(model, rules(mesh, 8, **(strategy or {})), OPTIM,
                                             StepConfig(**step), sync_every)


@pytest.mark.parametrize("kwargs, match", [
    ({"sync_every": 0}, "--sync-every must be an integer >= 1, got 0"),
    ({"sync_every": 2.0}, "--sync-every must be an integer >= 1, got 2.0"),
    ({"mesh": "data=4,fsdp=2"}, "--sync-every averages replicas over data only; the mesh also has fsdp=2"),
    ({"mesh": "data=4,tensor=2", "sync_every": 1}, "the mesh also has tensor=2"),
    ({"strategy": {"zero": 1}}, "--sync-every keeps a whole replica per device: not with --zero"),
    ({"grad_accum": 2}, "--sync-every steps once per batch"),
    ({"pipeline_schedule": "gpipe"}, "--sync-every has no pipeline"),
    ({"model": TransformerLM(get_preset("moe-tiny"))}, "--sync-every covers dense models"),
    ({"param_dtype": "bfloat16"}, "--sync-every needs float32 params"),
    ({"compute_dtype": "float16"}, "--sync-every needs float32 params and no loss scaling"),
    ({"reducer": "explicit"}, "--sync-every reduces the gradients itself: not with --strategy explicit"),
])
def test_bad_inputs_are_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        build(**kwargs)
    assert "\n" not in str(e.value)


def test_sync_every_through_the_command_line(tmp_path):
    """--sync-every 1 trains as DDP; H = 4 checkpoints every replica and resumes only on the
    same data size."""
    import json

    from test_cli import assert_one_line_error, train as cli_train

    def losses(path):
        return [json.loads(line)["loss"] for line in path.read_text().splitlines()]

    common = ["--model", "tiny", "--mesh", "data=4", "--cpu-devices", "4", "--batch-size", "8", "--seq-len", "32",
              "--steps", "6"]
    ddp = cli_train(*common, "--metrics", str(tmp_path / "ddp.jsonl"))
    one = cli_train(*common, "--sync-every", "1", "--metrics", str(tmp_path / "h1.jsonl"))
    assert ddp.returncode == 0 and one.returncode == 0, ddp.stderr + one.stderr
    np.testing.assert_allclose(losses(tmp_path / "h1.jsonl"), losses(tmp_path / "ddp.jsonl"), rtol=1e-6)
    ck = str(tmp_path / "ck")
    four = cli_train(*common, "--sync-every", "4", "--checkpoint-dir", ck, "--report", str(tmp_path / "r.json"))
    assert four.returncode == 0, four.stderr
    assert "local SGD, averaged every 4 steps" in four.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["sync_every"] == 4
    # The prediction is local SGD's (not DDP's): 4 x params on synchronising steps, found in the
    # compiled step's conditional; outside it only scalars.
    [predicted] = report["predicted"]["collectives"]
    [synced] = report["collectives_when_synchronising"]
    assert predicted["kind"] == synced["kind"] == "all-reduce"
    assert predicted["bytes"] == 4 * 4 * report["n_params"] and abs(synced["bytes"] - predicted["bytes"]) <= 64
    assert sum(c["bytes"] for c in report["collectives"]) <= 64
    other = cli_train("--model", "tiny", "--mesh", "data=2", "--cpu-devices", "2", "--batch-size", "8", "--seq-len", "32",
                      "--steps", "8", "--sync-every", "4", "--checkpoint-dir", ck, "--resume")
    assert_one_line_error(other, "the checkpoint holds 4 replicas (data=4) but this mesh has data=2")

    # Generation and the converter read the replicas' average (step 6: two local steps after
    # the last synchronisation, so the replicas differ).
    from jaxshard.train import restore_model

    one = rules("data=1", 1)
    model, params, _, step = restore_model(ck, one)
    assert step == 6
    shapes = param_shapes(model.abstract_params())
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype, sharding=one.replicated()),
                           model.abstract_params())
    reader = Checkpointer(CheckpointConfig(directory=ck))
    raw, _ = reader.restore_params(stacked, shapes)
    reader.close()
    raw = host(raw)
    assert not replicas_equal(raw)
    for got, replicas in zip(jax.tree.leaves(host(params)), jax.tree.leaves(raw)):
        np.testing.assert_allclose(got, replicas.mean(0), rtol=1e-6, atol=1e-7)
    from test_cli import ROOT

    for script, args in (("experiments/generate.py", ["--checkpoint", ck, "--max-new-tokens", "4"]),
                         ("scripts/convert_checkpoint.py", [ck, str(tmp_path / "hf")])):
        r = subprocess.run([sys.executable, str(ROOT / script), *args, "--cpu-devices", "1", "--platform", "cpu"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "config.json").is_file()
