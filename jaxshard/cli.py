"""Flags -> typed configs: one parser for every experiment, and one-line errors."""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from jaxshard.analysis.devices import KNOWN_DEVICES
from jaxshard.data.corpus import DataConfig
from jaxshard.distributed import DistributedConfig
from jaxshard.errors import ConfigError, JaxshardError
from jaxshard.mesh import MeshSpec
from jaxshard.parallel import pipeline
from jaxshard.remat import NAMES, Remat
from jaxshard.rules import Strategy
from jaxshard.runtime import DEFAULT_CACHE, RuntimeConfig
from jaxshard.training.checkpoint import CheckpointConfig
from jaxshard.training.optim import OptimConfig
from jaxshard.training.step import DTYPES, StepConfig


SAMPLE_PROMPT = "\n"  # the final sample's default prompt


@dataclass(frozen=True, slots=True)
class TrainConfig:
    model: str | None  # a preset (None: --init-from's, or tiny)
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
    # ModelConfig shape fields the flags override (n_layers, d_model, ...): (field, value) pairs
    shape: tuple[tuple[str, object], ...] = ()
    sync_every: int | None = None  # local SGD: average the data replicas every H steps (None: DDP)
    init_from: str | None = None  # a Hugging Face model folder to start from
    export_hf: str | None = None  # write the final params as a Hugging Face model folder
    log_every: int = 0  # a log line every N steps; 0: about ten over the run
    tensorboard: str | None = None  # TensorBoard event files go here
    profile_steps: str | None = None  # "A:B": a jax.profiler trace of steps A..B
    profile_dir: str | None = None
    sample_tokens: int = 0  # after training, generate this many tokens from sample_prompt
    sample_prompt: str = SAMPLE_PROMPT
    flags: dict | None = None  # every flag's effective value (the config file's and the command line's)

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
        if self.log_every < 0 or self.sample_tokens < 0:
            raise ConfigError("--log-every and --sample-tokens must be >= 0")
        if self.sample_prompt != SAMPLE_PROMPT and not self.sample_tokens:
            raise ConfigError("--sample-prompt is the prompt of --sample-tokens N's sample; add it")
        if self.init_from and self.model:
            raise ConfigError("--model and --init-from both name the model: give one")
        if self.init_from and self.shape:
            flags = ", ".join("--" + k.replace("_", "-") for k, _ in self.shape)
            raise ConfigError(f"{flags}: the shape of an --init-from model is its checkpoint's")
        if self.init_from and self.moe:
            raise ConfigError("--moe-* flags: Hugging Face import covers dense GPT-2 and Llama models")

    @property
    def model_name(self) -> str:
        return self.model or "tiny"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown flag, a value of the wrong type) are
    :class:`ConfigError`s: one line on stderr and status 2 under :func:`one_line_errors`, like
    every other bad input, not argparse's usage block."""

    def error(self, message: str):
        raise ConfigError(message)


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def train_parser() -> argparse.ArgumentParser:
    p = Parser(
        description="Train a transformer LM on a device mesh (DDP, ZeRO-1/2/3, FSDP, HSDP, "
                    "tensor, sequence, context and pipeline parallelism).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="a TOML file of flags (keys are the flags' names, e.g. batch_size = 32); "
                        "flags on the command line override it")
    g = p.add_argument_group("model and mesh")
    g.add_argument("--model", default=None, help="preset name (see models/presets.py; default tiny)")
    g.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="start from a local Hugging Face GPT-2 or Llama folder (config.json + "
                        "*.safetensors): its shape, its weights read straight into their shardings")
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
    g.add_argument("--strategy", default="gspmd", choices=("gspmd", "explicit"),
                   help="gspmd: the partitioner places the collectives; explicit: the data-parallel "
                        "step written with shard_map, reducing its gradients itself in buckets like "
                        "DDP's Reducer (an all-reduce per bucket; a reduce-scatter per bucket, "
                        "explicit ZeRO-2, with --zero 1/2; data-only meshes)")
    g.add_argument("--bucket-mb", type=float, default=None,
                   help="--strategy explicit: MB of gradients per bucket, filled in reverse layer order "
                        "(default 25, DDP's)")
    g.add_argument("--sync-every", type=int, default=None, metavar="H",
                   help="local SGD: each data replica steps on its own rows and the replicas (params "
                        "and Adam moments) are averaged every H steps, those steps DDP steps; H = 1 is "
                        "DDP (data-only meshes)")
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
    s = p.add_argument_group("model shape (override the preset's fields)")
    for flag, kind, text in SHAPE_FLAGS:
        s.add_argument(flag, type=kind, default=None, help=text)
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
                   help="a text file, a folder of .txt/.md/.py files (one document each), a "
                        ".tokens file or a uint16 .bin; default: the Python standard library's source")
    g.add_argument("--tokenizer", default=None, metavar="bytes|bpe:N|PATH",
                   help="bytes (ids are UTF-8 bytes), bpe:N (a byte-level BPE of N tokens trained on "
                        "the training split), or a tokenizer.json (or a folder holding one); default: "
                        "the --init-from folder's tokenizer.json if it has one, else bytes")
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
    g.add_argument("--log-every", type=int, default=0,
                   help="print a line (loss, tokens/s, MFU) every N steps; 0: about ten per run")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars (loss, val loss, lr, grad norm, tokens/s, MFU)")
    g.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="record a jax.profiler trace of steps A to B into --profile-dir")
    g.add_argument("--profile-dir", default=None, metavar="DIR")
    g.add_argument("--sample-tokens", type=int, default=0,
                   help="after training, generate N tokens from --sample-prompt and print them")
    g.add_argument("--sample-prompt", default=SAMPLE_PROMPT, help="the prompt of the final sample")
    g.add_argument("--cpu-devices", type=int, default=None,
                   help="force N host devices when running on CPU (acts before JAX starts)")
    g.add_argument("--platform", default=None, help="cpu, gpu or tpu (default: JAX's choice)")
    g.add_argument("--compile-cache", default=str(DEFAULT_CACHE),
                   help="persistent XLA compilation cache directory; '' disables")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, help="where sharded checkpoints go")
    g.add_argument("--save-every", type=int, default=0, help="steps between saves (0: at the end only)")
    g.add_argument("--keep", type=int, default=None, help="most recent checkpoints kept (default 3)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir, on any mesh")
    g.add_argument("--export", default=None, help="write the final params to this .npz (plain numpy)")
    g.add_argument("--export-hf", default=None, metavar="DIR",
                   help="write the final model as a Hugging Face folder (config.json, safetensors, "
                        "tokenizer.json) that transformers loads as it is")

    g = p.add_argument_group("multi-process (one process per host; see the README)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--init-timeout", type=float, default=None,
                   help="seconds to wait for every process to join (default 120)")
    return p


