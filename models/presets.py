"""Named model presets, one function each. Sizes of the published models they follow are
in the docstrings; ``tests/test_models.py`` checks the parameter counts."""

from __future__ import annotations

from typing import Callable

from jaxshard.errors import ConfigError
from models.config import ModelConfig, Mlp, Norm, Positions


def gpt2_family(name: str, n_layers: int, d_model: int, n_heads: int, *, vocab_size: int = 50257,
                max_seq_len: int = 1024, d_mlp: int | None = None) -> ModelConfig:
    """A GPT-2-shaped model: LayerNorm, GELU MLP (4 d_model unless given), learned positions, tied embedding."""
    return ModelConfig(name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                       d_mlp=d_mlp or 4 * d_model, vocab_size=vocab_size, max_seq_len=max_seq_len,
                       norm=Norm.LAYER, mlp=Mlp.GELU, positions=Positions.LEARNED,
                       use_bias=True, tie_embeddings=True)


def llama_family(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, *,
                 vocab_size: int, max_seq_len: int, tie_embeddings: bool = False,
                 rope_theta: float = 10_000.0) -> ModelConfig:
    """A Llama-shaped model: RMSNorm, SwiGLU MLP, rotary positions, no biases, untied head."""
    return ModelConfig(name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_mlp=d_mlp, vocab_size=vocab_size,
                       max_seq_len=max_seq_len, norm=Norm.RMS, mlp=Mlp.SWIGLU,
                       positions=Positions.ROPE, use_bias=False, tie_embeddings=tie_embeddings,
                       rope_theta=rope_theta)


FAMILIES = ("gpt2", "llama")
_REQUIRED = ("n_layers", "d_model", "n_heads", "d_mlp", "vocab_size")


def of_shape(family: str, max_seq_len: int, **shape: int) -> ModelConfig:
    """A model of ``family`` with an explicit shape (n_layers, d_model, n_heads, d_mlp,
    vocab_size; n_kv_heads for llama, default n_heads), named after it."""
    missing = [f"--{k.replace('_', '-')}" for k in _REQUIRED if k not in shape]
    if family not in FAMILIES or missing:
        raise ConfigError(f"a {family} model of explicit shape needs {', '.join(missing) or 'a known family'}"
                          f" (families: {', '.join(FAMILIES)})")
    name = f"{family}-{shape['n_layers']}x{shape['d_model']}"
    kv = shape.get("n_kv_heads", shape["n_heads"])
    if family == "gpt2":
        if kv != shape["n_heads"]:
            raise ConfigError("--n-kv-heads: the gpt2 family has no grouped-query attention")
        return gpt2_family(name, shape["n_layers"], shape["d_model"], shape["n_heads"], d_mlp=shape["d_mlp"],
                           vocab_size=shape["vocab_size"], max_seq_len=max_seq_len)
    return llama_family(name, shape["n_layers"], shape["d_model"], shape["n_heads"], kv, shape["d_mlp"],
                        vocab_size=shape["vocab_size"], max_seq_len=max_seq_len)


def tiny() -> ModelConfig:
    """GPT-2 family, 2 layers, d_model 64, 8 heads, byte vocabulary: for tests (0.13M params).
    8 heads so that tensor=8 splits them."""
    return gpt2_family("tiny", 2, 64, 8, vocab_size=256, max_seq_len=256)


def tiny_llama() -> ModelConfig:
    """Llama family at the size of ``tiny``, with grouped-query attention (8 heads, 2 kv: with
    tensor > 2 the kv heads are replicated)."""
    return llama_family("tiny-llama", 2, 64, 8, 2, 192, vocab_size=256, max_seq_len=256)


def small() -> ModelConfig:
    """GPT-2 family, 4 layers, d_model 128, byte vocabulary (0.9M params): the default
    experiment, a few minutes on CPU."""
    return gpt2_family("small", 4, 128, 4, vocab_size=256, max_seq_len=512)


def llama_tiny() -> ModelConfig:
    """Llama family: 4 layers, d_model 256, 4 heads, mlp 1024, byte vocabulary (4.3M params)."""
    return llama_family("llama-tiny", 4, 256, 4, 4, 1024, vocab_size=256, max_seq_len=1024)


def gpt2_small() -> ModelConfig:
    """GPT-2 124M (Radford et al. 2019): 12 layers, d 768, 12 heads. 124,430,592 params: the
    published 124,439,808 less the 9,216 key biases, which softmax makes inert (see Attention)."""
    return gpt2_family("gpt2-small", 12, 768, 12)


def gpt2_medium() -> ModelConfig:
    """GPT-2 350M: 24 layers, d 1024, 16 heads."""
    return gpt2_family("gpt2-medium", 24, 1024, 16)


def gpt2_large() -> ModelConfig:
    """GPT-2 774M: 36 layers, d 1280, 20 heads."""
    return gpt2_family("gpt2-large", 36, 1280, 20)


def gpt2_xl() -> ModelConfig:
    """GPT-2 1.5B: 48 layers, d 1600, 25 heads; 1,557,534,400 params (published 1,557,611,200
    less 76,800 inert key biases)."""
    return gpt2_family("gpt2-xl", 48, 1600, 25)


