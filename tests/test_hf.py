"""Hugging Face checkpoints in and out, checked against transformers' own models (CPU torch):
imports give transformers' loss and logits on one device and on fsdp=2,tensor=2; exports load
back in transformers with no conversion code and give jaxshard's logits."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from models import hf
from jaxshard.errors import ConfigError
from jaxshard.mesh import build_mesh
from jaxshard.pytree import named_leaves
from jaxshard.rules import ShardingRules, StateKind, Strategy, use_rules
from models import TransformerLM, get_preset
from models.config import RopeScaling

VOCAB, LENGTH = 256, 40
MESHES = {"one device": ("data=1", 1), "fsdp=2,tensor=2": ("fsdp=2,tensor=2", 4)}


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight, norms and biases included, moved off its init (ones, zeros), so that no
    mapping mistake can hide behind a constant."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


HF_MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, initializer_range=0.2,
        bos_token_id=0, eos_token_id=0)),
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2)),
    # Llama 3's RoPE scaling (positions past original_max matter here) and tied embeddings.
    "llama3-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2,
        tie_word_embeddings=True, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    torch.manual_seed(0)
    out = {}
    for i, (name, make) in enumerate(HF_MODELS.items()):
        folder = tmp_path_factory.mktemp(name)
        _perturbed(make(), i).save_pretrained(folder)
        out[name] = folder
    return out


def _tokens(seed=0, batch=4):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, LENGTH + 1))


def _hf_outputs(folder, x):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model(torch.tensor(x), labels=torch.tensor(x))
    return out.loss.item(), out.logits.numpy()


def _rules(mesh):
    spec, n = MESHES[mesh]
    return ShardingRules(build_mesh(spec, jax.devices()[:n]), Strategy())


def _ours(model, params, rules, x):
    """(mean loss, logits) of jaxshard's model on x's next-token task."""
    with use_rules(rules):
        loss = jax.jit(lambda p, a, b: model.loss(p, a, b))(params, x[:, :-1], x[:, 1:])
        logits = jax.jit(lambda p, a: model.head(p, model.blocks(p, model.embed(p, a))))(params, x[:, :-1])
    return float(loss.nll / loss.tokens), np.asarray(logits)[..., :model.cfg.vocab_size]


def _shardings(model, rules):
    return rules.param_shardings(model.param_axes(), model.abstract_params(), StateKind.PARAMS)


def _assert_logits_close(ours, ref):
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_import_gives_transformers_loss_and_logits(hf_folders, name, mesh):
    x = _tokens()
    ref_loss, ref_logits = _hf_outputs(hf_folders[name], x)
    model = TransformerLM(hf.read_config(hf_folders[name]))
    rules = _rules(mesh)
    shardings = _shardings(model, rules)
    params = hf.load_params(hf_folders[name], model, shardings)
    for (key, p), (_, s) in zip(named_leaves(params), named_leaves(shardings)):
        assert p.sharding == s, key  # read straight into the layout training uses
    if mesh != "one device":  # the layout really splits: q's heads over tensor, its rows over fsdp
        wq = params["blocks"]["attn"]["wq"]
        assert wq.addressable_shards[0].data.shape == (2, 32, model.cfg.n_heads // 2, model.cfg.d_head)
    loss, logits = _ours(model, params, rules, x)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (loss, ref_loss)
    _assert_logits_close(logits, ref_logits[:, :-1])
    if name == "gpt2":  # the import dropped a key bias far from zero, at no cost
        k_bias = load_file(hf_folders[name] / "model.safetensors")["transformer.h.0.attn.c_attn.bias"][64:128]
        assert np.abs(k_bias).max() > 0.05


def test_import_reads_each_devices_block_not_whole_tensors(hf_folders, monkeypatch):
    """On fsdp=2,tensor=2 a query projection splits four ways (its rows over fsdp, its heads
    over tensor): every read of one from the file is one device's quarter, never the tensor."""
    reads = []
    read = hf.Weights.read

    def recorded(self, key, index):
        out = read(self, key, index)
        reads.append((key, out.size, int(np.prod(self.shape(key)))))
        return out

    monkeypatch.setattr(hf.Weights, "read", recorded)
    model = TransformerLM(hf.read_config(hf_folders["llama-gqa"]))
    hf.load_params(hf_folders["llama-gqa"], model, _shardings(model, _rules("fsdp=2,tensor=2")))
    q = [(size, whole) for key, size, whole in reads if key.endswith("q_proj.weight")]
    assert len(q) >= 4 * model.cfg.n_layers and all(4 * size == whole for size, whole in q), q


