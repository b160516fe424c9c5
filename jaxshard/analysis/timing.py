"""How long a training step takes on real accelerators: a model from shapes, the software's
kernels and the devices' measured rates, with nothing fitted to the runs it predicts.

A step's time on one device is the sum of

* **matmuls** -- the layers' projections, MLP and vocabulary head, forward, backward (twice the
  forward) and what the recompute policy runs again -- each on the roofline of its shape (a
  microbatch's tokens): its FLOPs at the bf16 rate measured at transformer-layer shapes
  (:attr:`Device.matmul_tflops`), or its operands and result through HBM, whichever is slower;
* **the attention core** -- materialised (Megatron 2021: ``QK^T`` and ``PV`` as batched
  matmuls per head, the full square, on their roofline; the scores through HBM) or a flash
  kernel (causal blocks skipped: half the square; the backward recomputes the scores, 2.5
  forwards; one forward more where the remat policy does not keep its output) at that
  kernel's measured rate by head width and sequence (:func:`flash_tflops`);
* **memory-bound work** -- norms, activations, softmax, dropout, residual adds -- priced by the
  bytes they move at HBM's measured rate: each activation a layer stores for the backward pass
  (Korthikanti et al. 2022's count, :func:`stored_bytes`) is written and read once in the
  forward pass, twice that in the backward, and once more per recompute; in an eager framework
  every elementwise op's own reads and writes (:func:`eager_bytes`); the loss's passes
  over the logits (:data:`LOSS_BYTES`); under XLA's layer scan the copies through its stacked
  buffers (:func:`scan_copy_bytes`); and the embedding gradient's scatter-add at its measured
  rate (:data:`EMBED_SCATTER`);
* **the optimizer** -- AdamW reads and writes the params and both moments and reads the
  gradients twice (the clipping's norm, the update), at HBM's rate;
* **communication** that the software does not hide behind compute: each collective of the
  accounting (:mod:`jaxshard.analysis.traffic`) priced as a ring over its group at NCCL's
  measured bus bandwidth over the slowest link it crosses -- NVLink within a host, and across
  hosts the NICs of the group's devices in each host (NCCL runs one ring per NIC, so a group
  with ``g`` devices per host crosses at ``g`` NICs' bandwidth, at most NVLink's) -- gradients
  in the dtype the software reduces them in; ZeRO-1/2's gather of the updated params follows
  the update and is never hidden; a gradient reduction the software overlaps hides behind the
  backward pass only (its gradients exist no sooner), a gather behind the whole step;
* **the pipeline bubble** -- (P - 1) / (V M) of the compute with P stages, V virtual stages per
  device and M microbatches -- and the stage-to-stage sends.

What the software does (:class:`Software`) is stated per code base with its source: which
attention kernel, whether the data-parallel reduction and FSDP's gathers overlap compute,
whether elementwise work is fused. Hidden communication is taken as free (it shares neither
SMs nor HBM with compute here), and a collective has no latency term: both are left out, not
fitted. Predictions are checked against published runs in ``scripts/bench_plan.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from jaxshard.analysis import accounting
from jaxshard.analysis.devices import KNOWN_DEVICES, Device
from jaxshard.analysis.traffic import Transfer
from jaxshard.parallel import attention as attention_lib
from jaxshard.axes import Dim
from jaxshard.errors import ConfigError
from jaxshard.model import Stageable
from jaxshard.remat import Kind, Remat
from jaxshard.rules import ShardingRules, StateKind

# Flash attention's forward + backward throughput, causal, head dim 128, counted as the
# kernel's FLOPs (causal half square, backward 2.5 forwards), measured. FlashAttention-2 (Dao
# 2023, arXiv 2307.08691, the fwd+bwd figures; the repository's
# assets/flash2_{a100,h100}_fwd_bwd_benchmark.png), sequence 8k: A100 182 TFLOP/s, H100 308.
# cuDNN on Hopper (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, sequence 16k): forward
# 539 causal (Fig. 5), backward 516 (Fig. 6) -- 3.5 forwards' FLOPs in 1/539 + 2.5/516 per
# TFLOP: 522. On Ampere cuDNN's flash kernel is FA2's algorithm (an assumption: not measured).
_FA2 = {"a100-80gb": 182.0, "a100-40gb": 182.0, "h100": 308.0, "h200": 308.0}
_CUDNN_HOPPER = 3.5 / (1 / 539 + 2.5 / 516)
FLASH_TFLOPS = {
    "fa2": _FA2,
    "cudnn": {"a100-80gb": _FA2["a100-80gb"], "a100-40gb": _FA2["a100-40gb"], "h100": _CUDNN_HOPPER,
              "h200": _CUDNN_HOPPER},
}
# cuDNN on Hopper by head width and sequence length, measured: jax.nn.dot_product_attention
# (implementation="cudnn", causal, bf16) forward + backward on an H100 SXM at 700 W,
# scripts/bench_gpu.py --parts attention (docs/bench/gpu.json; clocks logged, no thermal
# slowdown). Head width 128: 468 TFLOP/s at sequence 4096 (32 kv heads 475, 8 kv heads 462),
# 526 at 8192 (two machines: 519, 533), 548 at 16384 -- FA3's 522 above, at 16k, agrees within
# 5%. Head width 64: 388 at 8192. A sequence between two measured lengths takes the shorter's
# rate; one below 4096 the 4096 rate, an upper bound (shorter sequences run slower still).
# Ampere, and FA2 anywhere, keep the single figures above (head width 128, sequence 8k).
FLASH_TFLOPS_BY_SHAPE = {"cudnn": {"h100": {128: {4096: 468.0, 8192: 526.0, 16384: 548.0}, 64: {8192: 388.0}}}}
FLASH_TFLOPS_BY_SHAPE["cudnn"]["h200"] = FLASH_TFLOPS_BY_SHAPE["cudnn"]["h100"]  # the same chip's SMs
for _name in ("h100-hbm2e-500w", "h100-a3-high"):  # the same chip (at 700 W: an upper bound at 500 W)
    for _kernel in FLASH_TFLOPS.values():
        _kernel[_name] = _kernel["h100"]
    FLASH_TFLOPS_BY_SHAPE["cudnn"][_name] = FLASH_TFLOPS_BY_SHAPE["cudnn"]["h100"]


def flash_tflops(kernel: str, device: str, head_dim: int, seq_len: int) -> float | None:
    """A flash kernel's forward + backward TFLOP/s on ``device`` at ``head_dim`` and ``seq_len``:
    the measured rate of the nearest head width at or above it, at the longest measured
    sequence not above ``seq_len`` (the shortest for shorter ones); else the kernel's single
    figure (None: unknown)."""
    widths = FLASH_TFLOPS_BY_SHAPE.get(kernel, {}).get(device, {})
    if fits := [w for w in sorted(widths) if w >= head_dim]:
        by_seq = widths[fits[0]]
        below = [n for n in sorted(by_seq) if n <= seq_len]
        return by_seq[below[-1] if below else min(by_seq)]
    return FLASH_TFLOPS[kernel].get(device)


@dataclass(frozen=True)
class Software:
    """What a code base does that its step time depends on (facts about its code, not fits)."""

    name: str
    attention: str  # "materialized" (scores in HBM, fused scale-mask-softmax) or a FLASH_TFLOPS kernel
    overlap_data: bool  # the data-parallel reduction and FSDP's gathers run behind compute
    dropout: bool = False  # dropout masks stored and applied (Megatron 2021's GPT runs)
    # Gradients reduced once per step (DDP's no_sync, Megatron's accumulation buffers), or once
    # per microbatch as jaxshard's compiled accumulation scan does (the accounting's count).
    reduce_per_microbatch: bool = False
    # Elementwise work as separate kernels, each reading and writing HBM (PyTorch eager: norms,
    # rotary embeddings, SwiGLU, casts, kv-head repeats; :func:`eager_bytes`), not fused.
    eager: bool = False
    reduce_bytes: int | None = None  # the data-parallel gradients' dtype bytes (None: the compute dtype's)
    # HBM bytes per logit the loss moves beyond the head's matmuls (:data:`LOSS_BYTES`).
    loss_bytes: float = 0.0
    # XLA's layer scan: saved matmul outputs and the weights copied through the scan's stacked
    # buffers (:func:`scan_copy_bytes`).
    scan_copies: bool = False
    # The embedding's gradient a scatter-add of 2-byte rows (a gather from the table cast to the
    # compute dtype; :data:`EMBED_SCATTER`), not a sorted segment sum.
    embed_scatter: bool = False
    source: str = ""


# The cross-entropy over the logits, per logit per step, beyond the head matmul's own operands
# and its 2-byte result (the roofline's): what each code's loss reads and writes.
LOSS_BYTES = {
    # jaxshard (parallel/vocab.py, optax's softmax_cross_entropy_with_integer_labels under XLA):
    # the head writes float32 logits (2 bytes more than the roofline's result); the forward
    # reads them twice (max, sum of exponentials); the backward reads them once and writes the
    # gradient in bf16 for the head's backward matmuls: 2 + 4 + 4 + 4 + 2. On an H100 the
    # loss's kernels took 10.9 ms of a 4-layer 8B step (16,384 tokens x 128,256), this count's
    # 12 bytes of float32 passes 11.2 ms (docs/gpus.md).
    "xla-f32": 16.0,
    # Eager PyTorch, F.cross_entropy(logits.float(), ...) (torchtitan's loss; Megatron 2021's
    # vocab-parallel cross entropy is likewise a chain of kernels): the float() copy (read 2,
    # write 4), log_softmax (read 4, write 4), the backward's log_softmax gradient (read the
    # incoming gradient 4 and the output 4, write 4), its scatter of the targets' gradient
    # (write 4), and float()'s backward (read 4, write 2).
    "eager": 36.0,
}


# The embedding gradient's scatter-add of bf16 rows into the table (XLA:GPU's scatter with
# atomic adds), updates (token x d_model elements) per second, measured on an H100 SXM at 700 W
# in jaxshard's step (scripts/bench_gpu.py, its profile's ``input_scatter_fusion``;
# docs/bench/gpu.json) with token ids drawn at Zipf's law frequencies over the vocabulary, as
# text's are (the commoner ids' rows collide): 16,384 tokens x 4,096 into 32,000 rows in 4.55 ms
# (14.7e9 a second), 8,192 x 2,048 into 128,256 rows in 0.91 ms (18.4e9). By the measured
# vocabulary nearest the model's. Where none is measured, the scatter's bytes at HBM's rate (a
# lower bound: atomics on colliding rows run below it).
EMBED_SCATTER = {"h100": {32000: 14.7e9, 128256: 18.4e9}}
for _name in ("h100-hbm2e-500w", "h100-a3-high", "h200"):  # the same chip's atomics (H200: not measured)
    EMBED_SCATTER[_name] = EMBED_SCATTER["h100"]


def embed_scatter_s(device: Device, tokens: float, d_model: int, vocab: int, c: int = 2) -> float:
    """Seconds of the embedding gradient's scatter-add of ``tokens`` rows of ``d_model``."""
    if rates := EMBED_SCATTER.get(device.name):
        nearest = min(rates, key=lambda v: abs(v - vocab))
        return tokens * d_model / rates[nearest]
    return (2 * c * tokens * d_model + c * vocab * d_model) / device.hbm  # read the rows, add, zero the table


