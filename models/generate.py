"""Text generation with a KV cache: the prompts in one pass, then one token per step.

Prompts of different lengths are right-padded: each row's tokens keep positions ``0..p-1``,
and each row then decodes at its own position (``KVCache.start``), so a row gets the tokens
it gets alone. The prompt's padding slots are overwritten by the row's next tokens before
anything attends to them.

With ``rules``, the same :func:`~jaxshard.rules.use_rules` layout as training: the params in
their at-rest shardings, the rows over the batch axes when their count divides them (else
replicated), heads and the cache's kv heads over ``tensor`` (kv heads fewer than ``tensor``
are replicated, and so is their cache). Collectives per step: the row-parallel all-reduces
over ``tensor`` as in training; the vocab-split logits reduced to each row's argmax, or
gathered (``[B, V]``) and sorted to sample; under ZeRO-3/FSDP every layer's weights gathered
again each step, as a training forward does (decoding is cheaper with params laid out
without them). Sequence parallelism is off while decoding: one token has no sequence to split.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxshard.axes import Dim, MeshAxis
from jaxshard.errors import ConfigError
from jaxshard.rules import ShardingRules, constrain, use_rules
from models.transformer import TransformerLM

# Prompts are padded to a multiple of this (within max_seq_len): fewer shapes to compile.
_PROMPT_BUCKET = 8


def generate(model: TransformerLM, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, rules: ShardingRules | None = None,
             stop_id: int | None = None) -> list[list[int]]:
    """Each prompt's new tokens, at most ``max_new_tokens``; with ``stop_id``, a row ends at
    that token (which it includes). ``temperature`` 0 is greedy (argmax); otherwise tokens are
    drawn from the logits divided by ``temperature``, restricted to the ``top_k`` likeliest,
    then to the smallest set of them whose probability reaches ``top_p``. Draws depend only
    on ``seed`` and the step (the same on any mesh)."""
    lengths = _check(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_id, rules)
    cfg = model.cfg
    B, P = len(prompts), max(lengths)
    P = min(-(-P // _PROMPT_BUCKET) * _PROMPT_BUCKET, cfg.max_seq_len - max_new_tokens + 1)
    tokens_BP = np.zeros((B, P), np.int32)
    for row, prompt in enumerate(prompts):
        tokens_BP[row, :len(prompt)] = prompt
    lengths_B = np.asarray(lengths, np.int32)
    if rules is not None:
        rules = _for_decoding(rules)
        rules.check_model(model.param_axes(), params)
        params = jax.device_put(params, rules.param_shardings(model.param_axes(), params))
        rows = rules.activation_spec((Dim.BATCH,), (B,))  # replicated if B does not divide
        tokens_BP, lengths_B = jax.device_put((tokens_BP, lengths_B),
                                              (rules.named(rows + (None,)), rules.named(rows)))
    # Traced, so that other values reuse the compiled program.
    sampling = (jnp.float32(temperature or 1.0), jnp.int32(top_k or cfg.padded_vocab),
                jnp.float32(top_p or 1.0))
    stop = jnp.int32(-1 if stop_id is None else stop_id)
    out_BN, count = _decode(model, rules, temperature == 0.0, max_new_tokens)(
        params, tokens_BP, lengths_B, jax.random.key(seed), sampling, stop)
    out_BN, count = np.asarray(out_BN), int(count)
    results = []
    for row in out_BN:
        row = row[:count].tolist()
        results.append(row[:row.index(stop_id) + 1] if stop_id in row else row)
    return results


@functools.lru_cache(maxsize=16)
def _decode(model: TransformerLM, rules: ShardingRules | None, greedy: bool, max_new: int):
    """The jitted prefill and decode loop for one (model, rules, kind of pick, length)."""

    def run(params, tokens_BP, lengths_B, key, sampling, stop_id):
        with use_rules(rules):
            B, P = tokens_BP.shape
            cache = model.new_cache(B, P + max_new - 1, params["tokens"].dtype)
            logits_B1V, cache = model.extend(params, tokens_BP, cache, at_B=lengths_B - 1)
            cache = cache._replace(start=lengths_B)
            token_B = _pick(logits_B1V[:, 0], key, 0, model.cfg.vocab_size, greedy, *sampling)
            out_BN = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(token_B)
            out_BN = constrain(out_BN, (Dim.BATCH, None))

            def more(state):
                i, _, _, _, done_B = state
                return (i < max_new) & ~jnp.all(done_B)

            def step(state):
                i, token_B, cache, out_BN, done_B = state
                logits_B1V, cache = model.extend(params, token_B[:, None], cache)
                token_B = _pick(logits_B1V[:, 0], key, i, model.cfg.vocab_size, greedy, *sampling)
                return i + 1, token_B, cache, out_BN.at[:, i].set(token_B), done_B | (token_B == stop_id)

            count, _, _, out_BN, _ = jax.lax.while_loop(
                more, step, (jnp.int32(1), token_B, cache, out_BN, token_B == stop_id))
            return out_BN, count

    return jax.jit(run)


@functools.lru_cache(maxsize=16)
def _for_decoding(rules: ShardingRules) -> ShardingRules:
    """``rules`` less sequence parallelism, which has no sequence to split one token at a time
    (and does not change where params are)."""
    if not rules.strategy.sequence_parallel:
        return rules
    return ShardingRules(rules.mesh, dataclasses.replace(rules.strategy, sequence_parallel=False))


def _pick(logits_BV: jax.Array, key: jax.Array, step: jax.Array | int, vocab_size: int, greedy: bool,
          temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The next token of each row: argmax, or a draw after temperature, top-k and top-p."""
    V = logits_BV.shape[-1]
    logits_BV = jnp.where(jnp.arange(V) < vocab_size, logits_BV, -jnp.inf)  # the vocab's padding
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
    sorted_BV = jnp.where(jnp.arange(V) < top_k, sorted_BV, -jnp.inf)
    p_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Keep a token while the mass before it is short of top_p (the first always stays; with
    # top_p 1 all, whatever the rounding of the sums).
    short_BV = (jnp.cumsum(p_BV, axis=-1) - p_BV < top_p) | (top_p >= 1)
    kept_B = jnp.sum(short_BV & (sorted_BV > -jnp.inf), axis=-1)
    cutoff_B1 = jnp.take_along_axis(sorted_BV, kept_B[:, None] - 1, axis=-1)
    logits_BV = jnp.where(logits_BV >= cutoff_B1, logits_BV, -jnp.inf)
    return jax.random.categorical(jax.random.fold_in(key, step), logits_BV, axis=-1).astype(jnp.int32)


def greedy_by_recompute(model: TransformerLM, params, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding without a cache, a reference for :func:`generate`: every step runs the
    model's ordinary forward over the whole sequence (right-padded to a fixed length, which
    causal attention makes invisible) and takes the argmax at its last token."""
    total = len(prompt) + max_new_tokens
    tokens = np.zeros((1, min(-(-total // 32) * 32, model.cfg.max_seq_len)), np.int32)
    tokens[0, :len(prompt)] = prompt
    forward = _forward(model)
    for n in range(len(prompt), total):
        logits_V = forward(params, tokens)[0, n - 1, :model.cfg.vocab_size]
        tokens[0, n] = int(jnp.argmax(logits_V))
    return tokens[0, len(prompt):total].tolist()


@functools.lru_cache(maxsize=16)
def _forward(model: TransformerLM):
    """The model's ordinary forward: logits ``[B, L, V]``."""
    return jax.jit(lambda params, tokens_BL: model.head(params, model.blocks(params, model.embed(params, tokens_BL))))


def _check(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_id, rules) -> list[int]:
    """The prompts' lengths, or a one-line ConfigError."""
    cfg = model.cfg
    if model.moe_layers:
        raise ConfigError(f"generation does not support MoE models yet (model {cfg.name})")
    staged = rules is not None and rules.sizes[MeshAxis.STAGE] > 1
    if model.stage_layout is not None or staged:
        raise ConfigError("generation does not support pipeline-staged models yet")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ConfigError("top_k and top_p choose among tokens to sample; temperature 0 decodes greedily")
    if not prompts:
        raise ConfigError("generation needs at least one prompt")
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ConfigError(f"prompt {lengths.index(0)} is empty; each prompt needs at least one token")
    if max(lengths) + max_new_tokens > cfg.max_seq_len:
        raise ConfigError(f"the longest prompt ({max(lengths)} tokens) plus max_new_tokens "
                          f"({max_new_tokens}) exceeds model {cfg.name}'s max_seq_len {cfg.max_seq_len}")
    bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside model {cfg.name}'s vocabulary (0..{cfg.vocab_size - 1})")
    if stop_id is not None and not 0 <= stop_id < cfg.vocab_size:
        raise ConfigError(f"stop_id {stop_id} is outside model {cfg.name}'s vocabulary (0..{cfg.vocab_size - 1})")
    return lengths
