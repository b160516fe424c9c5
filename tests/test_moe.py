"""The mixture-of-experts layer on one device against independent references: routing, queue
places and the dropped fraction against a token-by-token numpy simulation of the queues; the
layer's output against a numpy loop over each token's kept choices; dropless against a
capacity that drops nothing (outputs and gradients); the auxiliary losses against their
textbook formulas; bad configurations as one-line errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxshard.errors import ConfigError
from models import get_preset
from models.moe import MoEFeedForward, route


def moe_cfg(family="tiny-llama", experts=4, k=2, factor=1.25, **kw):
    return get_preset(family).replace(moe_experts=experts, moe_top_k=k, moe_capacity_factor=factor, **kw)


def queues(probs, k, cap):
    """Token by token, GShard's priority (all first choices, then all second ...): numpy."""
    G, S, E = probs.shape
    experts = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    kept = np.zeros((G, S, k), bool)
    for g in range(G):
        load = np.zeros(E, int)
        for c in range(k):
            for s in range(S):
                e = experts[g, s, c]
                kept[g, s, c] = cap == 0 or load[e] < cap
                load[e] += 1
    return experts, kept


def capacity(group, k, experts, factor):
    """GShard's expert capacity, restated: ceil(c k S / E) choices per group (0: dropless)."""
    return 0 if factor == 0 else max(1, math.ceil(factor * k * group / experts))


def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("factor", [1.0, 0.5, 0.0])
def test_routing_drops_what_the_queues_drop(k, factor):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(3, 32, 4)).astype(np.float32) * 2
    cap = capacity(32, k, 4, factor)
    r = route(jnp.asarray(logits), k, cap)
    experts, kept = queues(softmax(logits), k, cap)
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_array_equal(np.asarray(r.kept), kept)
    assert float(r.dropped) == pytest.approx(1 - kept.mean(), abs=1e-7)
    if factor == 0:
        assert float(r.dropped) == 0
    elif factor == 0.5:
        assert float(r.dropped) > 0.2  # half the capacity a balanced router needs
    p = softmax(logits)
    top = np.take_along_axis(p, experts, -1)
    np.testing.assert_allclose(np.asarray(r.gates), top if k == 1 else top / top.sum(-1, keepdims=True), rtol=1e-6)
    f = np.stack([(experts == e).mean() for e in range(4)])  # over tokens and choices
    np.testing.assert_allclose(float(r.load_balance), 4 * np.sum(f * p.mean((0, 1))), rtol=1e-6)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(r.z_loss), np.mean(lse ** 2), rtol=1e-6)


def reference(layer, x, kept_only=True):
    """Each token: the sum over its kept choices of gate x that expert's MLP, in numpy."""
    params = jax.tree.map(lambda v: np.asarray(v, np.float64), nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    x64 = np.asarray(x, np.float64)
    B, L, D = x64.shape
    logits = x64 @ params["router"]
    probs = softmax(logits)
    cap = capacity(L, layer.k, layer.n_experts, layer.cfg.moe_capacity_factor)
    experts, kept = queues(probs.astype(np.float32), layer.k, cap)
    top = np.take_along_axis(probs, experts, -1)
    gates = top if layer.k == 1 else top / top.sum(-1, keepdims=True)
    out = np.zeros_like(x64)
    for b in range(B):
        for s in range(L):
            for c in range(layer.k):
                if kept_only and not kept[b, s, c]:
                    continue
                e = experts[b, s, c]
                h = x64[b, s] @ params["w_in"][e] + (params["b_in"][e] if layer.use_bias else 0)
                if layer.swiglu:
                    g = x64[b, s] @ params["w_gate"][e]
                    h = g / (1 + np.exp(-g)) * h
                else:
                    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
                y = h @ params["w_out"][e] + (params["b_out"][e] if layer.use_bias else 0)
                out[b, s] += gates[b, s, c] * y
    return out, 1 - kept.mean()


@pytest.mark.parametrize("family", ["tiny", "tiny-llama"])  # GELU with biases; SwiGLU
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("factor", [1.0, 0.0])
def test_layer_equals_a_token_by_token_reference(family, k, factor):
    cfg = moe_cfg(family, experts=4, k=k, factor=factor)
    layer = MoEFeedForward(cfg, nnx.Rngs(0))
    if cfg.use_bias:  # non-zero biases, so that a misplaced one shows
        for name in ("b_in", "b_out"):
            b = getattr(layer, name)
            b[...] = jax.random.normal(jax.random.key(7), b[...].shape) * 0.1
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    y, r = layer(x)
    want, dropped = reference(layer, x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    assert float(r.dropped) == pytest.approx(dropped, abs=1e-7)
    if factor == 1.0 and k == 2:
        assert dropped > 0  # the test sees drops


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_equals_a_capacity_that_drops_nothing_with_gradients(k):
    """A capacity of S (factor E / k), the most an expert can get: nothing drops, and the einsum
    dispatch and the sorted grouped matmuls give the same outputs and gradients."""
    x = jax.random.normal(jax.random.key(2), (2, 16, 64))
    results = []
    for factor in (0.0, 4.0 / k):
        layer = MoEFeedForward(moe_cfg("tiny-llama", experts=4, k=k, factor=factor), nnx.Rngs(0))
        graph, params = nnx.split(layer, nnx.Param)

        def loss(params, x):
            y, r = nnx.merge(graph, params)(x)
            return jnp.sum(y * jnp.cos(y)) + r.load_balance + r.z_loss, r.dropped

        (value, dropped), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        assert float(dropped) == 0
        results.append((value, grads))
    (v0, g0), (v1, g1) = results
    assert float(v0) == pytest.approx(float(v1), rel=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_shared_expert_adds_a_dense_mlp():
    cfg = moe_cfg("tiny-llama", factor=0.0, moe_shared_experts=1)
    layer = MoEFeedForward(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (1, 8, cfg.d_model))
    y, _ = layer(x)
    routed, _ = reference(layer, x)
    np.testing.assert_allclose(np.asarray(y), routed + np.asarray(layer.shared(x), np.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("changes, message", [
    (dict(moe_experts=1), "--moe-experts must be 0 (dense) or >= 2, got 1"),
    (dict(moe_experts=4, moe_top_k=5), "--moe-top-k must be between 1 and the experts (4), got 5"),
    (dict(moe_experts=4, moe_every=3), "--moe-every 3 must be >= 1 and divide the model's 2 layers"),
    (dict(moe_experts=4, moe_capacity_factor=-1.0), "--moe-capacity-factor must be >= 0 (0: dropless), got -1.0"),
])
def test_bad_moe_configs_are_one_line_errors(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_preset("tiny").replace(**changes)
