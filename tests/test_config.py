"""The run's config tree is the one source of the flags, the TOML keys, the report's echo and
the flag reference: each setting is written once, as a field beside the code that reads it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from jaxshard import cli, options
from jaxshard.errors import ConfigError
from jaxshard.model import ModelChoice, Moe, Shape
from jaxshard.run import RunConfig
from jaxshard.training.step import StepConfig

ROOT = Path(__file__).resolve().parents[1]

# The command line's contract: these flags (train.py's, and inspect.py's two of its own, as of
# the config tree's introduction) keep their names whatever the tree's shape; new ones may join.
FLAGS = {
    "--balance", "--batch-size", "--beta1", "--beta2", "--bucket-mb", "--checkpoint-dir", "--compile-cache",
    "--compute-dtype", "--config", "--coordinator", "--cpu-devices", "--d-head", "--d-mlp", "--d-model",
    "--data", "--dcn-mesh", "--decay-steps", "--device", "--dropout", "--eval-batches", "--eval-every",
    "--export", "--export-hf", "--fsdp-min-size", "--grad-accum", "--grad-clip", "--init-from",
    "--init-timeout", "--keep", "--log-every", "--loss-scale", "--loss-scale-period", "--lr",
    "--max-seq-len", "--measure-bubble", "--mesh", "--metrics", "--microbatches", "--min-lr-ratio",
    "--model", "--moe-aux-coef", "--moe-capacity-factor", "--moe-d-mlp", "--moe-every", "--moe-experts",
    "--moe-shared-experts", "--moe-top-k", "--moe-z-coef", "--n-heads", "--n-kv-heads", "--n-layers",
    "--no-progress", "--num-processes", "--offload", "--param-dtype", "--peak-tflops",
    "--pipeline-schedule", "--platform", "--process-id", "--profile-dir", "--profile-steps", "--remat",
    "--report", "--reshard-after-forward", "--resume", "--rope-theta", "--sample-prompt",
    "--sample-tokens", "--save-every", "--seed", "--seq-len", "--sequence-parallel", "--stage-layers",
    "--steps", "--strategy", "--strict", "--sync-every", "--tensorboard", "--tokenizer", "--val-fraction",
    "--virtual-stages", "--vocab-multiple", "--vocab-size", "--warmup-steps", "--weight-decay", "--zero",
}


def test_the_flags_keep_their_names():
    parser = cli.inspect_parser()
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
    assert FLAGS <= flags, sorted(FLAGS - flags)


def test_docs_flag_reference_is_the_generated_one():
    written = (ROOT / "docs" / "flags.md").read_text()
    assert written == cli.reference(), "docs/flags.md is stale: python -m jaxshard.cli > docs/flags.md"


def test_the_toml_keys_are_the_flags_and_the_echo_is_every_key():
    parser = cli.train_parser()
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    assert set(RunConfig().flags) == dests
    assert [e.key for e in cli.entries()] == sorted(dests, key=[e.key for e in cli.entries()].index)
    assert len({e.key for e in cli.entries()}) == len(cli.entries())  # no two fields share a flag


# A run far from the defaults in every section: its echo, written as a TOML file, must give the
# same config back -- so each field's printed form parses to its value.
OTHER = ["--model", "tiny-llama", "--mesh", "data=2,fsdp=2,tensor=2", "--dcn-mesh", "data=1", "--zero", "2",
         "--fsdp-min-size", "7", "--sequence-parallel", "--reshard-after-forward", "false",
         "--offload", "optimizer,params", "--remat", "names:qkv,attn_proj", "--compute-dtype", "float16",
         "--param-dtype", "float16", "--loss-scale", "1024", "--loss-scale-period", "3",
         "--pipeline-schedule", "interleaved", "--microbatches", "4", "--virtual-stages", "2",
         "--stage-layers", "1,1,1,1", "--steps", "7", "--batch-size", "8", "--seq-len", "32",
         "--grad-accum", "1", "--seed", "3", "--lr", "0.5", "--warmup-steps", "2", "--decay-steps", "9",
         "--beta1", "0.8", "--n-layers", "4", "--d-model", "48", "--moe-experts", "4", "--moe-top-k", "2",
         "--dropout", "0.1", "--vocab-multiple", "64", "--data", "x.txt", "--tokenizer", "bpe:300",
         "--val-fraction", "0.2", "--eval-every", "3", "--eval-batches", "2", "--device", "h100",
         "--metrics", "m.jsonl", "--no-progress", "--log-every", "2", "--sample-tokens", "5",
         "--sample-prompt", "def ", "--cpu-devices", "8", "--platform", "cpu", "--compile-cache", "",
         "--checkpoint-dir", "ck", "--save-every", "2", "--keep", "1", "--resume", "--export", "p.npz",
         "--init-timeout", "30"]


def _toml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return repr(value)


def test_a_config_echoed_as_toml_parses_back_to_itself(tmp_path):
    cfg = cli.parse_train(OTHER)
    changed = {k for k, v in cfg.flags.items() if v != RunConfig().flags[k]}
    # Every section has fields away from their defaults here (or the round trip proves little).
    sections = {e.owner for e in cli.entries()}
    assert {e.owner for e in cli.entries() if e.key in changed} == sections
    assert len(changed) > 50
    file = tmp_path / "run.toml"
    file.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in cfg.flags.items() if v is not None))
    assert cli.parse_train(["--config", str(file)]) == cfg
    # A table groups keys without changing them; the command line wins over the file.
    file.write_text('[training]\nsteps = 5\nseq_len = 64\n')
    assert cli.parse_train(["--config", str(file), "--steps", "6"]).seq_len == 64
    assert cli.parse_train(["--config", str(file), "--steps", "6"]).steps == 6


def test_defaults_come_from_the_fields():
    """The parser's defaults are the fields' (nothing restates them): changing a field's default
    changes the flag's."""
    parser = cli.train_parser()
    assert parser.get_default("bucket_mb") == StepConfig().bucket_mb == 25.0
    assert cli.parse_train([]) == RunConfig.from_flags()
    assert f"(default: {StepConfig().bucket_mb})" in re.sub(r"\s+", " ", parser.format_help())