def test_imported_config_is_the_checkpoints(hf_folders):
    gpt2 = hf.read_config(hf_folders["gpt2"])
    assert (gpt2.n_layers, gpt2.d_model, gpt2.n_heads, gpt2.d_mlp, gpt2.max_seq_len) == (2, 64, 4, 256, 64)
    assert gpt2.tie_embeddings and gpt2.use_bias and hf.family(gpt2) == "gpt2"
    llama = hf.read_config(hf_folders["llama3-tied"])
    assert (llama.n_heads, llama.n_kv_heads, llama.d_mlp, llama.rope_theta) == (4, 2, 128, 500_000.0)
    assert llama.tie_embeddings and llama.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)


def _our_model(name: str, **changes) -> TransformerLM:
    # A larger init than training's so that logits are far from uniform.
    return TransformerLM(get_preset(name).replace(init_std=0.2, max_seq_len=64, **changes))


@pytest.mark.parametrize("name, changes, mesh", [
    ("tiny", {}, "one device"),
    ("tiny-llama", {}, "fsdp=2,tensor=2"),
    ("tiny-llama", {"tie_embeddings": True, "rope_scaling": RopeScaling(4.0, 1.0, 4.0, 16)}, "one device"),
    ("tiny", {"vocab_multiple": 3}, "fsdp=2,tensor=2"),  # padding rows are dropped
])
def test_export_loads_in_transformers(tmp_path, name, changes, mesh):
    model = _our_model(name, **changes)
    rules = _rules(mesh)
    params = jax.jit(model.init, out_shardings=_shardings(model, rules))(jax.random.key(3))
    # Biases and norms off their init too.
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape), params)
    x = _tokens(1)
    _, logits = _ours(model, params, rules, x)
    folder = hf.export(params, model.cfg, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    _, ref_logits = _hf_outputs(folder, x)
    _assert_logits_close(logits, ref_logits[:, :-1])
    if name == "tiny":  # the inert key bias is written as zeros
        c_attn = load_file(folder / "model.safetensors")["transformer.h.0.attn.c_attn.bias"]
        assert not c_attn[64:128].any() and c_attn[:64].any()
    # ... and the export imports back to the same params.
    again = hf.load_params(folder, TransformerLM(hf.read_config(folder).replace(
        vocab_multiple=model.cfg.vocab_multiple)), _shardings(model, rules))
    for (key, a), (_, b) in zip(named_leaves(params), named_leaves(again)):
        if key.endswith("tokens") or key == "lm_head":
            assert not np.asarray(b)[VOCAB:].any(), key  # padding rows come back as zeros
            a, b = np.asarray(a)[:VOCAB], np.asarray(b)[:VOCAB]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=key)


