"""Real models and real text through the command line: fine-tuning a Hugging Face checkpoint,
a BPE tokenizer that travels with checkpoints and exports, config files and shape overrides,
TensorBoard and profiles, text generation."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from jaxshard.training.observe import read_scalars

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.environ.get("JAXSHARD_TEST_CACHE", str(ROOT / ".cache" / "xla-tests"))
SMALL = ["--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--no-progress",
         "--platform", "cpu", "--compile-cache", CACHE]


def run(script, *flags, timeout=300, cwd=ROOT, env=None):
    cmd = [sys.executable, str(ROOT / script), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def train(*flags, **kw):
    return run("experiments/train.py", *SMALL, *flags, **kw)


def one_line_error(result, message):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder)
    return folder


def _reports_equal_but_timing(a: dict, b: dict) -> None:
    timing = {"compile_time_s", "step_time_s_median", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "goodput"}
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


def test_fine_tune_an_hf_checkpoint_with_fsdp_and_generate_from_the_export(tmp_path, gpt2_folder):
    out = tmp_path / "export"
    r = train("--init-from", str(gpt2_folder), "--mesh", "fsdp=4", "--cpu-devices", "4", "--steps", "20",
              "--lr", "1e-3", "--warmup-steps", "2", "--metrics", str(tmp_path / "m.jsonl"),
              "--export-hf", str(out), "--report", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    assert f"initialised from {gpt2_folder}" in r.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.3  # it learned the stdlib's bytes
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model_config"]["n_layers"] == 2 and report["strategy"] == "fsdp"
    # The first step's loss is the imported model's: transformers' on the same batch.
    from jaxshard.data import corpus as data

    first = data.Batches(data.load_corpus(data.DataConfig()).train, 32, 8, seed=0).batch_at(0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(gpt2_folder).eval()
    with torch.no_grad():
        logits = ref(torch.tensor(first["inputs"], dtype=torch.long)).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                 torch.tensor(first["targets"], dtype=torch.long).reshape(-1))
    assert abs(losses[0] - want.item()) <= 1e-5 * want.item(), (losses[0], want.item())
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
        changed = (model.lm_head.weight - ref.lm_head.weight).abs().max().item()
    assert tokens.shape == (1, 12) and changed > 1e-3  # it generates, from trained weights


def test_config_file_equals_flags_and_rejects_unknown_keys_and_types(tmp_path):
    flags = ["--model", "tiny-llama", "--mesh", "data=2,tensor=2", "--cpu-devices", "4", "--steps", "3",
             "--n-layers", "1", "--d-model", "32", "--n-heads", "4", "--d-mlp", "48", "--lr", "0.002"]
    (tmp_path / "run.toml").write_text(
        '# the same run as the flags\nmodel = "tiny-llama"\nmesh = "data=2,tensor=2"\ncpu_devices = 4\n'
        'steps = 3\nlr = 0.002\n[model_shape]\nn_layers = 1\nd-model = 32\nn_heads = 4\nd_mlp = 48\n')
    report = tmp_path / "r.json"
    a = train(*flags, "--report", str(report))
    ra = json.loads(report.read_text()) if a.returncode == 0 else None
    b = train("--config", str(tmp_path / "run.toml"), "--report", str(report))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    rb = json.loads(report.read_text())
    _reports_equal_but_timing(ra, rb)
    # The shape set by override trained, and the report names it.
    shape = ra["model_config"]
    assert (shape["n_layers"], shape["d_model"], shape["n_heads"], shape["d_head"], shape["d_mlp"]) == (1, 32, 4, 8, 48)
    assert ra["config"]["n_layers"] == 1
    D, F, V, q, kv = 32, 48, 256, 4 * 8, 2 * 8  # tiny-llama keeps its 2 kv heads of d_head 8
    assert ra["n_params"] == 2 * V * D + D + (2 * D + 2 * D * q + 2 * D * kv + 3 * D * F)
    # Command-line flags override the file.
    c = train("--config", str(tmp_path / "run.toml"), "--steps", "2", "--report", str(tmp_path / "c.json"))
    assert c.returncode == 0 and json.loads((tmp_path / "c.json").read_text())["steps"] == 2
    (tmp_path / "bad.toml").write_text("stepz = 3\n")
    one_line_error(train("--config", str(tmp_path / "bad.toml")), "unknown key 'stepz'")
    (tmp_path / "type.toml").write_text('steps = "three"\n')
    one_line_error(train("--config", str(tmp_path / "type.toml")), "steps must be an integer, got 'three'")
    one_line_error(train("--config", str(tmp_path / "nope.toml")), "no such file")
    one_line_error(train("--n-layers", "0", "--cpu-devices", "1"), "n_layers must be >= 1")


def test_bpe_tokenizer_travels_with_checkpoint_resume_and_export(tmp_path):
    text = tmp_path / "text.txt"
    words = ["alpha", "beta", "gamma", "delta", "señor", "naïve", "日本"]
    rng = np.random.default_rng(0)
    text.write_text(" ".join(rng.choice(words, 20_000)) + "\n", encoding="utf-8")
    ck = tmp_path / "ck"
    common = ["--model", "tiny", "--mesh", "data=2", "--cpu-devices", "2", "--data", str(text),
              "--checkpoint-dir", str(ck), "--metrics", str(tmp_path / "m.jsonl"),
              "--tokenizer", "bpe:300", "--seq-len", "32"]
    env = {"JAXSHARD_CACHE": str(tmp_path / "cache")}
    first = train(*common, "--steps", "3", "--report", str(tmp_path / "r1.json"), env=env)
    assert first.returncode == 0, first.stderr
    r1 = json.loads((tmp_path / "r1.json").read_text())
    vocab = r1["tokenizer"]["vocab_size"]  # at most 300: merges can run out on a small text
    assert r1["tokenizer"]["spec"] == "bpe:300" and 257 < vocab <= 300 and r1["model_config"]["vocab_size"] == vocab
    # Resumed on other text: a retrained tokenizer would differ; the checkpoint's is used.
    text.write_text(" ".join(rng.choice(["omega", "sigma"], 20_000)) + "\n", encoding="utf-8")
    second = train(*common, "--steps", "5", "--resume", "--export-hf", str(tmp_path / "hf"), env=env)
    assert second.returncode == 0, second.stderr
    assert "tokenizer: the checkpoint's (bpe:300" in second.stdout
    from jaxshard.data.tokenizer import load_tokenizer

    exported = load_tokenizer(tmp_path / "hf")
    from jaxshard.training.checkpoint import CheckpointConfig, Checkpointer

    saved = Checkpointer(CheckpointConfig(directory=str(ck)))
    meta = saved.meta(3)
    saved.close()
    sample = "alpha gamma señor 日本"
    assert exported.decode(exported.encode(sample)) == sample
    assert len(exported.encode("alpha beta gamma")) < len("alpha beta gamma")  # merges from the first text
    assert exported.encode("omega sigma").size > 6  # never merged: not trained on the second text
    assert meta["tokenizer_spec"] == "bpe:300"
    assert json.loads(meta["tokenizer"]) == json.loads(exported.to_json())
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["vocab_size"] == vocab == exported.vocab_size and hf_config["eos_token_id"] == exported.eot_id


def test_tensorboard_and_profile_of_a_run(tmp_path):
    r = train("--mesh", "data=2", "--cpu-devices", "2", "--steps", "6", "--eval-every", "3",
              "--tensorboard", str(tmp_path / "tb"), "--profile-steps", "2:3",
              "--profile-dir", str(tmp_path / "prof"), "--log-every", "2")
    assert r.returncode == 0, r.stderr
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalars["val/loss"]] == [3, 6]
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(scalars)
    assert list((tmp_path / "prof").rglob("*.xplane.pb"))
    # A line every 2 steps, and the validation steps' lines carry the val loss.
    lines = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "3/6", "4/6", "6/6"]
    assert "val" in lines[1] and "val" not in lines[0]
    one_line_error(train("--profile-steps", "3:9", "--profile-dir", str(tmp_path / "p"), "--steps", "5",
                         "--cpu-devices", "1"), "--profile-steps")


def test_generate_from_a_checkpoint_and_from_an_hf_folder(tmp_path, gpt2_folder):
    ck = tmp_path / "ck"
    r = train("--mesh", "data=2", "--cpu-devices", "2", "--steps", "2", "--checkpoint-dir", str(ck),
              "--sample-tokens", "5", "--sample-prompt", "def ")
    assert r.returncode == 0, r.stderr
    assert "sample (" in r.stdout
    common = ["--prompt", "def f", "--prompt", "import", "--max-new-tokens", "6", "--platform", "cpu",
              "--compile-cache", CACHE]
    a = run("experiments/generate.py", "--checkpoint", str(ck), *common, "--temperature", "0",
            "--mesh", "tensor=2", "--cpu-devices", "2")
    b = run("experiments/generate.py", "--checkpoint", str(ck), *common, "--temperature", "0",
            "--mesh", "data=1", "--cpu-devices", "1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("def f")  # greedy: the same on any mesh
    hf = run("experiments/generate.py", "--init-from", str(gpt2_folder), *common, "--top-k", "5",
             "--seed", "3", "--cpu-devices", "1")
    again = run("experiments/generate.py", "--init-from", str(gpt2_folder), *common, "--top-k", "5",
                "--seed", "3", "--cpu-devices", "1")
    assert hf.returncode == 0 and hf.stdout == again.stdout, hf.stderr
    one_line_error(run("experiments/generate.py", "--checkpoint", str(tmp_path / "none"), "--cpu-devices", "1"),
                   "no complete checkpoint")
    one_line_error(run("experiments/generate.py", "--init-from", str(gpt2_folder), "--step", "1", "--cpu-devices", "1"),
                   "--step picks a step of --checkpoint's")
    # The converter writes the checkpoint as a Hugging Face folder with jaxshard's logits.
    converted = run("scripts/convert_checkpoint.py", str(ck), str(tmp_path / "hf"), "--mesh", "tensor=2",
                    "--cpu-devices", "2", "--platform", "cpu")
    assert converted.returncode == 0 and "wrote step 2" in converted.stdout, converted.stderr
    import jax

    from jaxshard.mesh import build_mesh
    from jaxshard.rules import ShardingRules, Strategy, use_rules
    from jaxshard.train import restore_model

    model, params, tokenizer, step = restore_model(str(ck), ShardingRules(build_mesh("data=1", jax.devices()[:1]), Strategy()))
    assert step == 2 and tokenizer.spec == "bytes"
    x = np.random.default_rng(0).integers(0, 256, (2, 16))
    with use_rules(None):
        ours = np.asarray(model.head(params, model.blocks(params, model.embed(params, x))))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(torch.tensor(x)).logits.numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    one_line_error(run("scripts/convert_checkpoint.py", str(ck), str(tmp_path / "hf"), "--cpu-devices", "1"),
                   "exists and is not an empty folder")


def test_the_installed_command_runs_from_any_folder(tmp_path):
    """``pip install .`` gives ``jaxshard-train`` (installed here without dependencies into a
    folder of its own; the test's environment provides them)."""
    source, target = tmp_path / "source", tmp_path / "installed"
    source.mkdir()  # a copy: the build leaves its build/ folder there, not in the checkout
    for part in ("jaxshard", "models", "pyproject.toml", "README.md"):
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy)(ROOT / part, source / part)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([str(target / "bin" / "jaxshard-train"), *SMALL, "--steps", "2", "--cpu-devices", "1",
                        "--report", "r.json"], capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads((work / "r.json").read_text())["steps"] == 2
    m = subprocess.run([sys.executable, "-m", "jaxshard.train", "--steps", "0"], capture_output=True,
                       text=True, timeout=120, cwd=work, env=env)
    one_line_error(m, "--steps must be >= 1")
