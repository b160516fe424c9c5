"""Golden at-rest PartitionSpecs, leaf by leaf, for every data-parallel strategy."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxshard.axes import Dim
from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.rules import ShardingRules, StateKind, Strategy
from jaxshard.training.optim import OptimConfig, make
from jaxshard.training.state import state_layout
from models import ModelConfig, TransformerLM, get_preset

# The dim that ZeRO/FSDP shards in each param: the first that divides (never `layers` or
# `position`), so shards are contiguous blocks. Shapes in the comments.
STATE_DIM = {
    "tiny": {
        "blocks/attn/bo": 1,  # (2, 64)
        "blocks/attn/bq": 1,  # (2, 8, 8)
        "blocks/attn/bv": 1,  # (2, 8, 8)
        "blocks/attn/wk": 1,  # (2, 64, 8, 8)
        "blocks/attn/wo": 1,  # (2, 8, 8, 64): heads, not the minor embed dim
        "blocks/attn/wq": 1,
        "blocks/attn/wv": 1,
        "blocks/attn_norm/bias": 1,  # (2, 64)
        "blocks/attn_norm/scale": 1,
        "blocks/ffn/b_in": 1,  # (2, 256)
        "blocks/ffn/b_out": 1,  # (2, 64)
        "blocks/ffn/w_in": 1,  # (2, 64, 256)
        "blocks/ffn/w_out": 1,  # (2, 256, 64)
        "blocks/ffn_norm/bias": 1,
        "blocks/ffn_norm/scale": 1,
        "final_norm/bias": 0,  # (64,)
        "final_norm/scale": 0,
        "positions": 1,  # (256, 64): never the position rows, which are sliced
        "tokens": 0,  # (256, 64)
    },
    "tiny-llama": {
        "blocks/attn/wk": 1,  # (2, 64, 2, 8)
        "blocks/attn/wo": 1,  # (2, 8, 8, 64)
        "blocks/attn/wq": 1,  # (2, 64, 8, 8)
        "blocks/attn/wv": 1,
        "blocks/attn_norm/scale": 1,  # (2, 64)
        "blocks/ffn/w_gate": 1,  # (2, 64, 192)
        "blocks/ffn/w_in": 1,
        "blocks/ffn/w_out": 1,  # (2, 192, 64)
        "blocks/ffn_norm/scale": 1,
        "final_norm/scale": 0,  # (64,)
        "lm_head": 0,  # (64, 256)
        "tokens": 0,  # (256, 64)
    },
}

# strategy -> (mesh, zero, mesh axes on the state dim for params, grads, optimizer state)
STRATEGIES = {
    "ddp": ("data=8", 0, (), (), ()),
    "zero1": ("data=8", 1, (), (), ("data",)),
    "zero2": ("data=8", 2, (), ("data",), ("data",)),
    "zero3": ("data=8", 3, ("data",), ("data",), ("data",)),
    "fsdp": ("fsdp=8", 0, ("fsdp",), ("fsdp",), ("fsdp",)),
    "hsdp": ("data=2,fsdp=4", 0, ("fsdp",), ("fsdp",), ("fsdp",)),
    "hsdp+zero1": ("data=2,fsdp=4", 1, ("fsdp",), ("fsdp",), ("fsdp", "data")),
}


def flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
    return {"/".join(k.key for k in path): v for path, v in leaves}


def expected_spec(shape, dim, axes):
    entries = [None] * len(shape)
    if axes:
        entries[dim] = axes[0] if len(axes) == 1 else axes
    return P(*entries)


def rules_for(strategy, min_size=0):
    mesh, zero, *_ = STRATEGIES[strategy]
    return ShardingRules(build_mesh(mesh), Strategy(zero=zero, fsdp_min_size=min_size))


@pytest.mark.parametrize("model_name", sorted(STATE_DIM))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_golden_specs_of_params_grads_and_optimizer_state(model_name, strategy):
    model = TransformerLM(get_preset(model_name))
    rules = rules_for(strategy)
    _, _, *kind_axes = STRATEGIES[strategy]
    shapes = flat(model.abstract_params())
    assert set(shapes) == set(STATE_DIM[model_name])
    for kind, axes in zip((StateKind.PARAMS, StateKind.GRADS, StateKind.OPT_STATE), kind_axes):
        got = flat(rules.param_specs(model.param_axes(), model.abstract_params(), kind))
        for path, spec in got.items():
            want = expected_spec(shapes[path].shape, STATE_DIM[model_name][path], axes)
            assert spec == want, f"{strategy} {kind.name} {path}: {spec} != {want}"


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_optimizer_state_layout_leaf_by_leaf(strategy):
    """Adam's mu and nu take the OPT_STATE layout; step counts are replicated."""
    model = TransformerLM(get_preset("tiny-llama"))
    rules = rules_for(strategy)
    tx = make(OptimConfig(), model.param_axes())
    layout = state_layout(model, tx, rules)
    opt_axes = STRATEGIES[strategy][4]
    shapes = flat(model.abstract_params())
    n_moment_trees = 0
    for sub in jax.tree.leaves(layout.shardings.opt_state, is_leaf=lambda x: isinstance(x, dict)):
        if isinstance(sub, dict):
            n_moment_trees += 1
            for path, sharding in flat(jax.tree.map(lambda s: s.spec, sub)).items():
                want = expected_spec(shapes[path].shape, STATE_DIM["tiny-llama"][path], opt_axes)
                assert sharding == want, f"{strategy} opt state {path}"
    assert n_moment_trees == 2  # mu and nu
    counts = [x for x in jax.tree.leaves(layout.abstract.opt_state) if x.ndim == 0]
    assert counts and all(x.sharding.spec == P() for x in counts)


