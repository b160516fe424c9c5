"""The training loop behind ``experiments/train.py``: compile, init or resume, train, evaluate,
checkpoint, report."""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxshard.analysis import accounting, bubble, devices, hlo, inspect, timing
from jaxshard.axes import Dim
from jaxshard.data import corpus as data_lib
from jaxshard.data import mixture
from jaxshard.data import tokenizer as tokenizer_lib
from jaxshard.data.mixture import MixedBatches
from jaxshard.errors import ConfigError, DataError, TrainingError
from jaxshard.mesh import axis_sizes, build_mesh
from jaxshard.model import LanguageModel, Stageable
from jaxshard.parallel import attention
from jaxshard.rules import ShardingRules
from jaxshard.run import RunConfig
from jaxshard.training import local_sgd
from jaxshard.training.checkpoint import Checkpointer, check_export_path, export_params, param_shapes
from jaxshard.training.metrics import MetricsLog, progress, write_json_atomic
from jaxshard.training.observe import ProfileWindow, TensorBoardLog
from jaxshard.training.goodput import Goodput
from jaxshard.training.watchdog import EXIT_STATUS, Watchdog
from jaxshard.training.step import Program, balance_stages, build_program, check_batch


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def _check_model_fits_data(model: LanguageModel, corpus: data_lib.Corpus, seq_len: int) -> None:
    if corpus.vocab_size > model.cfg.vocab_size:
        raise DataError(f"data {corpus.name} has token ids up to {corpus.vocab_size - 1} but model "
                        f"{model.cfg.name} has a vocabulary of {model.cfg.vocab_size}")
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds model {model.cfg.name}'s max_seq_len "
                          f"{model.cfg.max_seq_len}")


def _gpu_kernel(cfg: RunConfig, model_cfg, documents: bool = False) -> str:
    """The kernel the dense attention path takes on a GPU for this run (``attention.gpu_kernel``;
    ``documents``: packed documents' ids given)."""
    return attention.gpu_kernel(cfg.step.compute_dtype, model_cfg.d_head, cfg.seq_len, attention.gpu_capability(),
                                documents)


def _dense_kernel(cfg: RunConfig, model_cfg) -> str:
    """The kernel the dense attention path runs: "xla" but on GPUs, where packed documents take
    the blockwise one in cuDNN's place."""
    if jax.default_backend() != "gpu":
        return "xla"
    return _gpu_kernel(cfg, model_cfg, model_cfg.documents_eot is not None)


def step_flops(cfg: RunConfig, model: LanguageModel, rules: ShardingRules, B: int, L: int) -> accounting.Flops:
    """One step's FLOPs (MFU's and HFU's), its attention as the kernel the run's dense path
    takes computes it (:func:`_dense_kernel`)."""
    return accounting.flops(model.cfg, rules, B, L, remat=model.remat, kernel=_dense_kernel(cfg, model.cfg))


def documents_eot(cfg: RunConfig, eot: int | None, data_name: str, rules: ShardingRules, model_cfg) -> int | None:
    """The end-of-text id (``eot``: the data's, None if they have none) that packs the windows'
    documents (``--packing``), or None: off, by
    the flag, or by default where the attention path does not take segment ids -- the data
    have no such id, or on GPUs cuDNN's fused kernel would run it (the blockwise kernel, which
    takes them, is slower: it is the packed run's only with ``--packing true``)."""
    asked = cfg.data.packing
    if asked and eot is None:
        raise DataError(f"--packing true finds documents by the end-of-text id; data {data_name} has no "
                        "tokenizer that names one (give --tokenizer)")
    ring = attention.ring_size(rules) > 1
    fused = jax.default_backend() == "gpu" and not ring and _gpu_kernel(cfg, model_cfg) == "cudnn"
    if fused and asked:
        _log("--packing true: cuDNN's fused attention takes no segment ids here; the blockwise kernel runs")
    if fused and asked is None:
        _log("documents not packed: cuDNN's fused attention takes no segment ids here (--packing true "
             "packs them with the slower blockwise kernel)")
    return None if asked is False or (fused and asked is None) else eot


def _fault(kind: str, step: int, ckpt: Checkpointer | None = None) -> None:
    """Fault injection for the crash tests: JAXSHARD_FAULT=kill-after-save:STEP kills this
    process (SIGKILL) while that step's checkpoint is being written; exit:PROCESS:STEP makes
    process PROCESS exit with status 17 at that step; term:STEP sends this process SIGTERM (a
    scheduler's preemption notice) as that step is dispatched; stall:PROCESS:STEP makes process
    PROCESS sleep as it dispatches that step (a hung peer, for the watchdog); kill:PROCESS:STEP
    SIGKILLs it there, once the saves started before are complete (on a loaded machine an async
    save can take steps to finish; the restart's checkpoint is then known). Only on a job's first
    attempt (``JAXSHARD_ATTEMPT``, set by a launcher that restarts it)."""
    if os.environ.get("JAXSHARD_ATTEMPT", "0") != "0":  # a launcher's restart: the fault has happened
        return
    spec = os.environ.get("JAXSHARD_FAULT", "").split(":")
    if kind == "step" and spec[0] == "kill" and int(spec[1]) == jax.process_index() and int(spec[2]) == step:
        if ckpt is not None:
            ckpt.wait()  # every process's writes and the primary's commit
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "step" and spec[0] == "stall" and int(spec[1]) == jax.process_index() and int(spec[2]) == step:
        time.sleep(10**6)
    if kind == "step" and spec[0] == "term" and int(spec[1]) == step:
        os.kill(os.getpid(), signal.SIGTERM)
    if kind == "save" and spec[0] == "kill-after-save" and int(spec[1]) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "step" and spec[0] == "exit" and int(spec[1]) == jax.process_index() and int(spec[2]) == step:
        os._exit(17)


