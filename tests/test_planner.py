"""The planner follows the classic guidance because the numbers say so."""

import os
import re

import jax
import pytest

from jaxshard.analysis import devices, planner
from jaxshard.errors import ConfigError
from models import TransformerLM, get_preset

H100 = devices.device_spec("h100")


def top(plans):
    return next(p for p in plans if p.fits)


def test_a_model_that_fits_one_device_gets_data_parallelism():
    """It fits one device: every device holds a replica's work (data=8, no model parallelism).
    DDP, or ZeRO over data where the time model prices the sharded optimizer step faster (one
    eighth of AdamW's HBM traffic) and the gathers hidden; DDP within 10% of it."""
    model = TransformerLM(get_preset("gpt2-small"))
    plans = planner.plan(model, 8, H100, 64, 1024)
    best = top(plans)
    assert best.mesh_flag == "data=8" and best.name in ("ddp", "zero1", "zero2", "zero3"), best.name
    ddp = next(p for p in plans if p.name == "ddp" and p.grad_accum == 1 and p.remat == planner.Remat.NONE)
    assert ddp.fits and ddp.step_s <= 1.10 * best.step_s
    assert "It fits one h100" in " ".join(planner.explain(model, plans, H100, 1, "bfloat16"))


def test_a_model_that_does_not_fit_gets_its_state_sharded():
    model = TransformerLM(get_preset("llama-8b"))  # 8B x 16 B = 128 GB > 80 GB
    plans = planner.plan(model, 8, H100, 16, 2048)
    ddp = [p for p in plans if p.name == "ddp"]
    assert ddp and all(not p.fits for p in ddp)
    best = top(plans)
    # what made it fit: the optimizer state (the bulk: 2 x 4 B per param) split over the
    # ZeRO/FSDP axes, tensor parallelism's or pipeline stages -- 4 or 8 ways
    shards = (best.mesh.get("fsdp", 1) * (best.mesh.get("data", 1) if best.strategy.zero else 1)
              * best.mesh.get("tensor", 1) * best.mesh.get("stage", 1))
    assert shards >= 4, best.name
    assert best.memory.opt_state <= 1.01 * ddp[0].memory.opt_state / shards
    # Without sharding over ZeRO/FSDP (data and tensor alone) it only fits by keeping fewer
    # activations: by recomputing, or by accumulating gradients over microbatches.
    if not best.strategy.zero and best.mesh.get("fsdp", 1) == 1 and not best.microbatches:
        assert best.remat != planner.Remat.NONE or best.grad_accum > 1, best.flags
    assert "does not fit one h100" in " ".join(planner.explain(model, plans, H100, 1, "bfloat16"))


def test_tensor_parallelism_when_one_layer_does_not_fit():
    model = TransformerLM(get_preset("llama-70b"))  # a layer is 1.7 GB in bf16
    small = devices.device_spec("h100", memory=devices.parse_bytes("6GB"))
    plans = planner.plan(model, 512, small, 64, 512, hosts=64)
    assert not [p for p in plans if p.fits and p.mesh["tensor"] == 1]  # sharding alone is not enough
    best = top(plans)
    assert best.mesh["tensor"] > 1 and "tensor" not in best.host_axes  # TP stays within a host
    assert "tensor parallelism" in " ".join(planner.explain(model, plans, small, 64, "bfloat16"))


def test_data_parallelism_on_the_slow_axis_across_hosts():
    """A slow network between hosts (5 GB/s per device): the axis that crosses hosts is data
    (each gradient once per step), FSDP's gathers stay inside a host; flipped, slower."""
    model = TransformerLM(get_preset("llama-1b"))
    slow = devices.device_spec("h100", inter_gbs=5.0)
    plans = planner.plan(model, 64, slow, 256, 2048, hosts=8)
    best = top(plans)
    assert best.host_axes == ("data",), (best.name, best.mesh, best.host_axes)
    hsdp = next(p for p in plans if p.fits and p.name == "hsdp" and p.mesh == {"data": 8, "fsdp": 8, "tensor": 1})
    flipped = next(p for p in plans if list(p.mesh.items()) == [("fsdp", 8), ("data", 8), ("tensor", 1)]
                   and p.strategy == hsdp.strategy and p.remat is hsdp.remat and p.grad_accum == hsdp.grad_accum)
    assert hsdp.host_axes == ("data",) and flipped.host_axes[0] == "fsdp" and flipped.step_s > hsdp.step_s
    assert plans.index(flipped) > plans.index(hsdp)