def test_an_init_from_folder_gives_its_tokenizer_unless_one_is_named(tmp_path):
    """A Hugging Face folder's own tokenizer.json is the run's default; --tokenizer still wins,
    and a folder without one leaves bytes (None)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    assert cli.parse_train(["--init-from", str(folder)]).data.tokenizer is None
    (folder / "tokenizer.json").write_text("{}")
    assert cli.parse_train(["--init-from", str(folder)]).data.tokenizer == str(folder / "tokenizer.json")
    assert cli.parse_train(["--init-from", str(folder), "--tokenizer", "bytes"]).data.tokenizer == "bytes"
    assert cli.parse_train([]).data.tokenizer is None


def test_inspect_takes_a_training_runs_config_file(tmp_path):
    """A config file describes the whole run: inspect.py reads the step's keys from it and lets
    the training run's keys be; the same flags on its command line are one line each."""
    file = tmp_path / "run.toml"
    file.write_text('batch_size = 16\nsteps = 7\ncheckpoint_dir = "ck"\nmetrics = "m.jsonl"\n'
                    'eval_every = 3\n')
    cfg, _ = cli.parse_run(cli.inspect_parser(), ["--config", str(file)], compile_only=True)
    assert (cfg.batch_size, cfg.steps) == (16, 7)
    for flags in (["--checkpoint-dir", "ck"], ["--metrics", "m.jsonl"], ["--eval-every", "3"]):
        with pytest.raises(ConfigError, match=f"^{flags[0]} belongs to a training run: inspect.py compiles"):
            cli.parse_run(cli.inspect_parser(), ["--config", str(file), *flags], compile_only=True)


def test_error_messages_name_the_flag_from_the_tree():
    assert options.flag(StepConfig, "reducer") == "--strategy"
    assert options.flag(ModelChoice, "preset") == "--model"
    with pytest.raises(KeyError):
        options.flag(StepConfig, "eps")
    with pytest.raises(ConfigError, match="^--strategy must be one of"):
        StepConfig(reducer="ring")
    with pytest.raises(ConfigError, match="^--n-layers, --d-model: the shape of an --init-from model"):
        ModelChoice(init_from="x", shape=Shape(n_layers=2, d_model=8))


def test_model_overrides_are_fields_of_the_model_config():
    """--n-layers ... and --moe-* set fields of the same names on the family's ModelConfig."""
    from models import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for overrides in (Shape, Moe):
        assert {f.name for f in dataclasses.fields(overrides)} <= names, overrides
    cfg = cli.parse_train(["--n-layers", "3", "--moe-experts", "4", "--moe-top-k", "2"])
    assert cfg.model.shape.given() == {"n_layers": 3}
    assert cfg.model.moe.given() == {"moe_experts": 4, "moe_top_k": 2}


def test_settings_that_follow_others():
    assert cli.parse_train(["--steps", "40"]).optim.total_steps == 40
    assert cli.parse_train(["--steps", "40", "--decay-steps", "90"]).optim.total_steps == 90
    assert cli.parse_train(["--param-dtype", "bfloat16"]).step.compute_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--bucket-mb sizes the buckets of --strategy explicit"):
        cli.parse_train(["--bucket-mb", "25"])  # given, even at its default: it would do nothing
