"""Tensor, sequence and context parallelism: equal to one device, and what the compiled step
sends (no full-vocab transfers, no weight gathers, reduce-scatter/all-gather under SP)."""

import math

import jax
import numpy as np
import pytest

from harness import BATCH, SEQ, assert_matches_reference, make_program
from jaxshard.analysis import inspect
from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.rules import ShardingRules, Strategy
from models import ModelConfig, TransformerLM, get_preset

# mesh, sequence parallelism, strategy name
CASES = {
    "tensor=2": ("tensor=2", False, "tp"),
    "tensor=4": ("tensor=4", False, "tp"),
    "tensor=8": ("tensor=8", False, "tp"),
    "data=2,fsdp=2,tensor=2": ("data=2,fsdp=2,tensor=2", False, "hsdp+tp"),
    "tensor=2+sp": ("tensor=2", True, "tp+sp"),
    "sequence=2": ("sequence=2", False, "cp"),
    "sequence=4": ("sequence=4", False, "cp"),
    "fsdp=2,tensor=2,sequence=2": ("fsdp=2,tensor=2,sequence=2", False, "fsdp+tp+cp"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_matches_one_device(model_name, case):
    mesh, sp, name = CASES[case]
    program = assert_matches_reference(model_name, mesh, sequence_parallel=sp)
    assert program.rules.name == name


@pytest.mark.parametrize("mesh, sp", [("fsdp=2,tensor=2,sequence=2", False), ("data=4,tensor=2", True)])
def test_dropout_matches_one_device(mesh, sp):
    assert_matches_reference("tiny", mesh, sequence_parallel=sp, dropout=0.1)


def test_gqa_kv_heads_replicated_when_fewer_than_tensor():
    program = make_program(TransformerLM(get_preset("tiny-llama")), "tensor=8")
    specs = jax.tree.map(lambda s: s.spec, program.layout.shardings.params["blocks"]["attn"])
    P = jax.sharding.PartitionSpec
    assert specs["wq"] == P(None, None, "tensor", None)  # 8 query heads: one per device
    assert specs["wk"] == P(None, None, None, None)  # 2 kv heads < 8: every device holds both
    assert specs["wo"] == P(None, "tensor", None, None)
    assert make_program(TransformerLM(get_preset("tiny-llama")), "tensor=2").layout.shardings \
        .params["blocks"]["attn"]["wk"].spec == P(None, None, "tensor", None)


@pytest.mark.parametrize("mesh", ["sequence=4", "fsdp=2,tensor=2,sequence=2"])
@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])  # 8 kv heads; 2, repeated on sequence=4
def test_ulysses_matches_one_device(model_name, mesh):
    program = assert_matches_reference(model_name, mesh, context_parallel="ulysses")
    assert program.rules.name.endswith("cp-ulysses")


# ---- what the compiled step sends ---------------------------------------------------------

VOCAB = 320  # a size no other dim of the test models has


def compiled_collectives(model, mesh, sp=False, **kw):
    program = make_program(model, mesh, sequence_parallel=sp, **kw)
    return inspect.compiled_collectives(program.lower_step(BATCH, SEQ).compile(), program.rules.mesh)


@pytest.mark.parametrize("mesh, sp", [("tensor=8", False), ("data=2,fsdp=2,tensor=2", False),
                                      ("data=4,tensor=2", True), ("fsdp=2,tensor=2,sequence=2", False)])
@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])  # tied and untied embeddings
def test_no_collective_carries_the_full_vocab(model_name, mesh, sp):
    model = TransformerLM(get_preset(model_name).replace(vocab_size=VOCAB))
    found = compiled_collectives(model, mesh, sp)
    assert found
    offenders = [(c.kind, c.shapes) for c in found if VOCAB in c.dims()]
    assert not offenders, offenders


