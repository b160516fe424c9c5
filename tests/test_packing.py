"""Packed documents: a batch of documents packed into rows, end-of-text between them, gives each
token the loss it has when its document runs alone, unpacked -- on one device and under tensor,
sequence (ring, balanced ring, Ulysses) and data parallelism, with learned and rotary
positions -- and no attention weight crosses a document on any attention path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshard.mesh import MeshSpec
from jaxshard.parallel import attention
from jaxshard.parallel.attention import causal_attention, dense_probabilities, document_layout
from models import TransformerLM, get_preset
from harness import RTOL, assert_params_close, make_program, under

EOT = 0
L = 32


def _packed(batch: int, vocab: int, seed: int = 0, length: int = L):
    """Rows of ``length`` + 1 tokens packed with random documents (3 to 13 tokens, EOT after
    each; the last cut where the row ends), and per row the (start, tokens) of each document."""
    rng = np.random.default_rng(seed)
    rows, docs = [], []
    for _ in range(batch):
        row, placed = [], []
        while len(row) < length + 1:
            d = [int(t) for t in rng.integers(1, vocab, rng.integers(3, 14))]
            placed.append((len(row), d))
            row += d + [EOT]
        rows.append(row[:length + 1])
        docs.append(placed)
    return np.array(rows, np.int32), docs


def _under(mesh: str, fn, *args, cp: str = "ring", sp: bool = False) -> np.ndarray:
    return np.asarray(under(mesh, fn, *args, cp=cp, sp=sp))


@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])


@pytest.mark.parametrize("mesh, cp, sp, kernel, length", [
    ("data=1", "ring", False, "auto", L),
    ("data=1", "ring", False, "blockwise", L),
    ("data=2,tensor=2", "ring", False, "auto", L),
    ("data=2,tensor=2", "ring", True, "auto", L),
    ("sequence=2", "ring", False, "auto", L),  # the balanced ring (L splits into 2S halves)
    ("sequence=4", "ring", False, "auto", 36),  # the contiguous ring (36 does not split into 8)
    ("sequence=4,tensor=2", "ring", True, "auto", L),
    ("sequence=2", "ulysses", False, "auto", L),
])


def test_packed_losses_equal_each_document_run_alone(model_name, mesh, cp, sp, kernel, length):
    cfg = get_preset(model_name)
    packed, alone = TransformerLM(cfg.replace(documents_eot=EOT)), TransformerLM(cfg)
    params = packed.init(jax.random.key(1))
    rows, docs = _packed(4, cfg.vocab_size, length=length)
    with attention.kernel(kernel):
        got = _under(mesh, packed.token_losses, params, rows[:, :-1], rows[:, 1:], cp=cp, sp=sp)
    one = jax.jit(alone.token_losses)
    checked = 0
    for b, placed in enumerate(docs):
        for start, d in placed:
            if start >= length:
                continue
            row = np.array([d + [EOT] + [5] * length], np.int32)[:, :length + 1]  # (what follows is never seen)
            want = np.asarray(one(params, row[:, :-1], row[:, 1:]))[0]
            n = min(len(d), length - start)  # its targets in the packed row, the last its end-of-text
            np.testing.assert_allclose(got[b, start:start + n], want[:n], rtol=1e-5, atol=1e-5)
            checked += n
            if start + len(d) < length:  # the target after its end-of-text: the next document's first
                assert got[b, start + len(d)] == 0.0
    assert checked > 3 * length  # (most of the batch)


@pytest.mark.parametrize("remat", ["selective", "full"])


def test_packed_gradients_are_the_same_under_recompute(remat):
    """The attention core recomputed from its inputs (segment ids among them) in the backward
    pass gives the gradients of keeping everything."""
    cfg = get_preset("tiny-llama").replace(documents_eot=EOT)
    rows, _ = _packed(4, cfg.vocab_size, seed=2)
    grads = {}
    for policy in ("none", remat):
        model = TransformerLM(cfg, remat=policy)
        params = model.init(jax.random.key(0))
        grads[policy] = jax.jit(jax.grad(lambda p: model.loss(p, rows[:, :-1], rows[:, 1:]).total))(params)
    assert_params_close(grads[remat], jax.tree.map(np.asarray, grads["none"]))  # (per leaf, by norm)


@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])


def test_generation_continues_a_document_as_packed_training_sees_it(model_name):
    """Generation's cache runs a prompt as one document from position 0: its prefill and
    its token-by-token steps give the logits the packed forward gives the same tokens
    anywhere in a packed row (here documents that start after others)."""
    model = TransformerLM(get_preset(model_name).replace(documents_eot=EOT))
    params = model.init(jax.random.key(5))
    rows, docs = _packed(2, model.cfg.vocab_size, seed=4)
    inputs = jnp.asarray(rows[:, :-1])
    segments, positions, _ = document_layout(inputs, EOT)

    def packed_logits(params, inputs):
        with attention.documents(segments, positions):
            return model.head(params, model.blocks(params, model.embed(params, inputs)))

    want = np.asarray(jax.jit(packed_logits)(params, inputs))
    extend = jax.jit(model.extend)
    checked = 0
    for b, placed in enumerate(docs):
        for start, d in placed[1:]:
            n = min(len(d), L - start)
            if n < 3:
                continue
            cache = model.new_cache(1, n)
            got = []
            first = np.array([d[:2]], np.int32)  # the prefill, then one token at a time
            logits, cache = extend(params, first, cache)
            got.append(np.asarray(logits)[0])
            for t in d[2:n]:
                logits, cache = extend(params, np.array([[t]], np.int32), cache)
                got.append(np.asarray(logits)[0])
            np.testing.assert_allclose(np.concatenate(got), want[b, start:start + n], rtol=1e-5, atol=1e-5)
            checked += n
    assert checked > L


def test_the_document_layout():
    inputs = jnp.array([[7, 8, 0, 9, 0, 0, 4, 5]])
    segments, positions, counted = document_layout(inputs, 0)
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert counted.tolist() == [[True, True, False, True, False, False, True, True]]


def test_no_attention_probability_crosses_a_document():
    rng = np.random.default_rng(3)
    B, K, G, H = 2, 2, 2, 8
    q = jnp.asarray(rng.normal(size=(B, L, K, G, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, L, K, H)), jnp.float32)
    rows, _ = _packed(B, 50, seed=4)
    segments, _, _ = document_layout(jnp.asarray(rows[:, :-1]), EOT)
    p = np.asarray(dense_probabilities(q, k, segments))  # [B, K, G, L, L]
    seg = np.asarray(segments)
    same = seg[:, :, None] == seg[:, None, :]
    causal = np.tril(np.ones((L, L), bool))
    allowed = (same & causal)[:, None, None]
    assert (p[~np.broadcast_to(allowed, p.shape)] == 0).all()  # none across a document, none ahead
    assert (p[np.broadcast_to(allowed, p.shape)] > 0).all()  # every earlier key of its own
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert len(np.unique(seg[0])) >= 3


def test_the_blockwise_kernels_backward_keeps_the_ids_not_an_l_by_l_mask():
    """What the packed blockwise kernel keeps for its backward pass (the pullback's residuals):
    nothing with two dims of the sequence's length. The materialised softmax, the control,
    keeps its L x L probabilities."""
    rng = np.random.default_rng(3)
    n = 64  # (two blocks of 32 keys)
    q = jnp.asarray(rng.normal(size=(1, n, 2, 2, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, n, 2, 8)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[0, 1, 2, 3]], n // 4, axis=1))

    def square(f):
        _, pullback = jax.vjp(f, q, k, v)
        return [x.shape for x in jax.tree.leaves(pullback) if list(np.shape(x)).count(n) >= 2]

    assert square(lambda *a: attention.blockwise(*a, 32, segments_BL=segments)) == []
    assert square(lambda *a: attention._dense(*a, "xla", segments)) != []


@pytest.mark.parametrize("mesh, cp, kernel, balanced", [
    ("data=1", "ring", "auto", False), ("data=1", "ring", "blockwise", False),
    ("data=1", "ring", "blockwise-8", False),  # four blocks of 8 keys: whole blocks of another document
    ("sequence=2", "ring", "auto", False), ("sequence=4", "ring", "auto", False),
    ("sequence=2", "ring", "auto", True), ("sequence=4", "ring", "auto", True),
    ("sequence=2", "ulysses", "auto", False),
    ("sequence=2", "ulysses", "blockwise", False),  # (a GPU's: cuDNN's kernel takes no segment ids)
    ("sequence=2,tensor=2", "ulysses", "blockwise", False),
])


def test_no_attention_path_lets_one_document_see_another(mesh, cp, kernel, balanced):
    """Every path's output for a document does not move when another document's keys and
    values do (its gradient with respect to them is exactly 0), and equals the dense path's,
    gradients too."""
    rng = np.random.default_rng(5)
    B, K, G, H = 2, 2, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((B, L, K, G, H), (B, L, K, H), (B, L, K, H)))
    rows, _ = _packed(B, 50, seed=6)
    segments, _, _ = document_layout(jnp.asarray(rows[:, :-1]), EOT)
    S = dict(MeshSpec.parse(mesh).axes).get("sequence", 1)
    order = attention.balanced_order(L, S) if balanced else None
    perm = (lambda x: x) if order is None else (lambda x: x[:, order])
    seg = np.asarray(segments)
    mine = jnp.asarray(seg == seg[:, -1:])  # [B, L]: the last document of each row (others before it)

    def attend(q, k, v):
        if kernel == "blockwise-8":
            return attention.blockwise(q, k, v, 8, segments_BL=segments)
        with attention.kernel(kernel), attention.balanced(order):
            out = causal_attention(perm(q), perm(k), perm(v), perm(segments))
        return out if order is None else out[:, np.argsort(order)]

    def last_document(q, k, v):  # the last document's outputs, summed
        return jnp.where(mine[:, :, None, None, None], attend(q, k, v), 0.0).sum()

    out = _under(mesh, attend, q, k, v, cp=cp)
    want = np.asarray(attention._dense(q, k, v, "auto", segments))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    cot = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    grads = _under(mesh, lambda *a: jnp.stack(jax.grad(lambda *b: (attend(*b) * cot).sum(), argnums=(1, 2))(*a)),
                   q, k, v, cp=cp)
    dense = jax.grad(lambda *b: (attention._dense(*b, "auto", segments) * cot).sum(), argnums=(1, 2))(q, k, v)
    np.testing.assert_allclose(grads, np.stack(dense), rtol=1e-5, atol=1e-6)
    dk, dv = (_under(mesh, lambda q, k, v: jax.grad(last_document, argnums=i)(q, k, v), q, k, v, cp=cp)
              for i in (1, 2))
    others = ~np.asarray(mine)
    assert (dk[others] == 0).all() and (dv[others] == 0).all()
    assert np.abs(dv[~others]).sum() > 0 and others.sum() > L


def _train_packed(model, mesh: str, steps: int = 3, **step) -> tuple[list[float], float, dict]:
    """(the losses of ``steps`` steps on packed batches of 16 rows, the validation loss of
    the next batch after them, the params) of ``model`` under ``mesh``."""
    program = make_program(model, mesh, **step)
    state, losses = program.init(0), []
    batches = [_packed(16, model.cfg.vocab_size, seed=10 + n)[0] for n in range(steps + 1)]
    batches = [{"inputs": rows[:, :-1], "targets": rows[:, 1:]} for rows in batches]
    for batch in batches[:-1]:
        state, metrics = program.step(state, jax.device_put(batch, program.batch_sharding))
        losses.append(float(metrics["loss"]))
    val = float(program.eval(state.params, jax.device_put(batches[-1], program.batch_sharding)))
    return losses, val, jax.tree.map(np.asarray, program.saved(state).params)


@pytest.mark.parametrize("name, mesh, step", [
    ("tiny", "stage=2,data=4", dict(pipeline_schedule="1f1b", microbatches=4)),
    ("tiny-llama", "data=2,stage=2,tensor=2", dict(pipeline_schedule="interleaved", microbatches=2)),
    ("tiny-llama", "stage=2,data=4", dict(pipeline_schedule="zb-h1", microbatches=4)),
    ("tiny", "stage=2,data=4", dict(pipeline_schedule="gpipe", microbatches=2, stage_layers=(3, 1))),
    # (data: replicas inside the executor, each weighting its routing statistics by its own rows)
    ("moe-tiny", "data=2,stage=2,expert=2", dict(pipeline_schedule="1f1b", microbatches=4)),
])


def test_pipelines_train_packed_documents_as_one_device(name, mesh, step):
    """Each stage takes its microbatch's segment ids (attention within documents, positions
    from 0 in each) and the last counts only the targets one device counts: 3 packed steps
    of a 4-layer model give one device's losses, validation loss and params (an MoE model:
    one device accumulating the same microbatches, whose routing statistics are per
    microbatch). The same batches unpacked give other losses, so the comparison can fail."""
    cfg = get_preset(name).replace(n_layers=4)
    packed = TransformerLM(cfg.replace(documents_eot=EOT))
    accum = step["microbatches"] if cfg.moe_experts else 1
    want_losses, want_val, want_params = _train_packed(packed, "data=1", accum=accum)
    losses, val, params = _train_packed(packed, mesh, **step)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    np.testing.assert_allclose(val, want_val, rtol=RTOL)
    assert_params_close(params, want_params)
    unpacked_losses, _, _ = _train_packed(TransformerLM(cfg), "data=1", steps=1, accum=accum)
    assert abs(unpacked_losses[0] - want_losses[0]) > 100 * RTOL * want_losses[0]


COMMON = ["--model", "tiny", "--n-layers", "1", "--cpu-devices", "8", "--platform", "cpu", "--steps", "2",
          "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--warmup-steps", "0", "--no-progress"]


def _run(tmp_path, name, *flags):
    from jaxshard.train import main

    report = tmp_path / f"{name}.json"
    assert main([*COMMON, "--report", str(report), *flags]) == 0
    import json
    return json.loads(report.read_text())


def test_packing_is_on_by_default_pipelines_included_and_off_when_asked(tmp_path):
    import json

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    (tmp_path / "short.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choice(words, rng.integers(2, 8)))}) + "\n" for _ in range(300)))
    data = ["--data", str(tmp_path / "short.jsonl")]  # documents shorter than a window
    on = _run(tmp_path, "on", "--mesh", "data=8", *data)
    off = _run(tmp_path, "off", "--mesh", "data=8", "--packing", "false", *data)
    assert on["packing"] and not off["packing"]
    assert on["model_config"]["documents_eot"] == 0 and off["model_config"]["documents_eot"] is None
    assert on["first_loss"] != off["first_loss"]
    staged = _run(tmp_path, "staged", "--mesh", "data=4,stage=2", "--n-layers", "2", *data)
    assert staged["packing"] and staged["model_config"]["documents_eot"] == 0


@pytest.mark.parametrize("packing, dtype, eot, says", [
    (None, "bfloat16", None, "documents not packed: cuDNN's fused attention takes no segment ids here"),
    (True, "bfloat16", EOT, "--packing true: cuDNN's fused attention takes no segment ids here; the blockwise "
                            "kernel runs"),
    (None, "float32", EOT, None),  # (cuDNN's kernel would not run: the blockwise one takes the ids)
    (False, "bfloat16", None, None),
])
def test_on_gpus_packing_is_off_where_cudnns_kernel_would_run(monkeypatch, capsys, packing, dtype, eot, says):
    """The choice on a GPU, where the backend says so (here: faked): unasked, packing is off
    where cuDNN's fused kernel runs (it takes no segment ids), and the log says so."""
    from jaxshard import cli, loop
    from jaxshard.mesh import build_mesh
    from jaxshard.rules import ShardingRules

    monkeypatch.setattr(loop.jax, "default_backend", lambda: "gpu")
    asked = [] if packing is None else ["--packing", str(packing).lower()]
    cfg = cli.parse_train(["--compute-dtype", dtype, "--mesh", "data=8", *asked])
    rules = ShardingRules(build_mesh(cfg.mesh), cfg.strategy)
    capsys.readouterr()
    assert loop.documents_eot(cfg, EOT, "corpus", rules, get_preset("tiny").replace(n_layers=1)) == eot
    out = capsys.readouterr().out
    assert (says in out) if says else out == "", out


