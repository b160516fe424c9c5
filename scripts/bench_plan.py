"""The time model against published training runs: each run's full configuration, its
published step time (or throughput), and jaxshard's prediction with the ratio.

    python scripts/bench_plan.py [--json runs/bench_plan.json]

Nothing here is fitted to a row: the device numbers are datasheet and measured ceilings
(``jaxshard.analysis.devices.SOURCES``), and the software's kernels and overlap are facts about
each code base (``jaxshard.analysis.timing.SOFTWARE``). Megatron's rows give TFLOP/s per GPU;
the step time follows from their FLOP count (Narayanan et al. 2021, Eq. 3). Runs only the
analysis: no device is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxshard.analysis import timing  # noqa: E402
from jaxshard.mesh import abstract_mesh  # noqa: E402
from jaxshard.analysis.devices import KNOWN_DEVICES  # noqa: E402
from jaxshard.remat import Remat  # noqa: E402
from jaxshard.rules import ShardingRules, Strategy  # noqa: E402
from models import TransformerLM  # noqa: E402
from models.config import ModelConfig, Mlp, Norm, Positions  # noqa: E402

NARAYANAN = "Narayanan et al. 2021 (Megatron-LM, SC21), Table 1"


def gpt(name: str, layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(name=name, n_layers=layers, d_model=hidden, n_heads=heads, d_mlp=4 * hidden,
                       vocab_size=51200, max_seq_len=2048, norm=Norm.LAYER, mlp=Mlp.GELU,
                       positions=Positions.LEARNED, tie_embeddings=True)


def llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int) -> ModelConfig:
    return ModelConfig(name=name, n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=kv, d_mlp=ffn,
                       vocab_size=vocab, max_seq_len=seq, norm=Norm.RMS, mlp=Mlp.SWIGLU,
                       positions=Positions.ROPE, use_bias=False, tie_embeddings=False)


@dataclass(frozen=True)
class Run:
    """A published run: the model, the cluster, the layout and what was measured."""

    source: str
    model: ModelConfig
    device: str
    gpus: int
    mesh: dict[str, int]  # outermost first; tensor innermost (within a host)
    batch: int  # global, sequences
    seq_len: int
    software: str
    remat: str
    published: str  # as the source states it
    step_s: float  # the published step time (derived from the stated figure where needed)
    microbatches: int = 1  # a pipeline's per step, or accumulation steps without one
    virtual_stages: int = 1
    recompute: float | None = None  # the share of forward matmuls the source's policy recomputes
    attention_recompute: float | None = None  # the share of the attention core's forward it recomputes
    compute_dtype: str = "bfloat16"
    # Why the prediction misses the published time by more than the goal (0.8-1.25), where it
    # does: what is known of the run that no measured quantity here prices.
    gap: str = ""


def megatron_step(m: ModelConfig, batch: int, gpus: int, tflops: float) -> float:
    """Step seconds from Megatron's TFLOP/s per GPU (its Eq. 3 count, sequence 2048)."""
    return timing.model_flops_per_token(m, 2048)["megatron_eq3"] * batch * 2048 / (gpus * tflops * 1e12)