def test_fsdp_min_size_keeps_small_params_replicated():
    model = TransformerLM(get_preset("tiny"))
    rules = rules_for("fsdp", min_size=1024)
    shapes = flat(model.abstract_params())
    got = flat(rules.param_specs(model.param_axes(), model.abstract_params()))
    for path, spec in got.items():
        size = shapes[path].size
        axes = ("fsdp",) if size >= 1024 else ()
        assert spec == expected_spec(shapes[path].shape, STATE_DIM["tiny"][path], axes), path
    assert got["blocks/attn_norm/scale"] == P(None, None)  # 128 elements
    assert got["blocks/ffn/w_in"] == P(None, "fsdp", None)


def test_fsdp_with_tensor_shards_the_first_other_dim_that_divides():
    """docs/tensor-sequence-context.md: where tensor splits a weight's heads, mlp or vocab dim,
    FSDP takes the first other dim that divides (after the layers'), or shares tensor's dim
    where no other can (a bias)."""
    model = TransformerLM(get_preset("tiny-llama"))
    rules = ShardingRules(build_mesh("data=2,fsdp=2,tensor=2"), Strategy())
    got = flat(rules.param_specs(model.param_axes(), model.abstract_params()))
    assert got["blocks/attn/wq"] == P(None, "fsdp", "tensor", None)  # (2, 64, 8, 8): embed first
    assert got["blocks/attn/wo"] == P(None, "tensor", "fsdp", None)  # (2, 8, 8, 64): d_head before embed
    assert got["blocks/ffn/w_out"] == P(None, "tensor", "fsdp")
    assert got["lm_head"] == P("fsdp", "tensor") and got["tokens"] == P("tensor", "fsdp")
    gpt2 = TransformerLM(get_preset("tiny"))
    got = flat(rules.param_specs(gpt2.param_axes(), gpt2.abstract_params()))
    assert got["blocks/ffn/b_in"] == P(None, ("tensor", "fsdp"))  # (2, 256): no other dim


def test_uneven_dims_fall_back_to_another_dim_or_fewer_axes():
    # d_model 36 is not divisible by 8: FSDP shards another dim where one divides.
    cfg = ModelConfig(name="odd", n_layers=2, d_model=36, n_heads=4, d_mlp=144, vocab_size=256,
                      max_seq_len=64)
    model = TransformerLM(cfg)
    got = flat(rules_for("fsdp").param_specs(model.param_axes(), model.abstract_params()))
    assert got["blocks/ffn/w_in"] == P(None, None, "fsdp")  # (2, 36, 144)
    assert got["blocks/ffn/w_out"] == P(None, "fsdp", None)  # (2, 144, 36)
    assert got["tokens"] == P("fsdp", None)  # (256, 36)
    assert got["blocks/attn/wq"] == P(None, None, None, None)  # (2, 36, 4, 9): nothing divides
    # HSDP + ZeRO-1 shards optimizer state 8 ways; heads (4) divide by fsdp=4 only.
    got = flat(rules_for("hsdp+zero1").param_specs(model.param_axes(), model.abstract_params(),
                                                   StateKind.OPT_STATE))
    assert got["blocks/attn/bq"] == P(None, "fsdp", None)  # (2, 4, 9)
    assert got["blocks/ffn/w_in"] == P(None, None, ("fsdp", "data"))


@pytest.mark.parametrize("strategy, batch_spec", [
    ("ddp", P("data", None)), ("fsdp", P("fsdp", None)), ("hsdp", P(("data", "fsdp"), None))])
def test_batch_and_activation_specs(strategy, batch_spec):
    rules = rules_for(strategy)
    assert rules.batch_sharding().spec == batch_spec
    assert rules.activation_spec((Dim.BATCH, Dim.LENGTH, Dim.ACT_EMBED)) == P(batch_spec[0], None, None)
    # compute layout of a weight: ZeRO/FSDP axes gathered away
    assert rules.compute_param_spec((Dim.EMBED, Dim.MLP), (64, 256)) == P(None, None)


def test_single_device_rules_replicate_everything():
    rules = ShardingRules(build_mesh("data=1", jax.devices()[:1]))
    assert rules.name == "single"
    assert rules.batch_sharding().spec == P(None, None)
    assert rules.param_spec((Dim.EMBED, Dim.MLP), (64, 256)) == P(None, None)


@pytest.mark.parametrize("strategy, name", [
    ("ddp", "ddp"), ("zero1", "zero1"), ("zero2", "zero2"), ("zero3", "zero3"), ("fsdp", "fsdp"),
    ("hsdp", "hsdp"), ("hsdp+zero1", "hsdp+zero1")])
def test_strategy_names(strategy, name):
    assert rules_for(strategy).name == name


def test_bad_strategy_values():
    with pytest.raises(ConfigError, match="--zero must be 0, 1, 2 or 3"):
        Strategy(zero=4)
    with pytest.raises(ConfigError, match="--fsdp-min-size"):
        Strategy(fsdp_min_size=-1)
    with pytest.raises(ConfigError, match=r"--zero 1 shards state over the data axis, which --mesh does not split"):
        ShardingRules(build_mesh("fsdp=8"), Strategy(zero=1))
    with pytest.raises(ConfigError, match=r"--fsdp-min-size keeps small params out of ZeRO/FSDP sharding"):
        ShardingRules(build_mesh("data=8"), Strategy(fsdp_min_size=1024))
    ShardingRules(build_mesh("data=8"), Strategy(zero=1, fsdp_min_size=1024))  # ZeRO-1 shards the moments
    rules = rules_for("hsdp")
    with pytest.raises(ConfigError, match=r"--batch-size 12 is not divisible by the batch-sharding "
                                          r"axes \(data=2,fsdp=4: 8 shards\)"):
        rules.check_batch(12)
