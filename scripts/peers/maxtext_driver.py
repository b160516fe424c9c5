#!/usr/bin/env python3
"""Time MaxText pre-training steps of a small Llama-2-style model on fake CPU devices.

What it runs
------------
MaxText's own pre-training entry point (``maxtext.trainers.pre_train.train.main``,
i.e. what ``python -m maxtext.trainers.pre_train.train base.yml key=value ...`` runs),
in-process, through ``absl.app.run`` like the module's ``__main__`` does, with:

  * N fake CPU devices (JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=N,
    set before jax is imported; N = product of the --mesh axes, 8 by default),
  * MaxText's bundled ``configs/base.yml`` plus key=value overrides (see ``build_overrides``):
    synthetic data, no checkpointing, no profiler, no TensorBoard / GCS metrics / goodput,
    hardware=cpu, no jax.distributed, no persistent compilation cache,
    decoder_block=llama2, float32 activations and weights, AdamW (MaxText defaults otherwise:
    remat_policy=full, scan_layers=true, attention=autoselected -> dot_product on CPU),
  * the ICI mesh from --mesh (axes: data, fsdp, tensor, ...; unnamed axes are set to 1).

Output
------
stdout carries only JSON lines:
  {"step": i, "step_time_s": t}      one per completed training step, i 0-based as MaxText counts.
  {"summary": true, ...}             once at the end.
Everything else (MaxText/absl/XLA logs, MaxText's print()s) goes to stderr: the real stdout
file descriptor is duplicated for the JSON lines and fd 1 is then pointed at stderr.

step_time_s is MaxText's own ``perf/step_time_seconds`` metric (the value it logs as
"completed step: i, seconds: t"), taken by wrapping ``MetricLogger.write_metrics``, not by parsing
logs. MaxText measures it as wall time between consecutive returns from the (asynchronously
dispatched) jitted train step; its metric logger materialises the previous step's metrics each
iteration, so the loop runs at most one step ahead and the steady-state values are device step times.

peak_bytes_per_device is MaxText's own estimate from the AOT-compiled train step's
``memory_analysis()`` (argument + output + temp - alias bytes, per device), captured by wrapping
``max_utils.print_compiled_memory_stats``; null if unavailable.

Usage
-----
  python maxtext_driver.py --mesh fsdp=4,tensor=2 --steps 30 --batch-size 8 --seq-len 128 \
      --layers 4 --d-model 256 --heads 4 --mlp 1024 --vocab 256
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

MESH_AXES = (
    "data",
    "fsdp",
    "fsdp_transpose",
    "sequence",
    "context",
    "tensor",
    "tensor_sequence",
    "pipeline",
    "expert",
    "autoregressive",
)


def parse_mesh(spec):
  """'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2}."""
  mesh = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    name = name.strip()
    if name not in MESH_AXES or not size.strip().isdigit():
      raise SystemExit(f"bad --mesh entry {part!r}; expected AXIS=INT with AXIS in {MESH_AXES}")
    mesh[name] = int(size)
  return mesh


