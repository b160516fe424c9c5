"""DDP's Reducer by hand (--strategy explicit): the gradients reduced by the step itself in
buckets, equal to GSPMD DDP and to one device, one collective per bucket in the compiled step."""

import jax
import numpy as np
import pytest

from harness import assert_params_close, make_program, reference, train
from jaxshard.analysis.inspect import bucket_check, compiled_collectives
from jaxshard.errors import ConfigError
from jaxshard.pytree import named_leaves
from models import TransformerLM, get_preset


@pytest.fixture(scope="module")
def gspmd():
    """GSPMD DDP on data=8 (losses, grad norms, params) per model."""
    out = {}
    for name in ("tiny", "tiny-llama"):
        program = make_program(TransformerLM(get_preset(name)), "data=8")
        out[name] = _run(program, name)
    return out


def _run(program, name):
    from harness import random_batches

    state = program.init(0)
    losses, norms = [], []
    for batch in random_batches(get_preset(name).vocab_size):
        state, m = program.step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return np.array(losses), np.array(norms), jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("zero", [0, 2])
def test_explicit_with_dropout_draws_the_whole_batch_mask(zero):
    """Each device drops its own rows of the mask the whole batch draws: explicit DDP and
    explicit ZeRO-2 with dropout equal GSPMD DDP with dropout and one device (a replicated
    mask drawn at each device's shape would make every replica drop the same units)."""
    model = TransformerLM(get_preset("tiny").replace(dropout=0.1))
    program = make_program(model, "data=8", zero=zero, reducer="explicit", bucket_mb=0.1)
    losses, norms, params = _run(program, "tiny")
    want_losses, want_norms, want_params = _run(make_program(model, "data=8"), "tiny")
    np.testing.assert_allclose(norms, want_norms, rtol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert_params_close(params, want_params, rtol=1e-6)
    ref_losses, ref_params = reference("tiny", dropout=0.1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params, ref_params)
    assert np.abs(ref_losses - reference("tiny")[0]).max() > 1e-3  # dropout is on


@pytest.mark.parametrize("name, zero, bucket_mb", [
    ("tiny", 0, 0.05), ("tiny", 0, 0.2), ("tiny", 2, 0.05), ("tiny", 1, 0.2),
    ("tiny-llama", 0, 0.05), ("tiny-llama", 2, 0.2),
])
def test_buckets_equal_gspmd_ddp_and_one_device(gspmd, name, zero, bucket_mb):
    program = make_program(TransformerLM(get_preset(name)), "data=8", zero=zero, reducer="explicit",
                           bucket_mb=bucket_mb)
    losses, norms, params = _run(program, name)
    want_losses, want_norms, want_params = gspmd[name]
    # The gradient norm first: Adam and clipping would hide a wrongly scaled gradient from the rest.
    np.testing.assert_allclose(norms, want_norms, rtol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert_params_close(params, want_params, rtol=1e-6)
    ref_losses, ref_params = reference(name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params, ref_params)

    # The compiled step holds one gradient collective per bucket, of the bucket's size.
    compiled = program.lower_step(16, 32).compile()
    found = compiled_collectives(compiled, program.rules.mesh)
    planned, got = bucket_check(program, found)
    assert planned == got and len(got) == len(program.buckets) > 1
    # The textbook's volume: every gradient byte goes through one bucket collective once, 4 bytes
    # per param (counted from the model's shapes, not from the plan).
    assert sum(got) == 4 * TransformerLM(get_preset(name)).n_params()
    kind = "all-reduce" if zero == 0 else "reduce-scatter"
    assert {b.kind for b in program.buckets} == {kind}
    assert all(c.axes == ("data",) for c in found if c.kind == kind)


def test_buckets_are_filled_in_reverse_layer_order_and_hold_every_gradient_once():
    model = TransformerLM(get_preset("tiny-llama"))
    program = make_program(model, "data=8", reducer="explicit", bucket_mb=0.1)
    limit = 0.1 * 2 ** 20
    for b in program.buckets:
        assert b.bytes <= limit or len(b.pieces) == 1  # a param larger than a bucket is one alone
    first, last = program.buckets[0].pieces[0], program.buckets[-1].pieces[-1]
    assert first.layer == model.cfg.n_layers - 1 and last.layer is None  # last layer first, outer params last
    layers = [p.layer for b in program.buckets for p in b.pieces if p.layer is not None]
    assert layers == sorted(layers, reverse=True)
    held = {}
    for b in program.buckets:
        for p in b.pieces:
            held[p.name] = held.get(p.name, 0) + p.size
    sizes = {name: x.size for name, x in named_leaves(model.abstract_params())}
    assert held == sizes


@pytest.mark.parametrize("kwargs, message", [
    ({"mesh": "data=4,fsdp=2"}, "reduces over data only; the mesh also has fsdp=2"),
    ({"zero": 3}, "covers DDP and ZeRO-1/2"),
    ({"accum": 2}, "not with --grad-accum > 1"),
    ({"bucket_mb": 0.0}, "--bucket-mb must be > 0"),
])
def test_what_buckets_do_not_cover_is_one_line(kwargs, message):
    mesh = kwargs.pop("mesh", "data=8")
    with pytest.raises(ConfigError, match=message):
        make_program(TransformerLM(get_preset("tiny")), mesh, reducer="explicit", **kwargs)
    with pytest.raises(ConfigError, match="covers dense models"):
        make_program(TransformerLM(get_preset("moe-tiny")), "data=8", reducer="explicit")


def test_inspect_verifies_the_buckets_and_a_run_reports_them(tmp_path):
    import json
    import subprocess
    import sys

    from test_cli import CACHE, ROOT, assert_one_line_error, train as cli_train

    common = ["--model", "tiny", "--mesh", "data=8", "--cpu-devices", "8", "--strategy", "explicit",
              "--bucket-mb", "0.1", "--batch-size", "16", "--seq-len", "32"]
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "inspect.py"), *common, "--strict",
                        "--platform", "cpu", "--compile-cache", CACHE],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the same sizes" in r.stdout
    run = cli_train(*common, "--steps", "3", "--zero", "2", "--report", str(tmp_path / "r.json"))
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["reducer"] == "explicit" and {b["kind"] for b in report["buckets"]} == {"reduce-scatter"}
    assert_one_line_error(cli_train("--bucket-mb", "4", "--cpu-devices", "1"), "--bucket-mb sizes the buckets")