def test_host_spanning_axes():
    assert planner.host_spanning_axes({"data": 8, "fsdp": 8, "tensor": 1}, 8) == ("data",)
    assert planner.host_spanning_axes({"fsdp": 64, "tensor": 1}, 8) == ("fsdp",)
    assert planner.host_spanning_axes({"data": 2, "fsdp": 4, "tensor": 8}, 8) == ("data", "fsdp")
    assert planner.host_spanning_axes({"data": 8, "tensor": 8}, 64) == ()


def test_devices_and_sizes_are_never_guessed():
    with pytest.raises(ConfigError, match="unknown device 'tpu9'; known: h100"):
        devices.device_spec("tpu9")
    with pytest.raises(ConfigError, match="without --device, give --peak-tflops, --intra-bw"):
        devices.device_spec(None, memory=80e9)
    custom = devices.device_spec(None, memory=16e9, peak_tflops=100, intra_gbs=64, inter_gbs=12.5, hbm_gbs=900)
    assert (custom.memory, custom.bf16_tflops, custom.inter_host_gbs) == (16e9, 100, 12.5)
    assert devices.parse_bytes("80GB") == 80e9 and devices.parse_bytes("1 GiB") == 2**30
    with pytest.raises(ConfigError, match="cannot read a size"):
        devices.parse_bytes("lots")


class FakeDevice:
    def __init__(self, platform, device_kind):
        self.platform, self.device_kind = platform, device_kind


def test_peak_flops_for_mfu_comes_from_flags_or_a_recognised_gpu_never_a_guess():
    assert devices.peak_flops(None, 123.0, "bfloat16") == (123e12, "--peak-tflops")
    assert devices.peak_flops("a100-80gb", None, "bfloat16")[0] == 312e12
    assert devices.peak_flops("h100", None, "float32")[0] == 494e12  # TF32
    # --fp8: the float8 peak where the device has float8 tensor cores (A100: none)
    assert devices.peak_flops("h100", None, "bfloat16", fp8=True) == (1979e12, "--device h100 float8")
    assert devices.peak_flops("a100-80gb", None, "bfloat16", fp8=True) == (312e12, "--device a100-80gb")
    peak, source = devices.peak_flops(None, None, "bfloat16", FakeDevice("gpu", "NVIDIA H100 80GB HBM3"))
    assert peak == 989e12 and "detected h100" in source
    assert devices.peak_flops(None, None, "bfloat16", FakeDevice("cpu", "cpu"))[0] is None
    assert devices.peak_flops(None, None, "bfloat16", FakeDevice("gpu", "NVIDIA RTX 9090"))[0] is None
    assert devices.detect_device("NVIDIA A100-SXM4-40GB").name == "a100-40gb"


def test_gradient_accumulation_is_a_plan_of_its_own():
    model = TransformerLM(get_preset("llama-8b"))
    plans = planner.plan(model, 8, H100, 16, 2048)
    accum = [p for p in plans if p.grad_accum > 1]
    assert accum and all(p.remat == planner.Remat.NONE and not p.microbatches for p in accum)
    one = next(p for p in plans if p.grad_accum == 1 and p.remat == planner.Remat.NONE
               and p.mesh == accum[0].mesh and p.strategy == accum[0].strategy)
    # The same step in k microbatches: 1/k of the activations, the same compute.
    assert accum[0].memory.activations < one.memory.activations
    assert accum[0].compute_s == one.compute_s
    assert f"--grad-accum {accum[0].grad_accum}" in accum[0].flags