def build_overrides(args, mesh, num_devices, out_dir):
  """MaxText key=value overrides on top of configs/base.yml."""
  if args.batch_size % num_devices:
    raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the device count {num_devices}")
  head_dim = args.head_dim or args.d_model // args.heads
  o = {
      "run_name": "maxtext_driver",
      "base_output_directory": out_dir,
      # Runtime: single-process CPU, nothing external.
      "hardware": "cpu",
      "skip_jax_distributed_system": "true",
      "jax_cache_dir": "",  # empty -> None -> no persistent compilation cache (default is ~/jax_cache)
      "dataset_type": "synthetic",
      "enable_checkpointing": "false",
      "async_checkpointing": "false",
      "save_checkpoint_on_completion": "false",
      "enable_tensorboard": "false",
      "gcs_metrics": "false",
      "enable_goodput_recording": "false",
      "monitor_goodput": "false",
      "enable_gcp_goodput_metrics": "false",
      "enable_gcp_step_deviation_metrics": "false",
      "log_config": "true" if args.log_config else "false",
      "steps": str(args.steps),
      # Model: Llama-2-style decoder.
      "decoder_block": "llama2",
      "base_num_decoder_layers": str(args.layers),
      "base_emb_dim": str(args.d_model),
      "base_num_query_heads": str(args.heads),
      "base_num_kv_heads": str(args.kv_heads or args.heads),
      "head_dim": str(head_dim),
      "base_mlp_dim": str(args.mlp),
      "vocab_size": str(args.vocab),
      "max_target_length": str(args.seq_len),
      "per_device_batch_size": str(args.batch_size // num_devices),
      "dtype": "float32",
      "weight_dtype": "float32",
      "opt_type": "adamw",
  }
  # ICI mesh: every named axis from --mesh, all others 1 (base.yml defaults ici_fsdp_parallelism=-1).
  for axis in MESH_AXES:
    o[f"ici_{axis}_parallelism"] = str(mesh.get(axis, 1))
  for kv in args.extra:
    key, _, value = kv.partition("=")
    o[key] = value
  return [f"{k}={v}" for k, v in o.items()]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  p.add_argument("--mesh", default="fsdp=8", help="ICI mesh, e.g. fsdp=4,tensor=2 | fsdp=8 | data=8")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--batch-size", type=int, default=8, help="GLOBAL batch (sequences)")
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=0, help="0 = same as --heads")
  p.add_argument("--head-dim", type=int, default=0, help="0 = d_model // heads")
  p.add_argument("--mlp", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--out-dir", default="", help="MaxText base_output_directory (default: a fresh temp dir)")
  p.add_argument("--log-config", action="store_true", help="let MaxText log its full config (to stderr)")
  p.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE", help="extra MaxText override")
  args = p.parse_args()

  mesh = parse_mesh(args.mesh)
  num_devices = 1
  for size in mesh.values():
    num_devices *= size

  # Environment must be set before jax is imported (MaxText imports jax).
  os.environ["JAX_PLATFORMS"] = "cpu"
  xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  os.environ["XLA_FLAGS"] = " ".join(xla_flags + [f"--xla_force_host_platform_device_count={num_devices}"])
  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText's no-Google-Cloud mode: stubs gcloud deps
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

  # Keep the real stdout for JSON only; send everything else written to fd 1 to stderr.
  sys.stdout.flush()
  json_out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)

  def emit(obj):
    json_out.write(json.dumps(obj) + "\n")
    json_out.flush()

  import jax  # pylint: disable=import-outside-toplevel
  from absl import app  # pylint: disable=import-outside-toplevel
  import maxtext  # pylint: disable=import-outside-toplevel
  from maxtext.common import metric_logger  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  captured = {"config": None, "mem": None, "steps": 0}

  # Hook 1: MaxText's metric writer -> one JSON line per completed train step.
  orig_write_metrics = metric_logger.MetricLogger.write_metrics

  def write_metrics(self, metrics, step, metric_type="train"):
    if metric_type == "train" and metrics and "perf/step_time_seconds" in metrics.get("scalar", {}):
      emit({"step": int(step), "step_time_s": float(metrics["scalar"]["perf/step_time_seconds"])})
      captured["steps"] += 1
    return orig_write_metrics(self, metrics, step, metric_type)

  metric_logger.MetricLogger.write_metrics = write_metrics

  # Hook 2: the compiled train step's memory analysis (MaxText prints it right after AOT compile).
  orig_print_mem = max_utils.print_compiled_memory_stats

  def print_compiled_memory_stats(compiled_stats, prefix=""):
    if prefix == "train" and compiled_stats is not None:
      captured["mem"] = compiled_stats
    return orig_print_mem(compiled_stats, prefix=prefix)

  max_utils.print_compiled_memory_stats = print_compiled_memory_stats

  # Hook 3: keep the resolved config for the summary.
  orig_initialize = train.initialize

  def initialize(argv):
    config, recorder = orig_initialize(argv)
    captured["config"] = config
    return config, recorder

  train.initialize = initialize

  base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  out_dir = args.out_dir or tempfile.mkdtemp(prefix="maxtext_driver_")  # nothing is written there with these settings
  argv = ["maxtext_train", base_yml] + build_overrides(args, mesh, num_devices, out_dir)
  print("maxtext_driver argv: " + " ".join(argv), file=sys.stderr, flush=True)

  try:
    app.run(train.main, argv=argv)  # same as `python -m maxtext.trainers.pre_train.train <argv>`
  except SystemExit as e:
    if e.code not in (None, 0):
      raise
  finally:
    if not args.out_dir:
      shutil.rmtree(out_dir, ignore_errors=True)

  mem = captured["mem"]
  peak = None
  if mem is not None:
    peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
  cfg = captured["config"]
  summary = {
      "summary": True,
      "peak_bytes_per_device": peak,
      "maxtext_version": getattr(maxtext, "__version__", None) or _maxtext_version(),
      "jax_version": jax.__version__,
      "mesh": mesh,
      "num_devices": jax.device_count(),
      "steps_reported": captured["steps"],
  }
  if mem is not None:
    summary["memory_analysis"] = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }
  if cfg is not None:
    summary["maxtext_config"] = {
        k: str(getattr(cfg, k, None))
        for k in ("remat_policy", "scan_layers", "attention", "global_batch_size_to_train_on", "shardy")
    }
  emit(summary)


def _maxtext_version():
  try:
    from maxtext import version  # pylint: disable=import-outside-toplevel

    return version.__version__
  except ImportError:
    return None


if __name__ == "__main__":
  main()