def _start(cfg: RunConfig, program: Program, model: LanguageModel, ckpt: Checkpointer | None, family: Family):
    """The initial state, its step and global sample offset, and the checkpoint's record (None
    when not resumed): fresh (or --init-from's weights), or the latest checkpoint."""
    if ckpt is not None and cfg.checkpoint.resume and ckpt.latest_step() is not None:
        if isinstance(program, local_sgd.LocalSGDProgram):
            local_sgd.check_restore(ckpt.meta(), program.replicas)
        saved = ckpt.meta()
        if saved.get("seq_len") is not None and saved["seq_len"] != cfg.seq_len:
            # (its samples_seen counts windows of that length: another would read other tokens)
            raise ConfigError(f"the checkpoint was trained with --seq-len {saved['seq_len']}; resume with it "
                              f"(got --seq-len {cfg.seq_len})")
        if saved.get("seed") is not None and saved["seed"] != cfg.step.seed:  # (the data's order, the dropout)
            raise ConfigError(f"the checkpoint was trained with --seed {saved['seed']}; resume with it "
                              f"(got --seed {cfg.step.seed})")
        state, meta = ckpt.restore(program.saved_abstract, param_shapes(model.abstract_params()))
        state = program.unsaved(state)
        _log(f"resumed from {ckpt.directory}/{meta['step']} (trained on mesh {meta['mesh']}, "
             f"{meta['samples_seen']:,} samples seen)")
        return state, int(meta["step"]), int(meta["samples_seen"]), meta
    if ckpt is not None and ckpt.latest_step() is not None:
        raise ConfigError(f"--checkpoint-dir {ckpt.directory} already holds step {ckpt.latest_step()}: "
                          "pass --resume to continue it, or use an empty folder")
    if cfg.checkpoint.resume:
        _log(f"no complete checkpoint in {cfg.checkpoint.directory}: starting from step 0")
    if cfg.model.init_from:
        state = program.from_params(family.load_weights(cfg.model.init_from, model, program.weight_shardings()))
        _log(f"initialised from {cfg.model.init_from}")
        return state, 0, 0, None
    return program.init(cfg.step.seed), 0, 0, None


def _keep_metrics_until(path: str | None, step: int) -> int:
    """On resume, drop the lines of steps after the checkpoint (they will be run again); the
    last step the file held (``step`` when none beyond it, or no file)."""
    if path is None or not Path(path).exists() or jax.process_index() != 0:
        return step
    import json

    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= step))
    return max([step, *(r.get("step", 0) for r in records)])


