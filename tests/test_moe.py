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


@pytest.mark.parametrize("preset", ["moe-tiny", "moe-tiny-gpt2", "tiny"])
def test_weight_decay_reaches_matrices_only(preset):
    """One AdamW update with zero gradients is weight decay alone: every weight matrix (the
    experts', the router, projections, embeddings) shrinks by lr x decay, every bias and norm
    scale -- the experts' biases and the query/value biases included -- is left as it was.
    Which is which is read from the params' names here, not from their logical dims."""
    from jaxshard.pytree import named_leaves
    from jaxshard.training import optim
    from models import TransformerLM

    model = TransformerLM(get_preset(preset))
    cfg = optim.OptimConfig(lr=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    tx = optim.make(cfg, model.param_axes())
    # Random values everywhere: biases start at zero, where decay would not show.
    params = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), model.init(jax.random.key(0)))
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    vectors = 0
    for (name, p), u in zip(named_leaves(params), jax.tree.leaves(updates)):
        leaf = name.rsplit("/", 1)[-1]
        vector = leaf.startswith("b") or leaf in ("scale", "bias")
        vectors += vector
        want = np.zeros_like(p) if vector else -0.1 * 0.5 * np.asarray(p)
        np.testing.assert_allclose(np.asarray(u), want, rtol=1e-6, atol=1e-12, err_msg=name)
    assert vectors >= (3 if preset == "moe-tiny" else 10)  # norm scales; and biases


def _aux_numpy(logits, k, f=None):
    """(load balance E sum_e f_e P_e, z-loss mean lse^2, f) of one layer's router logits
    ``[B, L, E]``, in float64; ``f``: the routed fractions to hold fixed (they are counts)."""
    x = np.asarray(logits, np.float64)
    E = x.shape[-1]
    p = softmax(x)
    if f is None:
        chosen = np.argsort(-p, axis=-1, kind="stable")[..., :k]
        f = np.array([(chosen == e).mean() for e in range(E)])
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return E * np.sum(f * p.reshape(-1, E).mean(0)), np.mean(lse ** 2), f


@pytest.mark.parametrize("preset", ["moe-tiny", "moe-tiny-gpt2"])
def test_auxiliary_losses_reach_the_router_gradient(preset, monkeypatch):
    """The model's total adds coef x the load-balancing and z losses, and their gradient
    reaches the router: checked against numpy on the router logits the model computes
    (captured as it runs). Values: total - nll = tokens (a mean_l LB_l + z mean_l Z_l).
    Gradients: along a random direction V of the last MoE layer's router, the change the
    coefficients make to the total's gradient equals a central difference, in float64, of
    a LB + z Z at logits moved by that layer's x V (logits are linear in the router)."""
    from models import TransformerLM, moe

    captured = []
    real = moe.route

    def spy(logits, k, cap, bias=None):
        jax.debug.callback(lambda x: captured.append(np.asarray(x)), logits, ordered=True)  # in layer order
        return real(logits, k, cap, bias)

    monkeypatch.setattr(moe, "route", spy)
    a, z = 0.3, 0.05
    cfg = get_preset(preset).replace(moe_aux_coef=a, moe_z_coef=z)
    model, plain = TransformerLM(cfg), TransformerLM(cfg.replace(moe_aux_coef=0.0, moe_z_coef=0.0))
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    y = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    n_moe, k, tokens = cfg.n_moe_layers, cfg.moe_top_k, x.size

    sums = jax.jit(model.loss)(params, x, y)
    jax.effects_barrier()
    logits0, captured[:] = list(captured), []
    assert len(logits0) == n_moe
    layers = [_aux_numpy(lg, k) for lg in logits0]
    lb, zl = np.mean([t[0] for t in layers]), np.mean([t[1] for t in layers])
    np.testing.assert_allclose(float(sums.moe["moe_load_balance"]), tokens * lb, rtol=1e-5)
    np.testing.assert_allclose(float(sums.moe["moe_z_loss"]), tokens * zl, rtol=1e-5)
    np.testing.assert_allclose(float(sums.total - sums.nll), tokens * (a * lb + z * zl), rtol=1e-4)

    # The last MoE layer's router moved by V: its logits move by x V.
    V = rng.normal(size=params["moe_blocks"]["ffn"]["router"].shape[1:]).astype(np.float32)
    moved = jax.tree.map(lambda p: p, params)
    moved["moe_blocks"]["ffn"]["router"] = params["moe_blocks"]["ffn"]["router"].at[-1].add(V)
    jax.jit(model.loss)(moved, x, y)
    jax.effects_barrier()
    dL = np.asarray(captured[-1], np.float64) - logits0[-1]
    f = layers[-1][2]

    def aux(eps):
        lb_, z_, _ = _aux_numpy(logits0[-1] + eps * dL, k, f)
        return a * lb_ + z * z_

    eps = 1e-4
    want = tokens / n_moe * (aux(eps) - aux(-eps)) / (2 * eps)

    def router_grad(m):
        g = jax.grad(lambda p: m.loss(p, x, y).total)(params)
        return np.asarray(g["moe_blocks"]["ffn"]["router"][-1], np.float64)

    got = np.sum((router_grad(model) - router_grad(plain)) * V)
    assert abs(want) > 1e-3  # the direction moves the losses
    np.testing.assert_allclose(got, want, rtol=2e-3)