def test_inspect_compiles_the_packed_step_training_runs(tmp_path, capsys):
    """experiments/inspect.py compiles the program a run with the same flags trains -- packed
    by default, as training on the embedded corpus is -- and its verifier explains that
    program's collectives and bytes (--strict): the same fingerprint as the run's report.
    (``--packing false`` changing inspect's program: tests/test_flags.py.)"""
    import importlib
    import json
    import re

    from jaxshard.train import main as train

    inspect_main = importlib.import_module("experiments.inspect").main
    shape = ["--model", "tiny", "--n-layers", "2", "--cpu-devices", "8", "--platform", "cpu", "--batch-size", "8",
             "--seq-len", "32", "--mesh", "data=2,sequence=4", "--steps", "1", "--warmup-steps", "0"]
    report = tmp_path / "run.json"
    assert train([*shape, "--eval-batches", "1", "--no-progress", "--report", str(report)]) == 0
    trained = json.loads(report.read_text())
    assert trained["packing"]
    capsys.readouterr()
    assert inspect_main([*shape, "--strict"]) == 0
    out = capsys.readouterr().out
    assert "documents packed" in out
    assert re.search(r"^compiled step: fingerprint (\w+)", out, re.M).group(1) == trained["program_fingerprint"]


def test_inspect_packs_by_the_end_of_text_id_the_runs_data_have(tmp_path):
    """Without reading the data: bytes' id by default, a tokenizer file's (an --init-from
    folder's tokenizer.json) where one is named, none for token ids without a tokenizer file."""
    import importlib

    import tokenizers

    from jaxshard.data.corpus import DataConfig

    data_eot = importlib.import_module("experiments.inspect").data_eot
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2}, unk_token="a"))
    words.add_special_tokens(["<|endoftext|>"])  # (id 2: not bytes' 0)
    words.save(str(tmp_path / "tokenizer.json"))
    assert data_eot(DataConfig()) == 0
    assert data_eot(DataConfig(tokenizer=str(tmp_path / "tokenizer.json"))) == 2
    assert data_eot(DataConfig(path=str(tmp_path / "ids.bin"))) is None
    assert data_eot(DataConfig(path=f"{tmp_path / 'a.jsonl'}:0.5,{tmp_path / 'ids.tokens'}:0.5")) is None
    assert data_eot(DataConfig(path=str(tmp_path / "ids.bin"), tokenizer=str(tmp_path))) == 2


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "data=8", "--packing", "true", "--data", "{bin}"],
     "--packing true finds documents by the end-of-text id; data {bin} has no tokenizer that names one "
     "(give --tokenizer)"),
])


