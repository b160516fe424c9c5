"""A layer stack's backward pass split into B (the input's gradient) and W (the weights'):
together exactly the pullback's gradients, and every matmul of the pullback run once -- B's
and W's compiled matmul FLOPs sum to the pullback's, W's are the weight gradients' (one
matmul per weight use), B's no more than the rest."""

import contextlib
import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxshard.analysis import hlo
from jaxshard.parallel import pipeline, split_backward
from models import TransformerLM, get_preset


def _stack(preset, remat, shape=(2, 16)):
    """(f(chunk, x) -> (y, extra), the chunk's params, an input of ``shape`` rows x tokens) of
    a model's layer stack."""
    cfg = get_preset(preset)
    model = TransformerLM(cfg, remat=remat)
    params = model.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (*shape, cfg.d_model))
    if model.moe_layers:
        rest = {k: v for k, v in params.items() if k != "moe_blocks"}

        def f(c, x):
            y, stats = model.moe_stack({"moe_blocks": c, **rest}, x)
            return y, stats[0].sum()  # the load-balancing loss, differentiated too

        return f, params["moe_blocks"], x

    def f(c, x):
        return model.blocks({model.stack: c}, x), jnp.zeros((), jnp.float32)

    return f, params[model.stack], x


def _dot_flops(fn, *args) -> float:
    return hlo.dot_flops(jax.jit(fn).lower(*args).compile().as_text())


@pytest.mark.parametrize("preset, remat", [("tiny", "none"), ("tiny-llama", "none"), ("tiny-llama", "full"),
                                           ("tiny-llama", "selective"), ("tiny", "dots"), ("moe-tiny", "none"),
                                           ("tiny-llama", "dots_no_batch"), ("tiny", "names:qkv,attn_proj,mlp_in")])
def test_b_and_w_are_the_pullback_with_every_matmul_once(preset, remat):
    f, chunk, x = _stack(preset, remat)
    (y, extra), pullback = jax.vjp(f, chunk, x)
    res, treedef = jax.tree.flatten(pullback)

    def full(res, cot):
        return jax.tree.unflatten(treedef, res)(cot)

    cot = (jax.random.normal(jax.random.key(2), y.shape), jnp.ones_like(extra))
    n_weights = len(jax.tree.leaves(chunk))
    s = split_backward.split(full, res, cot, n_weights)
    d_x, stash = s.b(res, cot)
    d_w = s.w(res, stash)
    want = jax.tree.leaves(full(res, cot))
    for got, ref in zip(d_w + d_x, want):  # (eager: XLA fuses the sums of the two differently)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-7)
    # The weights B computes whole are those whose gradient takes no matmul (norm scales, biases).
    names = [path[-1].key for path, _ in jax.tree_util.tree_leaves_with_path(chunk)]
    assert all(not names[k].startswith("w") for k in s.in_b), [names[k] for k in s.in_b]
    # The attention's norm among them: else W is handed the cotangent it reduces, an
    # activation's size (a LayerNorm's scale and bias reduce the same one: B takes both). (The
    # MLP's norm, where W makes the attention output's gradient again from the cotangent it
    # reduces and the layer's, W may reduce: test_the_hand_over_fits_... counts the bytes.)
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(chunk)]
    norms = {p for p in paths if "attn_norm" in p}
    assert norms and norms <= {paths[k] for k in s.in_b}, (norms, [paths[k] for k in s.in_b])
    # But not the attention's biases: each reduces the cotangent W's matmul reads anyway.
    assert not [paths[k] for k in s.in_b if "['attn']['b" in paths[k]]
    b, w = _dot_flops(s.b, res, cot), _dot_flops(s.w, res, stash)
    assert b + w == _dot_flops(full, res, cot)
    # W is the weights' gradients: a matmul per weight use, 2 x (weight elements) x tokens each
    # for the stack's weights (per layer; an MoE layer's router and k of its experts' rows).
    tokens = x.shape[0] * x.shape[1]
    cfg = get_preset(preset)
    if not cfg.moe_experts:
        matrices = sum(p.size for path, p in jax.tree_util.tree_leaves_with_path(chunk)
                       if path[-1].key.startswith("w"))  # the weights (not biases nor norm scales)
        assert w == 2 * matrices * tokens
    assert 0 < w < b + w and b > 0


