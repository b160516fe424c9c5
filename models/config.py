"""Typed, validated model configuration. The family presets live in ``presets.py``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

from jaxshard.errors import ConfigError


MOE_BALANCE = ("aux", "bias", "both")  # how MoE layers balance their experts' load
# Dropless experts' grouped matmuls (jaxshard.parallel.grouped): auto is tiled on CPU, ragged elsewhere.
MOE_KERNELS = ("auto", "tiled", "ragged", "triton")


class Norm(StrEnum):
    LAYER = "layernorm"
    RMS = "rmsnorm"


class Mlp(StrEnum):
    GELU = "gelu"  # GPT-2: up, GELU, down
    SWIGLU = "swiglu"  # Llama: gate * up, SiLU, down


class Positions(StrEnum):
    LEARNED = "learned"  # GPT-2: a learned table of max_seq_len rows
    ROPE = "rope"  # Llama: rotary embedding of q and k


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling ("rope_type": "llama3" in Hugging Face configs):
    wavelengths longer than ``original_max_len / low_freq_factor`` are stretched by ``factor``,
    shorter than ``original_max_len / high_freq_factor`` kept, and those between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_len < 1 or not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"llama3 rope scaling needs factor > 0, original_max_len >= 1 and "
                              f"0 < low_freq_factor < high_freq_factor, got {self}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer. ``n_kv_heads < n_heads`` is grouped-query attention."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    vocab_size: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None: = n_heads
    d_head: int | None = None  # None: d_model // n_heads
    norm: Norm = Norm.LAYER
    mlp: Mlp = Mlp.GELU
    positions: Positions = Positions.LEARNED
    use_bias: bool = True
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None  # None: plain rotary frequencies
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    vocab_multiple: int = 1  # pad the vocab to a multiple (Megatron's divisible-by), e.g. for TP
    # Packed documents (--packing): the id that ends each document of a training sequence;
    # attention stays within documents, positions restart, the target after it is not counted.
    documents_eot: int | None = None
    # Mixture of experts (models/moe.py): 0 experts is a dense model.
    moe_experts: int = 0
    moe_top_k: int = 2  # 1: the hard (Switch) gate; >= 2: the sparse gate, renormalised
    moe_every: int = 1  # every n-th layer (after the first dense ones) is an MoE layer
    moe_first_dense: int = 0  # the first layers stay dense (DeepSeek's first_k_dense_replace)
    moe_capacity_factor: float = 1.25  # 0: dropless
    moe_d_mlp: int | None = None  # an expert's hidden size (None: d_mlp; smaller: fine-grained)
    moe_shared_experts: int = 0  # experts every token passes through (DeepSeek), of moe_d_mlp each
    moe_aux_coef: float = 0.01  # load-balancing loss coefficient
    moe_z_coef: float = 0.001  # router z-loss coefficient
    # How the load is balanced: "aux" (the load-balancing loss), "bias" (DeepSeek-V3's
    # auxiliary-loss-free routing bias, moved by moe_bias_rate a step towards the mean load) or
    # "both".
    moe_balance: str = "aux"
    moe_bias_rate: float = 0.001  # DeepSeek-V3's bias update speed gamma
    moe_kernel: str = "auto"  # dropless experts' grouped matmuls: one of MOE_KERNELS
    # The blocks' linear layers (attention projections, MLP) in float8 with this scaling recipe
    # (jaxshard.fp8: "tensorwise", "rowwise" or "delayed"); None: in the compute dtype.
    fp8: str | None = None

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "d_mlp", "vocab_size", "max_seq_len"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model {self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"model {self.name}: d_model {self.d_model} is not divisible by "
                                  f"n_heads {self.n_heads}; set d_head")
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model {self.name}: n_heads {self.n_heads} is not a multiple of "
                              f"n_kv_heads {self.n_kv_heads}")
        if self.positions is Positions.ROPE and self.d_head % 2:
            raise ConfigError(f"model {self.name}: rotary embeddings need an even d_head, got {self.d_head}")
        if self.vocab_multiple < 1:
            raise ConfigError(f"--vocab-multiple must be >= 1, got {self.vocab_multiple}")
        if self.moe_experts:
            self._check_moe()
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model {self.name}: dropout must be in [0, 1), got {self.dropout}")
        if self.fp8 is not None:
            self._check_fp8()

    def _check_fp8(self) -> None:
        from jaxshard.fp8 import RECIPES

        if self.fp8 not in RECIPES:
            raise ConfigError(f"--fp8 must be one of {', '.join(RECIPES)}, got {self.fp8!r}")
        if self.moe_experts:
            raise ConfigError("--fp8 with MoE layers is not implemented yet (the experts' grouped matmuls "
                              "have no float8 path)")

    def _check_moe(self) -> None:
        E, k = self.moe_experts, self.moe_top_k
        if E < 2:
            raise ConfigError(f"--moe-experts must be 0 (dense) or >= 2, got {E}")
        if not 1 <= k <= E:
            raise ConfigError(f"--moe-top-k must be between 1 and the experts ({E}), got {k}")
        if not 0 <= self.moe_first_dense < self.n_layers:
            raise ConfigError(f"model {self.name}: moe_first_dense must be in [0, {self.n_layers}), "
                              f"got {self.moe_first_dense}")
        rest = self.n_layers - self.moe_first_dense
        if self.moe_every < 1 or rest % self.moe_every:
            raise ConfigError(f"--moe-every {self.moe_every} must be >= 1 and divide the model's "
                              f"{rest} layers" + (f" after the first {self.moe_first_dense} dense ones"
                                                  if self.moe_first_dense else ""))
        if self.moe_shared_experts < 0:
            raise ConfigError(f"--moe-shared-experts must be >= 0, got {self.moe_shared_experts}")
        if self.moe_capacity_factor < 0:
            raise ConfigError(f"--moe-capacity-factor must be >= 0 (0: dropless), got {self.moe_capacity_factor}")
        if self.moe_d_mlp is not None and self.moe_d_mlp < 1:
            raise ConfigError(f"model {self.name}: moe_d_mlp must be >= 1, got {self.moe_d_mlp}")
        if self.moe_aux_coef < 0 or self.moe_z_coef < 0:
            raise ConfigError("--moe-aux-coef and --moe-z-coef must be >= 0")
        if self.moe_balance not in MOE_BALANCE:
            raise ConfigError(f"--moe-balance must be one of {', '.join(MOE_BALANCE)}, got {self.moe_balance!r}")
        if self.moe_bias_rate < 0:
            raise ConfigError(f"--moe-bias-rate must be >= 0, got {self.moe_bias_rate}")
        if self.moe_router_bias and self.moe_bias_rate == 0:
            raise ConfigError(f"--moe-balance {self.moe_balance} with --moe-bias-rate 0 never moves the routing "
                              f"bias: " + ("nothing would balance the experts" if self.moe_balance == "bias"
                                           else "use --moe-balance aux"))
        if self.moe_kernel not in MOE_KERNELS:
            raise ConfigError(f"--moe-kernel must be one of {', '.join(MOE_KERNELS)}, got {self.moe_kernel!r}")
        if self.moe_kernel != "auto" and not (self.moe_experts and self.moe_capacity_factor == 0):
            raise ConfigError(f"--moe-kernel {self.moe_kernel} chooses dropless experts' kernel: it needs MoE "
                              "layers with --moe-capacity-factor 0")

    @property
    def moe_router_bias(self) -> bool:
        """Whether MoE layers route with DeepSeek-V3's load-balancing bias."""
        return bool(self.moe_experts) and self.moe_balance in ("bias", "both")

    @property
    def moe_aux_weight(self) -> float:
        """The load-balancing loss's weight in the differentiated loss (0 under bias alone)."""
        return 0.0 if self.moe_balance == "bias" else self.moe_aux_coef

    @property
    def n_moe_layers(self) -> int:
        """MoE layers: the last of every group of ``moe_every`` after the first dense ones."""
        return (self.n_layers - self.moe_first_dense) // self.moe_every if self.moe_experts else 0

    def moe_capacity(self, group: int) -> int:
        """Choices each expert takes per group of ``group`` tokens: ceil(c k S / E); 0 when
        dropless (c = 0)."""
        c = self.moe_capacity_factor
        return 0 if c == 0 else max(1, math.ceil(c * self.moe_top_k * group / self.moe_experts))

    def is_moe_layer(self, layer: int) -> bool:
        return (bool(self.moe_experts) and layer >= self.moe_first_dense
                and (layer - self.moe_first_dense + 1) % self.moe_every == 0)

    @property
    def mlp_in(self) -> int:
        """The MLP's input projections: 2 for SwiGLU (gate and up), 1 for GELU's up."""
        return 2 if self.mlp is Mlp.SWIGLU else 1

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding table: vocab_size rounded up to vocab_multiple. The padding
        rows are never looked up and their logits are masked out of the loss."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_shape(self, **shape) -> ModelConfig:
        """This config with shape fields overridden: the head width follows d_model and n_heads
        unless given, and multi-head attention stays multi-head when n_heads changes."""
        if "d_model" in shape or "n_heads" in shape:
            shape.setdefault("d_head", None)
        if "n_heads" in shape and self.n_kv_heads == self.n_heads:
            shape.setdefault("n_kv_heads", None)
        return self.replace(**shape)

    def to_dict(self) -> dict:
        """Plain JSON values (reports, checkpoints); :meth:`from_dict` reads them back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update({k: str(out[k]) for k in ("norm", "mlp", "positions")})
        if self.rope_scaling is not None:
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        values = dict(values)
        for key, kind in (("norm", Norm), ("mlp", Mlp), ("positions", Positions)):
            if key in values:
                values[key] = kind(values[key])
        if values.get("rope_scaling") is not None:
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)