def scan_copy_bytes(cfg: Any, rules: ShardingRules, tokens: float, remat: Remat, c: int, param_bytes: int,
                    weights_split: int) -> float:
    """HBM bytes one layer's copies through XLA's layer scan move per step, per device: the
    outputs of library calls (cuBLAS's matmuls, cuDNN's attention) the layer saves for its
    backward pass are copied into the scan's stacked buffer in the forward pass and out of it
    in the backward (a kernel writes its own buffer, not a slice of the stack), and the
    backward pass copies the layer's weights out of the stacked params (split
    ``weights_split`` ways, as FSDP holds them); each copy read and written.

    Read from the optimized HLO of jaxshard's step on an H100 (Llama 2 7B's shape, 4 layers,
    ``dots_no_batch``): 7 such copies a layer forward and 14 backward, 28.8 GB a step; its
    memcpy kernels took 9.7 ms, this count's bytes at HBM's rate 9.7 ms. The 1B's (no recompute)
    and the 8B's (``selective``) copies took 11.7 and 10.1 ms, this count's 11.7 and 9.9
    (docs/gpus.md). An MoE layer is counted as a dense one of its ``d_mlp`` (not measured)."""
    saved = accounting.saved_library_outputs(cfg, rules, remat) * c * tokens
    weights = layer_weights(cfg, rules) * param_bytes / weights_split
    return 2 * (2 * saved + weights)