def _on_mesh(preset, remat, mesh=None, sp=False):
    """(the stack's chunk, an input of 4 x 16 tokens, the rules of ``mesh`` (None: no mesh),
    parts) where ``parts(chunk, x, cot_y, upto)`` runs the stack's forward pass and then, under
    the rules, its pullback: whole (``upto`` None), or B then W ("w": the weights' gradients,
    then the input's), or B alone ("b": the input's gradient and what it hands W), or "handed"
    (what B hands W, the residuals W reads, all residuals) or "over" (what B hands W but the
    weight gradients it makes whole)."""
    from jaxshard.mesh import build_mesh
    from jaxshard.rules import ShardingRules, Strategy, use_rules
    from tests.harness import first_devices

    f, chunk, x = _stack(preset, remat, (4, 16))
    rules = mesh and ShardingRules(build_mesh(mesh, first_devices(mesh)), Strategy(sequence_parallel=sp))
    n_weights = len(jax.tree.leaves(chunk))

    def parts(chunk, x, cot_y, upto):
        with use_rules(rules) if rules else contextlib.nullcontext():
            out, pullback = jax.vjp(f, chunk, x)
            cot = (cot_y, jnp.ones_like(out[1]))
            res, treedef = jax.tree.flatten(pullback)
            full = lambda res, cot: jax.tree.unflatten(treedef, res)(cot)  # noqa: E731
            if upto is None:
                return jax.tree.leaves(full(res, cot))
            s = split_backward.split(full, res, cot, n_weights)
            d_x, stash = s.b(res, cot)
            if upto == "over":  # what B hands W but the weight gradients it makes whole
                return jax.tree.leaves(stash[0])
            if upto == "handed":
                return jax.tree.leaves(stash), [r for r, w in zip(res, s.w_reads) if w], res
            return d_x + jax.tree.leaves(stash) if upto == "b" else s.w(res, stash) + d_x

    return chunk, x, rules, parts


@pytest.mark.parametrize("preset, mesh, sp", [("tiny", None, False), ("tiny-llama", None, False),
                                              ("tiny", "tensor=2", False), ("tiny-llama", "tensor=2", False),
                                              ("tiny", "tensor=4", True), ("tiny", "fsdp=4", False)])
def test_what_b_hands_w_under_dots_depends_on_the_cotangent(preset, mesh, sp):
    """Under ``dots`` every matmul's output is a residual, so what else both parts need of the
    forward pass (a norm's output, an activation) is cheap and made from the residuals: W runs
    it again instead of keeping B's copy -- under tensor parallelism too, where a column
    projection's output leaves a ``shard_map`` region that only reshapes its residual, and
    under FSDP, where a bias or a norm's scale is gathered first (B hands W the gathered
    weight, and W does not gather it again). So each value B hands W changes with the
    cotangent (a gradient), but for such weights, none is the forward's; and W reads more
    residuals than B hands it values."""
    chunk, x, _, parts = _on_mesh(preset, "dots", mesh, sp)
    run = jax.jit(lambda *a: parts(*a, "handed"))
    (one, w_reads, res), (two, _, _) = (run(chunk, x, jax.random.normal(jax.random.key(seed), x.shape))
                                        for seed in (2, 3))
    same = [a.shape for a, b in zip(one, two) if np.allclose(a, b)]
    weights = {p.shape for p in jax.tree.leaves(chunk)} if mesh and "fsdp" in mesh else set()
    assert one and set(same) <= weights and bool(same) == bool(weights) and len(same) < len(one), (same, weights)
    assert w_reads and sum(a.size for a in one) < sum(r.size for r in res)