def test_full_vocab_check_can_fail():
    """Control: under DDP the embedding gradient is all-reduced whole, and the check sees it."""
    model = TransformerLM(get_preset("tiny").replace(vocab_size=VOCAB))
    assert any(VOCAB in c.dims() for c in compiled_collectives(model, "data=8"))


@pytest.mark.parametrize("mesh, sp", [("tensor=2", False), ("tensor=8", False), ("tensor=2", True)])
@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_tensor_parallel_weights_are_never_gathered(model_name, mesh, sp):
    model = TransformerLM(get_preset(model_name))
    found = compiled_collectives(model, mesh, sp)
    # Every all-gather moves activations (their leading dim is the batch; no weight has one) or,
    # under SP, the gradient of the learned-position rows each device's sequence shard used.
    gathers = [c for c in found if c.kind == "all-gather"]
    positions = (SEQ, model.cfg.d_model)
    assert all(c.shapes[0][0] == BATCH or (sp and c.shapes[0] == positions) for c in gathers), \
        [c.shapes for c in gathers]
    assert (not sp) or gathers  # SP does gather (activations), so the check above bites
    kv_split = model.cfg.n_kv_heads % int(mesh.split("=")[1]) == 0
    if not sp and kv_split:  # Megatron TP: only activation all-reduces (and per-token losses)
        assert {c.kind for c in found} == {"all-reduce"}
    # With kv heads replicated (fewer than tensor), the backward pass also gathers the kv
    # activation gradients across the devices holding different kv heads -- never weights.


@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_fsdp_with_tensor_gathers_only_the_tensor_shards(model_name):
    model = TransformerLM(get_preset(model_name).replace(vocab_size=VOCAB, max_seq_len=96))
    found = compiled_collectives(model, "data=2,fsdp=2,tensor=2")
    gathers = [c for c in found if c.kind == "all-gather"]
    assert gathers  # FSDP gathers its shards of the weights -- over fsdp alone, never tensor
    assert all(c.axes == ("fsdp",) for c in gathers), [(c.axes, c.shapes) for c in gathers]


def activation_collectives(found):
    return [c for c in found if c.shapes and len(c.shapes[0]) == 3 and c.shapes[0][:1] == (BATCH,)]


@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_sequence_parallel_turns_block_all_reduces_into_reduce_scatter_all_gather(model_name):
    model = TransformerLM(get_preset(model_name))
    tp = activation_collectives(compiled_collectives(model, "tensor=2"))
    sp = activation_collectives(compiled_collectives(model, "tensor=2", sp=True))
    assert tp and {c.kind for c in tp} == {"all-reduce"}
    kinds = [c.kind for c in sp]
    assert set(kinds) == {"all-gather", "reduce-scatter"}, kinds
    # at least one of each per sublayer (attention, MLP) of every layer, forward and backward
    for kind in ("all-gather", "reduce-scatter"):
        assert sum(c.executions for c in sp if c.kind == kind) >= 2 * 2 * model.cfg.n_layers


@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_balanced_ring_under_selective_recompute_matches_one_device(model_name):
    """A ring's backward pass is traced after the model's forward has returned: it must run
    the balanced ring the forward ran (the contiguous one, read from the context then, gave
    wrong gradients when --remat selective recomputed the ring). Under selective too, which
    leaves a ring's core alone."""
    assert_matches_reference(model_name, "sequence=4", remat="selective")


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_a_ring_folded_in_key_blocks_matches_one_device(monkeypatch, remat):
    """Blocks of 4 keys (``attention.RING_BLOCK``) on ``sequence=2``, so that every pair of
    tiny-llama's chunks is folded block by block inside the remat'd layer scan: losses and
    params as one device's."""
    from jaxshard.parallel import attention

    monkeypatch.setattr(attention, "RING_BLOCK", 4)
    assert attention.blocked_share(2, SEQ, True) > 0.5
    assert_matches_reference("tiny-llama", "sequence=2", remat=remat)


