"""Sharded checkpoints with orbax: async saves, keep-N, restore onto any mesh, exact resume.

A checkpoint holds the train state (params, optimizer state, step) and a small JSON record:
the step, the **global sample offset** of the data stream (so the data order resumes exactly,
whatever the mesh or the number of processes), the seed (dropout keys derive from seed and
step), and the params' shapes (to refuse another model with one clear line). Restore reads
each array straight into its sharding on the current mesh; orbax finalises a step by renaming
its folder, so a step killed mid-write is never listed and the previous one is used.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxshard.errors import ConfigError, JaxshardError
from jaxshard.options import flag, option
from jaxshard.pytree import named_leaves


class CheckpointError(JaxshardError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model."""


KEEP = 3  # checkpoints kept without --keep


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    directory: str | None = option(None, "where sharded checkpoints go", flag="--checkpoint-dir",
                                   run_only=True)
    save_every: int = option(0, "steps between saves (0: at the end only)", run_only=True)
    save_every_minutes: float = option(
        0.0, "also save when this many minutes have passed since the last save (checked every step; "
             "with several processes every 10th, where they agree); 0: not by time", metavar="T", run_only=True)
    keep: int | None = option(None, "most recent checkpoints kept", default_text=str(KEEP), run_only=True)
    resume: bool = option(False, "continue from the latest complete checkpoint in --checkpoint-dir, "
                                 "on any mesh", run_only=True)
    export: str | None = option(None, "write the final params to this .npz (plain numpy)", run_only=True)
    export_hf: str | None = option(
        None, "write the final model as a Hugging Face folder (config.json, safetensors, "
              "tokenizer.json) that transformers loads as it is", metavar="DIR", run_only=True)

    def __post_init__(self) -> None:
        if self.save_every_minutes and not self.directory:
            raise ConfigError(f"{flag(CheckpointConfig, 'save_every_minutes')} needs --checkpoint-dir (where to save)")
        if self.save_every_minutes < 0:
            raise ConfigError(f"{flag(CheckpointConfig, 'save_every_minutes')} must be >= 0, got "
                              f"{self.save_every_minutes:g}")
        if (self.save_every or self.resume or self.keep is not None) and not self.directory:
            raise ConfigError(f"{flag(CheckpointConfig, 'save_every')}, {flag(CheckpointConfig, 'keep')} and "
                              f"{flag(CheckpointConfig, 'resume')} need {flag(CheckpointConfig, 'directory')}")
        if self.save_every < 0:
            raise ConfigError(f"{flag(CheckpointConfig, 'save_every')} must be >= 0, got {self.save_every}")
        if self.keep is not None and self.keep < 1:
            raise ConfigError(f"{flag(CheckpointConfig, 'keep')} must be >= 1, got {self.keep}")

    @property
    def kept(self) -> int:
        return KEEP if self.keep is None else self.keep


def param_shapes(params: Any) -> dict[str, list[int]]:
    return {name: list(x.shape) for name, x in named_leaves(params)}


