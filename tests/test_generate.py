"""Generation with a KV cache: greedy equals decoding by full recomputation on one device and
on meshes, a batch gives each row what it gives alone, and sampling is reproducible and draws
only from the top-k / top-p set."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.parallel.pipeline import StageLayout
from jaxshard.parallel.staged import staged
from jaxshard.rules import ShardingRules, Strategy, use_rules
from models import TransformerLM, get_preset
from models import generate as generation
from models.generate import generate, greedy_by_recompute
from models.config import RopeScaling

NEW = 10
# Lengths across the prompt buckets (right-padding to 8 and 16) and a one-token prompt.
PROMPTS = [[5, 17, 99], [200, 3, 4, 8, 9, 10, 11, 12, 13, 14], [7], [31, 41, 59, 26, 53, 58, 97, 93]]
# A wavelength cut-off short enough that the scaling changes the rotations of these positions.
LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=32)


def make_model(name: str, rope_scaling: RopeScaling | None = None):
    """Random init scaled up, so that logits are far from uniform and greedy ties unlikely."""
    cfg = get_preset(name)
    model = TransformerLM(cfg if rope_scaling is None else cfg.replace(rope_scaling=rope_scaling))
    return model, jax.tree.map(lambda p: 4 * p, model.init(jax.random.key(0)))


@functools.cache
def model_and_reference(name: str, rope_scaling: RopeScaling | None = None):
    """(model, params, greedy tokens of each of PROMPTS decoded alone by full recomputation)."""
    model, params = make_model(name, rope_scaling)
    return model, params, [greedy_by_recompute(model, params, p, NEW) for p in PROMPTS]


def on_mesh(model, params, mesh: str, strategy: Strategy = Strategy()):
    """(rules, the params in their at-rest shardings as training lays them out)."""
    n = int(np.prod([int(item.split("=")[1]) for item in mesh.split(",")]))
    rules = ShardingRules(build_mesh(mesh, jax.devices()[:n]), strategy)
    if params is None:
        return rules, None
    return rules, jax.device_put(params, rules.param_shardings(model.param_axes(), params))


def test_reference_is_not_degenerate():
    """The equalities below mean something: rows differ, and each row varies."""
    for name in ("tiny", "tiny-llama"):
        _, _, ref = model_and_reference(name)
        assert len({tuple(r) for r in ref}) == len(ref)
        assert all(len(set(r)) >= 4 for r in ref), ref


@pytest.mark.parametrize("name, scaling", [("tiny", None), ("tiny-llama", None), ("tiny-llama", LLAMA3)])
def test_greedy_matches_recompute(name, scaling):
    model, params, ref = model_and_reference(name, scaling)
    assert generate(model, params, PROMPTS, NEW) == ref


def test_rope_scaling_changes_the_tokens():
    """Control for the scaled case above: the scaling changes what greedy decoding gives."""
    assert model_and_reference("tiny-llama", LLAMA3)[2] != model_and_reference("tiny-llama")[2]


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_each_row_as_alone(name):
    model, params, _ = model_and_reference(name)
    batch = generate(model, params, PROMPTS, NEW)
    assert [generate(model, params, [p], NEW)[0] for p in PROMPTS] == batch


@pytest.mark.parametrize("mesh, strategy", [
    ("tensor=2", Strategy()),
    ("data=2,tensor=2", Strategy()),  # 4 rows: 2 per data shard
    ("fsdp=2,tensor=2", Strategy(sequence_parallel=True)),
])
@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_greedy_on_mesh_matches_recompute(name, mesh, strategy):
    model, params, ref = model_and_reference(name)
    rules, sharded = on_mesh(model, params, mesh, strategy)
    assert sharded["blocks"]["attn"]["wq"].sharding.spec[2] == "tensor"  # heads
    assert generate(model, sharded, PROMPTS, NEW, rules=rules) == ref
    # 3 rows do not divide the batch axes: replicated, same tokens.
    assert generate(model, sharded, PROMPTS[:3], NEW, rules=rules) == ref[:3]


@pytest.mark.parametrize("mesh, spec", [
    ("data=2,tensor=2", P(None, "data", None, "tensor", None)),
    ("fsdp=2,tensor=4", P(None, "fsdp", None, None, None)),  # 2 kv heads < tensor: replicated
    ("tensor=2", P(None, None, None, "tensor", None)),
])
def test_cache_layout(mesh, spec):
    model = TransformerLM(get_preset("tiny-llama"))
    rules, _ = on_mesh(model, None, mesh)

    def empty():
        with use_rules(rules):
            return model.new_cache(4, 16)

    cache = jax.jit(empty)()
    assert cache.k.shape == (2, 4, 16, 2, 8)
    for x in (cache.k, cache.v):
        assert x.sharding.is_equivalent_to(rules.named(spec), x.ndim), x.sharding.spec


def test_compiles_once_per_prompt_bucket():
    model, params, ref = model_and_reference("tiny")
    generation._decode.cache_clear()
    assert generate(model, params, [PROMPTS[0]], NEW) == ref[:1]
    assert generate(model, params, [PROMPTS[3]], NEW) == ref[3:]  # lengths 3 and 8: one bucket
    assert generate(model, params, [PROMPTS[1]], NEW) == ref[1:2]  # length 10: the next
    assert generation._decode.cache_info().currsize == 1
    assert generation._decode(model, None, True, NEW)._cache_size() == 2


def test_stop_id_ends_a_row_with_it():
    model, params, ref = model_and_reference("tiny")
    stop = ref[0][3]
    out = generate(model, params, PROMPTS, NEW, stop_id=stop)
    expected = [r[:r.index(stop) + 1] if stop in r else r for r in ref]
    assert out == expected
    assert out[0] == ref[0][:4] and any(len(r) == NEW for r in out)


SAMPLING = dict(temperature=1.5, top_k=40, top_p=0.9)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_sampling_reproducible_by_seed(name):
    model, params, ref = model_and_reference(name)
    first = generate(model, params, PROMPTS, NEW, seed=1, **SAMPLING)
    assert generate(model, params, PROMPTS, NEW, seed=1, **SAMPLING) == first
    assert generate(model, params, PROMPTS, NEW, seed=2, **SAMPLING) != first
    assert first != ref
    rules, sharded = on_mesh(model, params, "data=2,tensor=2")
    assert generate(model, sharded, PROMPTS, NEW, seed=1, rules=rules, **SAMPLING) == first


def test_top_k_1_and_tiny_top_p_are_greedy():
    model, params, ref = model_and_reference("tiny-llama")
    assert generate(model, params, PROMPTS, NEW, temperature=2.0, top_k=1, seed=3) == ref
    assert generate(model, params, PROMPTS, NEW, temperature=2.0, top_p=1e-6, seed=3) == ref


def first_token_probs(model, params, prompt, temperature):
    logits = model.head(params, model.blocks(params, model.embed(params, np.asarray([prompt]))))
    z = np.asarray(logits[0, -1, :model.cfg.vocab_size], np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.5), (8, 0.6)])
def test_draws_only_from_the_top_k_and_top_p_set(top_k, top_p):
    """64 copies of one prompt draw 64 first tokens: all in the allowed set, and more than one."""
    model, params, _ = model_and_reference("tiny")
    prompt, temperature = PROMPTS[1], 1.0
    p = first_token_probs(model, params, prompt, temperature)
    order = np.argsort(-p)
    allowed = order[:top_k or len(p)]
    if top_p is not None:
        q = p[allowed] / p[allowed].sum()
        allowed = allowed[:int(np.sum(np.cumsum(q) - q < top_p))]
    drawn = {r[0] for r in generate(model, params, [prompt] * 64, 1, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=0)}
    assert drawn <= set(allowed.tolist()), (drawn, allowed)
    assert len(drawn) > 1
    assert p[allowed].sum() < 0.8  # unfiltered, some of 64 draws would fall outside


def test_bad_arguments_are_one_line_errors():
    model, params = make_model("tiny")
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_k=0, temperature=1.0), "top_k must be >= 1"),
        (dict(top_p=0.0, temperature=1.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5, temperature=1.0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=5), "top_k and top_p choose among tokens to sample; temperature 0 decodes greedily"),
        (dict(top_p=0.9, temperature=0.0), "top_k and top_p choose among tokens to sample"),
        (dict(max_new_tokens=250), "exceeds model tiny's max_seq_len 256"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, 256]]), "token id 256 is outside"),
        (dict(stop_id=-1), "stop_id -1 is outside"),
    ]
    for changes, message in cases:
        args = dict(prompts=PROMPTS, max_new_tokens=NEW) | changes
        with pytest.raises(ConfigError, match=message) as e:
            generate(model, params, args.pop("prompts"), args.pop("max_new_tokens"), **args)
        assert "\n" not in str(e.value)
    # At the limit it runs: the longest prompt (10) plus 246 new tokens is max_seq_len.
    assert len(generate(model, params, [PROMPTS[1]], 246)[0]) == 246


def test_moe_and_pipelines_are_not_supported_yet():
    moe = TransformerLM(get_preset("moe-tiny"))
    with pytest.raises(ConfigError, match="does not support MoE models yet"):
        generate(moe, {}, PROMPTS, NEW)
    model, params = make_model("tiny")
    with pytest.raises(ConfigError, match="does not support pipeline-staged models yet"):
        generate(staged(model, StageLayout.make(2, 2)), params, PROMPTS, NEW)
    rules, _ = on_mesh(model, None, "stage=2")
    with pytest.raises(ConfigError, match="does not support pipeline-staged models yet"):
        generate(model, params, PROMPTS, NEW, rules=rules)