def layer_weights(cfg: Any, rules: ShardingRules) -> float:
    """One dense layer's matrix params per device, split over tensor."""
    t = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    return (cfg.d_model * (2 * q + 2 * kv) + (cfg.mlp_in + 1) * cfg.d_model * cfg.d_mlp) / t


SOFTWARE = {
    "megatron-2021": Software(
        "megatron-2021", "materialized", overlap_data=False, dropout=True, loss_bytes=LOSS_BYTES["eager"],
        source="Narayanan et al. 2021 (Megatron-LM, SC21): fused bias-GeLU, bias-dropout-add and "
               "scale-mask-softmax kernels; unfused attention; fp16 gradients all-reduced after the backward pass"),
    "torchtitan": Software(
        "torchtitan", "fa2", overlap_data=True, eager=True, reduce_bytes=4, loss_bytes=LOSS_BYTES["eager"],
        source="torchtitan (Liang et al. 2024, arXiv 2410.06511): SDPA's FlashAttention-2 kernel; FSDP2 "
               "prefetches the next layer's gather and reduce-scatters in float32 (reduce_dtype); without "
               "torch.compile every elementwise op is a kernel"),
    "maxtext": Software(
        "maxtext", "cudnn", overlap_data=True, reduce_bytes=4, loss_bytes=LOSS_BYTES["xla-f32"], scan_copies=True,
        embed_scatter=True,
        source="MaxText configs/a3 (GPU): cuDNN flash attention; float32 weights (weight_dtype) so float32 "
               "gradients; XLA fuses elementwise work and its latency-hiding scheduler overlaps collectives; "
               "the layers a scan (scan_layers); the embedding a gather from the table cast to the compute "
               "dtype (Embed, use_iota_embed off)"),
    "jaxshard": Software(
        "jaxshard", "cudnn", overlap_data=True, reduce_per_microbatch=True, loss_bytes=LOSS_BYTES["xla-f32"],
        scan_copies=True, embed_scatter=True,
        source="attention.gpu_kernel names cuDNN's flash kernel for 2-byte floats; XLA fuses elementwise "
               "work and overlaps collectives; the layers a scan; the embedding a gather from the table "
               "in the compute dtype (parallel/vocab.embed_lookup)"),
}


