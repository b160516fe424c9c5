"""ZeRO-Offload: optimizer state and FSDP's params kept in host memory between uses.

XLA:CPU backs its host memory space with the same RAM as the devices', so the saving itself
cannot show here; what can: the math is unchanged, the live arrays sit in host memory, and the
compiled step's entry layout places exactly the predicted arguments in the host memory space.
"""

import types

import jax
import numpy as np
import pytest

from harness import RTOL, assert_params_close, make_program, reference, train
from jaxshard.analysis import accounting, hlo, inspect
from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.rules import HOST_MEMORY, ShardingRules, Strategy, check_host_memory
from models import TransformerLM, get_preset

B, L = 16, 32  # harness.BATCH, harness.SEQ

CASES = [
    ("data=8", 0, ("optimizer",), {}),  # DDP
    ("data=8", 1, ("optimizer",), {}),  # ZeRO-1
    ("fsdp=8", 0, ("optimizer",), {}),
    ("fsdp=8", 0, ("params",), {}),
    ("data=2,fsdp=4", 0, ("optimizer", "params"), {}),  # HSDP
    # 2-byte params: the float32 master copy goes to the host with the moments.
    ("data=8", 1, ("optimizer",), {"param_dtype": "bfloat16", "dtype": "bfloat16"}),
    # float16 with loss scaling, recompute with offloaded activations, and both offloads.
    ("fsdp=8", 0, ("optimizer", "params"), {"dtype": "float16"}),
]


def _host_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if x.sharding.memory_kind == HOST_MEMORY]


@pytest.mark.parametrize("mesh, zero, offload, step", CASES)
def test_offload_equals_no_offload(mesh, zero, offload, step):
    remat = "offload:qkv,mlp_in" if step.get("dtype") == "float16" else "none"
    model = TransformerLM(get_preset("tiny"), remat=remat)
    losses, state, _ = train(model, mesh, zero=zero, **step)
    off_losses, off_state, program = train(model, mesh, zero=zero, offload=offload, **step)
    np.testing.assert_allclose(off_losses, losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(off_state), jax.tree.leaves(state)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-7)
    if not step:  # float32: also the one-device run
        ref_losses, ref_params = reference("tiny")
        np.testing.assert_allclose(off_losses, ref_losses, rtol=RTOL)
        assert_params_close(off_state.params, ref_params)

    # Where the live state is: every params-shaped part of what was offloaded, nothing else
    # (the optimizer's step counters stay on the device).
    moments = [x for x in jax.tree.leaves(off_state.opt_state) if x.ndim > 0]
    want_opt = moments if "optimizer" in offload else []
    assert [id(x) for x in _host_leaves(off_state.opt_state)] == [id(x) for x in want_opt]
    want_params = jax.tree.leaves(off_state.params) if "params" in offload else []
    assert [id(x) for x in _host_leaves(off_state.params)] == [id(x) for x in want_params]
    assert not _host_leaves(state)

    # The compiled step takes those arrays from the host memory space, as many bytes as the
    # live host arrays and the accounting say.
    compiled = program.lower_step(B, L).compile()
    live = inspect.max_bytes_per_device(off_state, "host")
    assert live > 0
    assert hlo.host_argument_bytes(compiled.as_text()) == live
    mem = accounting.memory(model, program.rules, B, L, compute_dtype=step.get("dtype", "float32"),
                            param_dtype=step.get("param_dtype", "float32"), remat=remat)
    assert mem.host == live


def test_verifier_checks_the_host_memory_space():
    model = TransformerLM(get_preset("tiny"))
    program = make_program(model, "fsdp=8", offload=("optimizer", "params"))
    compiled = program.lower_step(B, L).compile()
    assert not inspect.verify(model, program, compiled, B, L).flags
    # Checked against rules that expect no offload, the host bytes are flagged.
    plain = make_program(model, "fsdp=8").rules
    flags = inspect.verify(model, program, compiled, B, L, expected=plain).flags
    assert any(f.startswith("host memory: the compiled step places") for f in flags), flags


def test_offload_errors():
    mesh = build_mesh("data=8")
    with pytest.raises(ConfigError, match="--offload params keeps ZeRO-3/FSDP's sharded params"):
        ShardingRules(mesh, Strategy(offload=("params",)))
    with pytest.raises(ConfigError, match="--offload takes none or a comma-separated subset"):
        Strategy(offload=("disk",))
    with pytest.raises(ConfigError, match="--offload takes none or a comma-separated subset"):
        Strategy(offload=("optimizer", "optimizer"))
    # A backend without a host memory space the devices can address.
    device = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [
        types.SimpleNamespace(kind="device")])
    fake = types.SimpleNamespace(devices=np.array([device]))
    with pytest.raises(ConfigError, match="--offload needs pinned_host memory, which tpu devices do not have"):
        check_host_memory(fake, "--offload")
    check_host_memory(jax.sharding.AbstractMesh((8,), ("data",)), "--offload")  # the planner's: nothing to ask


def test_what_cpu_can_show_of_offloaded_activations():
    """``--remat offload:qkv,mlp_in`` lowers to XLA placement annotations on the named
    residuals (``names:`` has none), so the policy reaches the program XLA receives. What
    XLA:CPU then does is place nothing in host memory: on CPU every annotation names the
    device's memory, the compiled step has no host temporaries and no buffer in the host memory
    space (``S(5)``). CPU thus shows the policy's math (equal losses, above) and which residuals it
    picks, not its saving; on a GPU the compiled step must hold them in host memory."""
    import re

    lowered = make_program(TransformerLM(get_preset("tiny"), remat="offload:qkv,mlp_in"), "fsdp=8").lower_step(B, L)
    names = make_program(TransformerLM(get_preset("tiny"), remat="names:qkv,mlp_in"), "fsdp=8").lower_step(B, L)
    placements = re.findall(r'annotate_device_placement.*?_xla_buffer_placement = "(\w+)"', lowered.as_text())
    assert placements and "annotate_device_placement" not in names.as_text()
    compiled = lowered.compile()
    host_temp = inspect.xla_memory(compiled)["host_temp"]
    if jax.default_backend() == "cpu":
        assert set(placements) == {"device"} and host_temp == 0 and "S(5)" not in compiled.as_text()
    else:  # where the backend has a host memory space (not run here: no GPU in the test machines)
        assert host_temp > 0 or "S(5)" in compiled.as_text()
