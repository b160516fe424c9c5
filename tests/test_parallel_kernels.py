"""Each explicit shard_map kernel against its dense one-device computation, values and grads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxshard.axes import Dim
from jaxshard.mesh import build_mesh
from jaxshard.parallel import attention
from jaxshard.parallel.attention import causal_attention
from jaxshard.parallel.vocab import cross_entropy, embed_lookup
from jaxshard.rules import ShardingRules, Strategy, constrain, use_rules
from harness import under

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("mesh, sp", [("tensor=8", False), ("data=2,tensor=4", False),
                                      ("data=2,tensor=4", True), ("sequence=2,tensor=4", True)])
def test_vocab_parallel_embedding(mesh, sp):
    table = RNG.normal(size=(64, 16)).astype(np.float32)
    tokens = RNG.integers(0, 64, (4, 8)).astype(np.int32)
    cot = RNG.normal(size=(4, 8, 16)).astype(np.float32)

    def f(t):  # a scalar of the lookup, so the gradient w.r.t. the table is checked too
        return (embed_lookup(t, tokens) * cot).sum()

    np.testing.assert_allclose(under(mesh, lambda t: embed_lookup(t, tokens), table, sp=sp),
                               table[tokens], rtol=1e-6)
    np.testing.assert_allclose(under(mesh, jax.grad(f), table, sp=sp), jax.grad(f)(table), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", ["tensor=8", "data=2,tensor=4", "sequence=2,tensor=4"])
@pytest.mark.parametrize("vocab, padded", [(64, 64), (60, 64)])
def test_vocab_parallel_cross_entropy(mesh, vocab, padded):
    logits = (3 * RNG.normal(size=(4, 8, padded))).astype(np.float32)
    targets = RNG.integers(0, vocab, (4, 8)).astype(np.int32)
    want = optax.softmax_cross_entropy_with_integer_labels(logits[..., :vocab], targets)

    def f(lg):
        lg = constrain(lg, (Dim.BATCH, Dim.LENGTH, Dim.ACT_VOCAB))
        return cross_entropy(lg, targets, vocab)

    np.testing.assert_allclose(under(mesh, f, logits), want, rtol=1e-5)
    grad = under(mesh, jax.grad(lambda lg: f(lg).sum()), logits)
    want_grad = jax.grad(lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, targets).sum())(
        logits[..., :vocab])
    np.testing.assert_allclose(grad[..., :vocab], want_grad, rtol=1e-5, atol=1e-6)
    assert not np.any(grad[..., vocab:])  # padding columns get no gradient
    np.testing.assert_allclose(cross_entropy(jnp.asarray(logits), targets, vocab), want, rtol=1e-5)


def _context_parallel_attention(mesh, kv_heads, groups, cp):
    B, L, H = 2, 32, 8
    q = RNG.normal(size=(B, L, kv_heads, groups, H)).astype(np.float32)
    k, v = (RNG.normal(size=(B, L, kv_heads, H)).astype(np.float32) for _ in range(2))
    cot = RNG.normal(size=q.shape).astype(np.float32)

    def f(q, k, v):
        q = constrain(q, (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None, None))
        return causal_attention(q, k, v)

    dense = causal_attention(q, k, v)  # no rules: the dense path
    np.testing.assert_allclose(under(mesh, f, q, k, v, cp=cp), dense, rtol=1e-5, atol=1e-6)

    def loss(*a):
        return (f(*a) * cot).sum()

    grads = under(mesh, jax.grad(loss, argnums=(0, 1, 2)), q, k, v, cp=cp)
    want = jax.grad(lambda *a: (causal_attention(*a) * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh", ["data=4,sequence=2", "sequence=8", "data=2,sequence=4",
                                  "sequence=4,tensor=2"])
@pytest.mark.parametrize("kv_heads, groups", [(4, 1), (2, 2)])
def test_ring_attention(mesh, kv_heads, groups):
    _context_parallel_attention(mesh, kv_heads, groups, "ring")


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("mesh, kv_heads, groups", [("data=2,sequence=4", 2, 2), ("sequence=2", 4, 1)])
def test_ring_attention_gradients_in_bfloat16_and_either_layout(mesh, kv_heads, groups, balanced):
    """The ring's own backward pass in both layouts (balanced: the tokens in
    ``balanced_order``, each device's two halves): values and gradients against dense
    attention in float32, and from bfloat16 inputs within bfloat16's rounding (its matmuls
    take bfloat16 and sum in float32, as FlashAttention-2's)."""
    B, L, H = 2, 32, 8
    S = int(mesh.split("sequence=")[1])
    order = attention.balanced_order(L, S) if balanced else np.arange(L)
    q = jnp.asarray(RNG.normal(size=(B, L, kv_heads, groups, H)), jnp.float32) * 2
    k, v = (jnp.asarray(RNG.normal(size=(B, L, kv_heads, H)), jnp.float32) for _ in range(2))
    cot = jnp.asarray(RNG.normal(size=q.shape), jnp.float32)

    def ring(q, k, v):  # in the sequence's order, through the layout's
        q = constrain(q[:, order], (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None, None))
        return causal_attention(q, k[:, order], v[:, order], balanced=balanced)[:, np.argsort(order)]

    def loss(f, *a):
        return (f(*a).astype(jnp.float32) * cot).sum()

    np.testing.assert_allclose(under(mesh, ring, q, k, v), causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
    want = jax.grad(lambda *a: loss(causal_attention, *a), argnums=(0, 1, 2))(q, k, v)
    got = under(mesh, jax.grad(lambda *a: loss(ring, *a), argnums=(0, 1, 2)), q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    low = under(mesh, jax.grad(lambda *a: loss(ring, *a), argnums=(0, 1, 2)), *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    for g, w in zip(low, want):
        assert g.dtype == jnp.bfloat16
        assert float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w)) < 2e-2


@pytest.mark.parametrize("mesh, kv_heads, groups", [
    ("data=2,sequence=4", 4, 1),  # S divides the kv heads
    ("data=2,sequence=4", 2, 2),  # 2 kv heads on 4 devices: each repeated twice
    ("sequence=8", 1, 8),  # multi-query: the one kv head on every device
    ("sequence=4,tensor=2", 8, 1),  # tensor splits the heads first, sequence each device's
    ("sequence=2,tensor=4", 2, 4),  # kv heads fewer than tensor: repeated to one a device
])
def test_ulysses_attention(mesh, kv_heads, groups):
    """DeepSpeed-Ulysses: the sequence split traded for a head split by all-to-all, the
    whole-sequence attention, and back; values and all three gradients."""
    _context_parallel_attention(mesh, kv_heads, groups, "ulysses")


@pytest.mark.parametrize("mesh, kv_heads, groups", [("data=2,sequence=4", 4, 1), ("sequence=2,tensor=4", 2, 4)])
def test_ulysses_attention_by_the_blockwise_kernel(mesh, kv_heads, groups):
    """Ulysses' whole-sequence attention by the blockwise kernel, a GPU's where cuDNN's does
    not apply (float32, packed documents) and the plan's confirmation's: its scans' carries
    vary over the region's axes as their inputs do."""
    with attention.kernel("blockwise"):
        _context_parallel_attention(mesh, kv_heads, groups, "ulysses")


def test_dense_attention_is_causal_softmax():
    B, L, K, G, H = 1, 6, 1, 2, 4
    q = RNG.normal(size=(B, L, K, G, H))
    k, v = RNG.normal(size=(B, L, K, H)), RNG.normal(size=(B, L, K, H))
    s = np.einsum("blkgh,bmkh->bkglm", q, k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bkglm,bmkh->blkgh", p, v)
    got = causal_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads, groups", [(4, 1), (2, 2)])
def test_fused_attention_path_equals_the_dense_one(kv_heads, groups):
    """GPUs run attention through ``jax.nn.dot_product_attention`` (cuDNN where it applies);
    here its XLA implementation checks the head layout (query head k*G+g with kv head k), the
    causal mask and the gradients against the portable path."""
    from jaxshard.parallel.attention import _dense, fused

    B, L, H = 2, 16, 8
    q = jnp.asarray(RNG.normal(size=(B, L, kv_heads, groups, H)), jnp.float32)
    k, v = (jnp.asarray(RNG.normal(size=(B, L, kv_heads, H)), jnp.float32) for _ in range(2))
    cot = jnp.asarray(RNG.normal(size=q.shape), jnp.float32)
    np.testing.assert_allclose(fused(q, k, v, "xla"), _dense(q, k, v), rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda *a: (fused(*a, "xla") * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: (_dense(*a) * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_heads, groups, block, documents",
                         [(4, 1, 8, False), (2, 2, 4, False), (2, 2, 32, False), (2, 2, 4, True)])
def test_blockwise_attention_equals_the_dense_one(kv_heads, groups, block, documents):
    """Flash attention's algorithm (the plan's confirmation's stand-in for a GPU's flash
    kernel): output and all three gradients against the materialised softmax, on random inputs
    with several blocks of queries and of keys (and one block of the whole sequence), with and
    without packed documents; bfloat16 inputs within bfloat16's rounding."""
    from jaxshard.parallel.attention import _dense, blockwise

    B, L, H = 2, 32, 8
    q = jnp.asarray(RNG.normal(size=(B, L, kv_heads, groups, H)), jnp.float32) * 2
    k, v = (jnp.asarray(RNG.normal(size=(B, L, kv_heads, H)), jnp.float32) for _ in range(2))
    cot = jnp.asarray(RNG.normal(size=q.shape), jnp.float32)
    seg = jnp.asarray(np.sort(RNG.integers(0, 4, size=(B, L)), axis=1)) if documents else None
    flash = functools.partial(blockwise, block=block, segments_BL=seg)
    dense = functools.partial(_dense, segments_BL=seg)
    np.testing.assert_allclose(flash(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda *a: (flash(*a) * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: (dense(*a) * cot).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = jax.grad(lambda *a: (flash(*a).astype(jnp.float32) * cot).sum(), argnums=(0, 1, 2))(*low)
    for g, w in zip(got, want):
        assert float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w)) < 2e-2


def _blockwise_gradients(L, block, documents):
    """The blockwise kernel's forward and backward pass, compiled: one head of width 8, float32,
    with or without packed documents."""
    from jaxshard.parallel.attention import blockwise

    q = jax.ShapeDtypeStruct((1, L, 1, 1, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, L, 1, 8), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, L), jnp.int32)

    def loss(q, k, v, s):
        return blockwise(q, k, v, block, s if documents else None).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, seg).compile()


@pytest.mark.parametrize("documents", [False, True])
def test_blockwise_attentions_temp_scales_with_the_block_not_the_sequence(documents):
    """The blockwise kernel's compiled forward and backward pass (one head, 4,096 tokens) takes
    queries a block at a time as well as keys: halving the block takes the temp below 0.7x, one
    block of the whole sequence over 3x, and twice the tokens less than 1.3x (with the queries
    whole, about 2x: 34 and 68 MB where blocks take 4.7 and 5.1)."""
    from jaxshard.parallel.attention import BLOCK

    def temp(block, L):
        return _blockwise_gradients(L, block, documents).memory_analysis().temp_size_in_bytes

    L = 4096
    blocked, half, whole, longer = temp(BLOCK, L), temp(BLOCK // 2, L), temp(L, L), temp(BLOCK, 2 * L)
    assert half < 0.7 * blocked and 3 * blocked < whole and longer < 1.3 * blocked, (blocked, half, whole, longer)


@pytest.mark.parametrize("documents", [False, True])
def test_blockwise_attention_skips_the_blocks_wholly_in_the_future(documents):
    """The compiled forward and backward pass's matmuls (counted by the loops' trip counts)
    cover the causal triangle of blocks, n (n + 1) / 2 of the n^2 with n blocks: seven
    ``[L, L]`` products (q k^T and p v forward; the scores again, dv, dp, dq and dk backward),
    each at 10/16 of the square for 4 blocks, 36/64 for 8, and whole for one block, where the
    scores are made once; ``attention.computed_share``, what the FLOP count takes, is that
    share."""
    from jaxshard.analysis import hlo

    def square_products(L, block):
        return hlo.dot_flops(_blockwise_gradients(L, block, documents).as_text()) / (2 * L * L * 8)

    for n in (4, 8):
        assert square_products(32 * n, 32) == pytest.approx(7 * (n + 1) / (2 * n), rel=0.01), n
    assert square_products(32, 32) == pytest.approx(6, rel=0.01)
    # the share the FLOP count gives the kernel (a GPU's HFU), at its own block
    from jaxshard.parallel.attention import BLOCK, computed_share

    assert square_products(4 * BLOCK, BLOCK) == pytest.approx(7 * computed_share("blockwise", 4 * BLOCK), rel=0.01)


def test_blockwise_attention_under_remat_makes_each_blocks_mask_in_the_loop():
    """Under remat in a layer scan, as training runs it, no block's causal mask is computed
    ahead of the key loop and kept stacked (``[L/T, B, K, G, T, T]`` booleans, or with the
    queries whole ``[L/T, B, K, G, L, T]``: the L x L mask a flash kernel avoids), which JAX's
    partial evaluation does to anything that depends only on the block index; each mask is one
    block of queries against one of keys."""
    import re

    from jaxshard.parallel.attention import blockwise

    B, L, T = 1, 64, 16
    x = jnp.asarray(RNG.normal(size=(B, L, 1, 2, 8)), jnp.float32)
    layer = jax.checkpoint(lambda x: blockwise(x, x[:, :, :, 0, :], x[:, :, :, 1, :], T))

    def loss(x):
        y, _ = jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)
        return (y ** 2).sum()

    text = str(jax.make_jaxpr(jax.grad(loss))(x))
    masks = [[int(d) for d in m.split(",")] for m in re.findall(r"bool\[([0-9,]+)\]", text)]
    assert [1, 1, 2, T, T] in masks, masks  # one block's mask, in the loop
    assert max(map(np.prod, masks)) <= 2 * T * T, masks  # none stacked, none over all queries


def test_attention_kernel_is_chosen_by_name_and_keeps_no_scores():
    """Under ``kernel("blockwise")`` the dense path keeps q, k, v, the output and one float32
    statistic per query row -- not the ``L x L`` probabilities it keeps otherwise; an unknown
    kernel and a sequence the blocks do not divide are one-line errors."""
    from jaxshard.analysis.inspect import jaxpr_saved_bytes
    from jaxshard.parallel import attention

    B, L, K, G, H = 1, 64, 2, 2, 4
    q = jnp.asarray(RNG.normal(size=(B, L, K, G, H)), jnp.float32)
    k = v = jnp.asarray(RNG.normal(size=(B, L, K, H)), jnp.float32)
    dense = jaxpr_saved_bytes(causal_attention, q, k, v)
    with attention.kernel("blockwise"):
        flash = jaxpr_saved_bytes(causal_attention, q, k, v)
    assert dense >= 4 * B * K * G * L * L
    assert flash == 4 * (2 * q.size + 2 * k.size + B * K * G * L)  # q, o, k, v, log-sum-exp
    with pytest.raises(ValueError, match="attention kernel 'pallas': one of auto, blockwise"):
        with attention.kernel("pallas"):
            pass
    with pytest.raises(ValueError, match="not a multiple of the attention block 3"):
        attention.blockwise(q, k, v, 3)


def test_gpu_attention_is_cudnn_or_blockwise_never_the_materialised_softmax_where_avoidable():
    """jax.nn.dot_product_attention with no implementation named is XLA's materialised softmax
    (its L x L probabilities kept per layer ran out of an H100 at sequence 8192): on GPUs the
    dense path names cuDNN for 2-byte floats and takes the blockwise kernel otherwise."""
    assert attention.gpu_kernel(jnp.bfloat16, 64, 8192) == "cudnn"
    assert attention.gpu_kernel(jnp.float16, 128, 100) == "cudnn"
    assert attention.gpu_kernel(jnp.float32, 64, 8192) == "blockwise"
    assert attention.gpu_kernel(jnp.bfloat16, 160, 2048) == "blockwise"
    assert attention.gpu_kernel(jnp.float32, 64, 1000) == "xla"  # no block divides it
    assert attention.gpu_kernel(jnp.float16, 64, 8192, capability=7.0) == "blockwise"  # cuDNN's needs Ampere
    assert attention.gpu_kernel(jnp.bfloat16, 64, 8192, capability=9.0) == "cudnn"
    # packed documents' ids, which cuDNN's kernel is not given here
    assert attention.gpu_kernel(jnp.bfloat16, 64, 8192, documents=True) == "blockwise"
    assert attention.gpu_kernel(jnp.bfloat16, 64, 1000, documents=True) == "xla"


def test_backend_xla_options_exist_in_this_jaxlib(monkeypatch):
    """The GPU step's options are names this jaxlib knows: one it lacks (XLA retires them; a
    renamed one would fail every compile on the GPU only) is left out with a warning naming it,
    the others kept; on CPU the step compiles with none."""
    from jaxshard import runtime

    gpu = runtime.xla_options("gpu")
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert runtime.xla_options("cpu") == {}
    assert float(jax.jit(lambda x: x * 2, compiler_options=gpu)(jnp.ones(()))) == 2.0
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x * 2, compiler_options={"xla_gpu_no_such_option": True})(jnp.ones(()))
    monkeypatch.setitem(runtime.XLA_OPTIONS, "gpu", dict(runtime.XLA_OPTIONS["gpu"], xla_gpu_no_such_option=True))
    with pytest.warns(UserWarning, match="has no XLA option xla_gpu_no_such_option"):
        assert runtime.xla_options("gpu") == gpu


def test_global_norm_of_sharded_leaves_is_one_scalar_reduction():
    """Leaves split over fsdp, over data x fsdp, and replicated: each device's shards counted
    once, equal to the norm of the whole arrays, and the compiled step reduces one scalar."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxshard.analysis import hlo
    from jaxshard.training.optim import global_norm

    mesh = build_mesh("data=2,fsdp=4")
    specs = {"a": P("fsdp", None), "b": P(None, ("fsdp", "data")), "c": P(), "d": P("data")}
    shapes = {"a": (8, 3), "b": (5, 16), "c": (7,), "d": (6,)}
    tree = {k: jnp.asarray(RNG.normal(size=shapes[k]), jnp.float32) for k in specs}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    tree = jax.device_put(tree, shardings)
    fn = jax.jit(lambda t: global_norm(t, shardings))
    np.testing.assert_allclose(fn(tree), optax.tree.norm(jax.device_get(tree)), rtol=1e-6)
    found = hlo.parse(fn.lower(tree).compile().as_text())
    assert [(c.kind, c.bytes) for c in found] == [("all-reduce", 4)], found


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_ring_pairs_are_folded_a_block_of_queries_and_keys_at_a_time(monkeypatch, block, balanced, documents):
    """With blocks of 4 queries and keys, or of one (``attention.RING_BLOCK``; one cuts the
    balanced ring's causal diagonals too), a ring's pairs are folded and differentiated block by
    block, each block of queries against each block of keys; values
    and gradients as dense attention's, with and without packed documents (which leave rows'
    first blocks wholly masked)."""
    monkeypatch.setattr(attention, "RING_BLOCK", block)
    B, L, K, G, H, S = 2, 32, 2, 2, 8, 2
    order = attention.balanced_order(L, S) if balanced else np.arange(L)
    q = jnp.asarray(RNG.normal(size=(B, L, K, G, H)), jnp.float32) * 2
    k, v = (jnp.asarray(RNG.normal(size=(B, L, K, H)), jnp.float32) for _ in range(2))
    cot = jnp.asarray(RNG.normal(size=q.shape), jnp.float32)
    seg = jnp.asarray(np.sort(RNG.integers(0, 4, size=(B, L)), axis=1)) if documents else None

    def ring(q, k, v):
        q = constrain(q[:, order], (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None, None))
        s = None if seg is None else seg[:, order]
        return causal_attention(q, k[:, order], v[:, order], s, balanced=balanced)[:, np.argsort(order)]

    def loss(f, *a):
        return (f(*a) * cot).sum()

    dense = functools.partial(attention._dense, segments_BL=seg)
    np.testing.assert_allclose(under(f"sequence={S}", ring, q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-6)
    got = under(f"sequence={S}", jax.grad(lambda *a: loss(ring, *a), argnums=(0, 1, 2)), q, k, v)
    want = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_a_ring_steps_temp_scales_with_the_block_not_the_chunk(monkeypatch):
    """The compiled forward and backward pass's temp on ``sequence=2`` (one head, 2,048 tokens
    a device) falls with the block and not with the tokens a device holds, in both layouts:
    halving the block takes it below 0.7x, the ring made without blocks (a pair's whole
    ``[Q, M]`` scores) takes over 3x what blocks of :data:`attention.BLOCK` queries and keys
    take, and twice the tokens take less than 1.3x (blocking the keys alone, about 2x: a
    block's scores grew with the chunk). And the balanced layout takes less than 1.5x the
    contiguous one's temp: its pieces are computed one after the other, each one's queries
    and cotangents after the whole of the one before (``attention._after``; left in any order,
    XLA:CPU held all their scores at once, 3.3x; ordered by the queries alone, 1.7x)."""
    B, K, G, H, S = 1, 1, 1, 8, 2

    def temp(balanced, block, L):
        monkeypatch.setattr(attention, "RING_BLOCK", block)
        rules = ShardingRules(build_mesh(f"sequence={S}", jax.devices()[:S]), Strategy())
        q = jax.ShapeDtypeStruct((B, L, K, G, H), jnp.float32)
        k = jax.ShapeDtypeStruct((B, L, K, H), jnp.float32)

        def loss(q, k, v):
            with use_rules(rules):
                q = constrain(q, (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None, None))
                return causal_attention(q, k, v, balanced=balanced).sum()

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    found, L = {}, 4096
    for balanced in (False, True):
        blocked, half, whole, longer = (temp(balanced, attention.BLOCK, L), temp(balanced, attention.BLOCK // 2, L),
                                        temp(balanced, L, L), temp(balanced, attention.BLOCK, 2 * L))
        found[balanced] = (blocked, half, whole, longer)
        assert half < 0.7 * blocked and 3 * blocked < whole and longer < 1.3 * blocked, found
    assert found[True][0] < 1.5 * found[False][0], found


@pytest.mark.parametrize("balanced, T", [(False, 4), (True, 2)])
def test_ring_under_remat_makes_each_blocks_mask_in_the_loop(monkeypatch, balanced, T):
    """A ring's blocked pairs under remat in a layer scan, as training runs them: no mask
    stacked over blocks, nor larger than one block's (``[B, K, G, T, T]``), anywhere in the
    program -- JAX's partial evaluation would otherwise make every block's causal mask ahead of
    the loop, which depends only on positions, and keep them stacked (balanced: blocks of 2
    cut its causal diagonals' pieces)."""
    import re

    monkeypatch.setattr(attention, "RING_BLOCK", T)
    B, L, S = 1, 64, 2
    rules = ShardingRules(build_mesh(f"sequence={S}", jax.devices()[:S]), Strategy())
    x = jnp.asarray(RNG.normal(size=(B, L, 1, 2, 8)), jnp.float32)

    @jax.checkpoint
    def layer(x):
        q = constrain(x, (Dim.BATCH, Dim.LENGTH, Dim.ACT_KV_HEADS, None, None))
        return causal_attention(q, x[:, :, :, 0, :], x[:, :, :, 1, :], balanced=balanced)

    def loss(x):
        with use_rules(rules):
            y, _ = jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)
        return (y ** 2).sum()

    text = str(jax.make_jaxpr(jax.grad(loss))(x))
    masks = [[int(d) for d in m.split(",")] for m in re.findall(r"bool\[([0-9,]+)\]", text)]
    assert masks and max(len(m) for m in masks) <= 5 and max(map(np.prod, masks)) <= B * 2 * T * T, masks