def _megatron(name, layers, hidden, heads, gpus, tp, pp, dp, mbs, batch, tflops, v=1) -> Run:
    m = gpt(name, layers, hidden, heads)
    mesh = {"stage": pp, "data": dp, "tensor": tp} if pp > 1 else {"data": dp, "tensor": tp}
    per_replica = batch // dp
    return Run(NARAYANAN, m, "a100-80gb", gpus, mesh, batch, 2048, "megatron-2021", "full",
               f"{tflops} TFLOP/s per GPU", megatron_step(m, batch, gpus, tflops),
               microbatches=per_replica // mbs, virtual_stages=v, compute_dtype="float16")


RUNS = [
    _megatron("GPT 1.7B", 24, 2304, 24, 32, 1, 1, 32, 16, 512, 137),
    _megatron("GPT 7.5B", 36, 4096, 32, 128, 4, 1, 32, 16, 512, 142),
    _megatron("GPT 18.4B", 40, 6144, 48, 256, 8, 1, 32, 8, 1024, 135),
    _megatron("GPT 145.6B", 80, 12288, 96, 1536, 8, 8, 24, 2, 2304, 148, v=2),
    _megatron("GPT 529.6B", 105, 20480, 128, 2520, 8, 35, 9, 1, 2520, 163, v=3),
    Run("torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
        llama("Llama 3.1 8B", 32, 4096, 32, 8, 14336, 128256, 8192), "h100-hbm2e-500w", 8, {"fsdp": 8}, 16, 8192,
        # Selective "op" checkpointing: every second matmul recomputed, the flash attention's
        # output kept (torchtitan's _save_list names aten._scaled_dot_product_flash_attention).
        "torchtitan", "full", "5,762 tokens/s per GPU", 2 * 8192 / 5762, recompute=0.5, attention_recompute=0.0,
        gap="its H100s run at a 500 W power limit; torchtitan puts their peak between the SXM's 989 and "
            "the NVL's 835 TFLOP/s (its footnote 2): priced at the SXM's rates, an upper bound (at the "
            "NVL's, 0.81)"),
    Run("torchtitan docs/performance.md",
        llama("Llama 3 70B", 80, 8192, 64, 8, 28672, 128256, 8192), "a100-80gb", 64, {"fsdp": 64}, 64, 8192,
        "torchtitan", "full", "331 tokens/s per GPU", 8192 / 331),
    Run("MaxText configs/a3/llama_2_7b (1 host)",
        llama("Llama 2 7B", 32, 4096, 32, 32, 11008, 32000, 4096), "h100-a3-high", 8, {"fsdp": 8}, 32, 4096,
        "maxtext", "dots", "492 TFLOP/s per chip (6N + causal attention)", 0.0),
    Run("MaxText configs/a3/llama_2_7b (8 hosts)",
        llama("Llama 2 7B", 32, 4096, 32, 32, 11008, 32000, 4096), "h100-a3-high", 64, {"data": 8, "fsdp": 8}, 256,
        4096, "maxtext", "dots", "409 TFLOP/s per chip (6N + causal attention)", 0.0),
]


def maxtext_step(run: Run, tflops: float) -> float:
    """MaxText's TFLOP/s per chip count 6N + causal attention per token."""
    per_token = timing.model_flops_per_token(run.model, run.seq_len)["6n_causal_attention"]
    return per_token * run.batch * run.seq_len / run.gpus / (tflops * 1e12)


def abstract_rules(mesh: dict[str, int]) -> ShardingRules:
    return ShardingRules(abstract_mesh(mesh), Strategy())


def predict(run: Run) -> timing.StepTime:
    model = TransformerLM(run.model, remat=Remat.parse(run.remat))
    stages = run.mesh.get("stage", 1)
    return timing.step_time(
        model, abstract_rules(run.mesh), KNOWN_DEVICES[run.device], run.batch, run.seq_len,
        software=timing.SOFTWARE[run.software], compute_dtype=run.compute_dtype, remat=Remat.parse(run.remat),
        recompute=run.recompute, attention_recompute=run.attention_recompute, microbatches=run.microbatches if stages > 1 else 1,
        virtual_stages=run.virtual_stages, grad_accum=run.microbatches if stages == 1 else 1)


def published_step(run: Run) -> float:
    if run.step_s:
        return run.step_s
    return maxtext_step(run, float(run.published.split()[0]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--markdown", action="store_true", help="also print the rows as the docs' table")
    a = p.parse_args(argv)
    rows = []
    print(f"{'run':<14} {'device':<16} {'GPUs':>5} {'mesh':<26} {'published':<34} {'step s':>7} "
          f"{'predicted':>9} {'ratio':>6}  breakdown")
    for run in RUNS:
        t = predict(run)
        step = published_step(run)
        mesh = ",".join(f"{k}={v}" for k, v in run.mesh.items())
        parts = (f"matmul {t.matmul:.2f}, attention {t.attention:.2f}, memory {t.memory_bound:.2f}, "
                 f"optimizer {t.optimizer:.2f}, bubble {t.bubble:.2f}, exposed "
                 + ", ".join(f"{k} {v:.2f}" for k, v in t.exposed.items()))
        print(f"{run.model.name:<14} {run.device:<16} {run.gpus:>5} {mesh:<26} {run.published:<34} "
              f"{step:>7.2f} {t.total:>9.2f} {t.total / step:>6.2f}  {parts}")
        rows.append({"run": run.model.name, "source": run.source, "device": run.device, "gpus": run.gpus,
                     "mesh": run.mesh, "batch": run.batch, "seq_len": run.seq_len, "software": run.software,
                     "published": run.published, "published_step_s": step, "predicted": t.as_dict(),
                     "ratio": t.total / step, "gap": run.gap})
    if a.markdown:
        print("\n| run | device | GPUs | mesh | software | published | step s | predicted | ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
            print(f"| {r['run']} | {r['device']} | {r['gpus']} | `{mesh}` | {r['software']} | "
                  f"{r['published'].split(' (')[0]} | {r['published_step_s']:.2f} | {r['predicted']['step_s']:.2f} | "
                  f"{r['ratio']:.2f} |")
    for r in rows:
        if r["gap"]:
            print(f"{r['run']} on {r['device']} ({r['ratio']:.2f}): {r['gap']}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