def parse_train(argv: Sequence[str] | None = None) -> TrainConfig:
    return train_config(parse_with_config(train_parser(), argv))


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser``'s flags, with ``--config FILE.toml`` giving any of them (flags on the command
    line win). TOML: typed values and comments in the standard library (``tomllib``); keys are
    the flags' names (``batch_size`` or ``batch-size``), at the top or in tables of any name
    (for grouping). An unknown key or a wrong type is an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**read_config_file(parser, known.config))
    return parser.parse_args(argv)


def read_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """The flag values a TOML file sets, checked against ``parser``'s flags and types."""
    import tomllib

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    flat: dict[str, object] = {}
    for key, value in table.items():
        for k, v in (value.items() if isinstance(value, dict) else [(key, value)]):
            flat[k.replace("-", "_")] = v
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values = {}
    for key, value in flat.items():
        if key not in actions:
            raise ConfigError(f"--config {path}: unknown key '{key}' (keys are the flags' names, "
                              "e.g. batch_size)")
        values[key] = _typed(actions[key], value, f"--config {path}: {key}")
    return values


def _typed(action: argparse.Action, value: object, where: str) -> object:
    """``value`` as the flag would have parsed it; an error if it is of the wrong type."""
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    kind = action.type or str
    wanted = {int: (int,), float: (int, float), str: (str,), _bool: (bool,)}.get(kind)
    if wanted is None or isinstance(value, bool) and bool not in wanted or not isinstance(value, wanted):
        name = {int: "an integer", float: "a number", str: "a string", _bool: "true or false"}.get(kind, "a value")
        raise ConfigError(f"{where} must be {name}, got {value!r}")
    value = float(value) if kind is float else value
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


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