class Preempted(Exception):
    """SIGTERM stopped the run at a step boundary; ``code`` is the exit status it asks for."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Family:
    """What the loop needs of the model families beyond a model's own functions. The command
    (``jaxshard.train``) gives it, so the library imports no model code."""

    build: Callable[..., Any]  # (cfg, tokenizer_vocab=None, documents_eot=None) -> model
    load_weights: Callable[[str, Any, Any], Any]  # (--init-from folder, model, shardings) -> params
    check_export: Callable[[Any, str], None]  # (model config, --export-hf folder): fail now, not after training
    export: Callable[..., Path]  # (params, model config, folder, tokenizer_json, eot_id) -> folder
    generate: Callable[..., list[list[int]]]  # (model, params, prompts, n, **sampling, rules=...)


def train(cfg: RunConfig, family: Family, started: float | None = None) -> dict[str, Any]:
    """Train the model ``cfg`` names; returns (and writes, with ``--report``) the report.
    Raises :class:`Preempted` when SIGTERM ends the run early (after saving, with a checkpoint
    folder). ``started``: the command's start (``time.perf_counter``), where goodput's wall
    time begins (default: now)."""
    goodput = Goodput(started)
    B, L = cfg.batch_size, cfg.seq_len
    mesh = build_mesh(cfg.mesh, dcn=cfg.dcn_mesh)
    rules = ShardingRules(mesh, cfg.strategy)
    window = ProfileWindow.parse(cfg.outputs.profile_steps, cfg.outputs.profile_dir)
    if window is not None:
        window.check(cfg.steps)
    if cfg.checkpoint.export:
        check_export_path(cfg.checkpoint.export)
    ckpt = Checkpointer(cfg.checkpoint) if cfg.checkpoint.directory else None
    try:
        tokenizer = None
        meta = ckpt.latest_meta() if ckpt is not None and cfg.checkpoint.resume else None
        if meta and meta.get("tokenizer"):
            tokenizer = tokenizer_lib.HFTokenizer.from_json(meta["tokenizer"], meta.get("tokenizer_spec", "checkpoint"))
            _log(f"tokenizer: the checkpoint's ({meta.get('tokenizer_spec')}, {tokenizer.vocab_size:,} tokens)")
        corpus = data_lib.load_corpus(cfg.data, tokenizer)
        if meta and meta.get("data_position") and not corpus.sources:  # (its samples count the mixture's stream)
            raise DataError(f"the checkpoint was trained on the mixture {mixture.describe(meta['data_position'])}: "
                            "resume with the same --data")
        text = corpus.tokenizer is not None and corpus.tokenizer.to_json() is not None
        vocab = corpus.tokenizer.vocab_size if text else None
        model = family.build(cfg, tokenizer_vocab=vocab)
        eot = documents_eot(cfg, corpus.tokenizer.eot_id if corpus.tokenizer is not None else None,
                            corpus.name, rules, model.cfg)
        if eot is not None:
            model = family.build(cfg, tokenizer_vocab=vocab, documents_eot=eot)
        if cfg.checkpoint.export_hf:
            family.check_export(model.cfg, cfg.checkpoint.export_hf)
        if cfg.step.balance:
            step, line = balance_stages(model, rules, cfg.step, B, L)
            _log(line)
            cfg = dataclasses.replace(cfg, step=step)
        if cfg.sync_every is not None:
            program = local_sgd.build_local_sgd_program(model, rules, cfg.optim, cfg.step, cfg.sync_every,
                                                        measure_spread=False)
        else:
            program = build_program(model, rules, cfg.optim, cfg.step)  # nothing compiled yet
        check_batch(rules, B, L, cfg.step.grad_accum, program.schedule.microbatches if program.schedule else 1)
        if cfg.measure_bubble and program.schedule is None:
            raise ConfigError("--measure-bubble needs a stage axis (a pipeline) in --mesh")
        _check_model_fits_data(model, corpus, L)
        eval_sets = data_lib.load_eval_sets(cfg.data, corpus)
        return _train(cfg, model, rules, corpus, program, ckpt, window, family, goodput, eval_sets)
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for the last save to be complete


def _train(cfg: RunConfig, model: LanguageModel, rules: ShardingRules, corpus: data_lib.Corpus,
           program: Program, ckpt: Checkpointer | None, window: ProfileWindow | None,
           family: Family, goodput: Goodput, eval_sets: dict[str, np.ndarray]) -> dict[str, Any]:
    B, L = cfg.batch_size, cfg.seq_len
    mesh = rules.mesh
    tokenizer = corpus.tokenizer  # None: the data came as ids
    _log(f"model {model.cfg.name}: {model.n_params():,} params | mesh {axis_sizes(mesh)} | "
         f"strategy {rules.name}{f' + local SGD, averaged every {cfg.sync_every} steps' if cfg.sync_every else ''} | remat {model.remat} | {jax.device_count()} {jax.default_backend()} devices"
         + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    if model.cfg.documents_eot is not None:
        _log(f"documents packed: attention within each, positions from 0 in each, no loss after an "
             f"end-of-text (id {model.cfg.documents_eot}; --packing false: one sequence per window)")
    schedule = program.schedule
    if schedule:
        chunks = f" x {schedule.virtual} chunks" if schedule.virtual > 1 else ""
        tables = f"{schedule.idle():.0%}"  # a zero-bubble schedule's own, where it is not the theory's
        tables = f" (these tables: {tables})" if schedule.split and tables != f"{schedule.bubble():.0%}" else ""
        _log(f"pipeline {schedule.kind}: {schedule.stages} stages{chunks} (layers {schedule.layout.describe()}), "
             f"{schedule.microbatches} microbatches in {schedule.ticks} ticks, bubble "
             f"{schedule.bubble_formula} = {schedule.bubble():.0%}{tables}, {schedule.slots} microbatches' "
             f"activations kept per stage")
        for note in (schedule.idle_note(), schedule.memory_note(model.remat)):
            if note:
                _log(f"note: {note}")
    if unbalanced := attention.imbalance_note(model.cfg, L, rules):
        _log(f"note: {unbalanced}")
    state, start, samples, resumed = _start(cfg, program, model, ckpt, family)
    t0 = time.perf_counter()
    compiled = program.lower_step(B, L).compile()
    compile_s = time.perf_counter() - t0
    goodput.add("compile", compile_s)
    if start >= cfg.steps:
        _log(f"the checkpoint is at step {start}, already --steps {cfg.steps}: nothing to do")
        return {}
    held = {"params": inspect.max_bytes_per_device(state.params),
            "opt_state": inspect.max_bytes_per_device(state.opt_state),
            "host": inspect.max_bytes_per_device(state, "host")}
    _log(f"compiled in {compile_s:.1f}s | per device: params {held['params']:,} B, "
         f"optimizer state {held['opt_state']:,} B"
         + (f" ({held['host']:,} B of them in host memory)" if held["host"] else ""))

    flops = step_flops(cfg, model, rules, B, L)
    peak, peak_source = devices.peak_flops(cfg.peak.device, cfg.peak.peak_tflops, cfg.step.compute_dtype,
                                           jax.devices()[0], fp8=model.cfg.fp8 is not None)
    n_dev = jax.device_count()
    _log(f"model FLOPs per step {flops.model:.3e} ({flops.formula}); MFU peak: {peak_source}")
    # The compiled step's matmuls against the useful ones (XLA:CPU's dots, a pipeline's tick ops
    # as its tables run them; a GPU's library calls are not counted).
    # Dropless experts' tiles run as many times as the routing asks: counted at k rows a token
    # here, and again at the rows the steps ran (their ``moe_computed``) for the report.
    def count_waste(computed: float | None = None) -> dict[str, Any] | None:
        return accounting.matmul_waste(flops, compiled.as_text(), model.cfg, rules, B, L, computed=computed,
                                       grad_accum=cfg.step.grad_accum, schedule=schedule)

    def waste_line(waste: dict[str, Any], tiles: str) -> str:
        return (f"matmul FLOPs per device: compiled {waste['compiled']:.3e} = x{waste['ratio']:.2f} the useful "
                f"{waste['useful']:.3e} (recompute {waste['recompute']:.2e}, masked attention and empty expert "
                f"slots {waste['masked_or_padding']:.2e}: x{waste['unexplained']:.2f} what they explain)"
                + (f"; the dropless experts' tiles at {tiles}" if waste["data_dependent"] else ""))

    waste = count_waste() if jax.default_backend() == "cpu" and cfg.sync_every is None else None
    if waste is not None:
        _log(waste_line(waste, "k rows a token until the steps say how many ran"))
    elif jax.default_backend() == "cpu" and (why := accounting.uncounted(compiled.as_text(), schedule)):
        _log(f"matmul FLOPs per device: not counted ({why})")

    def throughput(dt: float) -> dict[str, float]:
        out = {"tokens_per_s": B * L / dt, "tflops_per_device": flops.model / n_dev / dt / 1e12}
        if peak:
            out["mfu"] = flops.model / n_dev / dt / peak
            out["hfu"] = flops.hardware / n_dev / dt / peak
        return out

    rows, cols = data_lib.process_block(program.batch_sharding, B, L)
    train_data = data_lib.split_batches(corpus, "train", L, B, cfg.step.seed, rows, cols)
    val_data = data_lib.split_batches(corpus, "val", L, B, cfg.step.seed, rows, cols)
    mixed = isinstance(train_data, MixedBatches)
    if mixed:
        _log("mixture: " + ", ".join(f"{s.name} {s.weight:.1%} ({len(s.train):,} tokens)" for s in corpus.sources)
             + " of documents")
        if resumed and resumed.get("data_position"):
            train_data.seek(resumed["data_position"])  # no need to draw the stream again up to here
    more_val = {name: data_lib.Batches(tokens, L, B, cfg.step.seed, rows, shuffle=False, cols=cols,
                                       what=f"--eval-data set {name}") for name, tokens in eval_sets.items()}
    if eval_sets:
        _log("validation sets: the data's tail split" + "".join(
            f", {name} ({len(tokens):,} tokens)" for name, tokens in eval_sets.items()))

    dog = Watchdog(cfg.step_timeout)
    if cfg.step_timeout is not None:  # (the automatic limit is the module's; said in --help)
        _log(f"watchdog: a step that takes over {cfg.step_timeout:g} s stops the run (exit status "
             f"{EXIT_STATUS})" if dog.enabled else "watchdog: off (--step-timeout 0)")

    def validate() -> dict[str, float]:
        """``val_loss`` (the tail split's), and ``val/NAME/loss`` and ``val/NAME/perplexity`` of
        each ``--eval-data`` set."""
        with dog.paused(), goodput.timed("evaluation"):
            out = {"val_loss": _validate(val_data)}
            for name, data in more_val.items():
                out[f"val/{name}/loss"] = loss = _validate(data)
                out[f"val/{name}/perplexity"] = math.exp(min(loss, 700.0))
            return out

    def _validate(data: data_lib.Batches) -> float:
        losses = [program.eval(state.params, data_lib.to_global(data.batch_at(i * B), program.batch_sharding, (B, L)))
                  for i in range(cfg.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    def val_text(record: dict[str, Any]) -> str:
        return f" | val {record['val_loss']:.4f}" + "".join(
            f" | {name} {record[f'val/{name}/loss']:.4f}" for name in more_val)

    def save(step: int, samples: int) -> None:
        with dog.paused(), goodput.timed("checkpoint"):
            _save(step, samples)

    def _save(step: int, samples: int) -> None:
        timer.saved()
        ckpt.save(step, program.saved(state), {"step": step, "samples_seen": samples, "seed": cfg.step.seed,
                                "batch_size": B, "seq_len": L, "model": model.cfg.name,
                                "mesh": axis_sizes(mesh), "strategy": rules.name,
                                "param_shapes": param_shapes(model.abstract_params()),
                                "model_config": model.cfg.to_dict(),
                                "tokenizer_spec": tokenizer and tokenizer.spec,
                                "tokenizer": tokenizer and tokenizer.to_json(), "flags": cfg.flags,
                                # a mixture's place in its stream of documents (mixture.MixedBatches)
                                "data_position": train_data.position(samples) if mixed else None})
        _fault("save", step)

    def evaluates(step: int) -> bool:
        return step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)

    timer = SaveTimer(cfg.checkpoint.save_every_minutes)

    def saves(step: int) -> bool:
        return ckpt is not None and (step == cfg.steps or bool(
            cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0) or timer.due(step))

    done_before = _keep_metrics_until(cfg.outputs.metrics, start)  # a crashed run's steps past its checkpoint
    records: list[dict[str, Any]] = []
    val_loss = None
    clock = StepClock()
    writer = MetricsLog(cfg.outputs.metrics if jax.process_index() == 0 else None, append=start > 0)
    board = TensorBoardLog(cfg.outputs.tensorboard, start_step=start)
    bar = progress(cfg.steps, not cfg.outputs.no_progress and jax.process_index() == 0)
    bar.update(start)
    log_every = cfg.outputs.log_every or max(1, cfg.steps // 10)

    def complete(i: int, metrics: dict) -> None:
        """Read step ``i``'s metrics (waiting for it to finish), log them, and at the steps
        that asked for it -- only ever the newest step -- evaluate and checkpoint."""
        nonlocal val_loss
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        dt = clock.seconds(i)  # (StepClock says what a step's time holds)
        step = i + 1
        if m.get("skipped") and jax.process_index() == 0:
            bar.write(f"step {step}: float16 gradients overflowed at loss scale "
                      f"{m['loss_scale']:g}; step skipped, scale halved")
        dog.beat(step, dt)
        goodput.add("recomputed" if step <= done_before else "steps", dt)
        record = {"step": step, **m, "step_time_s": dt, **throughput(dt)}
        if math.isfinite(m["loss"]) and evaluates(step):
            record.update(validate())
            val_loss = record["val_loss"]
        writer.write(record)
        board.write(step, record)
        records.append(record)
        if not math.isfinite(m["loss"]):
            raise TrainingError(f"loss is {m['loss']} at step {step}; lower --lr or check the "
                                "data (no report written)")
        if saves(step):
            save(step, samples + (step - start) * B)
        speed = (f"{record['mfu']:.1%}" if "mfu" in record
                 else f"{record['tflops_per_device'] * 1e3:,.2f} GFLOP/s/dev")
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                        **{"mfu" if "mfu" in record else "speed": speed}, refresh=False)
        bar.update()
        if (step % log_every == 0 or "val_loss" in record) and jax.process_index() == 0:
            val = val_text(record) if "val_loss" in record else ""
            bar.write(f"step {step}/{cfg.steps} | loss {m['loss']:.4f}{val} | "
                      f"{record['tokens_per_s']:,.0f} tokens/s | {'MFU ' if 'mfu' in record else ''}{speed}")

    def make_batch(i: int) -> dict:
        return data_lib.to_global(train_data.batch_at(samples + (i - start) * B), program.batch_sharding, (B, L))

    # The devices never wait on the host: batches are made and put on the devices ahead on a
    # background thread, and step i's metrics are read after step i + 1 is dispatched (so a
    # non-finite loss stops the run one step late, before anything is saved). Only the steps
    # that evaluate or checkpoint -- which need that step's state -- wait for themselves.
    def dispatch(i: int) -> dict:
        nonlocal state
        _fault("step", i + 1, ckpt)
        if window is not None:
            with dog.paused():  # starting a trace, and below writing it, are not the step's
                window.before(i + 1)
        started = time.perf_counter()
        batch = batches.get(i)
        state, metrics = compiled(state, batch)
        clock.dispatched(i, metrics, started)
        if window is not None:
            with dog.paused():
                window.after(i + 1, lambda: jax.block_until_ready(state))
        return metrics

    with writer, board, bar, data_lib.Prefetch(make_batch, range(start, cfg.steps)) as batches, \
            Termination() as term, dog:
        try:
            if cfg.eval_at_start:  # a record of its own: step ``start``'s weights, before any update
                baseline = {"step": start, **validate()}
                writer.write(baseline)
                board.write(start, baseline)
                if jax.process_index() == 0:
                    bar.write(f"step {start}/{cfg.steps}{val_text(baseline)} (before training)")
            # Start-up: everything before the first step but its compilation (and a first evaluation).
            goodput.add("startup", time.perf_counter() - goodput.start - sum(goodput.seconds.values()))
            stopped = run_pipelined(range(start, cfg.steps), dispatch, complete,
                                    waits=lambda i: evaluates(i + 1) or saves(i + 1), stop=term.agreed)
        finally:
            clock.close()
            if window is not None:
                window.close()
    finished = time.perf_counter()
    if ckpt is not None and stopped is None:  # the last save's background write, waited for here
        with goodput.timed("checkpoint"):
            ckpt.wait()
        finished = time.perf_counter()
    if stopped is not None:  # the preemption's save is checkpoint time; goodput still told
        try:
            with goodput.timed("checkpoint"):
                _preempted(stopped, samples + (stopped - start) * B, ckpt, save)
        finally:
            _tell_goodput(goodput, cfg.outputs.tensorboard, stopped)
    saved = program.saved(state)
    if isinstance(program, local_sgd.LocalSGDProgram):  # the replicas' average is the model
        saved = saved._replace(params=local_sgd.consensus(saved.params))
    if cfg.checkpoint.export:
        _log(f"exported params to {export_params(saved.params, cfg.checkpoint.export)}")
    if cfg.checkpoint.export_hf:
        path = family.export(saved.params, model.cfg, cfg.checkpoint.export_hf, tokenizer and tokenizer.to_json(),
                         tokenizer and tokenizer.eot_id)
        _log(f"exported a Hugging Face model to {path}")
    if cfg.sample_tokens and tokenizer is None:
        _log("no sample: the data came as token ids without a tokenizer (give --tokenizer)")
    elif cfg.sample_tokens:
        _sample(cfg, model, rules, saved.params, tokenizer, family.generate)
    measured = None
    if cfg.measure_bubble:
        state = None  # (saved and exported above) the timed programs make their own
        _log(f"measuring the bubble: the step and each stage's work alone ({schedule.stages + 3} programs)")
        measured = bubble.measure(
            lambda table: program if table is None else build_program(model, rules, cfg.optim, cfg.step, table),
            schedule, B, L, model.cfg.vocab_size, steps=5)
        _log(measured.line())
    ran = [r["moe_computed"] for r in records if "moe_computed" in r]
    if waste is not None and waste["data_dependent"] and ran:
        waste = count_waste(float(np.mean(ran)))
        _log(waste_line(waste, f"the rows the steps ran ({np.mean(ran):.3f} x k a token)"))
    report = _report(cfg, model, rules, compiled, held, records, val_loss, corpus, compile_s,
                     throughput, flops, peak_source, program, measured, eval_sets)
    if mixed:  # the documents drawn from each source (this run's and, resumed, its predecessors')
        report["mixture"] = drawn = train_data.drawn(samples + (records[-1]["step"] - start) * B)
        total = sum(d["documents"] for d in drawn)
        _log(f"mixture drawn ({total:,} documents): " + ", ".join(
            f"{d['source']} {d['share']:.1%} (weight {d['weight']:.1%})" for d in drawn))
    report["matmul_flops_per_device"] = waste  # accounting.Flops.waste; None where not counted
    report["predicted"]["time_model"] = predicted = _time_model(cfg, model, rules, schedule, flops)
    if predicted:
        _log(f"time model ({predicted['device']}): {predicted['step_time_s']:.4f} s per step, MFU "
             f"{predicted['mfu']:.1%} predicted; measured {report['step_time_s_median']:.4f} s"
             + (f", MFU {report['mfu']:.1%}" if report["mfu"] is not None else ""))
    goodput.add("finish", time.perf_counter() - finished)
    report["goodput"] = _tell_goodput(goodput, cfg.outputs.tensorboard, records[-1]["step"])
    if cfg.outputs.report and jax.process_index() == 0:
        write_json_atomic(cfg.outputs.report, report)
    return report


def _tell_goodput(goodput: Goodput, tensorboard: str | None, step: int) -> dict[str, Any]:
    """Goodput's summary, printed as one line and written to TensorBoard at ``step``."""
    spent = goodput.summary()
    _log(goodput.line(spent))
    with TensorBoardLog(tensorboard) as board:  # (a file of its own: the steps' is closed)
        board.write(step, {f"goodput_{k}": v for k, v in spent["fractions"].items()})
    return spent


def run_pipelined(steps: range, dispatch: Callable[[int], Any], complete: Callable[[int, Any], None],
                  waits: Callable[[int], bool], stop: Callable[[int], bool] = lambda i: False) -> int | None:
    """``dispatch(i)`` for each step in order and ``complete(i, dispatch(i))`` one step late,
    after ``dispatch(i + 1)``, so the devices have the next step queued while the host reads
    this one's results; a step where ``waits(i)`` (evaluation, checkpoint, the last) completes
    right after its own dispatch. ``stop(i)`` is asked before dispatching step ``i``: if true,
    the steps before it are completed and ``i`` is returned (None when all ran)."""
    pending = None
    for i in steps:
        if stop(i):
            if pending is not None:
                complete(*pending)
            return i
        out = dispatch(i)
        if pending is not None:
            complete(*pending)
            pending = None
        if waits(i) or i == steps[-1]:
            complete(i, out)
        else:
            pending = (i, out)


class StepClock:
    """Each step's time: from the previous step's completion to its own, where a step completes
    when its outputs are ready -- seen by a thread that waits on them in order, not by the host
    when it reads the metrics. Where the previous step was read before this one was dispatched
    (it evaluated or checkpointed, or there is none), from this one's dispatch if later: the
    pause between is not a step's. Elsewhere the interval holds whatever held the devices up,
    host work included, so the steps' times add up to the wall time.

    The host reads a step's metrics one step late, after dispatching the next step, and a
    dispatch can hold the host (a second call's one-off work; a step whose loops wait on the
    device): timed from that read, the wait would count to the earlier step and be missing from
    the later one (an H200's MoE run logged MFU 289% at step 2). ``wait``: what waits for a
    step's outputs (``jax.block_until_ready``)."""

    def __init__(self, wait: Callable[[Any], Any] = jax.block_until_ready):
        self._wait = wait
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon: a step that never completes (its peer process died) must not hold the exit.
        threading.Thread(target=self._watch, name="step-clock", daemon=True).start()
        self._steps: dict[int, tuple[float | None, Future]] = {}
        self._last = 0.0  # when the previous step completed

    def dispatched(self, i: int, outputs: Any, started: float) -> None:
        """Step ``i`` was dispatched at ``started`` (``time.perf_counter``) and gives ``outputs``."""
        read_before = i - 1 not in self._steps  # (else the previous step is still to be read)
        ready: Future = Future()
        self._queue.put((outputs, ready))
        self._steps[i] = (started if read_before else None, ready)

    def _watch(self) -> None:
        while (item := self._queue.get()) is not None:
            outputs, ready = item
            try:
                self._wait(outputs)
                ready.set_result(time.perf_counter())
            except BaseException as e:  # (raised where the step is read)
                ready.set_exception(e)

    def seconds(self, i: int) -> float:
        """Step ``i``'s time, once it has completed (waiting for it), in the order of the steps."""
        started, ready = self._steps.pop(i)
        done = ready.result()
        dt = done - (self._last if started is None else max(self._last, started))
        self._last = done
        return dt

    def close(self) -> None:
        self._queue.put(None)


class SaveTimer:
    """``--save-every-minutes``: whether a step saves because that long has passed since the last
    save, decided once per step. With several processes (whose clocks differ, and which must save
    the same step) only every ``every``-th step decides, by a small all-gather: any process late
    makes all save."""

    def __init__(self, minutes: float, every: int = 10, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.every, self.clock = minutes * 60, every, clock
        self.last = clock()
        self._decided: dict[int, bool] = {}

    def saved(self) -> None:
        self.last = self.clock()

    def due(self, step: int) -> bool:
        if not self.seconds:
            return False
        if step not in self._decided:
            late = self.clock() - self.last >= self.seconds
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                late = step % self.every == 0 and bool(np.any(multihost_utils.process_allgather(np.int32(late))))
            self._decided[step] = late
        return self._decided[step]


class Termination:
    """SIGTERM (a scheduler's preemption notice) asks the run to stop at the next step boundary;
    :meth:`agreed` says whether to stop before step ``i``. With several processes the request is
    agreed every ``every`` steps (each may receive the signal at a different step, and they
    must stop at the same one): a small all-gather, which waits for the step before it."""

    def __init__(self, every: int = 10):
        self.requested, self.every, self._previous = False, every, None

    def __enter__(self) -> Termination:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, i: int) -> bool:
        if jax.process_count() == 1:
            return self.requested
        if i % self.every:
            return False
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))