@pytest.mark.parametrize("mesh", [None, "tensor=2"])
def test_under_dots_b_hands_w_each_weight_matmuls_output_gradient_once(mesh):
    """tiny-llama's hand-over under ``dots``: the gradient of each weight matmul's output, once
    -- the queries', keys' and values', the attention output's and the MLP output's, and one
    of the MLP's width, from which W makes both SwiGLU gates' gradients again (the minimum cut
    of ``split_backward._fewer_bytes``). So too under tensor parallelism, where those gradients
    would leave the column projections' ``shard_map`` region (each device's share, tensor-major)
    unless B hands W their product's gradient outside it and W makes them there."""
    chunk, x, _, parts = _on_mesh("tiny-llama", "dots", mesh)
    over = jax.eval_shape(lambda *a: parts(*a, "over"), chunk, x, x)
    cfg = get_preset("tiny-llama")
    per_token = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head + 2 * cfg.d_model + cfg.d_mlp
    assert sum(a.size for a in over) == per_token * x.shape[0] * x.shape[1] * cfg.n_layers, \
        [a.shape for a in over]


def _handed_and_b_only(preset, remat):
    """(bytes B hands W but the weight gradients B makes whole, bytes of the residuals B alone
    reads -- not the params) for a stage's microbatch of 64 tokens."""
    f, chunk, x = _stack(preset, remat, (1, 64))
    (y, extra), pullback = jax.vjp(f, chunk, x)
    res, treedef = jax.tree.flatten(pullback)
    params = {id(p) for p in jax.tree.leaves(chunk)}

    def full(res, cot):
        return jax.tree.unflatten(treedef, res)(cot)

    cot = (jnp.ones(y.shape), jnp.ones_like(extra))
    s = split_backward.split(full, res, cot, len(jax.tree.leaves(chunk)))
    _, handed = jax.eval_shape(s.b, res, cot)
    nbytes = lambda xs: sum(a.size * a.dtype.itemsize for a in xs)  # noqa: E731
    made = nbytes([p for k, p in enumerate(jax.tree.leaves(chunk)) if k in s.in_b])
    assert made == nbytes(handed[1])
    return (nbytes(jax.tree.leaves(handed)) - made,
            nbytes([r for r, w in zip(res, s.w_reads) if not w and id(r) not in params]))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "moe-tiny"])
def test_the_hand_over_fits_in_the_b_only_residuals_under_the_policies_zb_h1_widens_for(preset):
    """``pipeline.HANDOVER_FITS``: under those policies what B hands W, but the weight
    gradients B makes whole (a norm's scale and bias, some biases: each the weight's size), is
    no more than the residuals B alone reads, so it can take their place and ZB-H1 may hold as
    many microbatches as 1F1B. So too under ``selective`` now that B makes a LayerNorm's scale
    and bias together (GPT-2's was 1.58x when W was handed the cotangent they reduce). Under
    the others it is several times more: ``full`` (which keeps none), ``dots_no_batch`` and
    ``names``, whose W is handed matmul inputs B made again: under those two, of the dense
    stacks, only the attention's output beyond what it is handed under ``dots`` (B runs the
    matmul that makes it, a forward one W alone reads, and hands it on rather than the L x L
    probabilities it reads: ``split_backward._b_runs_it``)."""
    for remat in pipeline.HANDOVER_FITS:
        handed, b_only = _handed_and_b_only(preset, remat)
        assert handed <= b_only, (remat, handed, b_only)
    under_dots = _handed_and_b_only(preset, "dots")[0]
    cfg = get_preset(preset)
    per_value = cfg.n_layers * 64 * 4  # a layer's 64 tokens, float32
    if preset != "moe-tiny":
        # Under dots, each weight matmul's output gradient, once: the queries', keys' and
        # values', the attention output's and the MLP output's (d_model each) and one of the MLP's
        # width (a SwiGLU's two gates' gradients W makes again from that of their product).
        textbook = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head + 2 * cfg.d_model + cfg.d_mlp
        assert under_dots == textbook * per_value, (under_dots, textbook * per_value)
    attention_out = per_value * cfg.d_model
    for remat in ("full", "dots_no_batch", "names:qkv,attn_proj,mlp_in"):
        handed, b_only = _handed_and_b_only(preset, remat)
        assert handed > 3 * b_only, (remat, handed, b_only)
        if remat != "full" and preset != "moe-tiny":
            assert handed == under_dots + attention_out, (remat, handed, under_dots)


