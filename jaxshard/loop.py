"""The training loop behind ``experiments/train.py``: compile, init, train, evaluate, report."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from jaxshard import data as data_lib
from jaxshard import accounting, devices, hlo, inspect
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

    flops = accounting.flops(model.cfg, rules, B, L, remat=model.remat)
    peak, peak_source = devices.peak_flops(cfg.device, cfg.peak_tflops, cfg.step.compute_dtype,
                                           jax.devices()[0])
    n_dev = jax.device_count()
    _log(f"model FLOPs per step {flops.model:.3e} ({flops.formula}); MFU peak: {peak_source}")

    def throughput(dt: float) -> dict[str, float]:
        out = {"tokens_per_s": B * L / dt, "tflops_per_device": flops.model / n_dev / dt / 1e12}
        if peak:
            out["mfu"] = flops.model / n_dev / dt / peak
            out["hfu"] = flops.hardware / n_dev / dt / peak
        return out

    rows = data_lib.process_rows(program.batch_sharding, B, L)
    train_data = data_lib.Batches(corpus.train, L, B, cfg.step.seed, rows)
    val_data = data_lib.Batches(corpus.val, L, B, cfg.step.seed, rows, shuffle=False)

    def validate() -> float:
        losses = [program.eval(state.params, data_lib.to_global(val_data.batch(i), program.batch_sharding, B))
                  for i in range(cfg.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

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
            record = {"step": i + 1, **m, "step_time_s": dt, **throughput(dt)}
            last = i + 1 == cfg.steps
            if math.isfinite(m["loss"]) and (last or (cfg.eval_every and (i + 1) % cfg.eval_every == 0)):
                val_loss = record["val_loss"] = validate()
            writer.write(record)
            records.append(record)
            if not math.isfinite(m["loss"]):
                raise TrainingError(f"loss is {m['loss']} at step {i + 1}; lower --lr or check the "
                                    "data (no report written)")
            speed = (f"{record['mfu']:.1%}" if "mfu" in record
                     else f"{record['tflops_per_device'] * 1e3:,.2f} GFLOP/s/dev")
            bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                            **{"mfu" if "mfu" in record else "speed": speed}, refresh=False)
            bar.update()

    timed = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    median = throughput(float(np.median(timed)))
    comm = accounting.communication(model, rules, B, L, compute_dtype=cfg.step.compute_dtype,
                                    remat=model.remat, grad_accum=cfg.step.grad_accum)
    predicted_memory = accounting.memory(model, rules, B, L, compute_dtype=cfg.step.compute_dtype,
                                         remat=model.remat, grad_accum=cfg.step.grad_accum)
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
        "predicted": {"argument_bytes": predicted_memory.argument,
                      "activation_bytes": predicted_memory.activations,
                      "collectives": [{"kind": k, "bytes": b} for k, b in sorted(comm.by_kind().items())]},
        "compile_time_s": compile_s,
        "step_time_s_median": float(np.median(timed)),
        "tokens_per_s": median["tokens_per_s"],
        "flops_per_step": {"model": flops.model, "hardware": flops.hardware, "formula": flops.formula},
        "tflops_per_device": median["tflops_per_device"],
        "mfu": median.get("mfu"),
        "hfu": median.get("hfu"),
        "peak_flops_source": peak_source,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "final_val_loss": val_loss,
        "data": corpus.name,
    }
    speed = f"MFU {report['mfu']:.1%}" if report["mfu"] is not None else \
        f"{report['tflops_per_device'] * 1e3:,.2f} GFLOP/s per device"
    _log(f"done: loss {report['first_loss']:.3f} -> {report['final_loss']:.3f}, val {val_loss:.3f}, "
         f"{report['tokens_per_s']:,.0f} tokens/s, {speed}")
    if cfg.report and jax.process_index() == 0:
        write_json_atomic(cfg.report, report)
    return report
