"""The single-process DataParallel pattern: it trains like one device and DDP, its params stay
on device 0, and per device it moves one broadcast of the params more than DDP's all-reduce."""

import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from harness import OPTIM, RTOL, assert_params_close, make_program
from jaxshard.analysis.inspect import compiled_collectives
from jaxshard.errors import ConfigError
from jaxshard.mechanics import data_parallel as dp
from models import TransformerLM, get_preset

ROOT = Path(__file__).resolve().parents[1]
MODEL = TransformerLM(get_preset("tiny"))


def test_moved_bytes_of_broadcast_scatter_and_gather():
    """Against hand counts: 4 devices, an f32[8, 4] array (128 B)."""
    d = jax.devices()[:4]
    mesh = jax.make_mesh((4,), ("data",), devices=d, axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(np.ones((8, 4), np.float32), SingleDeviceSharding(d[0]))
    assert dp.moved_bytes(x, NamedSharding(mesh, P())) == ({1: 128, 2: 128, 3: 128}, {0: 384})
    assert dp.moved_bytes(x, NamedSharding(mesh, P("data"))) == ({1: 32, 2: 32, 3: 32}, {0: 96})
    rows = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert dp.moved_bytes(rows, SingleDeviceSharding(d[0])) == ({0: 96}, {1: 32, 2: 32, 3: 32})
    assert dp.moved_bytes(rows, NamedSharding(mesh, P("data"))) == ({}, {})


def test_trains_like_one_device_and_ddp():
    """Three AdamW steps on random 8 x 32 token batches."""
    c = dp.compare(MODEL, jax.devices(), OPTIM, steps=3, batch_size=8, seq_len=32)
    one, ddp, data_parallel = (c.runs[k] for k in ("one device", "DDP", "DataParallel"))
    np.testing.assert_allclose(data_parallel.losses, one.losses, rtol=RTOL)
    np.testing.assert_allclose(data_parallel.losses, ddp.losses, rtol=RTOL)
    # Adam and clipping hide a gradient's scale from the params: its norm does not.
    np.testing.assert_allclose(data_parallel.grad_norms, one.grad_norms, rtol=RTOL)
    assert_params_close(data_parallel.params, one.params)
    assert_params_close(data_parallel.params, ddp.params)
    assert data_parallel.losses[-1] < data_parallel.losses[0]  # it does learn
    assert c.max_param_diff("DataParallel") < 1e-5


def test_moves_a_params_broadcast_more_than_ddp():
    """Counted from the shardings of one real step's transfers (a model of what device_put
    moves: no compiled program holds them) and measured from the compiled programs (DDP's
    all-reduce, DataParallel's none), against a prediction from the parameter count. At the model's full sequence length every param gets
    a gradient (a shorter one leaves position rows whose zero gradients DDP need not reduce)."""
    n, batch, seq = 8, 8, MODEL.cfg.max_seq_len
    params_bytes = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(MODEL.abstract_params()))

    program = dp.build(MODEL, jax.devices(), OPTIM)
    state = program.init(0)
    root = {jax.devices()[0].id}
    assert dp.held_on(state.params) == dp.held_on(state.opt_state) == root
    inputs = np.random.default_rng(0).integers(0, 256, (batch, seq), dtype=np.int32)
    state, _, traffic = program.step(state, {"inputs": inputs, "targets": inputs})
    assert dp.held_on(state.params) == dp.held_on(state.opt_state) == root
    assert program.compiled_collectives(batch, seq) == []  # all traffic is the counted transfers

    others = range(1, n)
    assert [traffic.phase("broadcast").received[k] for k in others] == [params_bytes + 4] * (n - 1)
    assert [traffic.phase("gather grads").sent[k] for k in others] == [params_bytes] * (n - 1)
    assert traffic.phase("gather grads").received[0] == (n - 1) * params_bytes

    ddp = make_program(MODEL, "data=8")
    ddp_bytes = sum(c.bytes * c.executions for c in
                    compiled_collectives(ddp.lower_step(batch, seq).compile(), ddp.rules.mesh))
    assert abs(ddp_bytes - params_bytes) <= 0.01 * params_bytes  # one all-reduce of the gradients
    excess = traffic.moved(1) - ddp_bytes
    assert abs(excess - params_bytes) <= 0.03 * params_bytes, (excess, params_bytes)
    assert abs(traffic.moved(0) - (n - 1) * 2 * params_bytes) <= 0.03 * (n - 1) * 2 * params_bytes

    predicted = dp.predict(params_bytes // 4, n, batch, seq)
    assert traffic.moved(1) == predicted.data_parallel
    assert traffic.moved(0) == predicted.root


def test_batch_not_divisible_by_the_devices():
    program = dp.build(MODEL, jax.devices(), OPTIM)
    inputs = np.zeros((10, 32), np.int32)
    with pytest.raises(ConfigError, match="not divisible by the 8 devices"):
        program.step(program.init(0), {"inputs": inputs, "targets": inputs})


def test_demo_bad_input_is_one_line():
    cmd = [sys.executable, str(ROOT / "experiments" / "data_parallel_demo.py"), "--cpu-devices", "8",
           "--platform", "cpu", "--model", "tiny", "--steps", "2", "--batch-size", "10", "--compile-cache", ""]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "--batch-size 10 is not divisible by the 8 devices" in lines[0]