def eager_bytes(cfg: Any, tokens: int, tensor: int, c: int = 2) -> float:
    """HBM bytes one Llama layer's elementwise kernels move in a forward pass, per device, when
    each op is its own kernel (torchtitan's ``models/llama3/model.py`` run eagerly): per norm
    (RMSNorm in float32: cast, square, mean, scale, cast back, weight) 36 bytes per element read
    and written; rotary embeddings on q and k (cast to float32, complex multiply, cast back) 20;
    ``repeat_kv``'s copies of k and v to every query head; the attention output made contiguous;
    SwiGLU (SiLU, product) 10 per hidden element; the two residual adds 6. (The backward pass's
    kernels move about twice these, and a recompute these again: the caller's factor.)"""
    D, F, t = cfg.d_model, cfg.d_mlp, tensor
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    f32 = 4
    norm = (c + f32) + 2 * f32 + f32 + 2 * f32 + (f32 + c) + 2 * c  # per element, read and written
    rope = (c + f32) + (f32 + f32) + (f32 + c)
    repeat = 2 * (c * kv + c * q) if kv != q else 0
    per_token = 2 * norm * D + rope * (q + kv) / t + repeat / t + 2 * c * q / t + 5 * c * F / t + 2 * 3 * c * D
    return per_token * tokens


