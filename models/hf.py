"""Hugging Face checkpoints in and out, for the GPT-2 and Llama families (GQA included).

**In** (``--init-from DIR``): a local model folder -- ``config.json`` and ``*.safetensors``
(one file, or several with ``model.safetensors.index.json``). :func:`read_config` turns the
config into a :class:`~models.config.ModelConfig`; :func:`load_params` reads every param
straight into its sharding on the current mesh: each device's block of a param is read from
the memory-mapped file as a slice (``safe_open(...).get_slice``), so no host ever holds the
whole model -- at most one layer's tensor of one device's block.

**Out** (``--export-hf DIR``, ``scripts/convert_checkpoint.py``): ``config.json`` and
safetensors under Hugging Face's names, which ``transformers.AutoModelForCausalLM
.from_pretrained(DIR)`` loads with no conversion code; gathered one param at a time.

What does not map: GPT-2's key bias (the ``k`` third of ``c_attn.bias``). Softmax is invariant
to adding ``q . b_k`` to every score of a query, so the bias changes nothing -- not the loss,
not any other gradient (its own is identically zero). It is dropped on import and written as
zeros on export: no cost. Padding rows of the vocabulary (``--vocab-multiple``) are zeros on
import and dropped on export. Dropout rates are not imported (fine-tuning starts without;
``--dropout`` sets one).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from jaxshard import fp8
from jaxshard.errors import ConfigError, JaxshardError
from jaxshard.pytree import named_leaves
from models.config import ModelConfig, Mlp, Norm, Positions, RopeScaling

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30  # safetensors files of an export hold at most ~2 GiB each
# Tensors Hugging Face checkpoints may hold that are buffers, not weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


class HfError(JaxshardError):
    """A Hugging Face model folder that cannot be used: missing, unreadable, or unsupported."""


# ---- config --------------------------------------------------------------------------------

def read_config(folder: str | os.PathLike) -> ModelConfig:
    """The model a Hugging Face folder's ``config.json`` describes."""
    folder = Path(folder)
    path = folder / CONFIG
    if not path.is_file():
        raise HfError(f"--init-from {folder}: no {CONFIG} there (a Hugging Face model folder holds "
                      "config.json and *.safetensors)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HfError(f"{path} is unreadable: {e}") from None
    kind = hf.get("model_type")
    name = f"hf:{folder.resolve().name}"
    try:
        if kind == "gpt2":
            return _gpt2_config(hf, name)
        if kind == "llama":
            return _llama_config(hf, name)
    except KeyError as e:
        raise HfError(f"{path}: no {e.args[0]!r} entry") from None
    raise HfError(f"{path}: model_type {kind!r} is not supported (gpt2 and llama are)")


def _require(hf: dict, name: str, wanted: Any, key: str, default: Any = None) -> None:
    value = hf.get(key, default)
    if value != wanted:
        raise HfError(f"{name}: {key} = {value!r} is not supported (only {wanted!r})")


def _gpt2_config(hf: dict, name: str) -> ModelConfig:
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HfError(f"{name}: activation_function {hf['activation_function']!r} is not supported "
                      "(GPT-2's tanh GELU, gelu_new, is)")
    _require(hf, name, False, "scale_attn_by_inverse_layer_idx", False)
    _require(hf, name, True, "scale_attn_weights", True)
    _require(hf, name, True, "tie_word_embeddings", True)
    d = hf["n_embd"]
    return ModelConfig(name=name, n_layers=hf["n_layer"], d_model=d, n_heads=hf["n_head"],
                       d_mlp=hf.get("n_inner") or 4 * d, vocab_size=hf["vocab_size"],
                       max_seq_len=hf["n_positions"], norm=Norm.LAYER, mlp=Mlp.GELU,
                       positions=Positions.LEARNED, use_bias=True, tie_embeddings=True,
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def _llama_config(hf: dict, name: str) -> ModelConfig:
    _require(hf, name, "silu", "hidden_act", "silu")
    _require(hf, name, False, "attention_bias", False)
    _require(hf, name, False, "mlp_bias", False)
    # transformers >= 5 writes rope_parameters; earlier versions rope_theta and rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        rope_scaling = RopeScaling(factor=float(scaling["factor"]),
                                   low_freq_factor=float(scaling["low_freq_factor"]),
                                   high_freq_factor=float(scaling["high_freq_factor"]),
                                   original_max_len=int(scaling["original_max_position_embeddings"]))
    elif kind == "default":
        rope_scaling = None
    else:
        raise HfError(f"{name}: rope type {kind!r} is not supported (default and llama3 are)")
    heads = hf["num_attention_heads"]
    return ModelConfig(name=name, n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"],
                       n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
                       d_head=hf.get("head_dim") or hf["hidden_size"] // heads,
                       d_mlp=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                       max_seq_len=hf["max_position_embeddings"], norm=Norm.RMS, mlp=Mlp.SWIGLU,
                       positions=Positions.ROPE, use_bias=False,
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       rope_theta=float(theta), rope_scaling=rope_scaling,
                       norm_eps=hf.get("rms_norm_eps", 1e-6))


def family(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama': the Hugging Face architecture ``cfg`` is exactly; an error otherwise."""
    gpt2 = (Norm.LAYER, Mlp.GELU, Positions.LEARNED, True, True)
    llama = (Norm.RMS, Mlp.SWIGLU, Positions.ROPE, False)
    if cfg.moe_experts:
        raise ConfigError(f"model {cfg.name} has MoE layers: Hugging Face import/export covers the "
                          "dense GPT-2 and Llama families only")
    if (cfg.norm, cfg.mlp, cfg.positions, cfg.use_bias, cfg.tie_embeddings) == gpt2 \
            and cfg.n_kv_heads == cfg.n_heads and cfg.d_head * cfg.n_heads == cfg.d_model:
        return "gpt2"
    if (cfg.norm, cfg.mlp, cfg.positions, cfg.use_bias) == llama:
        return "llama"
    raise ConfigError(f"model {cfg.name} is neither a GPT-2 nor a Llama (its norm, MLP, positions, "
                      "biases and tying must all be one family's) and has no Hugging Face form")


def hf_config(cfg: ModelConfig, eot_id: int | None = None) -> dict:
    """``config.json`` for ``cfg``; ``eot_id``: the tokenizer's end-of-text id (bos/eos)."""
    if family(cfg) == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": cfg.n_layers, "n_embd": cfg.d_model, "n_head": cfg.n_heads,
                "n_inner": cfg.d_mlp, "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len,
                "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": 0.0,
                "tie_word_embeddings": True, "bos_token_id": eot_id, "eos_token_id": eot_id,
                "dtype": "float32"}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope |= {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                 "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_len}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            # Both spellings: transformers >= 5 reads rope_parameters, earlier versions the rest.
            "rope_parameters": rope, "rope_theta": cfg.rope_theta,
            "rope_scaling": None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
            "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": "float32"}


# ---- names and layouts ----------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """How one of our params (one layer's, for stacked ones) is a Hugging Face tensor: the HF
    tensor ``key`` (``{i}``: the layer), optionally only ``part`` = (axis, index, parts) of it
    (GPT-2's fused ``c_attn``), viewed as ``groups`` -- per HF axis, the dims it splits into --
    and transposed by ``perm`` into ours."""

    key: str
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...] | None = None
    part: tuple[int, int, int] | None = None


def mapping(cfg: ModelConfig) -> dict[str, Tensor]:
    """Our param names ('blocks/attn/wq', ...) -> their Hugging Face tensors."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp
    V = cfg.padded_vocab
    if family(cfg) == "gpt2":
        h = "transformer.h.{i}."
        return {
            "tokens": Tensor("transformer.wte.weight", ((V,), (D,))),
            "positions": Tensor("transformer.wpe.weight", ((cfg.max_seq_len,), (D,))),
            "final_norm/scale": Tensor("transformer.ln_f.weight", ((D,),)),
            "final_norm/bias": Tensor("transformer.ln_f.bias", ((D,),)),
            "blocks/attn_norm/scale": Tensor(h + "ln_1.weight", ((D,),)),
            "blocks/attn_norm/bias": Tensor(h + "ln_1.bias", ((D,),)),
            "blocks/attn/wq": Tensor(h + "attn.c_attn.weight", ((D,), (N, H)), part=(1, 0, 3)),
            "blocks/attn/wk": Tensor(h + "attn.c_attn.weight", ((D,), (N, H)), part=(1, 1, 3)),
            "blocks/attn/wv": Tensor(h + "attn.c_attn.weight", ((D,), (N, H)), part=(1, 2, 3)),
            "blocks/attn/bq": Tensor(h + "attn.c_attn.bias", ((N, H),), part=(0, 0, 3)),
            "blocks/attn/bv": Tensor(h + "attn.c_attn.bias", ((N, H),), part=(0, 2, 3)),
            "blocks/attn/wo": Tensor(h + "attn.c_proj.weight", ((N, H), (D,))),
            "blocks/attn/bo": Tensor(h + "attn.c_proj.bias", ((D,),)),
            "blocks/ffn_norm/scale": Tensor(h + "ln_2.weight", ((D,),)),
            "blocks/ffn_norm/bias": Tensor(h + "ln_2.bias", ((D,),)),
            "blocks/ffn/w_in": Tensor(h + "mlp.c_fc.weight", ((D,), (F,))),
            "blocks/ffn/b_in": Tensor(h + "mlp.c_fc.bias", ((F,),)),
            "blocks/ffn/w_out": Tensor(h + "mlp.c_proj.weight", ((F,), (D,))),
            "blocks/ffn/b_out": Tensor(h + "mlp.c_proj.bias", ((D,),)),
        }
    h = "model.layers.{i}."
    out = {
        "tokens": Tensor("model.embed_tokens.weight", ((V,), (D,))),
        "final_norm/scale": Tensor("model.norm.weight", ((D,),)),
        "blocks/attn_norm/scale": Tensor(h + "input_layernorm.weight", ((D,),)),
        # torch Linear weights are [out, in]; ours [in, out...].
        "blocks/attn/wq": Tensor(h + "self_attn.q_proj.weight", ((N, H), (D,)), (2, 0, 1)),
        "blocks/attn/wk": Tensor(h + "self_attn.k_proj.weight", ((K, H), (D,)), (2, 0, 1)),
        "blocks/attn/wv": Tensor(h + "self_attn.v_proj.weight", ((K, H), (D,)), (2, 0, 1)),
        "blocks/attn/wo": Tensor(h + "self_attn.o_proj.weight", ((D,), (N, H)), (1, 2, 0)),
        "blocks/ffn_norm/scale": Tensor(h + "post_attention_layernorm.weight", ((D,),)),
        "blocks/ffn/w_gate": Tensor(h + "mlp.gate_proj.weight", ((F,), (D,)), (1, 0)),
        "blocks/ffn/w_in": Tensor(h + "mlp.up_proj.weight", ((F,), (D,)), (1, 0)),
        "blocks/ffn/w_out": Tensor(h + "mlp.down_proj.weight", ((D,), (F,)), (1, 0)),
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = Tensor("lm_head.weight", ((V,), (D,)), (1, 0))
    return out


_VOCAB_TABLES = ("wte.weight", "embed_tokens.weight", "lm_head.weight")


def _hf_rows(cfg: ModelConfig, t: Tensor) -> int | None:
    """Rows of a vocabulary table in the HF tensor, where ours has padding rows beyond them;
    None for any other tensor."""
    padded = t.key.endswith(_VOCAB_TABLES) and cfg.padded_vocab != cfg.vocab_size
    return cfg.vocab_size if padded else None


# ---- reading --------------------------------------------------------------------------------

class Weights:
    """The safetensors files of a Hugging Face folder, opened lazily, read by slices."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self.folder = Path(folder)
        self._open = safe_open
        index = self.folder / INDEX
        if index.is_file():
            try:
                files = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise HfError(f"{index} is unreadable: {e}") from None
        else:
            files = {}
            for path in sorted(self.folder.glob("*.safetensors")):
                with self._handle(path.name, "numpy") as f:
                    files.update({k: path.name for k in f.keys()})
        if not files:
            raise HfError(f"--init-from {self.folder}: no *.safetensors weights there")
        # Some checkpoints name GPT-2's tensors without the "transformer." prefix.
        self.files = {**{f"transformer.{k}": v for k, v in files.items() if not k.startswith(("transformer.", "lm_head."))},
                      **files}
        self.names = set(files)
        self._handles: dict[tuple[str, str], Any] = {}

    def _handle(self, file: str, framework: str):
        try:
            return self._open(str(self.folder / file), framework)
        except Exception as e:  # noqa: BLE001 -- safetensors raises several kinds
            raise HfError(f"{self.folder / file} is unreadable: {e}") from None

    def _get(self, key: str, framework: str = "numpy"):
        file = self.files[key]
        name = key if key in self.names else key.removeprefix("transformer.")
        handle = self._handles.get((file, framework))
        if handle is None:
            handle = self._handles[(file, framework)] = self._handle(file, framework).__enter__()
        return handle.get_slice(name)

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.files:
            raise HfError(f"--init-from {self.folder}: the weights lack tensor {key}")
        return tuple(self._get(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` as float32 (bfloat16 and float16 files included)."""
        s = self._get(key)
        if s.get_dtype() in ("F32", "F64", "F16", "I64", "I32"):
            return np.asarray(s[index], np.float32)
        return np.asarray(self._get(key, "flax")[index]).astype(np.float32)  # bfloat16: numpy lacks it

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _block(weights: Weights, t: Tensor, layer: int | None, index: tuple[slice, ...],
           rows: int | None) -> np.ndarray:
    """``index`` of our (per-layer) param, read from its HF tensor: the smallest covering
    rectangle of the HF tensor is read, then the wanted elements taken from it."""
    key = t.key.format(i=layer)
    dims = [d for g in t.groups for d in g]
    perm = t.perm or tuple(range(len(dims)))
    # Our index, in the HF view's dim order.
    view_index = [None] * len(dims)
    for ours, view in enumerate(perm):
        view_index[view] = index[ours]
    view_ranges = [np.arange(*s.indices(n)) for s, n in zip(view_index, dims)]
    flat, at = [], 0
    for axis, g in enumerate(t.groups):
        grid = np.meshgrid(*view_ranges[at:at + len(g)], indexing="ij")
        f = np.ravel_multi_index([x.ravel() for x in grid], g) if g else np.zeros(1, int)
        if t.part is not None and t.part[0] == axis:
            f = f + t.part[1] * math.prod(g)
        flat.append(f)
        at += len(g)
    valid = [f < rows if rows is not None and axis == 0 else np.ones_like(f, bool)
             for axis, f in enumerate(flat)]
    out = np.zeros([len(f) for f in flat], np.float32)
    picked = [f[v] for f, v in zip(flat, valid)]
    if all(len(p) for p in picked):
        starts = [int(p.min()) for p in picked]
        block = weights.read(key, tuple(slice(s, int(p.max()) + 1) for s, p in zip(starts, picked)))
        out[np.ix_(*valid)] = block[np.ix_(*[p - s for p, s in zip(picked, starts)])]
    shape = [len(r) for r in view_ranges]
    return out.reshape(shape).transpose(perm)


def load_params(folder: str | os.PathLike, model: Any, shardings: Any) -> Any:
    """The params of ``model`` (built from :func:`read_config`, in model layer order) read from
    the folder's safetensors, each array created in its sharding of ``shardings`` (a params tree
    of ``NamedSharding``): every device's block is read as a slice of the files."""
    cfg = model.cfg
    table = mapping(cfg)
    weights = Weights(folder)
    try:
        _check_tensors(weights, cfg, table)
        abstract = model.abstract_params()
        names = dict(named_leaves(shardings))
        leaves = []
        for name, x in named_leaves(abstract):
            if name.endswith(fp8.META_SUFFIX):  # --fp8 delayed: a fresh amax history per layer
                fresh = np.broadcast_to(np.asarray(fp8.delayed_init()), x.shape)
                leaves.append(jax.make_array_from_callback(x.shape, names[name], lambda i, f=fresh: f[i]))
                continue
            if name not in table:
                raise HfError(f"param {name} of model {cfg.name} has no Hugging Face tensor")
            t, stacked = table[name], name.startswith("blocks/")
            rows = _hf_rows(cfg, t)

            def read(index, t=t, stacked=stacked, rows=rows):
                if not stacked:
                    return _block(weights, t, None, index, rows)
                layers = range(*index[0].indices(cfg.n_layers))
                return np.stack([_block(weights, t, i, index[1:], rows) for i in layers])

            leaves.append(jax.make_array_from_callback(x.shape, names[name], read, dtype=np.float32))
        return jax.tree.unflatten(jax.tree.structure(abstract), leaves)
    finally:
        weights.close()


def _hf_shape(cfg: ModelConfig, t: Tensor) -> tuple[int, ...]:
    shape = [math.prod(g) for g in t.groups]
    shape[0] = _hf_rows(cfg, t) or shape[0]
    if t.part is not None:
        shape[t.part[0]] *= t.part[2]
    return tuple(shape)


def _check_tensors(weights: Weights, cfg: ModelConfig, table: dict[str, Tensor]) -> None:
    """Every tensor the model needs is there with the right shape, and nothing else is."""
    wanted = {t.key.format(i=i): _hf_shape(cfg, t) for name, t in table.items()
              for i in (range(cfg.n_layers) if name.startswith("blocks/") else [None])}
    for key, shape in wanted.items():
        found = weights.shape(key)
        if found != shape:
            raise HfError(f"--init-from {weights.folder}: tensor {key} is {found}, the config says {shape}")
    known = set(wanted) | {k.removeprefix("transformer.") for k in wanted}
    if cfg.tie_embeddings:
        known |= {"lm_head.weight"}  # a tied head some checkpoints store anyway
    extra = sorted(k for k in weights.names if k not in known and not k.endswith(_BUFFERS))
    if extra:
        raise HfError(f"--init-from {weights.folder}: tensors the model has no place for: "
                      f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")


# ---- writing --------------------------------------------------------------------------------

def check_export(cfg: ModelConfig, folder: str | os.PathLike) -> None:
    """Fails now, not after training, if ``cfg`` has no Hugging Face form or ``folder`` is taken."""
    family(cfg)
    check_export_dir(folder)


def check_export_dir(path: str | os.PathLike) -> Path:
    """An export folder must be new or empty: an export never mixes with older files."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--export-hf {path} exists and is not an empty folder")
    return path


def _hf_tensors(cfg: ModelConfig, name: str, full: np.ndarray) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """(HF key, the part of it or None, tensor) for one of our params, whole (all layers)."""
    t = mapping(cfg)[name]
    layers = range(cfg.n_layers) if name.startswith("blocks/") else [None]
    for i in layers:
        x = full[i] if i is not None else full
        if t.perm:
            x = x.transpose(np.argsort(t.perm))
        x = x.reshape([math.prod(g) for g in t.groups])
        x = x[:_hf_rows(cfg, t)]
        yield t.key.format(i=i), t.part, x


def export(params: Any, cfg: ModelConfig, folder: str | os.PathLike, tokenizer_json: str | None = None,
           eot_id: int | None = None) -> Path:
    """Write ``params`` (model layer order, any sharding) as a Hugging Face folder: config.json,
    safetensors (split into ~2 GiB files with an index when larger) and, if given,
    tokenizer.json. Every process gathers one param at a time; process 0 writes into a
    temporary folder renamed into place at the end."""
    from jax.experimental import multihost_utils
    from safetensors.numpy import save_file

    folder = check_export_dir(folder)
    config = hf_config(cfg, eot_id)
    staging = folder.with_name(folder.name + ".partial")
    writer = jax.process_index() == 0
    if writer:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    parts: dict[str, dict[int, np.ndarray]] = {}
    files: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]

    def put(key: str, x: np.ndarray) -> None:
        if sizes[-1] and sizes[-1] + x.nbytes > SHARD_BYTES:
            flush()
        files[-1][key] = np.ascontiguousarray(x, np.float32)
        sizes[-1] += x.nbytes

    written: dict[str, str] = {}

    def flush() -> None:
        if files[-1]:
            name = f"model-{len(written) + 1:05d}.safetensors"
            if writer:
                save_file(files[-1], str(staging / name), metadata={"format": "pt"})
            written.update({k: name for k in files[-1]})
            files[-1], sizes[-1] = {}, 0

    for name, x in named_leaves(params):
        if name.endswith(fp8.META_SUFFIX):
            continue  # --fp8 delayed's amax histories: training state, not weights
        full = np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float32)
        for key, part, tensor in _hf_tensors(cfg, name, full):
            if part is None:
                put(key, tensor)
                continue
            got = parts.setdefault(key, {})
            got[part[1]] = tensor
            if key.endswith("c_attn.bias") and len(got) == 2:
                got[1] = np.zeros_like(tensor)  # the inert key bias
            if len(got) == part[2]:
                put(key, np.concatenate([got[j] for j in range(part[2])], axis=part[0]))
                del parts[key]
        del full
    flush()
    if writer:
        names = sorted(set(written.values()))
        if len(names) == 1:
            os.replace(staging / names[0], staging / "model.safetensors")
        else:
            total = sum(p.stat().st_size for p in staging.glob("*.safetensors"))
            (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                    "weight_map": dict(sorted(written.items()))}, indent=2))
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_json is not None:
            (staging / "tokenizer.json").write_text(tokenizer_json)
        if folder.exists():
            folder.rmdir()  # empty (checked above)
        os.replace(staging, folder)
    return folder