def test_export_split_into_files_with_an_index(tmp_path, monkeypatch, hf_folders):
    model = TransformerLM(hf.read_config(hf_folders["llama-gqa"]))
    rules = _rules("one device")
    params = hf.load_params(hf_folders["llama-gqa"], model, _shardings(model, rules))
    monkeypatch.setattr(hf, "SHARD_BYTES", 40_000)
    folder = hf.export(params, model.cfg, tmp_path / "split")
    index = json.loads((folder / hf.INDEX).read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 3 and sorted(set(index["weight_map"].values())) == files
    x = _tokens(2)
    ref_loss, ref_logits = _hf_outputs(folder, x)
    again = hf.load_params(folder, model, _shardings(model, rules))
    loss, logits = _ours(model, again, rules, x)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    _assert_logits_close(logits, ref_logits[:, :-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_checkpoint_imports_its_values(tmp_path, hf_folders, dtype):
    model16 = transformers.AutoModelForCausalLM.from_pretrained(hf_folders["llama-gqa"]).to(dtype)
    model16.save_pretrained(tmp_path)
    model = TransformerLM(hf.read_config(tmp_path))
    params = hf.load_params(tmp_path, model, _shardings(model, _rules("one device")))
    wq = np.asarray(params["blocks"]["attn"]["wq"][1])  # [D, N, H]
    ref = model16.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [N * H, D]
    np.testing.assert_array_equal(wq.reshape(64, -1), ref.T)


def _edit(src, dst, *, config=None, drop=None, add=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = load_file(src / "model.safetensors")
    weights = {k: v for k, v in weights.items() if k != drop} | (add or {})
    save_file(weights, dst / "model.safetensors")
    return dst


def test_bad_folders_fail_with_one_line(tmp_path, hf_folders):
    src = hf_folders["gpt2"]
    shardings = lambda m: _shardings(m, _rules("one device"))  # noqa: E731
    with pytest.raises(hf.HfError, match="no config.json there"):
        hf.read_config(tmp_path)
    with pytest.raises(hf.HfError, match="model_type 'bert' is not supported"):
        hf.read_config(_edit(src, tmp_path / "bert", config={"model_type": "bert"}))
    with pytest.raises(hf.HfError, match="activation_function 'relu' is not supported"):
        hf.read_config(_edit(src, tmp_path / "relu", config={"activation_function": "relu"}))
    missing = _edit(src, tmp_path / "missing", drop="transformer.h.1.mlp.c_fc.weight")
    model = TransformerLM(hf.read_config(missing))
    with pytest.raises(hf.HfError, match="lack tensor transformer.h.1.mlp.c_fc.weight"):
        hf.load_params(missing, model, shardings(model))
    wide = _edit(src, tmp_path / "wide", config={"n_inner": 128})
    model = TransformerLM(hf.read_config(wide))
    with pytest.raises(hf.HfError, match=r"tensor transformer.h.0.mlp.c_fc.weight is \(64, 256\), the config says \(64, 128\)"):
        hf.load_params(wide, model, shardings(model))
    extra = _edit(src, tmp_path / "extra", add={"score.weight": np.zeros((2, 64), np.float32)})
    model = TransformerLM(hf.read_config(extra))
    with pytest.raises(hf.HfError, match="tensors the model has no place for: score.weight"):
        hf.load_params(extra, model, shardings(model))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="exists and is not an empty folder"):
        hf.check_export_dir(tmp_path / "full")
    with pytest.raises(ConfigError, match="has MoE layers"):
        hf.family(get_preset("moe-tiny"))
    with pytest.raises(ConfigError, match="neither a GPT-2 nor a Llama"):
        hf.family(get_preset("tiny").replace(tie_embeddings=False))


def test_a_delayed_float8_models_export_holds_its_weights_only(tmp_path):
    """--fp8 delayed keeps amax histories beside the weights (``wq_fp8``, ...): training state
    that the Hugging Face folder leaves out; the weights are written as without float8."""
    plain, delayed = _our_model("tiny-llama"), _our_model("tiny-llama", fp8="delayed")
    params = delayed.init(jax.random.key(3))
    assert any(key.endswith("_fp8") for key, _ in named_leaves(params))
    ours = load_file(hf.export(params, delayed.cfg, tmp_path / "f8") / "model.safetensors")
    weights = {k: v for k, v in params["blocks"]["attn"].items() if not k.endswith("_fp8")}
    base = load_file(hf.export({**params, "blocks": {**params["blocks"], "attn": weights, "ffn": {
        k: v for k, v in params["blocks"]["ffn"].items() if not k.endswith("_fp8")}}}, plain.cfg,
        tmp_path / "plain") / "model.safetensors")
    assert sorted(ours) == sorted(base)
    for key in base:
        np.testing.assert_array_equal(ours[key], base[key], err_msg=key)
    # ... and it imports into a delayed float8 model with fresh histories (scales 1).
    back = hf.load_params(tmp_path / "f8", delayed, _shardings(delayed, _rules("fsdp=2,tensor=2")))
    meta = np.asarray(back["blocks"]["attn"]["wq_fp8"])
    assert meta.shape == (delayed.cfg.n_layers, 3, 17) and np.all(meta[..., :-1] == 0) and np.all(meta[..., -1] == 1)
    np.testing.assert_array_equal(np.asarray(back["blocks"]["attn"]["wq"]), np.asarray(params["blocks"]["attn"]["wq"]))