def test_a_ring_that_cannot_balance_says_why():
    """The training log's note where the ring keeps contiguous chunks (about twice the
    balanced ring's attention): dropout, or a sequence that does not split into 2S halves;
    none where it balances, without a ring, or under Ulysses."""
    from jaxshard.parallel import attention

    cfg = get_preset("tiny-llama")
    ring = ShardingRules(build_mesh("sequence=4", jax.devices()[:4]))
    assert attention.imbalance_note(cfg, 64, ring) is None
    assert "(dropout 0.1, whose masks follow the sequence's order)" in attention.imbalance_note(
        cfg.replace(dropout=0.1), 64, ring)
    assert attention.imbalance_note(cfg, 68, ring).startswith(
        "ring attention keeps contiguous chunks (--seq-len 68 does not split into 2 x sequence=4 halves)")
    ulysses = ShardingRules(build_mesh("sequence=4", jax.devices()[:4]), Strategy(context_parallel="ulysses"))
    for rules in (ShardingRules(build_mesh("data=4", jax.devices()[:4])), ulysses):
        assert attention.imbalance_note(cfg.replace(dropout=0.1), 68, rules) is None


def test_context_parallel_passes_kv_chunks_around_a_ring():
    model = TransformerLM(get_preset("tiny-llama"))
    found = compiled_collectives(model, "sequence=4")
    ring = [c for c in found if c.kind == "collective-permute"]
    B, C, K, H = BATCH, SEQ // 4, model.cfg.n_kv_heads, model.cfg.d_head
    assert ring and all(c.shapes == ((B, C, K, H),) for c in ring)
    # Keys and values are never gathered: only the token ids and targets, once, to put them
    # in the balanced order (each device then holds halves d and 2S - 1 - d).
    gathered = [c for c in found if c.kind == "all-gather"]
    assert [c.shapes for c in gathered] == [((B, SEQ),)] * 2 or [c.shapes for c in gathered] == [((B, SEQ),) * 2]