def stored_bytes(cfg: Any, tokens: int, seq_len: int, tensor: int, sp: bool, software: Software,
                 c: int = 2) -> float:
    """Activation bytes one layer stores for its backward pass, per device: Korthikanti et al.
    2022 (Sec. 4.1: sbh(34 + 5as/h), with tensor t sbh(10 + 24/t + 5as/(ht)), with SP all of it
    over t), generalised to grouped-query heads and SwiGLU and without dropout's masks where
    the software has none; a flash kernel stores no scores."""
    D, F, t = cfg.d_model, cfg.d_mlp, tensor
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    drop = 1 if software.dropout else 0  # a byte-per-element mask after attention and after the MLP
    # Replicated over tensor unless SP splits them: the two norms' inputs, the attention's and
    # the MLP's inputs, the two dropout masks (10 sbh in the paper).
    shared = c * 2 * D + c * D + c * D + drop * 2 * D
    split = c * (2 * q + 2 * kv)  # q and k for the scores, v, the output projection's input (8 sbh)
    split += c * (cfg.mlp_in + 1) * F  # the MLP's hidden values: GELU's input and output, SwiGLU's three
    scores = 0.0
    if software.attention == "materialized":
        scores = cfg.n_heads * seq_len * (c + drop * (1 + c))  # softmax output (+ dropout's mask and output)
    per_token = (shared / t if sp else shared) + (split + scores) / t
    return per_token * tokens


@dataclass
class StepTime:
    """One step on one device, in seconds, by part (``exposed``: communication not hidden)."""

    matmul: float
    attention: float
    memory_bound: float
    optimizer: float
    bubble: float
    exposed: dict[str, float] = field(default_factory=dict)  # by mesh axes, e.g. "tensor", "data+fsdp"
    hidden: dict[str, float] = field(default_factory=dict)  # communication behind compute
    flops: float = 0.0  # what the device computes, per step
    backward: float = 0.0  # of the compute, the backward pass's (what can hide gradient reductions)

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.memory_bound + self.optimizer

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.exposed.values())

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.total, "compute_s": self.compute, "matmul_s": self.matmul,
                "attention_s": self.attention, "memory_bound_s": self.memory_bound,
                "optimizer_s": self.optimizer, "bubble_s": self.bubble,
                "exposed_communication_s": dict(self.exposed), "hidden_communication_s": dict(self.hidden),
                "backward_s": self.backward, "flops_per_device": self.flops}