def test_a_scan_carrying_what_both_parts_need_splits_and_stays_exact():
    """A toy recurrence whose weight gradient needs the carried cotangent at every step:
    B stacks it per iteration, W scans over the stack."""
    ws = jax.random.normal(jax.random.key(0), (5, 4, 4)) * 0.5

    def f(ws, x):
        def step(h, w):
            h = jnp.tanh(h @ w)
            return h, h.sum()

        h, ys = jax.lax.scan(step, x, ws)
        return h, ys

    x = jax.random.normal(jax.random.key(1), (3, 4))
    out, pullback = jax.vjp(f, ws, x)
    res, treedef = jax.tree.flatten(pullback)
    cot = jax.tree.map(lambda o: jax.random.normal(jax.random.key(2), o.shape), out)
    full = lambda res, cot: jax.tree.unflatten(treedef, res)(cot)  # noqa: E731
    s = split_backward.split(full, res, cot, 1)
    d_x, stash = s.b(res, cot)
    (d_ws,) = s.w(res, stash)
    want_ws, want_x = full(res, cot)
    np.testing.assert_allclose(d_ws, want_ws, rtol=1e-6)
    np.testing.assert_allclose(d_x[0], want_x, rtol=1e-6)


def test_a_cotangent_only_w_reads_is_handed_to_it():
    """Where the input's gradient does not depend on the cotangent (here it is zero), B
    reads none of it and hands it to W as it is: W's weight gradient reads it."""
    w, x = jax.random.normal(jax.random.key(0), (4, 3)), jax.random.normal(jax.random.key(1), (2, 4))
    out, pullback = jax.vjp(lambda w, x: jax.lax.stop_gradient(x) @ w, w, x)
    res, treedef = jax.tree.flatten(pullback)
    cot = jax.random.normal(jax.random.key(2), out.shape)
    full = lambda res, cot: jax.tree.unflatten(treedef, res)(cot)  # noqa: E731
    s = split_backward.split(full, res, cot, 1)
    d_x, stash = s.b(res, cot)
    for got, want in zip(s.w(res, stash) + d_x, jax.tree.leaves(full(res, cot))):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_b_runs_a_forward_matmul_for_w_only_where_it_makes_its_inputs_anyway():
    """Under full remat W makes again the forward matmuls whose outputs the weights' gradients
    read. A chain ``y = (x @ a) @ b`` whose outputs B does not read stays W's, though ``y`` is
    smaller than ``x @ a``: B running it would make ``x @ a`` too and hand W both (the
    attention's output under ``dots_no_batch`` is B's to run because B makes the
    probabilities it is made from anyway). W is handed the three output gradients alone."""
    ws = [jax.random.normal(jax.random.key(k), shape) for k, shape in enumerate([(16, 64), (64, 8), (8, 4)])]
    x = jax.random.normal(jax.random.key(3), (32, 16))

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def f(ws, x):
        return x @ ws[0] @ ws[1] @ ws[2]

    out, pullback = jax.vjp(f, ws, x)
    res, treedef = jax.tree.flatten(pullback)
    cot = jax.random.normal(jax.random.key(4), out.shape)
    full = lambda res, cot: jax.tree.unflatten(treedef, res)(cot)  # noqa: E731
    s = split_backward.split(full, res, cot, 3)
    d_x, stash = s.b(res, cot)
    assert sum(a.size for a in jax.tree.leaves(stash)) == 32 * (4 + 8 + 64)
    for got, want in zip(s.w(res, stash) + d_x, jax.tree.leaves(full(res, cot))):
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("preset, mesh, sp, remat", [("tiny-llama", "tensor=2", False, "none"),
                                                     ("tiny", "tensor=4", True, "none"),
                                                     ("tiny", "tensor=2", False, "dots"),
                                                     ("tiny-llama", "tensor=2", False, "dots"),
                                                     ("moe-tiny", "expert=4", False, "none")])