@pytest.mark.parametrize("kv_heads, mesh", [(2, "sequence=4"), (2, "sequence=2,tensor=4"), (8, "data=2,sequence=4")])
def test_ulysses_sends_each_device_its_heads_by_all_to_all(kv_heads, mesh):
    """Ulysses moves attention's inputs and output by all-to-alls over sequence: per layer
    forward and backward, the queries and outputs of a device's chunk ([rows, L/S, heads,
    d_head]) and its keys and values, each kv head repeated until S divides them (tiny-llama's
    2 on sequence=4: twice; with tensor=4, first one a tensor device) -- no ring, no token
    gather, nothing but the gradients' reductions besides."""
    model = TransformerLM(get_preset("tiny-llama").replace(n_kv_heads=kv_heads))
    program = make_program(model, mesh, context_parallel="ulysses")
    found = compiled_collectives(model, mesh, context_parallel="ulysses")
    sizes = dict((a, int(n)) for a, n in (part.split("=") for part in mesh.split(",")))
    S, T = sizes["sequence"], sizes.get("tensor", 1)
    cfg, c = model.cfg, 4
    rows, chunk = BATCH // sizes.get("data", 1), SEQ // S
    q_heads = cfg.n_heads // T
    kv_heads = max(cfg.n_kv_heads // T, 1)
    kv_heads *= S // math.gcd(kv_heads, S)
    per_layer = rows * chunk * cfg.d_head * c * (2 * q_heads + 2 * kv_heads)
    a2a = sum(x.bytes * x.executions for x in found if x.kind == "all-to-all")
    assert a2a == 2 * cfg.n_layers * per_layer  # forward and backward
    assert {x.kind for x in found} <= {"all-to-all", "all-reduce", "all-gather"}
    # (with kv heads replicated over tensor, their gradients' gather: traffic.tensor.kv_heads)
    assert not [x for x in found if x.kind == "all-gather" and "tensor" not in mesh]
    assert not inspect.verify(model, program, program.lower_step(BATCH, SEQ).compile(), BATCH, SEQ).flags


# ---- what each device holds ----------------------------------------------------------------

@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_tensor_parallel_weights_per_device(tensor):
    model = TransformerLM(get_preset("tiny"))
    program = make_program(model, f"tensor={tensor}")
    blocks = program.init(0).params["blocks"]
    big = {k: v for k, group in blocks.items() if k in ("attn", "ffn") for k, v in group.items()
           if v.ndim > 2}
    total = sum(v.nbytes for v in big.values())
    assert inspect.max_bytes_per_device(big) == total // tensor


def test_sequence_parallel_saves_activation_memory():
    model = TransformerLM(get_preset("tiny"))
    tp = inspect.saved_residual_bytes(make_program(model, "tensor=2"), BATCH, SEQ)
    sp = inspect.saved_residual_bytes(make_program(model, "tensor=2", sequence_parallel=True), BATCH, SEQ)
    assert sp < 0.95 * tp, (sp, tp)


# ---- bad input -----------------------------------------------------------------------------

def rules(mesh, sp=False):
    return ShardingRules(build_mesh(mesh), Strategy(sequence_parallel=sp))


@pytest.mark.parametrize("changes, message", [
    ({"n_heads": 4, "n_kv_heads": 4}, r"heads \(4\) is not divisible by tensor=8"),
    ({"n_heads": 24, "n_kv_heads": 3, "d_head": 8}, r"kv_heads \(3\) is not divisible by tensor=8"),
    ({"d_mlp": 100}, r"mlp \(100\) is not divisible by tensor=8"),
    ({"vocab_size": 250}, r"vocab \(250\) is not divisible by tensor=8 \(use a vocab multiple"),
])
def test_dims_tensor_cannot_split_are_one_line_errors(changes, message):
    model = TransformerLM(get_preset("tiny-llama").replace(**changes))
    with pytest.raises(ConfigError, match=message):
        rules("tensor=8").check_model(model.param_axes(), model.abstract_params())


def test_vocab_multiple_pads_the_vocab_so_tensor_divides_it():
    model = TransformerLM(get_preset("tiny").replace(vocab_size=250, vocab_multiple=8))
    assert model.abstract_params()["tokens"].shape == (256, 64)
    rules("tensor=8").check_model(model.param_axes(), model.abstract_params())


def test_sequence_errors():
    with pytest.raises(ConfigError, match=r"--seq-len 30 is not divisible by sequence=4"):
        rules("data=2,sequence=4").check_seq_len(30)
    with pytest.raises(ConfigError, match=r"--seq-len 6 is not divisible by tensor=4 \(sequence "
                                          r"parallelism splits the sequence over tensor too\)"):
        rules("data=2,tensor=4", sp=True).check_seq_len(6)
    rules("data=2,tensor=4").check_seq_len(6)  # without SP the sequence is not split
    with pytest.raises(ConfigError, match="--sequence-parallel needs a tensor axis"):
        rules("data=8", sp=True)


def test_ulysses_errors():
    with pytest.raises(ConfigError, match=r"^--context-parallel ulysses needs a sequence axis of size > 1 in --mesh$"):
        ShardingRules(build_mesh("data=8"), Strategy(context_parallel="ulysses"))
    with pytest.raises(ConfigError, match=r"--context-parallel must be one of ring, ulysses, got star"):
        Strategy(context_parallel="star")
    model = TransformerLM(get_preset("llama-tiny"))  # 4 heads
    with pytest.raises(ConfigError, match=r"^--context-parallel ulysses splits the query heads over sequence=8: "
                                          r"4 heads are not divisible by 8 \(use ring\)$"):
        make_program(model, "sequence=8", context_parallel="ulysses")
    with pytest.raises(ConfigError, match=r"over sequence=4: 2 heads per tensor shard \(4 over tensor=2\) are "
                                          r"not divisible by 4"):
        make_program(model, "sequence=4,tensor=2", context_parallel="ulysses")