def llama_1b() -> ModelConfig:
    """Llama-3.2-1B shape: 16 layers, d 2048, 32 heads / 8 kv, mlp 8192, vocab 128256, tied
    embeddings; 1,235,814,400 params."""
    return llama_family("llama-1b", 16, 2048, 32, 8, 8192, vocab_size=128256, max_seq_len=8192,
                  tie_embeddings=True, rope_theta=500_000.0)


def llama_7b() -> ModelConfig:
    """Llama-2-7B shape: 32 layers, d 4096, 32 heads, mlp 11008, vocab 32000; 6,738,415,616 params."""
    return llama_family("llama-7b", 32, 4096, 32, 32, 11008, vocab_size=32000, max_seq_len=4096)


def llama_8b() -> ModelConfig:
    """Llama-3-8B shape: 32 layers, d 4096, 32 heads / 8 kv, mlp 14336, vocab 128256;
    8,030,261,248 params."""
    return llama_family("llama-8b", 32, 4096, 32, 8, 14336, vocab_size=128256, max_seq_len=8192,
                  rope_theta=500_000.0)


def llama_70b() -> ModelConfig:
    """Llama-3-70B shape: 80 layers, d 8192, 64 heads / 8 kv, mlp 28672, vocab 128256;
    70,553,706,496 params."""
    return llama_family("llama-70b", 80, 8192, 64, 8, 28672, vocab_size=128256, max_seq_len=8192,
                  rope_theta=500_000.0)


def llama_405b() -> ModelConfig:
    """Llama-3.1-405B shape (Llama 3 paper, Table 3): 126 layers, d 16384, 128 heads / 8 kv,
    mlp 53248, vocab 128256; 405,853,388,800 params (at sequence 8192, without the long-context
    rope scaling)."""
    return llama_family("llama-405b", 126, 16384, 128, 8, 53248, vocab_size=128256, max_seq_len=8192,
                        rope_theta=500_000.0)


def moe_tiny() -> ModelConfig:
    """Llama family with an MoE layer in each of 2 layers: 8 SwiGLU experts of hidden size 64,
    top-2 (for tests; 8 experts so that expert=8 splits them)."""
    return tiny_llama().replace(name="moe-tiny", moe_experts=8, moe_top_k=2, moe_d_mlp=64)


def moe_tiny_gpt2() -> ModelConfig:
    """GPT-2 family, 4 layers, every 2nd an MoE layer of 8 GELU experts (hidden 64, biased), top-1
    (the Switch gate; for tests of the layer groups and the hard gate)."""
    return gpt2_family("moe-tiny-gpt2", 4, 64, 8, vocab_size=256, max_seq_len=256).replace(
        moe_experts=8, moe_top_k=1, moe_every=2, moe_d_mlp=64)


def mixtral_8x7b() -> ModelConfig:
    """Mixtral-8x7B shape (Jiang et al. 2024): 32 layers, d 4096, 32 heads / 8 kv, every FFN 8
    SwiGLU experts of 14336, top-2, vocab 32000; 46,702,792,704 params, 12,879,925,248 active
    (published: 46.7B and 12.9B). Counted from shapes, never allocated."""
    return llama_family("mixtral-8x7b", 32, 4096, 32, 8, 14336, vocab_size=32000, max_seq_len=32768,
                  rope_theta=1e6).replace(moe_experts=8, moe_top_k=2, moe_capacity_factor=0.0)


def deepseek_moe_16b() -> ModelConfig:
    """DeepSeekMoE-16B shape (Dai et al. 2024), fine-grained experts: 28 layers, d 2048, 16
    heads, the first layer a dense SwiGLU of 10944, the other 27 MoE layers of 64 routed experts
    of 1408 (top-6) and 2 shared ones, vocab 102400; 16,375,728,128 params, 2,828,650,496
    active (published: 16.4B and 2.8B)."""
    return llama_family("deepseek-moe-16b", 28, 2048, 16, 16, 10944, vocab_size=102400, max_seq_len=4096).replace(
        moe_experts=64, moe_top_k=6, moe_d_mlp=1408, moe_shared_experts=2, moe_first_dense=1,
        moe_capacity_factor=0.0, norm_eps=1e-6)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "tiny-llama": tiny_llama,
    "small": small,
    "llama-tiny": llama_tiny,
    "gpt2-small": gpt2_small,
    "gpt2-medium": gpt2_medium,
    "gpt2-large": gpt2_large,
    "gpt2-xl": gpt2_xl,
    "llama-1b": llama_1b,
    "llama-7b": llama_7b,
    "llama-8b": llama_8b,
    "llama-70b": llama_70b,
    "llama-405b": llama_405b,
    "moe-tiny": moe_tiny,
    "moe-tiny-gpt2": moe_tiny_gpt2,
    "mixtral-8x7b": mixtral_8x7b,
    "deepseek-moe-16b": deepseek_moe_16b,
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown model '{name}'; presets: {', '.join(PRESETS)}") from None
