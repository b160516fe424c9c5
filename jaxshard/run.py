"""A training run's config: one tree of frozen dataclasses.

Each concern's config is defined beside the code that reads it -- the model's choice in
:mod:`jaxshard.model`, the strategy in :mod:`jaxshard.rules`, the step (precision, pipeline,
gradient reduction) in :mod:`jaxshard.training.step`, the optimizer, the data, the checkpoints,
the outputs, the runtime and the processes in theirs -- and :class:`RunConfig` holds them with
the settings that belong to the run as a whole. Its fields are the flags (:mod:`jaxshard.options`):
the command line, the ``--config`` TOML keys, the report's echo and ``docs/flags.md`` are
generated from this tree (:mod:`jaxshard.cli`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxshard.analysis.devices import PeakConfig
from jaxshard.data.corpus import DataConfig
from jaxshard.distributed import DistributedConfig
from jaxshard.errors import ConfigError
from jaxshard.mesh import MeshSpec
from jaxshard.model import ModelChoice
from jaxshard.options import echo, flag, option, section
from jaxshard.remat import NAMES, Remat
from jaxshard.rules import Strategy
from jaxshard.runtime import RuntimeConfig
from jaxshard.training.checkpoint import CheckpointConfig
from jaxshard.training.observe import OutputConfig
from jaxshard.training.optim import OptimConfig
from jaxshard.training.step import StepConfig

SAMPLE_PROMPT = "\n"  # the final sample's default prompt


def parse_remat(text: str) -> Remat | None:
    """``--remat``'s text; ``auto`` is None (chosen by backend: :func:`jaxshard.remat.default_for`)."""
    return None if text == "auto" else Remat.parse(text)


def show_remat(remat: Remat | None) -> str:
    return "auto" if remat is None else str(remat)


def parse_mesh(text: str) -> MeshSpec:
    return MeshSpec.parse(text)


@dataclass(frozen=True, slots=True)
class RunConfig:
    model: ModelChoice = section(ModelChoice, "model")
    mesh: MeshSpec = option(
        MeshSpec.parse("data=-1"), "AXIS=SIZE,... over data, fsdp, stage, expert, sequence, tensor; "
                                   "outermost first; one -1 fills the remaining devices",
        parse=parse_mesh, show=str, group="mesh and strategy")
    dcn_mesh: MeshSpec | None = option(
        None, "hybrid mesh: how the hosts are laid out (e.g. data=4); --mesh then lays out each "
              "host's devices, and each axis is the product of the two", parse=parse_mesh,
        show=lambda m: None if m is None else str(m), group="mesh and strategy")
    strategy: Strategy = section(Strategy, "mesh and strategy")
    sync_every: int | None = option(
        None, "local SGD: each data replica steps on its own rows and the replicas (params and Adam "
              "moments) are averaged every H steps, those steps DDP steps; H = 1 is DDP (data-only "
              "meshes)", metavar="H", default_text="DDP", group="mesh and strategy")
    remat: Remat | None = option(
        None, "activation checkpointing of the layer scan: auto (the fastest measured on the backend: "
              "dots on CPU, none elsewhere), none, full, dots, dots_no_batch, selective (recompute the "
              "attention core), names:N1,N2 (keep only these activations), offload:N1,N2 (keep them "
              "in host memory); names: " + ", ".join(NAMES),
        parse=parse_remat, show=show_remat, group="memory")
    step: StepConfig = section(StepConfig, "training")
    measure_bubble: bool = option(
        False, "with a stage axis, after training: time the step and each stage's own work (the same "
               "executor on tables in which only that stage works) and report the measured bubble "
               "beside the theory's (compiles stages + 3 more programs)", group="pipeline", run_only=True)
    steps: int = option(100, "optimizer steps", group="training")
    step_timeout: float | None = option(
        None, "seconds a training step may take before the run stops as hung (a dead peer, a stuck "
              "collective), with one line and exit status 124 for a restart to take over; 0: never",
        default_text="10x the median step after the first 3, at least 300", metavar="S", group="training",
        run_only=True)
    batch_size: int = option(16, "global batch, in sequences", group="training")
    seq_len: int = option(128, "tokens per sequence", group="training")
    optim: OptimConfig = section(OptimConfig, "training")
    decay_steps: int | None = option(None, "cosine decay length", default_text="--steps", group="training")
    data: DataConfig = section(DataConfig, "data")
    eval_every: int = option(50, "validation every N steps; 0: at the end", group="data", run_only=True)
    eval_batches: int = option(4, "batches per validation", group="data", run_only=True)
    eval_at_start: bool = option(False, "also validate before the first step (the untrained baseline, "
                                        "about ln(vocab); a resumed run's starting point)", group="data",
                                 run_only=True)
    peak: PeakConfig = section(PeakConfig, "outputs")
    outputs: OutputConfig = section(OutputConfig, "outputs")
    sample_tokens: int = option(0, "after training, generate N tokens from --sample-prompt and print "
                                   "them", group="outputs", run_only=True)
    sample_prompt: str = option(SAMPLE_PROMPT, "the prompt of the final sample",
                                default_text="a new line", group="outputs", run_only=True)
    runtime: RuntimeConfig = section(RuntimeConfig, "runtime")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints")
    distributed: DistributedConfig = section(DistributedConfig, "multi-process (one process per host)")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(RunConfig, name)} must be >= 1, got {getattr(self, name)}")
        if self.step_timeout is not None and self.step_timeout < 0:
            raise ConfigError(f"{flag(RunConfig, 'step_timeout')} must be >= 0 (0: no watchdog), "
                              f"got {self.step_timeout:g}")
        for name in ("eval_every", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(RunConfig, name)} must be >= 0, got {getattr(self, name)}")
        if self.sample_prompt != SAMPLE_PROMPT and not self.sample_tokens:
            raise ConfigError(f"{flag(RunConfig, 'sample_prompt')} is the prompt of "
                              f"{flag(RunConfig, 'sample_tokens')} N's sample; add it")

    @classmethod
    def from_flags(cls, **fields: Any) -> RunConfig:
        """The tree with what follows from other settings filled in: the cosine's length
        (--decay-steps, else --steps) and an --init-from folder's tokenizer."""
        cfg = cls(**fields)
        optim = dataclasses.replace(cfg.optim, total_steps=cfg.steps if cfg.decay_steps is None else cfg.decay_steps)
        data, folder = cfg.data, cfg.model.init_from
        if folder and data.tokenizer is None and (Path(folder) / "tokenizer.json").is_file():
            data = dataclasses.replace(data, tokenizer=str(Path(folder) / "tokenizer.json"))
        return dataclasses.replace(cfg, optim=optim, data=data)

    @property
    def flags(self) -> dict[str, Any]:
        """Every flag's effective value, by its TOML key: the report's and the checkpoint's record."""
        return echo(self)
