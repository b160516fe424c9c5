"""Random token batches with something to learn, for equivalence tests and demonstrations."""

from __future__ import annotations

import numpy as np


def random_batches(vocab: int, steps: int, batch_size: int, seq_len: int, seed: int = 0) -> list[dict]:
    """Random tokens whose targets are a fixed function of the inputs (something to learn)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        inputs = rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32)
        out.append({"inputs": inputs, "targets": (inputs * 7 + 3) % vocab})
    return out