def _preempted(step: int, samples: int, ckpt: Checkpointer | None, save: Callable[[int, int], None]) -> None:
    """After SIGTERM stopped the run with ``step`` steps done: save them (unless that step is
    saved already) and raise :class:`Preempted` -- exit status 0 with a checkpoint, 143 (killed
    by SIGTERM) without a --checkpoint-dir to save into."""
    if ckpt is None:
        raise Preempted(f"SIGTERM: stopped after step {step}; nothing saved (no --checkpoint-dir)", 143)
    if ckpt.latest_step() != step:
        save(step, samples)
    ckpt.close()  # the save is complete before the process exits
    raise Preempted(f"SIGTERM: saved step {step} in {ckpt.directory}; continue with --resume", 0)


def _sample(cfg: RunConfig, model: LanguageModel, rules: ShardingRules, params: Any, tokenizer: Any,
            generate: Callable[..., list[list[int]]]) -> None:
    """Print ``--sample-tokens`` tokens generated from ``--sample-prompt`` (temperature 0.8,
    top-p 0.95, --seed): what the model learned, at a glance."""
    prompt = [int(t) for t in tokenizer.encode(cfg.sample_prompt)]
    try:
        new = generate(model, params, [prompt], cfg.sample_tokens, temperature=0.8, top_p=0.95,
                       seed=cfg.step.seed, rules=rules, stop_id=tokenizer.eot_id)[0]
    except ConfigError as e:
        _log(f"no sample: {e}")
        return
    text = tokenizer.decode(new[:-1] if new and new[-1] == tokenizer.eot_id else new)
    _log(f"sample ({len(new)} tokens after {cfg.sample_prompt!r}):\n{cfg.sample_prompt}{text}")