def test_a_pipeline_across_a_slow_link_between_hosts():
    """Two hosts joined by a slow link (1 GB/s per device): data parallelism across it would send
    every gradient over it each step; a pipeline whose stages split at the hosts sends only a
    microbatch's activations and their gradients, and ranks first by far."""
    model = TransformerLM(get_preset("llama-8b"))
    slow = devices.device_spec("h100", inter_gbs=1.0)
    plans = planner.plan(model, 16, slow, 32, 2048, hosts=2)
    best = top(plans)
    assert best.microbatches and best.mesh["stage"] >= 2 and best.host_axes == ("stage",), best.mesh
    assert list(best.mesh)[0] == "stage"  # outermost: it is the axis that crosses hosts
    flat = min((p for p in plans if p.fits and not p.microbatches), key=lambda p: p.step_s)
    assert best.step_s < 0.5 * flat.step_s and best.inter_host_bytes < 0.15 * flat.inter_host_bytes
    assert best.flags.endswith(f"--microbatches {best.microbatches}")
    assert "Pipelined over" in " ".join(planner.explain(model, plans, slow, 2, "bfloat16"))


def test_pipeline_plans_hold_a_stage_of_the_layers_and_few_microbatches():
    model = TransformerLM(get_preset("llama-8b"))
    flat = planner.evaluate(model, {"data": 4, "fsdp": 1, "tensor": 2}, planner.Strategy(), planner.Remat.NONE,
                            H100, 32, 2048)
    piped = planner.evaluate(model, {"stage": 2, "data": 2, "fsdp": 1, "tensor": 2}, planner.Strategy(),
                             planner.Remat.NONE, H100, 32, 2048, microbatches=8)
    # Half the layers' params and Adam moments per device (the embedding and head stay whole).
    assert 0.5 * flat.memory.opt_state < piped.memory.opt_state < 0.6 * flat.memory.opt_state
    # 1F1B keeps 3 of the 8 microbatches (2P - 1), each through half the layers, of a batch
    # that data=2 splits in two instead of four (and their stage inputs; the last stage one
    # microbatch's logits, not three halves of them).
    one = planner.accounting.memory(model, planner.ShardingRules(planner.abstract_mesh(piped.mesh)),
                                    32 // 8, 2048, compute_dtype="bfloat16", flash=True).activations
    assert piped.memory.activations == pytest.approx(one * 3 / 2, rel=0.05)
    # The bubble: (P - 1) / M of a stage's work idles (M + P - 1 ticks for M microbatches'
    # work); a stage runs half the layers.
    assert piped.time.bubble == pytest.approx(piped.time.compute * 1 / 8)
    assert piped.time.matmul < 0.6 * flat.time.matmul * 2  # half the layers, of twice the tokens


@pytest.mark.parametrize("stages, batch, shards, want", [(2, 32, 4, 8), (4, 16, 2, 8), (4, 8, 4, None), (2, 6, 1, 6)])
def test_pipeline_microbatches_are_the_most_up_to_4p_that_split_the_batch(stages, batch, shards, want):
    assert planner.pipeline_microbatches(stages, batch, shards) == want


def test_an_moe_model_is_planned_with_expert_parallelism_and_no_pipeline():
    """Mixtral on 64 H100s: meshes with an expert axis are weighed (no pipelines: their cost
    model does not count the all-to-alls yet), and one with experts over 8 devices and ZeRO-3 over the other 8 fits,
    holding 1/64 of the experts and 1/8 of the rest per device."""
    model = TransformerLM(get_preset("mixtral-8x7b"))
    plans = planner.plan(model, 64, H100, 64, 2048, hosts=8)
    assert plans and not any("stage" in p.mesh for p in plans)
    ep = next(p for p in plans if p.mesh_flag == "data=8,expert=8" and p.strategy.zero == 3)
    assert ep.fits
    flat = zip(jax.tree.leaves(model.param_axes(), is_leaf=lambda x: isinstance(x, tuple)),
               jax.tree.leaves(model.abstract_params()))
    experts = rest = 0
    for axes, x in flat:
        if "experts" in axes:
            experts += x.size
        else:
            rest += x.size
    assert ep.memory.params == pytest.approx(4 * (experts / 64 + rest / 8), rel=1e-3)
    assert "does not fit one h100" in " ".join(planner.explain(model, plans, H100, 8, "bfloat16"))


def test_plan_json_for_a_given_configuration(tmp_path):
    """plan.py --mesh evaluates one configuration of an explicit shape and --json writes its
    prediction: the keys, and figures that must agree with what they derive from -- throughput
    with the step time, the 6N count with the model's own parameter count, the memory and time
    parts with their totals."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "p.json"
    argv = ["--family", "llama", "--n-layers", "4", "--d-model", "256", "--n-heads", "8", "--n-kv-heads", "2",
            "--d-mlp", "512", "--vocab-size", "1000", "--devices", "16", "--hosts", "2", "--device", "h100",
            "--mesh", "data=2,fsdp=4,tensor=2", "--batch", "32", "--seq-len", "512", "--remat", "full",
            "--confirm-limit", "0", "--json", str(out)]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "experiments/plan.py", *argv], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "step " in done.stdout and f"wrote {out}" in done.stdout
    p = json.loads(out.read_text())
    assert {"step_s", "tokens_per_s_per_device", "model_tflops_per_device", "memory", "time"} <= set(p)
    assert set(p["memory"]) >= {"params", "grads", "optimizer", "activations", "temporaries", "peak"}
    assert p["mesh"] == {"data": 2, "fsdp": 4, "tensor": 2} and p["remat"] == "full"
    assert p["tokens_per_s_per_device"] * p["step_s"] * 16 == pytest.approx(32 * 512)
    # 6N: the params a token's matmuls use -- all but the embedding lookup and the norms' scales.
    h, layers, vocab, s, q = 256, 4, 1000, 512, 256
    matmul_params = p["params"] - vocab * h - (2 * layers + 1) * h
    six_n = (6 * matmul_params + 6 * layers * s * q) * p["tokens_per_s_per_device"] / 1e12
    assert p["model_tflops_per_device"]["6n_causal_attention"] == pytest.approx(six_n)
    m = p["memory"]
    assert m["peak"] == m["params"] + m["grads"] + m["optimizer"] + m["activations"] + m["temporaries"]
    t = p["time"]
    assert t["step_s"] == pytest.approx(p["step_s"]) == pytest.approx(
        t["compute_s"] + t["bubble_s"] + sum(t["exposed_communication_s"].values()))
    assert t["exposed_communication_s"]["tensor"] > 0  # Megatron's all-reduces are not hidden


def test_a_given_ulysses_configuration_is_priced_and_confirmed():
    """plan.py --context-parallel ulysses: priced (the dense kernel, on heads split over
    sequence), its flag in the plan's, and compiled (the blockwise kernel, as a GPU's flash
    kernel keeps its memory) with the argument bytes predicted."""
    import subprocess
    import sys
    from pathlib import Path

    argv = ["--model", "llama-tiny", "--devices", "8", "--device", "h100", "--mesh", "data=4,sequence=2",
            "--context-parallel", "ulysses", "--batch", "8", "--seq-len", "128"]
    done = subprocess.run([sys.executable, "experiments/plan.py", *argv], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^step \d+\.\d+ s: matmul", done.stdout, re.M)
    confirmed = re.findall(r"^Confirmed by compiling ddp\+cp-ulysses on --mesh data=4,sequence=2 .*argument bytes per "
                           r"device predicted ([\d,]+), XLA ([\d,]+)$", done.stdout, re.M)
    assert len(confirmed) == 2 and all(a == b for a, b in confirmed), done.stdout
    plan = planner.given(TransformerLM(get_preset("llama-tiny")), {"data": 4, "sequence": 2},
                         planner.Strategy(context_parallel="ulysses"), H100, 8, 128)
    assert plan.flags == "--context-parallel ulysses"


@pytest.mark.parametrize("mesh, kw, message", [
    ({"data": 8}, dict(virtual_stages=2), "--virtual-stages needs a stage axis"),
    ({"stage": 4, "data": 2}, dict(microbatches=2), "4 layers must split into 4 x 1 stages, with --microbatches at least 4"),
    ({"stage": 2, "data": 4}, dict(microbatches=4, virtual_stages=4), "must split into 2 x 4 stages"),
    ({"data": 8}, dict(microbatches=3), "--batch 16 does not split into 3 microbatch(es) over 8 batch shard(s)"),
    ({"data": 6}, dict(hosts=4), "has 6 devices: not a multiple of --hosts 4"),
    ({"data": 16}, {}, "16 devices on 1 host(s) is 16 a host, where a h100 host holds 8: give --hosts 2 or more"),
    ({"data": 8}, dict(seq_len=4096), "--seq-len 4096 exceeds model llama-tiny's max_seq_len"),
    ({"data": 8}, dict(compute_dtype="float32"), "jaxshard's attention is cudnn's flash kernel, which takes 2-byte "
                                                 "floats: no rate is known for --compute-dtype float32 attention"),
    ({"data": 4, "sequence": 2}, {}, "ring context parallelism computes attention as XLA's online-softmax blocks"),
])
def test_a_given_configuration_that_cannot_run_is_refused(mesh, kw, message):
    model = TransformerLM(get_preset("llama-tiny"))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        planner.given(model, mesh, planner.Strategy(), H100, 16, kw.pop("seq_len", 128), **kw)


def test_more_devices_than_a_host_holds_need_hosts():
    """Without --hosts, 64 H100s would all be priced as one host's NVLink."""
    model = TransformerLM(get_preset("llama-tiny"))
    with pytest.raises(ConfigError, match=re.escape("64 devices on 1 host(s) is 64 a host, where a h100 host holds 8: "
                                                    "give --hosts 8 or more")):
        planner.plan(model, 64, H100, 64, 128)