class Checkpointer:
    """Saves and restores one run's train state in ``cfg.directory``."""

    def __init__(self, cfg: CheckpointConfig):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.cfg = cfg
        self.directory = Path(cfg.directory).expanduser().resolve()  # orbax wants absolute paths
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"--checkpoint-dir {self.directory} is a file, not a folder")
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.kept, enable_async_checkpointing=True,
                                               create=True)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # noqa: BLE001 -- orbax raises many kinds; the user needs one line
            raise CheckpointError(f"cannot use --checkpoint-dir {self.directory}: {_first_line(e)}") from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def latest_meta(self) -> dict[str, Any] | None:
        """The record of the latest complete checkpoint (None if there is none)."""
        return None if self.latest_step() is None else self.meta()

    def _meta(self, step: int) -> Any:
        try:
            return self.manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 -- orbax raises many kinds; the user needs one line
            raise CheckpointError(f"checkpoint {self.directory}/{step} is unreadable: {_first_line(e)}") from None

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save (training goes on while it is written)."""
        ocp = self._ocp
        started = self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                  meta=ocp.args.JsonSave(meta)))
        if not started:
            raise CheckpointError(f"orbax declined to save step {step} in {self.directory} "
                                  f"(it already holds step {self.latest_step()})")

    def restore(self, abstract_state: Any, expected_shapes: dict[str, list[int]],
                step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """The state of ``step`` (default: the latest complete one) in ``abstract_state``'s
        shardings, and its record."""
        ocp = self._ocp
        step, where, meta = self._checked(step, expected_shapes)
        self._check_arrays(step, where, abstract_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{where} cannot be restored: {_first_line(e)}") from None
        return restored["state"], meta

    def restore_params(self, abstract_params: Any, expected_shapes: dict[str, list[int]],
                       step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Only the params of ``step`` (default: the latest), in ``abstract_params``' shardings
        (model layer order): what generation needs, without the optimizer state."""
        ocp = self._ocp
        step, where, meta = self._checked(step, expected_shapes)
        item = {"params": abstract_params}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{where} cannot be restored: {_first_line(e)}") from None
        return restored["state"]["params"], meta

    def _checked(self, step: int | None, expected_shapes: dict[str, list[int]]) -> tuple[int, str, dict]:
        """(step, its name, its record) once the record says it holds a model of these shapes."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        where = f"checkpoint {self.directory}/{step}"
        meta = self._meta(step)
        saved = meta.get("param_shapes") if isinstance(meta, dict) else None
        if saved != expected_shapes:
            raise CheckpointError(f"{where} holds another model: {_shape_difference(saved, expected_shapes)}")
        return step, where, meta

    def _check_arrays(self, step: int, where: str, abstract_state: Any) -> None:
        """Every array of ``abstract_state`` that ``step``'s metadata names is stored there
        with its shape, checked before a read starts: a mismatch (another data size under
        ``--sync-every``) is one line naming the array, and no read is begun and abandoned.
        An array the metadata does not name is left to orbax's restore, which says what is
        missing."""
        try:
            stored = self._ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        except Exception as e:  # noqa: BLE001 -- orbax raises many kinds; the user needs one line
            raise CheckpointError(f"{where} is unreadable: {_first_line(e)}") from None
        tree = getattr(stored, "tree", stored)
        shapes = {name: tuple(x.shape) for name, x in named_leaves(tree, lambda x: hasattr(x, "shape"), sep=".")}
        for name, x in named_leaves(abstract_state, sep="."):
            if name in shapes and shapes[name] != tuple(x.shape):
                raise CheckpointError(f"{where} holds {name} of shape {shapes[name]}, this run's is "
                                      f"{tuple(x.shape)}")

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """The record of ``step`` (default: the latest complete checkpoint)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        meta = self._meta(step)
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint {self.directory}/{step} has no readable record")
        return meta

    def wait(self) -> None:
        """Until the saves started are complete (written in the background until then)."""
        if self.manager is not None:
            self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the last save to be complete; closing twice is harmless."""
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()
            self.manager = None


def _shape_difference(saved: dict | None, expected: dict) -> str:
    if not isinstance(saved, dict):
        return "it has no record of its params' shapes"
    for name in sorted(set(saved) | set(expected)):
        if saved.get(name) != expected.get(name):
            return (f"param {name} is {tuple(saved[name]) if name in saved else 'absent'} there, "
                    f"{tuple(expected[name]) if name in expected else 'absent'} here")
    return "shapes differ"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def export_params(params: Any, path: str | os.PathLike) -> Path:
    """Write the params as a plain ``.npz`` (one array per '/'-joined name), loadable with numpy
    alone. Every process gathers; process 0 writes (via a temporary file, then a rename)."""
    import numpy as np
    from jax.experimental import multihost_utils

    path = check_export_path(path)
    writer = path.with_name(path.name + ".tmp.npz")
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
    # One parameter at a time: a host holds at most the largest one, never the whole model.
    with zipfile.ZipFile(writer, "w", allowZip64=True) if jax.process_index() == 0 else contextlib.nullcontext() as zf:
        for name, x in named_leaves(params):
            full = np.asarray(multihost_utils.process_allgather(x, tiled=True))  # every process
            if zf is not None:
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, full, allow_pickle=False)
    if jax.process_index() == 0:
        os.replace(writer, path)
    return path


def check_export_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        raise ConfigError(f"--export must name a .npz file, got {path}")
    return path