def _unpriced(cfg: RunConfig, model: Stageable, rules: ShardingRules) -> str | None:
    """Why the time model cannot price this run's step on a GPU, or None: it knows the rates of
    cuDNN's flash attention alone, prices every layer as a dense one and every matmul in the
    compute dtype, and a step as one that reduces the gradients."""
    if cfg.sync_every is not None:
        return "--sync-every's local steps do not reduce gradients, and its synchronising ones average the params"
    if model.cfg.fp8 is not None:
        return "it prices no float8 matmuls"
    kernel = _gpu_kernel(cfg, model.cfg)
    if kernel != "cudnn":
        return f"its attention would run the {kernel} kernel, whose rate is not measured (only cuDNN's is)"
    if why := timing.unpriced_attention(rules, timing.SOFTWARE["jaxshard"], cfg.step.compute_dtype):
        return why
    if cfg.data.packing:
        return "--packing true runs the blockwise attention kernel, whose rate is not measured (only cuDNN's is)"
    if getattr(model.cfg, "moe_experts", 0):
        return "it prices MoE layers as dense ones"
    return None


def _time_model(cfg: RunConfig, model: Stageable, rules, schedule, flops) -> dict[str, Any] | None:
    """The time model's step time and MFU for this run (``analysis.timing``, as ``plan.py``
    prices it), beside the measured ones: where the device is known (``--device`` or a
    recognised GPU) and the model can price the step (:func:`_unpriced`; else a log line says
    why); None otherwise."""
    device = devices.known_device(cfg.peak.device, jax.devices()[0])
    if device is None:
        return None
    if why := _unpriced(cfg, model, rules):
        _log(f"time model ({device.name}): not priced: {why}")
        return None
    device = dataclasses.replace(device, per_host=jax.local_device_count())
    pipe = dict(microbatches=schedule.microbatches, virtual_stages=schedule.virtual) if schedule else {}
    t = timing.step_time(model, rules, device, cfg.batch_size, cfg.seq_len, software=timing.SOFTWARE["jaxshard"],
                         compute_dtype=cfg.step.compute_dtype, param_dtype=cfg.step.param_dtype, remat=model.remat,
                         grad_accum=cfg.step.grad_accum, **pipe)
    peak = device.peak(cfg.step.compute_dtype)
    return {"device": device.name, "step_time_s": t.total,
            "mfu": flops.model / jax.device_count() / t.total / peak, "parts": t.as_dict()}