def test_a_shard_map_regions_weight_matmuls_run_in_w(preset, mesh, sp, remat):
    """Under tensor parallelism the column projections run in a ``shard_map`` region, and
    under an ``expert`` axis the experts: split into a B region and a W region over the same
    axes, each weight's gradient matmul runs in W. Per device, compiled: W's matmul FLOPs are
    every weight use's (a tensor-split weight's shard's), and B + W the pullback's; the
    gradients equal the pullback's. (Under ``dots`` W also runs again the regions that only
    reshape a residual, and on tiny-llama makes the SwiGLU's gates' gradients outside the
    column projections' region, which W reads as its inputs.)"""
    chunk, x, rules, parts = _on_mesh(preset, remat, mesh, sp)
    cot_y = jax.random.normal(jax.random.key(2), x.shape)

    flops = {k: _dot_flops(lambda *a: parts(*a, k), chunk, x, cot_y) for k in (None, "b", "w")}
    w = flops["w"] - flops["b"]
    assert w > 0 and flops["w"] == flops[None], flops
    got, want = (jax.jit(lambda *a: parts(*a, k))(chunk, x, cot_y) for k in ("w", None))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    cfg, tokens = get_preset(preset), x.shape[0] * x.shape[1]
    size = lambda part: sum(p.size for path, p in jax.tree_util.tree_leaves_with_path(chunk)  # noqa: E731
                            if path[-1].key.startswith(("w", "router")) and part(jax.tree_util.keystr(path)))
    if not cfg.moe_experts:  # every weight is split over tensor: its shard's gradient, per device
        assert w == 2 * size(lambda _: True) * tokens / rules.sizes["tensor"], (w, flops)
    else:  # the dense weights over the device's tokens; its experts' over their capacity's slots
        n = rules.sizes["expert"]
        slots = math.ceil(cfg.moe_capacity_factor * cfg.moe_top_k * tokens / cfg.moe_experts)
        experts = size(lambda p: "ffn" in p and "router" not in p) / n  # the device's experts
        assert w == 2 * size(lambda p: "ffn" not in p or "router" in p) * tokens / n + 2 * experts * slots, (w, flops)


@pytest.mark.parametrize("preset, mesh, sp", [("tiny", "tensor=4", True), ("tiny-llama", "tensor=2", False),
                                              ("tiny-llama", "sequence=4", False), ("tiny-llama", "fsdp=4", False)])
def test_the_split_sends_what_the_whole_pass_sends_but_sps_gathered_gradients(preset, mesh, sp):
    """Bytes each device sends, per kind of collective, in the compiled forward and backward
    pass whole and split into B and W: the same, but under SP, where a row projection's output
    gradient arrives split over the sequence and both of its gradients need it whole. The
    whole pass gathers it once; split, B gathers it and hands it on split, and W gathers it
    again: one all-gather more of ``[rows, seq, d]`` a row projection (attention output, MLP
    output) a layer (docs/pipelines.md, "What the split sends again under SP"). B and W compile
    into one program here, where XLA merges a collective both run on the same value, so this
    catches what a hand-over makes W send, not a collective W repeats of B's (in a pipeline
    they run in different ticks): the region and FSDP tests above check those."""
    chunk, x, rules, parts = _on_mesh(preset, "none", mesh, sp)
    sent = {}
    for upto in (None, "w"):
        text = jax.jit(lambda *a: parts(*a, upto)).lower(chunk, x, x).compile().as_text()
        sent[upto] = Counter()
        for c in hlo.parse(text):
            sent[upto][c.kind] += c.sent_bytes * c.executions
    assert sent[None], sent  # (each mesh sends something)
    extra = Counter(sent["w"])
    extra.subtract(sent[None])
    t = rules.sizes["tensor"]
    gathers = 2 * get_preset(preset).n_layers if sp else 0
    want = gathers * x.size * 4 * (t - 1) / t  # float32, the ring's (t - 1) / t of each
    assert {k: v for k, v in extra.items() if v} == ({"all-gather": want} if sp else {}), (sent, want)