def group_bandwidth(t: Transfer, mesh: dict[str, int], device: Device) -> float:
    """Bytes/s a device's ring over ``t``'s group moves at: NCCL's measured ring bus bandwidth
    over NVLink within a host; across hosts the group's NICs in each host (one ring per NIC), at
    most NVLink's. Devices fill hosts in mesh order, the last axis fastest."""
    stride, inner = 1, {}
    for axis, size in reversed(list(mesh.items())):
        inner[axis] = stride
        stride *= size
    per_host = device.per_host
    span = max(inner[a] * mesh[a] for a in t.axes)  # the devices one group's index range covers
    if span <= per_host:
        return device.intra
    # The group's devices within one host: the product of its axes' parts that lie inside a host.
    in_host = 1
    for a in t.axes:
        in_host *= max(1, min(mesh[a], per_host // inner[a]))
    return min(device.intra, in_host * device.inter)


def stage_share(t: Transfer, stages: int) -> float:
    """The part of the accounting's collective ``t`` one pipeline stage runs: it counts every
    layer's activation collectives, of which a stage runs 1/P; a stage's params' gathers and
    gradient reductions (over data, fsdp) are its own shard's already."""
    return 1.0 if set(t.axes) & {"data", "fsdp", "stage"} else 1 / stages


def roofline(m: float, k: float, n: float, rate: float, hbm: float, c: int) -> float:
    """Seconds of an ``m x k`` by ``k x n`` matmul: its FLOPs at ``rate`` or its operands and
    result through HBM at ``hbm`` bytes/s, whichever takes longer (Williams et al. 2009)."""
    return max(2 * m * k * n / rate, c * (m * k + k * n + m * n) / hbm)


def attention_recomputed(remat: Remat, materialized: bool = False) -> float:
    """Whether the backward pass runs the attention core's forward again: under every policy
    but ``none``. A fused kernel is a custom call, not a matmul ``dots`` keeps, and its backward
    needs its softmax statistics, which no ``names`` policy keeps (``attn_out`` is its output
    alone); ``selective`` recomputes exactly it. Materialised attention's ``q k^T`` and ``p v``
    are batched matmuls, which ``dots`` keeps (``dots_no_batch`` does not)."""
    if remat.kind == Kind.NONE or (materialized and remat.kind == Kind.DOTS):
        return 0.0
    return 1.0


def recomputed(remat: Remat) -> float:
    """The share of a layer's forward matmuls the backward pass runs again: none where every
    matmul output is kept (or only the attention core is recomputed), all of them otherwise
    (names/offload keep a few outputs; counted as full, as the accounting's FLOPs do)."""
    return 0.0 if remat.kind in (Kind.NONE, Kind.DOTS, Kind.SELECTIVE, Kind.DOTS_NO_BATCH) else 1.0


def unpriced_attention(rules: ShardingRules, software: Software, compute_dtype: str) -> str | None:
    """Why :func:`step_time` has no rate for the attention ``software`` would run here, or
    None: flash kernels take 2-byte floats, and jaxshard's ring context parallelism computes
    attention as online-softmax blocks of XLA's, whose rate is not measured."""
    if software.attention != "materialized" and accounting.dtype_bytes(compute_dtype) != 2:
        return (f"{software.name}'s attention is {software.attention}'s flash kernel, which takes 2-byte floats: "
                f"no rate is known for --compute-dtype {compute_dtype} attention")
    if software.name == "jaxshard" and attention_lib.ring_size(rules) > 1:
        return ("ring context parallelism computes attention as XLA's online-softmax blocks, whose rate is not "
                "measured (only cuDNN's flash kernel's is)")
    return None


def step_time(model: Stageable, rules: ShardingRules, device: Device,
              batch_size: int, seq_len: int, *, software: Software, compute_dtype: str = "bfloat16",
              param_dtype: str | None = None, remat: Remat = Remat.NONE, recompute: float | None = None,
              attention_recompute: float | None = None, microbatches: int = 1, virtual_stages: int = 1,
              grad_accum: int = 1) -> StepTime:
    """The predicted step time of ``model`` under ``rules`` on ``device``s laid out as the
    rules' mesh (outermost first; devices fill hosts in that order). ``microbatches`` and
    ``virtual_stages``: a pipeline's, with a stage axis;
    ``grad_accum``: microbatches without one. ``recompute`` overrides the share of forward
    matmuls the remat policy runs again (a policy of another code base, e.g. torchtitan's
    selective "op" policy recomputes every second matmul: 0.5); ``attention_recompute`` the
    share of the attention core's forward it runs again (that policy keeps the attention
    kernel's output: 0)."""
    if why := unpriced_attention(rules, software, compute_dtype):
        raise ConfigError(f"the time model cannot price this step: {why}")
    cfg, mesh = model.cfg, {str(a): int(n) for a, n in rules.mesh.shape.items()}
    c = accounting.dtype_bytes(compute_dtype)
    param_dtype = param_dtype or compute_dtype
    remat = Remat.parse(remat)
    again = recomputed(remat) if recompute is None else recompute
    attn_again = (attention_recomputed(remat, software.attention == "materialized") if attention_recompute is None
                  else attention_recompute)
    stages = mesh.get("stage", 1)
    tensor = rules.size(rules.activation_mesh_axes(Dim.ACT_HEADS))
    sp = rules.size(rules.activation_mesh_axes(Dim.RESIDUAL_LENGTH)) > rules.size(rules.activation_mesh_axes(Dim.LENGTH))
    cp = rules.size(rules.activation_mesh_axes(Dim.LENGTH))
    tokens = batch_size * seq_len // rules.size(rules.batch_axes) // cp  # this device's, per step
    L, layers = seq_len, cfg.n_layers / stages

    # Matmuls: the layers' and the head's (the head on one stage: the last stage's extra work
    # sets the pace; counted on every stage as the slowest one).
    fl = accounting.flops(cfg, rules, batch_size, seq_len, remat=Remat.NONE)
    layer_matmul = (fl.matmul_per_token - 2 * cfg.d_model * cfg.padded_vocab) / cfg.n_layers / tensor
    head = 2 * cfg.d_model * cfg.padded_vocab / tensor
    matmul_flops = tokens * ((3 + again) * layer_matmul * layers + 3 * head)
    rate = device.matmul_flops(compute_dtype)
    if device.hbm is None:
        raise ConfigError(f"the time model needs {device.name}'s HBM bandwidth; known devices: "
                          f"{', '.join(KNOWN_DEVICES)}")
    # Each matmul on the roofline of its shape (a microbatch's tokens): its FLOPs at the matmul
    # rate, or its operands and result through HBM, whichever is slower. The layers' matmuls run
    # at their projections' mean slowdown.
    m = tokens // max(microbatches if stages > 1 else 1, grad_accum)
    q, kv, D = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.d_model
    shapes = [(D, (q + 2 * kv) / tensor), (q / tensor, D), (D, cfg.mlp_in * cfg.d_mlp / tensor),
              (cfg.d_mlp / tensor, D)]
    slowdown = (sum(roofline(m, k, n, rate, device.hbm, c) for k, n in shapes)
                / sum(2 * m * k * n / rate for k, n in shapes))
    head_s = roofline(m, D, cfg.padded_vocab / tensor, rate, device.hbm, c) * tokens / m
    matmul_s = tokens * (3 + again) * layer_matmul * layers / rate * slowdown + 3 * head_s

    # The attention core, per layer per token, forward: 4 L q (the full square).
    square = 4 * L * cfg.n_heads * cfg.d_head / tensor / cp
    if software.attention == "materialized":  # per head, q k^T and p v as batched matmuls
        attention_flops = tokens * layers * square * (3 + attn_again)
        backward_attention = 2 + attn_again  # forwards' worth in the backward pass, against the forward's one
        dh, heads = cfg.d_head, cfg.n_heads / tensor / cp
        per_head = roofline(L / cp, dh, L, rate, device.hbm, c) + roofline(L / cp, L, dh, rate, device.hbm, c)
        attention_s = tokens / (L / cp) * heads * layers * (3 + attn_again) * per_head
    else:
        kernel = flash_tflops(software.attention, device.name, cfg.d_head, L)
        if kernel is None:
            raise ConfigError(f"no {software.attention} attention throughput is known for {device.name}; "
                              f"known: {', '.join(FLASH_TFLOPS[software.attention])}")
        attention_flops = tokens * layers * square / 2 * (3.5 + attn_again)
        attention_s = attention_flops / (kernel * 1e12)
        backward_attention = 2.5 + attn_again

    # Memory-bound work: the stored activations written and read, forward, recompute, backward.
    hbm = device.hbm
    stored = stored_bytes(cfg, tokens, L, tensor, sp, software, c) * layers
    memory_s = stored * (2 + 2 * again + 4) / hbm
    if software.eager:  # every elementwise op its own kernel: forward, recompute, backward (2x)
        memory_s = eager_bytes(cfg, tokens, tensor, c) * layers * (1 + again + 2) / hbm
    # The backward pass's part of what is counted so far (a gradient reduction overlaps no more).
    memory_bwd = memory_s * (2 + again) / (3 + again) if software.eager else stored * (4 + 2 * again) / hbm
    memory_s += software.loss_bytes * tokens * cfg.padded_vocab / tensor / hbm  # the loss (last stage's)
    if software.scan_copies:  # forward and backward halves (each layer's saved outputs, its weights)
        weights_split = rules.size(rules.state_axes(StateKind.PARAMS))  # as FSDP / ZeRO-3 holds them
        copies = scan_copy_bytes(cfg, rules, tokens, remat, c, accounting.dtype_bytes(param_dtype), weights_split)
        memory_s += copies * layers / hbm
        memory_bwd += copies * layers / hbm / 2
    if software.embed_scatter:  # the first stage's (every stage counted as the slowest)
        scatter = embed_scatter_s(device, tokens, cfg.d_model, cfg.padded_vocab, c)
        memory_s += scatter
        memory_bwd += scatter

    mem = accounting.memory(model, rules, batch_size, seq_len, compute_dtype=compute_dtype, remat=remat,
                            grad_accum=grad_accum * microbatches, param_dtype=param_dtype)
    # AdamW reads and writes the params and both moments; the gradients are read twice, by the
    # clipping's global norm and by the update.
    optimizer_s = (2 * mem.opt_state + 2 * mem.grads + 2 * mem.params) / hbm

    compute = matmul_s + attention_s + memory_s + optimizer_s
    matmul_bwd = (tokens * (2 + again) * layer_matmul * layers / rate * slowdown + 2 * head_s)
    attention_bwd = attention_s * (backward_attention / (backward_attention + 1))
    backward = matmul_bwd + attention_bwd + memory_bwd
    # Pipeline: (P - 1) / (V M) of the stage's compute idles.
    bubble = compute * (stages - 1) / (virtual_stages * microbatches) if stages > 1 else 0.0

    # (Split into microbatches or not, the activations' collectives add up to the same bytes.)
    split = max(grad_accum, microbatches if stages > 1 else 1) if software.reduce_per_microbatch else 1
    comm = accounting.communication(model, rules, batch_size, seq_len, compute_dtype=compute_dtype,
                                    remat=remat, grad_accum=split, param_dtype=param_dtype)
    exposed: dict[str, float] = {}
    hidden: dict[str, float] = {}
    reductions = 0.0  # of the hidden: the gradients' reductions, which only the backward pass can hide
    behind = {"data", "fsdp"} if software.overlap_data else set()
    for t in comm.transfers:
        sent = t.sent_bytes
        gradients = t.kind != "all-gather" and set(t.axes) <= {"data", "fsdp"}
        if software.reduce_bytes and gradients:
            sent = sent * software.reduce_bytes / c  # the gradients, reduced in the software's dtype
        seconds = sent / group_bandwidth(t, mesh, device) * stage_share(t, stages)
        name = "+".join(t.axes)
        where = hidden if set(t.axes) <= behind and not t.after_update else exposed
        where[name] = where.get(name, 0.0) + seconds
        if where is hidden and gradients:
            reductions += seconds
    if stages > 1:  # a microbatch's activations (and their gradients) to the next stage, per chunk
        act = c * tokens // microbatches * cfg.d_model / tensor  # Megatron's scatter-gather: 1/t each
        hops = 2 * virtual_stages * microbatches
        bw = group_bandwidth(Transfer("collective-permute", ("stage",), 0, 1, "", stages), mesh, device)
        exposed["stage"] = exposed.get("stage", 0.0) + hops * act / bw
    # What overlaps compute shows only where it outlasts it: all of it the step's compute, the
    # gradients' reductions the backward pass (a gradient exists only once its layer's backward
    # has run, and the optimizer needs them all; the pipeline's stages drain first).
    overflow = max(sum(hidden.values()) - compute, reductions - backward)
    if overflow > 0:
        exposed["overlap overflow"] = overflow
    return StepTime(matmul=matmul_s, attention=attention_s, memory_bound=memory_s, optimizer=optimizer_s,
                    bubble=bubble, exposed=exposed, hidden=hidden, flops=matmul_flops + attention_flops,
                    backward=backward)


def with_software(software: str | Software, **changes: Any) -> Software:
    base = SOFTWARE[software] if isinstance(software, str) else software
    return replace(base, **changes)


def model_flops_per_token(cfg: Any, seq_len: int) -> dict[str, float]:
    """Two published counts of a step's FLOPs per token, the ones runs report TFLOP/s by:
    Megatron's Eq. 3 (Narayanan et al. 2021: 96 B s l h^2 (1 + s/6h + V/16lh) over B s
    tokens; a GPT layer, full recompute counted) and 6N + causal attention (MaxText's: N the
    matmul params a token passes through, the vocabulary projection included, plus 6 l s q)."""
    h, l, V, s = cfg.d_model, cfg.n_layers, cfg.padded_vocab, seq_len
    q = cfg.n_heads * cfg.d_head
    megatron = 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    layer = h * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head + q * h + (cfg.mlp_in + 1) * h * cfg.d_mlp
    return {"megatron_eq3": megatron, "6n_causal_attention": 6 * (l * layer + h * V) + 6 * l * s * q}
