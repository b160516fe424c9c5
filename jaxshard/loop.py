"""The training loop behind ``experiments/train.py``: compile, init, train, evaluate, report."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from jaxshard import data as data_lib
from jaxshard import hlo, inspect
from jaxshard.cli import TrainConfig
from jaxshard.errors import ConfigError, DataError, TrainingError
from jaxshard.mesh import axis_sizes, build_mesh
from jaxshard.metrics import MetricsLog, progress, write_json_atomic
from jaxshard.rules import ShardingRules
from jaxshard.train_step import build_program, check_batch


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def _check_model_fits_data(model: Any, corpus: data_lib.Corpus, seq_len: int) -> None:
    if corpus.vocab_size > model.cfg.vocab_size:
        raise DataError(f"data {corpus.name} has token ids up to {corpus.vocab_size - 1} but model "
                        f"{model.cfg.name} has a vocabulary of {model.cfg.vocab_size}")
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds model {model.cfg.name}'s max_seq_len "
                          f"{model.cfg.max_seq_len}")


def train(cfg: TrainConfig, model: Any) -> dict[str, Any]:
    """Train ``model`` as ``cfg`` says; returns (and writes, with ``--report``) the report."""
    B, L = cfg.batch_size, cfg.seq_len
    mesh = build_mesh(cfg.mesh)
    rules = ShardingRules(mesh, cfg.strategy)
    check_batch(rules, B, L, cfg.step.grad_accum)
    corpus = data_lib.load_corpus(cfg.data)
    _check_model_fits_data(model, corpus, L)

    program = build_program(model, rules, cfg.optim, cfg.step)
    _log(f"model {model.cfg.name}: {model.n_params():,} params | mesh {axis_sizes(mesh)} | "
         f"strategy {rules.name} | {jax.device_count()} {jax.default_backend()} devices")
    t0 = time.perf_counter()
    compiled = program.lower_step(B, L).compile()
    compile_s = time.perf_counter() - t0
    state = program.init(cfg.step.seed)
    held = {"params": inspect.max_bytes_per_device(state.params),
            "opt_state": inspect.max_bytes_per_device(state.opt_state)}
    _log(f"compiled in {compile_s:.1f}s | per device: params {held['params']:,} B, "
         f"optimizer state {held['opt_state']:,} B")

    rows = data_lib.process_rows(program.batch_sharding, B, L)
    train_data = data_lib.Batches(corpus.train, L, B, cfg.step.seed, rows)
    val_data = data_lib.Batches(corpus.val, L, B, cfg.step.seed, rows, shuffle=False)

    def validate() -> float:
        losses = [program.eval(state.params, data_lib.to_global(val_data.batch(i), program.batch_sharding, B))
                  for i in range(cfg.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    tokens_per_step = B * L
    records, val_loss = [], None
    writer = MetricsLog(cfg.metrics if jax.process_index() == 0 else None)
    bar = progress(cfg.steps, cfg.progress and jax.process_index() == 0)
    with writer, bar:
        for i in range(cfg.steps):
            t = time.perf_counter()
            batch = data_lib.to_global(train_data.batch(i), program.batch_sharding, B)
            state, m = compiled(state, batch)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            dt = time.perf_counter() - t
            record = {"step": i + 1, **m, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
            last = i + 1 == cfg.steps
            if math.isfinite(m["loss"]) and (last or (cfg.eval_every and (i + 1) % cfg.eval_every == 0)):
                val_loss = record["val_loss"] = validate()
            writer.write(record)
            records.append(record)
            if not math.isfinite(m["loss"]):
                raise TrainingError(f"loss is {m['loss']} at step {i + 1}; lower --lr or check the "
                                    "data (no report written)")
            bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            bar.update()

    timed = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    report = {
        "model": model.cfg.name,
        "mesh": axis_sizes(mesh),
        "strategy": rules.name,
        "zero": cfg.strategy.zero,
        "backend": jax.default_backend(),
        "n_devices": jax.device_count(),
        "n_processes": jax.process_count(),
        "n_params": model.n_params(),
        "steps": cfg.steps,
        "batch_size": B,
        "seq_len": L,
        "grad_accum": cfg.step.grad_accum,
        "compute_dtype": cfg.step.compute_dtype,
        "per_device_bytes": held,
        "xla_memory": inspect.xla_memory(compiled),
        "collectives": hlo.summary(inspect.compiled_collectives(compiled, mesh)),
        "compile_time_s": compile_s,
        "step_time_s_median": float(np.median(timed)),
        "tokens_per_s": tokens_per_step / float(np.median(timed)),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": val_loss,
        "data": corpus.name,
    }
    _log(f"done: loss {report['first_loss']:.3f} -> {report['final_loss']:.3f}, val {val_loss:.3f}, "
         f"{report['tokens_per_s']:,.0f} tokens/s")
    if cfg.report and jax.process_index() == 0:
        write_json_atomic(cfg.report, report)
    return report
