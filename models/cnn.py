"""A small convolutional classifier with BatchNorm, and the synthetic images it learns.

``conv 3x3 -> BatchNorm -> ReLU`` per layer, global average pool, a linear classifier. Params
and running statistics are plain nested dicts of arrays (params to the optimizer, statistics to
the train state beside them); the BatchNorm's ``sync`` (``jaxshard.mechanics.batchnorm.Sync``) says whose
rows it normalises with when the batch is split over devices. Data-parallel runs keep the
params replicated. Shape letters: B batch, H height, W width, C channels, K classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxshard.errors import ConfigError
from jaxshard.mechanics.batchnorm import BatchNormConfig, Running, batch_norm

Params = dict[str, Any]
# float32 contractions at full precision: GPUs would otherwise take TF32 and move the runs apart.
_PRECISION = jax.lax.Precision.HIGHEST


@dataclass(frozen=True, slots=True)
class CNNConfig:
    channels: tuple[int, ...] = (16, 32, 32)  # per conv layer
    strides: tuple[int, ...] = (1, 2, 2)
    image_size: int = 16
    in_channels: int = 3
    n_classes: int = 10
    bn: BatchNormConfig = field(default_factory=BatchNormConfig)

    def __post_init__(self) -> None:
        if not self.channels or len(self.strides) != len(self.channels):
            raise ConfigError(f"a CNN needs one stride per conv layer, got channels {self.channels} "
                              f"and strides {self.strides}")
        if min(self.channels + self.strides) < 1 or min(self.image_size, self.in_channels, self.n_classes) < 1:
            raise ConfigError("CNN channels, strides, image size and class count must be >= 1")

    def replace(self, **changes) -> CNNConfig:
        return replace(self, **changes)


class CNN:
    def __init__(self, cfg: CNNConfig = CNNConfig()):
        self.cfg = cfg

    def init(self, key: jax.Array) -> tuple[Params, Params]:
        """Fresh params (He-normal convolutions, BatchNorm scale 1 and bias 0) and running
        statistics (mean 0, variance 1)."""
        cfg = self.cfg
        keys = jax.random.split(key, len(cfg.channels) + 1)
        params: Params = {}
        stats: Params = {}
        c_in = cfg.in_channels
        for i, (k, c) in enumerate(zip(keys, cfg.channels)):
            fan_in = 9 * c_in
            params[f"conv{i}"] = {
                "w_HWIO": jax.random.normal(k, (3, 3, c_in, c), jnp.float32) * np.sqrt(2.0 / fan_in),
                "bn_scale": jnp.ones((c,), jnp.float32),
                "bn_bias": jnp.zeros((c,), jnp.float32)}
            stats[f"conv{i}"] = Running.init(c)._asdict()
            c_in = c
        w_CK = jax.random.normal(keys[-1], (c_in, cfg.n_classes), jnp.float32) / np.sqrt(c_in)
        params["head"] = {"w_CK": w_CK, "b_K": jnp.zeros((cfg.n_classes,), jnp.float32)}
        return params, stats

    def apply(self, params: Params, stats: Params, images_BHWC: jax.Array,
              train: bool) -> tuple[jax.Array, Params]:
        """Logits ``[B, K]`` and the running statistics after this batch (unchanged when not
        ``train``, where they normalise instead of the batch's)."""
        x = images_BHWC
        new_stats = {}
        for i, stride in enumerate(self.cfg.strides):
            name = f"conv{i}"
            p = params[name]
            x = jax.lax.conv_general_dilated(x, p["w_HWIO"], (stride, stride), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                             precision=_PRECISION)
            x, running = batch_norm(x, p["bn_scale"], p["bn_bias"], Running(**stats[name]), self.cfg.bn, train)
            new_stats[name] = running._asdict()
            x = jax.nn.relu(x)
        pooled_BC = jnp.mean(x, axis=(1, 2))
        logits_BK = jnp.dot(pooled_BC, params["head"]["w_CK"], precision=_PRECISION) + params["head"]["b_K"]
        return logits_BK, new_stats

    def loss(self, params: Params, stats: Params, batch: dict[str, jax.Array]) -> tuple[jax.Array, Params]:
        """Training mode: the cross-entropies' sum over the rows given, and the new statistics."""
        logits, stats = self.apply(params, stats, batch["images"], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).sum(), stats


# ---- data ---------------------------------------------------------------------------------------
class SyntheticImages:
    """Classes of images made from ``seed`` alone: each class a smooth colour pattern (a few
    random gratings), each image its class's pattern shifted by up to 3 pixels, with its own
    contrast and brightness, plus pixel noise. Batch ``i`` is a function of (seed, i) only; the
    held-out images are drawn apart from every batch."""

    def __init__(self, seed: int, cfg: CNNConfig = CNNConfig(), noise: float = 0.5):
        if seed < 0:
            raise ConfigError(f"the image seed must be >= 0, got {seed}")
        self.seed, self.cfg, self.noise = seed, cfg, noise
        rng = np.random.default_rng([seed, 0])
        n, s, c = cfg.n_classes, cfg.image_size, cfg.in_channels
        yy, xx = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
        freq = rng.uniform(0.5, 2.5, (n, 3, 2, c)) * 2 * np.pi / s  # 3 gratings per class and channel
        phase = rng.uniform(0, 2 * np.pi, (n, 3, c))
        waves = np.cos(freq[..., 0, :][:, :, None, None, :] * yy[None, None, :, :, None]
                       + freq[..., 1, :][:, :, None, None, :] * xx[None, None, :, :, None]
                       + phase[:, :, None, None, :])
        self.patterns_KHWC = waves.sum(axis=1).astype(np.float32)

    def batch(self, index: int, size: int) -> dict[str, np.ndarray]:
        return self._draw(np.random.default_rng([self.seed, 1, index]), size)

    def held_out(self, size: int) -> dict[str, np.ndarray]:
        return self._draw(np.random.default_rng([self.seed, 2]), size)

    def _draw(self, rng: np.random.Generator, size: int) -> dict[str, np.ndarray]:
        labels = rng.integers(0, self.cfg.n_classes, size)
        shifts = rng.integers(-3, 4, (size, 2))
        images = np.stack([np.roll(self.patterns_KHWC[k], tuple(d), axis=(0, 1))
                           for k, d in zip(labels, shifts)])
        contrast = rng.uniform(0.5, 1.5, (size, 1, 1, 1))
        brightness = rng.normal(0.0, 0.5, (size, 1, 1, 1))
        images = contrast * images + brightness + self.noise * rng.standard_normal(images.shape)
        return {"images": images.astype(np.float32), "labels": labels.astype(np.int32)}

    def batches(self, steps: int, size: int, start: int = 0) -> list[dict[str, np.ndarray]]:
        return [self.batch(i, size) for i in range(start, start + steps)]