# Flags of a training run that compiling one step does not use (data, evaluation, outputs,
# checkpoints, processes): inspect.py rejects them on its command line. (A --config file may
# set them: it describes the whole run.)
TRAINING_ONLY = ("data", "tokenizer", "val_fraction", "eval_every", "eval_batches", "metrics", "report",
                 "no_progress", "log_every", "tensorboard", "profile_steps", "profile_dir", "sample_tokens",
                 "sample_prompt", "device", "peak_tflops", "checkpoint_dir", "save_every", "keep", "resume",
                 "export", "export_hf", "measure_bubble", "coordinator", "num_processes", "process_id",
                 "init_timeout")


def check_compile_only(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """One line for a training-only flag given to a command that compiles a step without
    running it (the defaults here are the config file's, if any)."""
    if a.tokenizer not in (None, "bytes"):  # from a config file too: it would change the model
        raise ConfigError(f"--tokenizer {a.tokenizer}: inspect.py compiles the step without reading data; "
                          "give --vocab-size for the tokenizer's vocabulary")
    for dest in TRAINING_ONLY:
        if getattr(a, dest) != parser.get_default(dest):
            flag = "--" + dest.replace("_", "-")
            hint = " (give --vocab-size for a tokenizer's vocabulary)" if dest in ("data", "tokenizer") else ""
            raise ConfigError(f"{flag} belongs to a training run: inspect.py compiles one step without "
                              f"running it or reading data{hint}")


def _step_config(a: argparse.Namespace) -> StepConfig:
    compute = a.compute_dtype or a.param_dtype
    scale = {k: v for k, v in (("loss_scale", a.loss_scale), ("loss_scale_period", a.loss_scale_period))
             if v is not None}
    step = StepConfig(grad_accum=a.grad_accum, compute_dtype=compute, seed=a.seed,
                      param_dtype=a.param_dtype, pipeline_schedule=a.pipeline_schedule,
                      microbatches=a.microbatches, virtual_stages=a.virtual_stages,
                      stage_layers=_counts(a.stage_layers), balance=a.balance, reducer=a.strategy,
                      **({"bucket_mb": a.bucket_mb} if a.bucket_mb is not None else {}), **scale)
    if a.bucket_mb is not None and a.strategy != "explicit":
        raise ConfigError("--bucket-mb sizes the buckets of --strategy explicit; add it")
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


SHAPE_FLAGS = (
    ("--n-layers", int, "layers"),
    ("--d-model", int, "width of the residual stream"),
    ("--n-heads", int, "attention heads"),
    ("--n-kv-heads", int, "key/value heads (fewer than --n-heads: grouped-query attention)"),
    ("--d-head", int, "width of a head (default d_model / n_heads)"),
    ("--d-mlp", int, "hidden width of the MLP"),
    ("--vocab-size", int, "vocabulary (default: the preset's, or a trained tokenizer's)"),
    ("--max-seq-len", int, "longest sequence (GPT-2: rows of the position table)"),
    ("--rope-theta", float, "rotary embedding base (Llama family)"),
)


def _fields(a: argparse.Namespace, flags) -> tuple[tuple[str, object], ...]:
    fields = (flag[2:].replace("-", "_") for flag, _, _ in flags)
    return tuple((f, getattr(a, f)) for f in fields if getattr(a, f) is not None)


def _moe(a: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    return _fields(a, MOE_FLAGS)


def _tokenizer(a: argparse.Namespace) -> str:
    if a.tokenizer:
        return a.tokenizer
    if a.init_from and (Path(a.init_from) / "tokenizer.json").is_file():
        return str(Path(a.init_from) / "tokenizer.json")
    return "bytes"


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
        data=DataConfig(path=a.data, val_fraction=a.val_fraction, tokenizer=_tokenizer(a)),
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
        export=a.export, measure_bubble=a.measure_bubble, moe=_moe(a),
        shape=_fields(a, SHAPE_FLAGS), sync_every=a.sync_every, init_from=a.init_from, export_hf=a.export_hf,
        log_every=a.log_every, tensorboard=a.tensorboard, profile_steps=a.profile_steps,
        profile_dir=a.profile_dir, sample_tokens=a.sample_tokens, sample_prompt=a.sample_prompt,
        flags={k: v for k, v in sorted(vars(a).items()) if k != "config"})


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Bad input -> ``error: ...`` on stderr and exit status 2; Ctrl-C -> status 130."""
    try:
        yield
    except JaxshardError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:  # a backend the machine lacks (--platform), found at the first device query
        if not str(e).startswith("Unable to initialize backend"):
            raise
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
