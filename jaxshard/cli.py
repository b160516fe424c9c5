"""Flags -> typed configs: one parser for every experiment, and one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

from jaxshard.checkpoint import CheckpointConfig
from jaxshard.data import DataConfig
from jaxshard.devices import KNOWN_DEVICES
from jaxshard.distributed import DistributedConfig
from jaxshard.errors import ConfigError, JaxshardError
from jaxshard.mesh import MeshSpec
from jaxshard.optim import OptimConfig
from jaxshard.parallel import pipeline
from jaxshard.remat import NAMES, Remat
from jaxshard.rules import Strategy
from jaxshard.runtime import DEFAULT_CACHE, RuntimeConfig
from jaxshard.train_step import DTYPES, StepConfig


@dataclass(frozen=True, slots=True)
class TrainConfig:
    model: str
    mesh: MeshSpec
    dcn_mesh: MeshSpec | None  # hosts' layout for a hybrid mesh
    strategy: Strategy
    optim: OptimConfig
    step: StepConfig
    data: DataConfig
    runtime: RuntimeConfig
    steps: int
    batch_size: int  # global, in sequences
    seq_len: int
    dropout: float | None  # None: the preset's
    vocab_multiple: int | None  # None: the preset's
    remat: Remat | None  # None: --remat auto, resolved by backend (remat.default_for)
    eval_every: int  # 0: only at the end
    eval_batches: int
    metrics: str | None
    report: str | None
    progress: bool
    device: str | None  # known accelerator name, for MFU (None: detect from the backend)
    peak_tflops: float | None  # dense peak per device, for MFU (overrides the device table)
    distributed: DistributedConfig
    checkpoint: CheckpointConfig
    export: str | None  # final params as .npz
    measure_bubble: bool = False  # after training, time each pipeline stage's work alone
    # ModelConfig moe_* fields the flags override: (field, value) pairs (the preset's otherwise)
    moe: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_batches"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ConfigError(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.device is not None and self.device.lower() not in KNOWN_DEVICES:
            raise ConfigError(f"unknown --device '{self.device}'; known: {', '.join(KNOWN_DEVICES)} "
                              "(or give --peak-tflops)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"--peak-tflops must be > 0, got {self.peak_tflops}")


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a transformer LM on a device mesh (DDP, ZeRO-1/2/3, FSDP, HSDP, "
                    "tensor, sequence, context and pipeline parallelism).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and mesh")
    g.add_argument("--model", default="tiny", help="preset name (see models/presets.py)")
    g.add_argument("--mesh", default="data=-1",
                   help="AXIS=SIZE,... over data, fsdp, stage, expert, sequence, tensor; "
                        "outermost first; one -1 fills the remaining devices")
    g.add_argument("--dcn-mesh", default=None,
                   help="hybrid mesh: how the hosts are laid out (e.g. data=4); --mesh then lays "
                        "out each host's devices, and each axis is the product of the two")
    g.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the data axis: 1 shards optimizer state, 2 also grads, "
                        "3 also params (the fsdp axis always shards all three)")
    g.add_argument("--fsdp-min-size", type=int, default=0,
                   help="params with fewer elements stay replicated under ZeRO/FSDP")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tensor > 1: split the residual stream's sequence over tensor "
                        "(the block all-reduces become reduce-scatter + all-gather)")
    g.add_argument("--vocab-multiple", type=int, default=None,
                   help="pad the vocab to a multiple of N (e.g. so tensor divides it); "
                        "padding logits are masked out of the loss")
    g.add_argument("--remat", default="auto",
                   help="activation checkpointing of the layer scan: auto (the fastest measured on "
                        "the backend: dots on CPU, none elsewhere), none, full, dots, dots_no_batch, "
                        "selective (recompute the attention core), names:N1,N2 (keep only these "
                        "activations), offload:N1,N2 (keep them in host memory); names: "
                        + ", ".join(NAMES))
    g.add_argument("--reshard-after-forward", type=_bool, default=True, metavar="true|false",
                   help="ZeRO-3/FSDP: gather each layer's weights again for its backward pass "
                        "instead of keeping all gathered layers from the forward pass")
    g.add_argument("--offload", default="none",
                   help="ZeRO-Offload: keep state in host memory between uses: optimizer (Adam's "
                        "moments and the float32 master copy), params (ZeRO-3/FSDP's shards), "
                        "optimizer,params, or none")
    g.add_argument("--pipeline-schedule", default=None, metavar="|".join(pipeline.SCHEDULES),
                   help="with a stage axis: naive (one microbatch through the stages in turn), "
                        "gpipe (all forwards, then all backwards), 1f1b (one forward and one "
                        "backward per tick: at most 2 x stages microbatches' activations kept), interleaved (1f1b over "
                        "--virtual-stages chunks per stage); default 1f1b")
    g.add_argument("--microbatches", type=int, default=None,
                   help="with a stage axis: microbatches per step (default: the stages; naive: 1); "
                        "the bubble is (stages - 1) / (virtual x microbatches + stages - 1)")
    g.add_argument("--virtual-stages", type=int, default=None,
                   help="interleaved: chunks of layers per stage, stage s holding chunks s, s + "
                        "stages, ... (default 2)")
    g.add_argument("--stage-layers", default=None, metavar="N1,N2,...",
                   help="layers of each (virtual) stage in pipeline order, e.g. 3,3,2 (default: "
                        "an even split)")
    g.add_argument("--balance", default=None, metavar="flops|profile",
                   help="choose --stage-layers so the slowest stage is fastest: from the FLOPs "
                        "model, or by timing a layer, the embedding and the head on this machine")
    g.add_argument("--measure-bubble", action="store_true",
                   help="with a stage axis, after training: time the step and each stage's own "
                        "work (the same executor on tables in which only that stage works) and "
                        "report the measured bubble beside the theory's (compiles stages + 3 "
                        "more programs)")
    g.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    m = p.add_argument_group("mixture of experts (override the preset's; see models/moe.py)")
    for flag, kind, text in MOE_FLAGS:
        m.add_argument(flag, type=kind, default=None, help=text)
    g.add_argument("--compute-dtype", default=None, choices=DTYPES,
                   help="dtype of matmuls (norms, softmax and the loss stay float32); default: "
                        "--param-dtype. float16 adds dynamic loss scaling")
    g.add_argument("--param-dtype", default="float32", choices=DTYPES,
                   help="dtype params and gradients are stored and communicated in; a 2-byte one "
                        "keeps a float32 master copy in the optimizer state (2+2+12 bytes/param)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="float16: the initial dynamic loss scale (default 32768)")
    g.add_argument("--loss-scale-period", type=int, default=None,
                   help="float16: finite steps before the loss scale doubles (default 2000)")

    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=100)
    g.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--grad-accum", type=int, default=1, help="microbatches per step")
    g.add_argument("--seed", type=int, default=0, help="drives init, data order and dropout")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int, default=20)
    g.add_argument("--decay-steps", type=int, default=None,
                   help="cosine decay length (default: --steps)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clip; 0 disables")

    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="text file (bytes are tokens) or uint16 .bin; default: the Python "
                        "standard library's source")
    g.add_argument("--val-fraction", type=float, default=0.05)
    g.add_argument("--eval-every", type=int, default=50, help="validation every N steps; 0: at the end")
    g.add_argument("--eval-batches", type=int, default=4)

    g = p.add_argument_group("outputs and runtime")
    g.add_argument("--device", default=None,
                   help="accelerator for MFU: h100, h200, a100-80gb, a100-40gb, v100 (default: "
                        "detected on GPUs; none on CPU)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak TFLOP/s per device for MFU (overrides --device)")
    g.add_argument("--metrics", default=None, help="JSON lines, one per step")
    g.add_argument("--report", default=None, help="JSON summary written at the end")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--cpu-devices", type=int, default=None,
                   help="force N host devices when running on CPU (acts before JAX starts)")
    g.add_argument("--platform", default=None, help="cpu, gpu or tpu (default: JAX's choice)")
    g.add_argument("--compile-cache", default=str(DEFAULT_CACHE),
                   help="persistent XLA compilation cache directory; '' disables")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, help="where sharded checkpoints go")
    g.add_argument("--save-every", type=int, default=0, help="steps between saves (0: at the end only)")
    g.add_argument("--keep", type=int, default=3, help="most recent checkpoints kept")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir, on any mesh")
    g.add_argument("--export", default=None, help="write the final params to this .npz (plain numpy)")

    g = p.add_argument_group("multi-process (one process per host; see the README)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--init-timeout", type=float, default=120.0,
                   help="seconds to wait for every process to join")
    return p


def parse_train(argv: Sequence[str] | None = None) -> TrainConfig:
    return train_config(train_parser().parse_args(argv))


def inspect_parser() -> argparse.ArgumentParser:
    p = train_parser()
    p.description = ("Compile one training step without running it and compare what each device "
                     "holds and sends with the strategy's accounting.")
    g = p.add_argument_group("inspection")
    g.add_argument("--strict", action="store_true", help="exit with status 1 if anything is flagged")
    g.add_argument("--no-unroll", action="store_true",
                   help="keep the layer scan rolled (faster to compile; XLA's FLOP count then "
                        "covers one layer of each loop)")
    return p


def _step_config(a: argparse.Namespace) -> StepConfig:
    compute = a.compute_dtype or a.param_dtype
    scale = {k: v for k, v in (("loss_scale", a.loss_scale), ("loss_scale_period", a.loss_scale_period))
             if v is not None}
    step = StepConfig(grad_accum=a.grad_accum, compute_dtype=compute, seed=a.seed,
                      param_dtype=a.param_dtype, pipeline_schedule=a.pipeline_schedule,
                      microbatches=a.microbatches, virtual_stages=a.virtual_stages,
                      stage_layers=_counts(a.stage_layers), balance=a.balance, **scale)
    if scale and not step.scaled:
        raise ConfigError("--loss-scale and --loss-scale-period apply to float16 training only "
                          "(--compute-dtype or --param-dtype float16)")
    return step


def _counts(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ConfigError(f"--stage-layers expects comma-separated layer counts like 3,3,2, got {text!r}") from None


MOE_FLAGS = (
    ("--moe-experts", int, "experts per MoE layer (0: a dense model); the expert axis splits them"),
    ("--moe-top-k", int, "experts per token: 1 is the hard (Switch) gate, >= 2 the sparse gate"),
    ("--moe-every", int, "every n-th layer is an MoE layer (the scan steps over groups of n)"),
    ("--moe-capacity-factor", float, "each expert takes at most ceil(c k S / E) of a sequence's "
     "S tokens' k choices, the rest dropped (their residual passes through); 0: dropless"),
    ("--moe-d-mlp", int, "an expert's hidden size (default the model's d_mlp; smaller: fine-grained)"),
    ("--moe-shared-experts", int, "experts every token passes through besides its routed ones"),
    ("--moe-aux-coef", float, "weight of the load-balancing loss E sum_e f_e P_e (logged as moe_load_balance)"),
    ("--moe-z-coef", float, "weight of the router z-loss mean logsumexp^2 (logged as moe_z_loss)"),
)


def _moe(a: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    fields = (flag[2:].replace("-", "_") for flag, _, _ in MOE_FLAGS)
    return tuple((f, getattr(a, f)) for f in fields if getattr(a, f) is not None)


def _offload(text: str) -> tuple[str, ...]:
    return () if text.strip().lower() == "none" else tuple(o.strip() for o in text.split(","))


def train_config(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=a.model,
        mesh=MeshSpec.parse(a.mesh),
        dcn_mesh=MeshSpec.parse(a.dcn_mesh) if a.dcn_mesh else None,
        strategy=Strategy(zero=a.zero, fsdp_min_size=a.fsdp_min_size,
                          sequence_parallel=a.sequence_parallel,
                          reshard_after_forward=a.reshard_after_forward,
                          offload=_offload(a.offload)),
        optim=OptimConfig(lr=a.lr, warmup_steps=a.warmup_steps,
                          total_steps=max(a.steps, 1) if a.decay_steps is None else a.decay_steps,
                          min_lr_ratio=a.min_lr_ratio,
                          b1=a.beta1, b2=a.beta2, weight_decay=a.weight_decay,
                          grad_clip=a.grad_clip),
        step=_step_config(a),
        data=DataConfig(path=a.data, val_fraction=a.val_fraction),
        runtime=RuntimeConfig(cpu_devices=a.cpu_devices, platform=a.platform,
                              compile_cache=a.compile_cache or None),
        steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, dropout=a.dropout,
        vocab_multiple=a.vocab_multiple,
        remat=None if a.remat == "auto" else Remat.parse(a.remat), eval_every=a.eval_every, eval_batches=a.eval_batches,
        metrics=a.metrics, report=a.report, progress=not a.no_progress, device=a.device,
        peak_tflops=a.peak_tflops,
        distributed=DistributedConfig.from_env(a.coordinator, a.num_processes, a.process_id, a.init_timeout),
        checkpoint=CheckpointConfig(directory=a.checkpoint_dir, save_every=a.save_every, keep=a.keep,
                                    resume=a.resume),
        export=a.export, measure_bubble=a.measure_bubble, moe=_moe(a))


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Bad input -> ``error: ...`` on stderr and exit status 2; Ctrl-C -> status 130."""
    try:
        yield
    except JaxshardError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