def test_the_coefficients_change_the_training_step_by_their_gradient():
    """Through the training step (one device): the logged gradient norm at the first step is the
    norm, per token, of the gradient of nll + a LB + z Z that the model's loss gives -- for
    (a, z) = (0, 0) and (0.5, 0.05), which differ -- and over 8 steps a load-balancing weight
    keeps the routing more balanced (LB nearer 1) than none does."""
    from harness import make_program, random_batches
    from models import TransformerLM

    batches = random_batches(256, 0)[:1] * 8  # one batch, again and again: routing drifts on it
    runs = {}
    for a, z in ((0.0, 0.0), (0.5, 0.05)):
        model = TransformerLM(get_preset("moe-tiny").replace(moe_aux_coef=a, moe_z_coef=z))
        program = make_program(model, "data=1")
        state = program.init(0)
        b = batches[0]
        grads = jax.grad(lambda p: model.loss(p, jnp.asarray(b["inputs"]), jnp.asarray(b["targets"])).total)(
            jax.tree.map(np.asarray, state.params))
        want = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))) / b["inputs"].size
        metrics = []
        for batch in batches:
            state, m = program.step(state, jax.device_put(batch, program.batch_sharding))
            metrics.append({k: float(v) for k, v in m.items()})
        np.testing.assert_allclose(metrics[0]["grad_norm"], want, rtol=1e-5)
        runs[(a, z)] = metrics
    plain, weighted = runs[(0.0, 0.0)], runs[(0.5, 0.05)]
    assert plain[0]["grad_norm"] != pytest.approx(weighted[0]["grad_norm"], rel=1e-4)
    assert plain[0]["moe_load_balance"] == pytest.approx(weighted[0]["moe_load_balance"], rel=1e-6)
    assert weighted[-1]["moe_load_balance"] < plain[-1]["moe_load_balance"]


def _biased_choices(probs, bias, k):
    """numpy: the top k of probs + bias (ties to the lower index), gated by the plain probs."""
    experts = np.argsort(-(probs + bias), axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(probs, experts, axis=-1)
    return experts, top if k == 1 else top / top.sum(-1, keepdims=True)


@pytest.mark.parametrize("k", [1, 2])
def test_a_routing_bias_chooses_the_experts_but_not_their_gates(k):
    """DeepSeek-V3's balancing bias: the top k of the biased probabilities, each gated by its
    unbiased probability; the max-violation statistic E max_e f_e - 1 is unchanged by the
    zero-valued term that carries the loads, and that term's gradient is f_e - 1/E."""
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(3, 32, 4)).astype(np.float32)
    bias = rng.normal(size=4).astype(np.float32) * 0.3
    r = route(jnp.asarray(logits), k, 0, jnp.asarray(bias))
    experts, gates = _biased_choices(softmax(logits.astype(np.float64)), bias, k)
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_allclose(np.asarray(r.gates), gates, rtol=1e-5)
    assert not np.array_equal(experts, np.argsort(-logits, axis=-1, kind="stable")[..., :k])  # the bias matters
    f = np.array([(experts == e).mean() for e in range(4)])
    assert float(r.max_violation) == pytest.approx(4 * f.max() - 1, abs=1e-6)
    grad = jax.grad(lambda b: route(jnp.asarray(logits), k, 0, b).max_violation)(jnp.asarray(bias))
    np.testing.assert_allclose(np.asarray(grad), f - 1 / 4, atol=1e-7)


@pytest.mark.parametrize("k", [2, 3])
def test_a_bias_below_minus_one_still_chooses_k_different_experts(k):
    """The bias has no floor (it steps by the rate every step): with every biased score below
    -1 the top k are still k different experts, the numpy order of the scores (a chosen expert
    masked at -1 would be chosen again; the dropless dispatcher's buffers hold at most one row
    a token per expert)."""
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(2, 16, 8)).astype(np.float32)
    bias = np.full(8, -2.0, np.float32) + rng.normal(size=8).astype(np.float32) * 0.1
    r = route(jnp.asarray(logits), k, 0, jnp.asarray(bias))
    experts, gates = _biased_choices(softmax(logits.astype(np.float64)), bias, k)
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_allclose(np.asarray(r.gates), gates, rtol=1e-5)
    assert all(len(set(row)) == k for row in np.asarray(r.experts).reshape(-1, k))