def _tensor_mesh():
    """4 devices on one ``tensor`` axis, left to the partitioner (as the library's meshes are)."""
    return jax.make_mesh((4,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_region_split_hands_each_devices_values_to_w(check_vma):
    """A toy column-parallel region (each device's weight columns, the input replicated):
    W's region is given B's per-device cotangents and makes each device's weight gradient;
    exact whether or not the region types what varies (unchecked, every value is handed on
    per device)."""
    mesh = _tensor_mesh()

    def f(w, x):
        y = jax.shard_map(lambda w, x: jnp.tanh(x @ w), mesh=mesh, in_specs=(P(None, "tensor"), P()),
                          out_specs=P(None, "tensor"), check_vma=check_vma)(w, x)
        return y, jnp.zeros(())

    w, x = (jax.random.normal(jax.random.key(k), s) for k, s in ((0, (6, 8)), (1, (5, 6))))
    cot = (jax.random.normal(jax.random.key(2), (5, 8)), jnp.ones(()))

    def parts(w, x, cot, split):
        _, pullback = jax.vjp(f, w, x)
        res, treedef = jax.tree.flatten(pullback)
        full = lambda res, cot: jax.tree.unflatten(treedef, res)(cot)  # noqa: E731
        if not split:
            return full(res, cot)
        s = split_backward.split(full, res, cot, 1)
        d_x, stash = s.b(res, cot)
        return s.w(res, stash)[0], d_x[0]

    got, want = (jax.jit(parts, static_argnums=3)(w, x, cot, split) for split in (True, False))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_w_runs_again_a_region_that_computes_on_its_own_values_but_not_one_that_sends():
    """Both parts need two regions' outputs, each made from a residual alone with no matmul: W
    runs again the one that only computes on each device's values (B hands it nothing of it)
    but not the one with a ``psum`` (W would send its bytes again, in another tick): B hands W
    that region's output."""
    mesh = _tensor_mesh()
    only_here = jax.shard_map(jnp.tanh, mesh=mesh, in_specs=P(None, "tensor"), out_specs=P(None, "tensor"))
    summed = jax.shard_map(lambda x: jax.lax.psum(2 * x, "tensor"), mesh=mesh, in_specs=P(None, "tensor"),
                           out_specs=P())

    def pullback(res, cot):
        w, x = res
        a, b = only_here(x)[:, :2], summed(x)
        return (a * b).T @ cot, (cot @ w.T) * a * b

    res = (jax.random.normal(jax.random.key(0), (2, 3)), jax.random.normal(jax.random.key(1), (8, 8)))
    cot = jax.random.normal(jax.random.key(2), (8, 3))
    _split_matches(pullback, res, cot, 1)
    s = split_backward.split(pullback, res, cot, 1)
    handed = [np.asarray(h) for h in jax.tree.leaves(jax.jit(s.b)(res, cot)[1])]
    a, b = np.tanh(np.asarray(res[1]))[:, :2], np.asarray(summed(res[1]))
    forward = {"psum": b, "tanh": a, "product": a * b}
    kept = {k for k, v in forward.items() for h in handed if h.shape == v.shape and np.allclose(h, v)}
    assert kept == {"psum"}, (kept, [h.shape for h in handed])


def _split_matches(pullback, res, cot, n_weights):
    """Split ``pullback`` and run B then W, jitted: each gradient equal to the pullback's."""
    def split_run(res, cot):
        s = split_backward.split(pullback, res, cot, n_weights)
        d_in, stash = s.b(res, cot)
        return s.w(res, stash) + d_in

    got, want = jax.jit(split_run)(res, cot), jax.tree.leaves(jax.jit(pullback)(res, cot))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["call", "region"])
def test_a_call_output_both_parts_need_is_made_by_b_too(kind):
    """A cheap value made from the residuals alone (W makes it again) that B's input gradient
    reads after the call: B's part of the call makes it as well, not only W's."""
    mesh = _tensor_mesh()

    def inner(x, cot):
        n = jnp.sin(x)
        return n, n.T @ cot

    def pullback(res, cot):
        w, x = res
        if kind == "call":
            n, d_w = jax.jit(inner)(x, cot)
        else:
            n, d_w = jax.shard_map(inner, mesh=mesh, in_specs=(P(), P(None, "tensor")),
                                   out_specs=(P(), P(None, "tensor")))(x, cot)
        return d_w, n, cot @ w.T

    res = (jax.random.normal(jax.random.key(0), (6, 8)), jax.random.normal(jax.random.key(1), (5, 6)))
    _split_matches(pullback, res, jax.random.normal(jax.random.key(2), (5, 8)), 1)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_region_returning_a_literal_and_its_own_input_splits(check_vma):
    """A region's outputs may be a literal and one of its inputs passed through (here only W
    reads it): W's region passes it on, and the literal needs neither part."""
    mesh = _tensor_mesh()

    def local(x, w, cot, scale):
        c = cot * scale
        return jax.lax.psum(c @ w.T, "tensor"), x.T @ (c * scale), 0.0, x

    def pullback(res, cot):
        w, x = res
        d_x, d_w, zero, x_again = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(None, "tensor"), P(None, "tensor"), P()),
            out_specs=(P(), P(None, "tensor"), P(), P()), check_vma=check_vma)(x, w, cot, 3.0)
        return d_w + zero + jnp.tanh(x_again).sum(), d_x

    res = (jax.random.normal(jax.random.key(0), (6, 8)), jax.random.normal(jax.random.key(1), (5, 6)))
    _split_matches(pullback, res, jax.random.normal(jax.random.key(2), (5, 8)), 1)


