"""The step-time model (jaxshard.analysis.timing): its parts reduce to the published formulas
they come from, links are priced by where a group's devices sit, and the published runs'
benchmark runs (scripts/bench_plan.py; its ratios are in docs/seeing.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxshard.analysis import planner, timing
from jaxshard.analysis.devices import GB, KNOWN_DEVICES
from jaxshard.analysis.traffic import Transfer
from jaxshard.remat import Remat
from models import TransformerLM
from models.config import ModelConfig, Mlp, Norm, Positions

ROOT = Path(__file__).resolve().parents[1]
A100 = KNOWN_DEVICES["a100-80gb"]


def gpt3_like(layers=4, h=2048, a=16):
    return ModelConfig(name="gpt3-like", n_layers=layers, d_model=h, n_heads=a, d_mlp=4 * h, vocab_size=51200,
                       max_seq_len=2048, norm=Norm.LAYER, mlp=Mlp.GELU, positions=Positions.LEARNED)


@pytest.mark.parametrize("t, sp", [(1, False), (4, False), (8, False), (4, True), (8, True)])
def test_stored_bytes_are_korthikantis_for_a_gpt(t, sp):
    """Korthikanti et al. 2022, Table 2 (16-bit activations, dropout): sbh(34 + 5as/h) without
    parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor t, sbh(34/t + 5as/(ht)) with SP."""
    cfg, s, b = gpt3_like(), 2048, 2
    h, a = cfg.d_model, cfg.n_heads
    megatron = timing.SOFTWARE["megatron-2021"]
    got = timing.stored_bytes(cfg, b * s, s, t, sp, megatron)
    linear = 34 / t if sp else 10 + 24 / t
    assert got == pytest.approx(s * b * h * (linear + 5 * a * s / (h * t)))
    # A flash kernel stores no scores; without dropout no masks and no dropout output.
    flash = timing.with_software(megatron, attention="fa2", dropout=False)
    assert timing.stored_bytes(cfg, b * s, s, t, sp, flash) == pytest.approx(
        s * b * h * ((32 / t) if sp else 8 + 24 / t))


def test_links_are_priced_by_where_the_group_sits():
    """Within a host NVLink (at NCCL's measured ring bus bandwidth); a group with one device per
    host crosses at one NIC; g devices per host at g NICs, never above NVLink."""
    mesh = {"data": 16, "tensor": 8}  # 16 hosts of 8: tensor within one, data one device per host
    nvlink, nic = A100.intra_busbw_gbs * GB, A100.inter_busbw_gbs * GB
    tp = Transfer("all-reduce", ("tensor",), 1, 1, "", 8)
    dp = Transfer("all-reduce", ("data",), 1, 1, "", 16)
    assert timing.group_bandwidth(tp, mesh, A100) == nvlink
    assert timing.group_bandwidth(dp, mesh, A100) == nic
    mesh = {"data": 32, "tensor": 4}  # two tensor groups per host: a data group has 2 devices in each
    assert timing.group_bandwidth(Transfer("all-reduce", ("data",), 1, 1, "", 32), mesh, A100) == 2 * nic
    assert timing.group_bandwidth(Transfer("all-gather", ("fsdp",), 1, 1, "", 64), {"fsdp": 64}, A100) \
        == min(nvlink, 8 * nic)


def _step(mesh, software=timing.SOFTWARE["megatron-2021"], **kw):
    from scripts.bench_plan import abstract_rules

    model = TransformerLM(gpt3_like(layers=8), remat=Remat.FULL)
    return timing.step_time(model, abstract_rules(mesh), A100, kw.pop("batch", 64), 2048,
                            software=software, compute_dtype="float16", remat=Remat.FULL, **kw)


def test_the_bubble_is_the_schedules_idle_share():
    t = _step({"stage": 4, "data": 2, "tensor": 8}, microbatches=16, virtual_stages=2)
    assert t.bubble == pytest.approx(t.compute * 3 / (2 * 16))
    assert _step({"stage": 4, "data": 2, "tensor": 8}, microbatches=16).bubble == pytest.approx(t.bubble * 2)


def test_overlapped_reduction_shows_only_beyond_compute():
    """Megatron 2021 all-reduces gradients after the backward pass (exposed); a software that
    overlaps them hides them unless they outlast the compute."""
    mesh = {"data": 64}
    overlapping = timing.with_software("megatron-2021", overlap_data=True)
    exposed, hidden = _step(mesh), _step(mesh, software=overlapping)
    assert exposed.exposed["data"] > 0 and "data" not in hidden.exposed
    assert hidden.hidden["data"] == pytest.approx(exposed.exposed["data"])


def test_more_tensor_parallelism_splits_the_matmuls():
    one, four = _step({"data": 8, "tensor": 1}), _step({"data": 2, "tensor": 4})
    assert four.matmul == pytest.approx(one.matmul)  # 4x fewer FLOPs per token on 4x the tokens
    assert four.exposed["tensor"] > 0 and "tensor" not in one.exposed


def test_the_published_runs_benchmark(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "scripts/bench_plan.py", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 9 and {r["software"] for r in rows} == {"megatron-2021", "torchtitan", "maxtext"}
    for r in rows:
        assert r["ratio"] == pytest.approx(r["predicted"]["step_s"] / r["published_step_s"])
        parts = r["predicted"]
        assert parts["step_s"] == pytest.approx(parts["compute_s"] + parts["bubble_s"]
                                                + sum(parts["exposed_communication_s"].values()))


def test_what_the_model_cannot_price_is_a_one_line_error():
    """A device without an HBM bandwidth, or a flash kernel never measured on it, is an error
    naming what is missing -- never a silent zero."""
    from dataclasses import replace

    from jaxshard.errors import ConfigError
    from scripts.bench_plan import abstract_rules

    model, mesh = TransformerLM(gpt3_like(layers=2)), {"data": 8}
    kw = dict(software=timing.SOFTWARE["megatron-2021"], compute_dtype="float16")
    with pytest.raises(ConfigError, match="HBM bandwidth"):
        timing.step_time(model, abstract_rules(mesh), replace(A100, hbm_gbs=None, hbm_achieved_gbs=None), 8, 2048,
                         **kw)
    kw["software"] = timing.SOFTWARE["maxtext"]  # cuDNN's flash kernel: never measured on a V100
    with pytest.raises(ConfigError, match="^no cudnn attention throughput is known for v100"):
        timing.step_time(model, abstract_rules(mesh), KNOWN_DEVICES["v100"], 8, 2048, **kw)
    # Flash kernels take 2-byte floats; jaxshard's ring runs XLA's blocks, its Ulysses the dense kernel.
    from jaxshard.mesh import abstract_mesh
    from jaxshard.rules import ShardingRules, Strategy

    jax_kw = dict(software=timing.SOFTWARE["jaxshard"], compute_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"^the time model cannot price this step: jaxshard's attention is cudnn's "
                                          r"flash kernel, which takes 2-byte floats: no rate is known for "
                                          r"--compute-dtype float32 attention$"):
        timing.step_time(model, abstract_rules(mesh), A100, 8, 2048, **(jax_kw | {"compute_dtype": "float32"}))
    assert timing.step_time(model, abstract_rules(mesh), A100, 8, 2048, software=timing.SOFTWARE["megatron-2021"],
                            compute_dtype="float32").total > 0  # (its attention materialised: matmuls)
    split = abstract_mesh({"data": 4, "sequence": 2})
    with pytest.raises(ConfigError, match="^the time model cannot price this step: ring context parallelism "
                                          "computes attention as XLA's online-softmax blocks"):
        timing.step_time(model, ShardingRules(split, Strategy()), A100, 8, 2048, **jax_kw)
    ulysses = ShardingRules(split, Strategy(context_parallel="ulysses"))
    assert timing.step_time(model, ulysses, A100, 8, 2048, **jax_kw).total > 0


def test_the_docs_table_is_what_the_benchmark_prints(tmp_path):
    """The table of published runs in docs/seeing.md and the README: each row's published and predicted step time
    and ratio as scripts/bench_plan.py computes them today (a changed model changes the page)."""
    import re

    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "scripts/bench_plan.py", "--json", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    rows = json.loads(out.read_text())
    for doc in ("docs/seeing.md", "README.md"):
        page = (ROOT / doc).read_text()
        table = [line.split("|")[1:-1] for line in page.splitlines()
                 if re.match(r"\| (GPT|Llama) ", line)]
        assert len(table) == len(rows), doc
        for cells, row in zip(table, rows):
            assert cells[0].strip() == row["run"] and cells[2].strip() == str(row["gpus"])
            assert [c.strip() for c in cells[-3:]] == [f"{row['published_step_s']:.2f}",
                                                      f"{row['predicted']['step_s']:.2f}", f"{row['ratio']:.2f}"]


def test_published_runs_within_the_goal_or_with_the_reason_they_miss():
    """Every published run within 0.8-1.25 of its step time, except the rows that carry the
    reason they miss (a fact of the run no measured quantity prices): those are still below
    0.8 -- a model that reaches them must drop the reason -- and not off by more than 0.7."""
    from scripts.bench_plan import RUNS, predict, published_step

    for run in RUNS:
        ratio = predict(run).total / published_step(run)
        if run.gap:
            assert 0.7 <= ratio < 0.8, (run.model.name, run.device, ratio)
        else:
            assert 0.8 <= ratio <= 1.25, (run.model.name, run.device, ratio)
    assert sum(not run.gap for run in RUNS) == 8  # all but torchtitan's Llama 3.1 8B at 500 W


def _bench_gpu():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gpu

    return bench_gpu


def test_the_model_against_jaxshards_steps_measured_on_an_h100():
    """docs/bench/gpu.json: jaxshard's training steps on one H100 SXM (scripts/bench_gpu.py) --
    three of them profiled, three held out of every measured cost the model takes from those
    profiles -- each predicted at 0.94-1.01 of its measured step, and the profiled parts the model
    prices from counts (the optimizer's passes, the layer scan's copies) within 15% of their
    traced kernels' time."""
    bench_gpu = _bench_gpu()
    recorded = json.loads((ROOT / "docs" / "bench" / "gpu.json").read_text())
    assert recorded["data"] == "zipf" and len(recorded["train"]) == 6
    ratios = []
    for case in recorded["train"]:
        t = bench_gpu.predicted(case["flags"])
        ratios.append(t.total / case["step_s"])
        assert 0.94 <= ratios[-1] <= 1.01, (case["case"], t.total, case["step_s"])  # as the README says
    # The planner calls plans closer than the model's spread ties (planner.TIE), no finer.
    assert max(ratios) / min(ratios) - 1 <= planner.TIE < max(ratios) / min(ratios) - 1 + 0.01, ratios
    hbm = KNOWN_DEVICES["h100"].hbm
    for case in recorded["profile"]:
        t, traced = bench_gpu.predicted(case["flags"]), case["profile"]["parts_s"]
        assert t.optimizer == pytest.approx(traced["optimizer"], rel=0.15), case["case"]
        moved = case["profile"]["scan_copies"]["moved_bytes"]
        assert moved / hbm == pytest.approx(traced["copy"], rel=0.15), case["case"]  # the copies' kernels


def test_the_model_against_steps_measured_on_an_h200():
    """docs/bench/gpu_h200.json: the 1B's and the 8B's (4 layers) bf16 steps on one H200 SXM, a
    device none of the model's measured costs came from (its rates are the datasheet's and a
    published triad), each predicted within 10% of its measured step."""
    bench_gpu = _bench_gpu()
    recorded = json.loads((ROOT / "docs" / "bench" / "gpu_h200.json").read_text())
    assert {case["case"] for case in recorded["train"]} == {"1b", "8b-4layers-selective"}
    for case in recorded["train"]:
        t = bench_gpu.predicted(case["flags"], device="h200")
        assert 0.9 <= t.total / case["step_s"] <= 1.1, (case["case"], t.total, case["step_s"])


@pytest.mark.parametrize("case", ["1b", "7b-4layers-dots"])
def test_scan_copies_are_what_the_compiled_step_copies(case):
    """The layer scan's copies the model counts (timing.scan_copy_bytes) against those in the
    optimized HLO XLA:GPU compiled for jaxshard's step on an H100 (docs/bench/hlo, read by
    analysis.hlo.scan_copies): within 10%."""
    import gzip

    from jaxshard.analysis import hlo
    from scripts.bench_plan import abstract_rules

    cfg, batch, seq, remat = _bench_gpu().case_shape(_bench_gpu().TRAIN[case])
    tokens = batch * seq
    counted = timing.scan_copy_bytes(cfg, abstract_rules({"data": 1}), tokens, remat, 2, 4, 1) * cfg.n_layers
    compiled = hlo.scan_copies(gzip.open(ROOT / "docs" / "bench" / "hlo" / f"{case}.hlo.txt.gz", "rt").read())
    assert [loop["runs"] for loop in compiled["loops"]] == [cfg.n_layers // 2] * 2  # forward, backward (2 a trip)
    assert counted == pytest.approx(compiled["moved_bytes"], rel=0.1)


def test_gradient_reductions_hide_only_behind_the_backward_pass():
    """A data-parallel gradient reduction overlaps the backward pass, not the forward (its
    gradients do not exist yet): a reduction longer than the backward pass shows by the excess,
    even where the whole step's compute would cover it."""
    from scripts.bench_plan import abstract_rules, llama

    cfg = llama("7b", 32, 4096, 32, 32, 11008, 32000, 4096)
    t = timing.step_time(TransformerLM(cfg, remat=Remat.DOTS_NO_BATCH), abstract_rules({"data": 16}),
                         KNOWN_DEVICES["h100-a3-high"], 64, 4096, software=timing.SOFTWARE["maxtext"],
                         remat=Remat.DOTS_NO_BATCH, param_dtype="float32")
    reduction = t.hidden["data"]
    assert 0.5 * t.compute < t.backward < 0.8 * t.compute  # two thirds of the matmuls, and more
    assert t.backward < reduction < t.compute
    assert t.exposed == {"overlap overflow": pytest.approx(reduction - t.backward)}


def _llama_step(remat, software: str | timing.Software = "jaxshard", **kw):
    from scripts.bench_plan import abstract_rules, llama

    cfg = llama("llama-like", 4, 4096, 32, 8, 14336, 128256, 8192)
    return timing.step_time(TransformerLM(cfg, remat=Remat.parse(remat)), abstract_rules({"data": 1}),
                            KNOWN_DEVICES["h100"], 2, 8192,
                            software=timing.SOFTWARE[software] if isinstance(software, str) else software,
                            remat=Remat.parse(remat), **kw)


def test_a_policy_that_does_not_keep_the_attention_output_runs_its_forward_again():
    """A flash kernel's forward + backward is 3.5 forwards; every policy but ``none`` recomputes
    one more: ``selective`` by design, ``dots`` because the fused kernel is a custom call, not a
    matmul, and ``names:attn_out`` because the kernel's backward also needs its softmax
    statistics -- unless the caller states its own policy's share. Materialised attention's
    batched matmuls are what ``dots`` keeps."""
    none = _llama_step("none").attention
    assert _llama_step("selective").attention == pytest.approx(none * 4.5 / 3.5)
    assert _llama_step("dots").attention == pytest.approx(none * 4.5 / 3.5)
    assert _llama_step("names:attn_out").attention == pytest.approx(none * 4.5 / 3.5)
    assert _llama_step("full", attention_recompute=0.0).attention == pytest.approx(none)
    materialized = timing.with_software("jaxshard", attention="materialized")
    plain = _llama_step("none", software=materialized).attention
    assert _llama_step("dots", software=materialized).attention == pytest.approx(plain)
    assert _llama_step("dots_no_batch", software=materialized).attention == pytest.approx(plain * 4 / 3)


def test_flash_rates_follow_head_width_and_sequence_length():
    rate = timing.flash_tflops
    assert rate("cudnn", "h100", 128, 4096) == 468 and rate("cudnn", "h100", 128, 8192) == 526
    assert rate("cudnn", "h100", 128, 12000) == 526  # between two measured lengths: the shorter's
    assert rate("cudnn", "h100", 128, 2048) == 468  # below the shortest: its rate, an upper bound
    assert rate("cudnn", "h100", 64, 8192) == 388 and rate("cudnn", "h100", 96, 8192) == 526
    assert rate("cudnn", "h100-a3-high", 128, 4096) == 468
    assert rate("cudnn", "a100-80gb", 128, 8192) == 182 and rate("fa2", "h100", 64, 8192) == 308
    # The step prices its attention at that rate: half the square, 3.5 forwards, no recompute.
    # tokens x layers x half of q k^T and p v's 4 L N H per token x 3.5 forwards
    cfg_flops = 2 * 8192 * 4 * (4 * 8192 * 32 * 128) / 2 * 3.5
    assert _llama_step("none").attention == pytest.approx(cfg_flops / 526e12)


def test_the_loss_moves_its_bytes_per_logit():
    """The cross-entropy's passes over the float32 logits: LOSS_BYTES per logit at HBM's rate,
    on top of the layers' memory-bound work."""
    with_loss = _llama_step("none")
    free = timing.with_software("jaxshard", loss_bytes=0.0)
    from scripts.bench_plan import abstract_rules, llama

    cfg = llama("llama-like", 4, 4096, 32, 8, 14336, 128256, 8192)
    h100 = KNOWN_DEVICES["h100"]
    bare = timing.step_time(TransformerLM(cfg), abstract_rules({"data": 1}), h100, 2, 8192, software=free)
    assert with_loss.memory_bound - bare.memory_bound == pytest.approx(16 * 2 * 8192 * cfg.padded_vocab / h100.hbm)


def test_the_data_benchmarks_target_rate_as_the_docs_give_it_now():
    """docs/real-models.md and the README compare the loader with llama-1b's step on one H100 by
    the time model: 69,965 tokens/s when data.json was recorded, 63,000 by the model since."""
    from scripts.bench_data import parser, step_rate

    recorded = json.loads((ROOT / "docs" / "bench" / "data.json").read_text())["target"]
    assert round(recorded["tokens_per_s"]) == 69_965
    assert round(step_rate(parser().parse_args([]))["tokens_per_s"], -3) == 63_000