def test_packing_that_cannot_be_is_one_line(tmp_path, capsys, flags, message):
    from jaxshard.train import main

    path = tmp_path / "ids.bin"
    np.arange(400, dtype="<u2").__mod__(200).astype("<u2").tofile(path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*COMMON, *(f.format(bin=path) for f in flags)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: " + message.format(bin=path)


def test_packed_learned_positions_need_no_rematerialisation_by_the_partitioner(capfd):
    """GPT-2's learned positions under packing are looked up per token (``vectors.take_rows``):
    on HSDP, the default experiment's mesh, the step compiles without the partitioner's
    "involuntary full rematerialization" (it had laid the rows out as the table, split over
    its model dim, and moved the activation's gradient into that layout: with ``jnp.take`` in
    its place, the warning is printed, so the log is read)."""
    from models import layers

    def warned():
        model = TransformerLM(get_preset("tiny").replace(documents_eot=EOT))
        capfd.readouterr()
        make_program(model, "data=2,fsdp=4").lower_step(8, L).compile()
        return "Involuntary full rematerialization" in capfd.readouterr().err

    from jax.experimental.compilation_cache import compilation_cache

    # A cached executable is not partitioned, so the cache is off here; JAX reads the flag once
    # a process, at its first compile, so the cache is reset to read it again (before, the flag
    # alone did nothing: with the programs cached by an earlier run, no compile here warned).
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        assert not warned()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layers, "take_rows", functools.partial(jnp.take, axis=0))
            assert warned()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_take_rows_and_its_gradient_are_a_lookups(dtype):
    """``vectors.take_rows`` under HSDP's rules: the rows and the table's gradient (repeated
    positions summed) as ``jnp.take``'s without rules. (In bfloat16, XLA:CPU's compiler
    aborted on the two-stage reduction when it reduced in bfloat16.)"""
    from jaxshard.parallel.vectors import take_rows

    rng = np.random.default_rng(7)
    table = jnp.asarray(rng.normal(size=(L, 16)), dtype)
    positions = jnp.asarray(rng.integers(0, L // 2, size=(8, L)), jnp.int32)  # rows used many times, some never
    cot = jnp.asarray(rng.normal(size=(8, L, 16)), dtype)

    def loss(take, table):
        return (take(table, positions) * cot).sum()

    lookup = functools.partial(jnp.take, axis=0)
    np.testing.assert_allclose(under("data=2,fsdp=4", take_rows, table, positions), lookup(table, positions))
    got = under("data=2,fsdp=4", jax.grad(functools.partial(loss, take_rows)), table)
    want = jax.grad(functools.partial(loss, lookup))(table.astype(jnp.float32))  # (summed in float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def test_the_packed_position_tables_gradient_is_reduced_in_two_stages():
    """On HSDP, the default experiment's mesh, the packed position table's gradient rests
    split over ``fsdp``: each device's scattered rows are reduce-scattered over ``fsdp`` and
    the shard all-reduced over ``data``, as a matmul's weight gradient is -- the compiled
    step's collectives on each set of axes move exactly the ledger's bytes. (Given the whole
    table, the partitioner all-reduced it over all 8 devices and sliced the shard: 1.75x the
    bytes, which the verifier's by-kind sums did not tell apart.)"""
    from jaxshard.analysis import inspect

    model = TransformerLM(get_preset("tiny").replace(documents_eot=EOT))
    program = make_program(model, "data=2,fsdp=4")
    check = inspect.verify(model, program, program.lower_step(8, L).compile(), 8, L)
    moved = {(kind, axes): (predicted, compiled) for kind, axes, predicted, compiled in check.collectives}
    assert moved[("reduce-scatter", ("fsdp",))][0] == moved[("reduce-scatter", ("fsdp",))][1], moved
    assert moved[("all-reduce", ("data",))][0] == moved[("all-reduce", ("data",))][1], moved
    assert moved.get(("reduce-scatter", ("data", "fsdp")), (0, 0))[1] == 0, moved


@pytest.mark.parametrize("mesh, remat, dropout, cp", [
    ("data=2,sequence=4", "none", 0.0, "ring"),  # balanced: the reordering's gather serves
    ("data=4,sequence=2", "full", 0.1, "ring"),  # contiguous (dropout keeps the order)
    ("data=2,sequence=4", "none", 0.0, "ulysses"),
])
def test_packed_documents_under_a_sequence_split_send_what_the_ledger_says(mesh, remat, dropout, cp):
    """The documents' ids, positions and loss flags are made once from the whole row of token
    ids, and the rings and Ulysses slice the ids they need: the compiled step's all-gathers and
    collective-permutes move exactly the ledger's bytes (one gather of the ids, or the balanced
    layout's two, and no id with a ring's chunks; made on the split, the prefix sums, the
    reordering and each layer's attention gathered or passed ids of their own)."""
    from jaxshard.analysis import inspect

    model = TransformerLM(get_preset("tiny-llama").replace(documents_eot=EOT, dropout=dropout), remat=remat)
    program = make_program(model, mesh, context_parallel=cp)
    check = inspect.verify(model, program, program.lower_step(8, 64).compile(), 8, 64)
    moved = {kind: (predicted, compiled) for kind, predicted, compiled in check.by_kind}
    assert moved["all-gather"][0] > 0 and not check.flags, (moved, check.flags)
    for kind in ("all-gather", "collective-permute"):
        assert moved.get(kind, (0, 0))[0] == moved.get(kind, (0, 0))[1], (kind, moved)