def test_the_minimum_cut_is_the_one_nearest_the_sink():
    """``split_backward._sink_side``: the sink's side of a minimum cut, checked against every
    cut of small graphs by brute force -- of the minimum cuts, the one whose sink side is
    smallest, so that W makes again only what it must."""
    import itertools

    def residual(edges):
        cap: dict = {"s": {}, "t": {}}
        for a, b, c in edges:
            cap.setdefault(a, {})[b] = cap.get(a, {}).get(b, 0) + c
            cap.setdefault(b, {}).setdefault(a, 0)
        return cap

    graphs = [
        [("s", "a", 2), ("a", "t", 2)],  # two cuts of 2: the one at the sink
        [("s", "a", 3), ("s", "b", 1), ("a", "b", 1), ("a", "t", 1), ("b", "t", 3)],  # one cut of 3
        [("s", "a", 1), ("a", "b", 5), ("b", "t", 1), ("s", "c", 4), ("c", "t", 2), ("c", "b", 1)],
    ]
    for edges in graphs:
        inner = sorted({n for a, b, _ in edges for n in (a, b)} - {"s", "t"})
        cuts = {}
        for k in range(len(inner) + 1):
            for side in itertools.combinations(inner, k):  # the sink's side, but t
                sink = {*side, "t"}
                cuts[frozenset(sink)] = sum(c for a, b, c in edges if a not in sink and b in sink)
        least = min(cuts.values())
        nearest = min((s for s, c in cuts.items() if c == least), key=len)
        assert split_backward._sink_side(residual(edges)) == set(nearest), edges
