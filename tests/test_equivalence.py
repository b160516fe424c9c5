"""Every data-parallel strategy trains exactly like one device (fp32, 1e-5 relative).

Five AdamW steps of the tiny GPT-2 and Llama models on fresh random tokens, on 8 fake CPU
devices, against the same steps on one device; with and without gradient accumulation. The
live arrays' shardings are checked against the rules' (whose golden values test_rules pins).
"""

import jax
import numpy as np
import pytest

from harness import RTOL, assert_live_shardings, assert_matches_reference, assert_params_close, reference, train
from jaxshard.remat import Remat
from models import ModelConfig, TransformerLM, get_preset

STRATEGIES = {
    "ddp": ("data=8", 0),
    "zero1": ("data=8", 1),
    "zero2": ("data=8", 2),
    "fsdp": ("fsdp=8", 0),
    "hsdp": ("data=2,fsdp=4", 0),
}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_strategy_matches_one_device(model_name, strategy, accum):
    mesh_spec, zero = STRATEGIES[strategy]
    program = assert_matches_reference(model_name, mesh_spec, zero=zero, accum=accum)
    assert program.rules.name == strategy


def test_gradient_accumulation_equals_the_full_batch():
    for name in ("tiny", "tiny-llama"):
        full, accumulated = reference(name, 1), reference(name, 2)
        np.testing.assert_allclose(accumulated[0], full[0], rtol=RTOL)
        assert_params_close(accumulated[1], full[1])


@pytest.mark.parametrize("mesh, zero, remat", [("data=8", 3, Remat.NONE), ("data=2,fsdp=4", 1, Remat.NONE),
                                              ("fsdp=8", 0, Remat.FULL)])
def test_zero3_hsdp_zero1_and_fsdp_with_remat_match_one_device(mesh, zero, remat):
    ref_losses, ref_params = reference("tiny")
    losses, state, program = train(TransformerLM(get_preset("tiny"), remat=remat), mesh, zero=zero)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, ref_params)
    assert_live_shardings(state, program)


def test_dropout_is_sharding_invariant():
    assert np.abs(reference("tiny", dropout=0.1)[0] - reference("tiny")[0]).max() > 1e-3  # it is on
    assert_matches_reference("tiny", "data=2,fsdp=4", dropout=0.1)


@pytest.mark.parametrize("mesh", ["data=1", "data=2,fsdp=2"])  # 4-row microbatches
def test_gradient_accumulation_with_dropout_equals_the_whole_batch(mesh):
    """Each microbatch drops its rows of the whole batch's mask: --grad-accum 4 with dropout
    trains as --grad-accum 1 with dropout does (one device, and sharded)."""
    model = TransformerLM(get_preset("tiny").replace(dropout=0.1))
    whole_losses, whole_params = reference("tiny", 1, dropout=0.1)
    losses, state, _ = train(model, mesh, accum=4)
    np.testing.assert_allclose(losses, whole_losses, rtol=RTOL)
    assert_params_close(state.params, whole_params)


def test_uneven_dims_train_like_one_device():
    """d_model 36 and 4 heads do not divide by 8: FSDP picks other dims instead of failing."""
    cfg = ModelConfig(name="odd", n_layers=2, d_model=36, n_heads=4, d_mlp=144, vocab_size=256,
                      max_seq_len=64)
    model = TransformerLM(cfg)
    ref_losses, ref_state, _ = train(model, "data=1")
    losses, state, program = train(model, "fsdp=8")
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(state.params, jax.tree.map(np.asarray, ref_state.params))
    assert state.params["blocks"]["ffn"]["w_in"].sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp")


@pytest.mark.parametrize("mesh, sp", [("data=8", False), ("fsdp=8", False), ("data=2,tensor=4", True),
                                      ("data=2,sequence=4", False)])
def test_bfloat16_compute_keeps_float32_master_params(mesh, sp):
    model = TransformerLM(get_preset("tiny"))
    ref_losses, _ = reference("tiny", 1)
    losses, state, _ = train(model, mesh, dtype="bfloat16", sequence_parallel=sp)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype in (np.float32, np.int32) for x in jax.tree.leaves(state.opt_state))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)  # bf16 rounding, not a different model
    assert not np.allclose(losses, ref_losses, rtol=1e-6)  # the matmuls really ran in bf16