def _report(cfg: RunConfig, model: Stageable, rules, compiled, held, records, val_loss, corpus, compile_s,
            throughput, flops, peak_source, program: Program, measured=None,
            eval_sets: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    B, L = cfg.batch_size, cfg.seq_len
    last = next((r for r in reversed(records) if "val_loss" in r), {})
    schedule, program_buckets = program.schedule, program.buckets
    timed = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    median = throughput(float(np.median(timed)))
    kwargs = accounting.step_options(cfg.step, model, program)
    found = inspect.compiled_collectives(compiled, rules.mesh)
    # (Under a pipeline, what the schedule's slots run -- FSDP's gathers, TP's reductions -- is
    # not predicted.)
    # Attention by cuDNN's or the blockwise flash kernel (attention.gpu_kernel): no probabilities kept.
    flash = _dense_kernel(cfg, model.cfg) != "xla" and not rules.activation_mesh_axes(Dim.LENGTH)
    predicted_memory, comm = accounting.predict(model, rules, B, L, schedule, flash=flash, **kwargs)
    report = {
        "model": model.cfg.name,
        "mesh": axis_sizes(rules.mesh),
        "strategy": rules.name,
        "zero": cfg.strategy.zero,
        "backend": jax.default_backend(),
        "n_devices": jax.device_count(),
        "n_processes": jax.process_count(),
        "n_params": model.n_params(),
        "steps": cfg.steps,
        "first_step": records[0]["step"],
        "batch_size": B,
        "seq_len": L,
        "grad_accum": cfg.step.grad_accum,
        "compute_dtype": cfg.step.compute_dtype,
        "param_dtype": cfg.step.param_dtype,
        "remat": str(model.remat),
        "packing": model.cfg.documents_eot is not None,
        "reshard_after_forward": cfg.strategy.reshard_after_forward,
        "reducer": cfg.step.reducer,
        "sync_every": cfg.sync_every,
        "buckets": program_buckets and [{"kind": b.kind, "bytes": b.bytes, "params": len(b.pieces)}
                                        for b in program_buckets],
        "offload": list(cfg.strategy.offload),
        "skipped_steps": int(records[-1].get("skipped_steps", 0)),
        "per_device_bytes": held,
        "xla_memory": inspect.xla_memory(compiled),
        # What the allocator held at most on this process's first device (GPUs; None on CPU).
        "peak_bytes_in_use": (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "collectives": hlo.summary([c for c in found if not ((schedule or cfg.sync_every) and c.conditional)]),
        # Local SGD: what its synchronising steps run (a conditional's branch), per such step.
        "collectives_when_synchronising": cfg.sync_every and hlo.summary([c for c in found if c.conditional]),
        # A pipeline's slots run these as often as the schedule gives a stage work; the counts
        # here are as if every tick ran them (XLA's loop does not record which ran).
        "collectives_in_slots": schedule and hlo.summary([c for c in found if c.conditional]),
        "predicted": {
            "argument_bytes": predicted_memory.argument, "activation_bytes": predicted_memory.activations,
            "temp_bytes": predicted_memory.temp,
            "collectives": [{"kind": k, "bytes": b} for k, b in sorted(comm.by_kind().items())],
            "collectives_scope": "outside the pipeline's slots" if schedule else "the whole step"}
        if cfg.sync_every is None else {  # local SGD: its own program (jaxshard/training/local_sgd.py)
            "argument_bytes": predicted_memory.argument,
            "collectives": local_sgd.predicted_collectives(model, cfg.sync_every),
            "collectives_scope": "beyond the loss's scalars"},
        "pipeline": schedule and {"schedule": schedule.kind, "stages": schedule.stages,
                                  "virtual_stages": schedule.virtual,
                                  "stage_layers": list(schedule.layout.layers),
                                  "assignment": schedule.layout.describe(),
                                  "microbatches": schedule.microbatches, "ticks": schedule.ticks,
                                  "microbatches_kept_per_stage": schedule.slots,
                                  "bubble_theory": schedule.bubble(),
                                  # --measure-bubble: jaxshard.analysis.bubble's measurement
                                  "measured": measured and measured.as_dict()},
        "program_fingerprint": hlo.fingerprint(compiled.as_text()),
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
        # --eval-data: each set's loss and perplexity at the last evaluation
        "eval_sets": {name: {"tokens": len(tokens), "final_loss": last.get(f"val/{name}/loss"),
                             "final_perplexity": last.get(f"val/{name}/perplexity")}
                      for name, tokens in (eval_sets or {}).items()},
        "data": corpus.name,
        "tokenizer": corpus.tokenizer and {"spec": corpus.tokenizer.spec,
                                           "vocab_size": corpus.tokenizer.vocab_size},
        "model_config": model.cfg.to_dict(),
        "config": cfg.flags,
    }
    speed = f"MFU {report['mfu']:.1%}" if report["mfu"] is not None else \
        f"{report['tflops_per_device'] * 1e3:,.2f} GFLOP/s per device"
    more = "".join(f", {name} {r['final_loss']:.3f}" for name, r in report["eval_sets"].items()
                   if r["final_loss"] is not None)
    _log(f"done: loss {report['first_loss']:.3f} -> {report['final_loss']:.3f}, val {val_loss:.3f}{more}, "
         f"{report['tokens_per_s']:,.0f} tokens/s, {speed}")
    return report