@pytest.mark.parametrize("row, name, n, hosts, batch, theirs, sp", [
    ("8B, 8, 16", "llama-8b", 8, 1, 16, {"fsdp": 8}, False),
    ("70B, 64 in 8 hosts, 128", "llama-70b", 64, 8, 128, {"fsdp": 8, "tensor": 8}, True),
    ("405B, 1,024 in 128 hosts, 1,024", "llama-405b", 1024, 128, 1024, {"fsdp": 128, "tensor": 8}, True),
])
def test_the_readmes_plans_are_the_planners(row, name, n, hosts, batch, theirs, sp):
    """The README's three plans (Llama 3 on H100s, sequence 8192): each row's top plan, step
    time, MFU and memory as the planner gives them today, and the published layout's price
    (full recompute, as torchtitan ran these)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith(f"| {row} |"))
    model = TransformerLM(get_preset(name))

    def mfu(p):
        return planner.prediction(model, p, H100, batch, 8192)["model_tflops_per_device"]["6n_causal_attention"] / 989

    best = top(planner.plan(model, n, H100, batch, 8192, hosts=hosts))
    flags = " ".join(x for x in (best.mesh_flag, best.flags,
                                 f"--remat {best.remat}" if best.remat != planner.Remat.NONE else "") if x)
    assert f"| `{flags}` | {best.step_s:.3g} s, {mfu(best):.0%}, {best.memory.peak / 1e9:.0f} |" in line, line
    published = planner.given(TransformerLM(model.cfg, remat="full"), theirs,
                              planner.Strategy(sequence_parallel=sp), H100, batch, 8192, hosts=hosts)
    assert line.split("|")[-2].strip().startswith(f"{published.step_s:.3g} s, {mfu(published):.0%}"), line


def test_the_planner_counts_the_gpu_pool_the_runtime_asks_for(monkeypatch):
    """A plan fits where its peak is within the share of GPU memory that the run's allocator
    gets: the runtime sets that share for JAX (whose own default, 0.75, is smaller) unless the
    user set the pool."""
    import inspect as pyinspect

    from jaxshard import runtime
    from jaxshard.analysis import planner

    asked = runtime.gpu_pool_environment({})
    assert float(asked["XLA_CLIENT_MEM_FRACTION"]) == pyinspect.signature(planner.evaluate).parameters["usable"].default
    for users in ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, {"XLA_CLIENT_MEM_FRACTION": "0.95"},
                  {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}):
        assert runtime.gpu_pool_environment(users) == {}
    for name in runtime.POOL_VARIABLES:  # (set, then removed: the test's end restores each as it was)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    runtime.configure(runtime.RuntimeConfig(compile_cache=None))
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == asked["XLA_CLIENT_MEM_FRACTION"]