def test_the_router_bias_steps_towards_the_mean_load_against_numpy(monkeypatch):
    """One training step of moe-tiny with ``--moe-balance bias`` from random biases: each
    layer's bias moves by gamma sign(1/E - f_e), f_e its experts' share of the step's choices
    counted in numpy from the router logits the step computed (captured as it runs) and the
    biases it started from. (The first step's learning rate is 0, warming up: the bias's step
    is its own rate, as DeepSeek-V3's, not Adam's.)"""
    from harness import make_program, random_batches
    from models import TransformerLM, moe

    captured = []
    real = moe.route

    def spy(logits, k, cap, bias=None):
        jax.debug.callback(lambda x: captured.append(np.asarray(x)), logits, ordered=True)
        return real(logits, k, cap, bias)

    monkeypatch.setattr(moe, "route", spy)
    gamma = 0.01
    cfg = get_preset("moe-tiny").replace(moe_balance="bias", moe_bias_rate=gamma)
    program = make_program(TransformerLM(cfg), "data=1")
    state = program.init(0)
    rng = np.random.default_rng(0)
    ffn = state.params["moe_blocks"]["ffn"]
    bias = (rng.normal(size=ffn["router_bias"].shape) * 0.05).astype(np.float32)
    params = jax.tree.map(lambda x: x, state.params)
    params["moe_blocks"]["ffn"]["router_bias"] = jax.device_put(bias, ffn["router_bias"].sharding)
    router = np.asarray(ffn["router"])
    state = state._replace(params=params)
    batch = random_batches(cfg.vocab_size, 0)[0]
    state, _ = program.step(state, jax.device_put(batch, program.batch_sharding))
    jax.effects_barrier()
    assert len(captured) == cfg.n_moe_layers
    E, k = cfg.moe_experts, cfg.moe_top_k
    want = []
    for layer, logits in enumerate(captured):
        experts, _ = _biased_choices(softmax(np.asarray(logits, np.float64)), bias[layer], k)
        f = np.array([(experts == e).mean() for e in range(E)])
        want.append(bias[layer] + gamma * np.sign(1 / E - f))
    got = np.asarray(state.params["moe_blocks"]["ffn"]["router_bias"])
    np.testing.assert_allclose(got, np.array(want, np.float32), atol=1e-7)
    assert np.any(got != bias)
    np.testing.assert_array_equal(np.asarray(state.params["moe_blocks"]["ffn"]["router"]), router)  # lr 0


def test_the_loads_do_not_count_in_the_clipping_norm():
    """The bias's gradient is the loads' deviation, not a gradient: the first step's norm (and
    loss) with the bias and the aux loss equals the aux loss's alone (the bias starts at zero,
    so the routing is the same)."""
    from harness import make_program, random_batches
    from models import TransformerLM

    batch = random_batches(256, 0)[0]
    norms = {}
    for balance in ("aux", "both"):
        program = make_program(TransformerLM(get_preset("moe-tiny").replace(moe_balance=balance)), "data=1")
        _, m = program.step(program.init(0), jax.device_put(batch, program.batch_sharding))
        norms[balance] = (float(m["grad_norm"]), float(m["loss"]), float(m["moe_max_violation"]))
    np.testing.assert_allclose(norms["both"], norms["aux"], rtol=1e-6)
    assert norms["aux"][2] > 0


@pytest.mark.parametrize("flags, message", [
    (dict(moe_balance="bias", moe_aux_coef=0.1),
     "--moe-aux-coef weights the load-balancing loss, which --moe-balance bias leaves out (use --moe-balance both)"),
    (dict(moe_bias_rate=0.01), "--moe-bias-rate needs --moe-balance bias or both"),
])
def test_balance_flags_that_would_do_nothing_are_errors(flags, message):
    from jaxshard.model import Moe

    with pytest.raises(ConfigError, match=re.escape(message)):
        Moe(**flags)


@pytest.mark.parametrize("balance, why", [("bias", "nothing would balance the experts"),
                                          ("both", "use --moe-balance aux")])
def test_a_routing_bias_that_never_moves_is_an_error(balance, why):
    cfg = get_preset("moe-tiny")
    assert cfg.replace(moe_balance=balance, moe_bias_rate=1e-4).moe_router_bias
    with pytest.raises(ConfigError, match=re.escape(
            f"--moe-balance {balance} with --moe-bias-rate 0 never moves the routing bias: {why}")):
        cfg.replace(moe_balance=balance, moe_bias_rate=0.0)
    assert cfg.replace(moe_balance="aux", moe_bias_rate=0.0).moe_aux_weight > 0  # (unused there)
