"""Activation checkpointing policies for the layer scan (``--remat``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Callable

import jax


class Remat(StrEnum):
    NONE = "none"  # keep every activation the backward pass needs
    FULL = "full"  # keep only each layer's input; recompute the layer in backward
    DOTS = "dots"  # keep matmul outputs, recompute elementwise ops
    DOTS_NO_BATCH = "dots_no_batch"  # keep only matmuls without batch dims (weights x acts)


def apply(fn: Callable, remat: Remat) -> Callable:
    """``fn`` wrapped with ``jax.checkpoint`` under ``remat`` (the scan body of the layers)."""
    policies = jax.checkpoint_policies
    match remat:
        case Remat.NONE:
            return fn
        case Remat.FULL:
            return jax.checkpoint(fn, policy=policies.nothing_saveable)
        case Remat.DOTS:
            return jax.checkpoint(fn, policy=policies.checkpoint_dots)
        case Remat.DOTS_NO_BATCH:
            return jax.checkpoint(fn, policy=policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"unknown remat policy {remat!r}")
