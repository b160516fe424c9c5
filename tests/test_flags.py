"""No flag is silently ignored. Every option of experiments/train.py, inspect.py, plan.py and
generate.py -- read from their parsers -- is given a non-default value on a small run, and the
run must either produce something else than the same run without it or exit with status 2 and
one line on stderr.

"Something else" is what the command produces, never its echo of the flags: for training the
compiled program (the report's fingerprint of its HLO), the trajectory (every metric but the
timings), the report's measured parts (memory, collectives, FLOPs, losses) and the files it
writes; for inspect.py its verification and fingerprint; for plan.py its plans; for
generate.py its text and the params' bytes per device. A few flags exist only to change what
is printed (progress, log lines, the sample); their cases say so and compare the console.

Values come from the parser (a choice other than the default, a switch, a number next to the
default) unless :data:`CASES` gives one, with flags it needs beside it. A flag with neither
fails the test, so a new flag must come with a value -- and then with an effect.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaxshard import cli, runtime
from jaxshard.options import parse_bool

ROOT = Path(__file__).resolve().parents[1]
CACHE = str(ROOT / ".cache" / "xla-tests")  # conftest's: the runs here share the process's
RUNTIME = ["--cpu-devices", "8", "--platform", "cpu", "--compile-cache", CACHE]


@dataclass(frozen=True)
class Case:
    value: tuple[str, ...] | None = None  # the flag's value tokens (None: from the parser)
    context: tuple[str, ...] = ()  # flags it acts with, given to both runs
    drop: tuple[str, ...] = ()  # flags of the base run it replaces (with their values)
    console: bool = False  # it changes what is printed only
    terminal: bool = False  # ... and only on a terminal (both runs get a stderr that says it is one)


def _experiment(name: str):
    """experiments/NAME.py as a module (its sys.path[0] edit undone)."""
    saved = list(sys.path)
    try:
        return importlib.import_module(f"experiments.{name}")
    finally:
        sys.path[:] = saved


# ---- the commands --------------------------------------------------------------------------

TRAIN_BASE = [*RUNTIME, "--mesh", "data=8", "--steps", "2", "--batch-size", "16", "--seq-len", "16",
              "--warmup-steps", "0", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
              "--data", "{corpus}", "--n-layers", "1", "--report", "r.json", "--metrics", "m.jsonl"]

# Cases shared by train.py and inspect.py ({...}: files of the workspace).
COMMON = {
    "--config": Case(("{config}",)),
    "--model": Case(("tiny-llama",)),
    "--init-from": Case(("{hf}",), drop=("--n-layers",)),
    "--mesh": Case(("fsdp=8",)),
    "--dcn-mesh": Case(("data=2",)),
    "--fsdp-min-size": Case(("1000",), context=("--zero", "1")),
    "--vocab-multiple": Case(("384",)),
    "--remat": Case(("full",)),
    "--bucket-mb": Case(("0.01",), context=("--strategy", "explicit")),
    "--offload": Case(("optimizer",)),
    "--pipeline-schedule": Case(("gpipe",)),
    "--stage-layers": Case(("1,1",)),
    "--balance": Case(("flops",)),
    "--d-model": Case(("32",)),
    "--n-heads": Case(("4",)),
    "--n-kv-heads": Case(("4",)),
    "--d-head": Case(("16",)),
    "--d-mlp": Case(("128",)),
    "--vocab-size": Case(("300",)),
    "--max-seq-len": Case(("128",)),
    "--compute-dtype": Case(("bfloat16",)),
    "--steps": Case(("3",)),
    "--batch-size": Case(("8",)),
    "--seq-len": Case(("32",)),
    "--warmup-steps": Case(("1",)),
    "--decay-steps": Case(("10",)),
    "--beta1": Case(("0.5",)),
    "--beta2": Case(("0.5",)),
    "--grad-clip": Case(("0.01",)),
    "--tokenizer": Case(("bpe:300",)),
    "--eval-every": Case(("1",)),
    "--eval-batches": Case(("2",)),
    "--data": Case(("{corpus2}",)),
    "--text-field": Case(("other",), context=("--data", "{records}")),
    "--eval-data": Case(("more={corpus2}",)),
    "--packing": Case(("false",), context=("--data", "{records}")),  # (short documents: on by default)
    "--device": Case(("h100",)),
    # (auto is the tiled kernel on CPU; ragged_dot computes every row by every expert there)
    "--moe-kernel": Case(("ragged",), context=("--model", "moe-tiny", "--moe-capacity-factor", "0")),
    "--log-every": Case(("2",), console=True),
    # The watchdog's limit: a run within it differs only in the line that states it (a run over
    # it exits with status 124: tests/test_watchdog.py).
    "--step-timeout": Case(("600",), console=True),
    "--no-progress": Case(console=True, terminal=True),  # there is no bar in a file to turn off
    "--sample-tokens": Case(("1",), console=True),
    "--sample-prompt": Case(("x",)),
    "--metrics": Case(("m2.jsonl",)),
    "--report": Case(("r2.json",)),
    "--tensorboard": Case(("tb",)),
    "--profile-steps": Case(("1:1",), context=("--profile-dir", "prof")),
    "--profile-dir": Case(("prof",)),
    "--checkpoint-dir": Case(("ck",)),
    "--save-every": Case(("1",), context=("--checkpoint-dir", "ck")),
    "--save-every-minutes": Case(("0.00001",), context=("--checkpoint-dir", "ck")),
    "--keep": Case(("1",), context=("--checkpoint-dir", "ck", "--save-every", "1")),
    "--resume": Case(),
    "--export": Case(("p.npz",)),
    "--export-hf": Case(("hf-out",)),
    "--coordinator": Case(("127.0.0.1:1",)),
}
INSPECT = {
    **COMMON,
    "--save-every": Case(("1",)),  # (--checkpoint-dir is refused first)
    "--text-field": Case(("other",)),  # (without the training run's --data, which is refused first)
    "--packing": Case(("false",)),
    "--save-every-minutes": Case(("1",)),
    "--keep": Case(("1",)),
    "--seed": Case(("1",), context=("--dropout", "0.1")),  # the seed draws dropout masks
    # A step the verifier flags (XLA keeps gathered expert weights the accounting expects
    # gathered again): --strict turns the flag into exit status 1.
    "--strict": Case((), context=("--model", "moe-tiny", "--mesh", "fsdp=4,expert=2", "--remat", "none"),
                     drop=("--mesh",)),
}

COMMANDS = {
    "train": dict(main=lambda: importlib.import_module("jaxshard.train").main, parser=cli.train_parser,
                  base=TRAIN_BASE, cases=COMMON),
    # The training run's step (the same program, so the compilation cache serves both walks).
    "inspect": dict(main=lambda: _experiment("inspect").main, parser=cli.inspect_parser,
                    base=[*RUNTIME, "--mesh", "data=8", "--steps", "2", "--batch-size", "16", "--seq-len", "16",
                          "--warmup-steps", "0", "--n-layers", "1"], cases=INSPECT),
    "plan": dict(main=lambda: _experiment("plan").main, parser=lambda: _experiment("plan").parser(),
                 base=["--model", "tiny", "--devices", "8", "--device", "h100", "--confirm-limit", "0"],
                 cases={"--model": Case(("tiny-llama",)), "--devices": Case(("4",)),
                        "--device": Case(("a100-80gb",)), "--device-memory": Case(("1KB",)),
                        "--inter-bw": Case(("1",), context=("--hosts", "2")),
                        # (tiny's plans print as 0.0 GB and 0.0 ms in either dtype)
                        "--compute-dtype": Case(("float32",), context=("--model", "llama-1b")), "--top": Case(("1",)),
                        "--vocab-multiple": Case(("384",)), "--hbm-bw": Case(("100",)),
                        "--family": Case(("llama",), drop=("--model",), context=(
                            "--n-layers", "2", "--d-model", "64", "--n-heads", "8", "--d-mlp", "128",
                            "--vocab-size", "256")),
                        "--n-layers": Case(("4",)), "--d-model": Case(("128",)), "--n-heads": Case(("16",), drop=("--model",), context=("--model", "llama-1b")),
                        "--n-kv-heads": Case(("4",)), "--d-mlp": Case(("128",)), "--vocab-size": Case(("300",)),
                        "--mesh": Case(("data=8",)),
                        # (the given configuration's flags, each on a --mesh it acts on)
                        "--zero": Case(("1",), context=("--mesh", "data=8")),
                        "--sequence-parallel": Case(context=("--mesh", "data=4,tensor=2")),
                        "--microbatches": Case(("4",), context=("--mesh", "data=8", "--batch", "32")),
                        "--virtual-stages": Case(("2",), context=("--mesh", "stage=2,data=4", "--microbatches", "4",
                                                                  "--n-layers", "4", "--batch", "32")),
                        "--remat": Case(("full",), context=("--mesh", "data=8")),
                        "--software": Case(("megatron-2021",), context=("--mesh", "data=8")),
                        "--json": Case(("p.json",))}),
    "generate": dict(main=lambda: _experiment("generate").main, parser=lambda: _experiment("generate").parser(),
                     base=[*RUNTIME, "--checkpoint", "{ck}", "--prompt", "alph", "--max-new-tokens", "8",
                           "--mesh", "data=-1"],
                     cases={"--checkpoint": Case(("{ck2}",)), "--init-from": Case(("{hf}",), drop=("--checkpoint",)),
                            "--step": Case(("50",)), "--prompt": Case(("alph",)), "--tokenizer": Case(("bpe:300",)),
                            "--mesh": Case(("data=-1,tensor=2",))}),
}
# Flags that act before JAX starts (or choose where it compiles to): a process of their own each.
PROCESS = ("--cpu-devices", "--platform", "--compile-cache")


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def flag_of(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def parser_value(action: argparse.Action) -> tuple[str, ...] | None:
    """A value other than the default, from the parser alone (None: it cannot tell)."""
    if action.nargs == 0:
        return ()
    if action.choices:
        other = [c for c in action.choices if c != action.default]
        return (str(other[0]),) if other else None
    if action.type is parse_bool:
        return (str(not action.default).lower(),)
    if action.type is int:
        return (str(2 if action.default is None else action.default + 1),)
    if action.type is float:
        return (str(0.5 if not action.default else action.default * 2),)
    return None


def walk(command: str) -> list[str]:
    return [flag_of(a) for a in options(COMMANDS[command]["parser"]()) if flag_of(a) not in PROCESS]


# ---- running and observing -----------------------------------------------------------------

@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str
    files: tuple[str, ...]
    cwd: Path
    argv: tuple[str, ...] = ()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_in_process(command: str, argv: list[str], cwd: Path, terminal: bool = False) -> Outcome:
    out, err = io.StringIO(), (_Terminal() if terminal else io.StringIO())
    cwd.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = COMMANDS[command]["main"]()(argv) or 0
        except SystemExit as e:
            rc = e.code
    files = tuple(sorted("/".join(p.relative_to(cwd).parts[:2]) for p in cwd.rglob("*")))
    return Outcome(rc, out.getvalue(), err.getvalue(), files, cwd, tuple(argv))


TIMING = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "compile_time_s",
          "step_time_s_median"}
# The report's parts that a run measures (not its echo of the flags, nor what the accounting
# predicts from them): the compiled program, what the live arrays and XLA hold, the losses.
REPORT_EFFECTS = ("program_fingerprint", "per_device_bytes", "xla_memory", "collectives", "collectives_in_slots",
                  "collectives_when_synchronising", "n_params", "n_devices", "n_processes", "skipped_steps",
                  "first_loss", "final_loss", "final_val_loss", "mfu")
# Metrics the step computes from the flags alone (the schedule's lr, the loss scale it starts from).
ECHOED_METRICS = {"lr", "loss_scale"}


def _timing(key, value):
    return ("timed" if value is not None else None) if key in TIMING else value


def effects(command: str, o: Outcome) -> dict:
    """What a successful run produced, for comparison (its echo of the flags left out)."""
    if command == "train":
        metrics = [{k: _timing(k, v) for k, v in json.loads(line).items() if k not in ECHOED_METRICS}
                   for line in (o.cwd / "m.jsonl").read_text().splitlines()] if (o.cwd / "m.jsonl").exists() else None
        report = json.loads((o.cwd / "r.json").read_text()) if (o.cwd / "r.json").exists() else {}
        return {"metrics": metrics, "report": {k: _timing(k, report[k]) for k in REPORT_EFFECTS if k in report},
                "files": o.files}
    if command == "inspect":  # the compiled step (its verification's predictions restate the flags)
        return {"program": re.findall(r"^compiled step: fingerprint \w+", o.stdout, re.M), "rc": o.rc}
    if command == "plan":  # the plans (its header restates the flags)
        return {"out": o.stdout.split("\n", 1)[-1], "rc": o.rc}
    # generate: the new text of each prompt (not the prompt it echoes) and the bytes per device
    prompts = [o.argv[i + 1] for i, a in enumerate(o.argv) if a == "--prompt"] or ["\n"]
    text = o.stdout
    for prompt in prompts:
        text = text.replace(prompt, "<prompt>", 1)
    return {"out": text, "err": o.stderr, "rc": o.rc}


def console(o: Outcome) -> str:
    return re.sub(r"\d[\d,.]*", "#", o.stdout + o.stderr)


def one_line_error(o: Outcome, flag: str | None = None) -> bool:
    """Exit status 2 and one line on stderr (naming ``flag``, when given)."""
    lines = o.stderr.strip().splitlines()
    named = flag is None or bool(lines) and re.search(rf"{re.escape(flag)}(?![\w-])", lines[0]) is not None
    return o.rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named


# ---- the workspace -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """Inputs the cases name: two small corpora, a config file, two checkpoints (steps 1 and 2)
    and a Hugging Face folder exported by a run."""
    root = tmp_path_factory.mktemp("flags")
    words = "alpha beta gamma delta def return class import self print".split()
    for name, seed in (("corpus.txt", 1), ("corpus2.txt", 2)):
        lines = [" ".join(words[(i * seed + j * 7) % len(words)] for j in range(12)) for i in range(2000)]
        (root / name).write_text("\n".join(lines))
    (root / "run.toml").write_text("lr = 0.01\n")
    # Records whose two text fields differ: the corpora above, a line per record.
    texts = [(root / n).read_text().splitlines() for n in ("corpus.txt", "corpus2.txt")]
    (root / "records.jsonl").write_text("".join(json.dumps({"text": a, "other": b}) + "\n" for a, b in zip(*texts)))
    names = {"corpus": root / "corpus.txt", "corpus2": root / "corpus2.txt", "config": root / "run.toml",
             "records": root / "records.jsonl",
             "ck": root / "ck", "ck2": root / "ck2", "hf": root / "hf"}
    names = {k: str(v) for k, v in names.items()}
    for ck, seed, extra in (("ck", "0", ["--export-hf", names["hf"]]), ("ck2", "1", [])):
        # Trained enough that what it writes depends on the prompt, the step and the sampling
        # (a near-uniform model draws the same tokens whatever the temperature or prompt).
        o = run_in_process("train", fill(TRAIN_BASE, names) + ["--checkpoint-dir", names[ck], "--steps", "100",
                                                               "--save-every", "50", "--seed", seed, "--lr", "0.02",
                                                               *extra], root / f"make-{ck}")
        assert o.rc == 0, o.stderr
    return root, names


def fill(argv, names) -> list[str]:
    return [a.format(**names) for a in argv]


def remove(argv: list[str], flags) -> list[str]:
    """``argv`` without ``flags`` and the values that follow them."""
    out, skip = [], False
    for a in argv:
        if skip and not a.startswith("--"):
            continue
        skip = a in flags
        if not skip:
            out.append(a)
    return out


_RUNS: dict[tuple[str, tuple[str, ...]], Outcome] = {}


def run_once(command: str, argv: list[str], cwd: Path) -> Outcome:
    """``run_in_process``, remembered: the walk's runs without a flag are mostly the same base
    run (test_the_same_run_twice_produces_the_same shows a rerun produces the same)."""
    key = (command, tuple(argv))
    if key not in _RUNS:
        _RUNS[key] = run_in_process(command, argv, cwd)
    return _RUNS[key]


def runs(command: str, flag: str, space) -> tuple[list[str], list[str], Case]:
    """(the argv without ``flag``, the argv with it, its case)."""
    root, names = space
    spec = COMMANDS[command]
    action = next(a for a in options(spec["parser"]()) if flag_of(a) == flag)
    case = spec["cases"].get(flag, Case())
    base = fill(spec["base"], names)
    value = case.value if case.value is not None else parser_value(action)
    if flag in base and case.value is None:  # the base run sets it: the default is the run without
        without = remove(base, {flag})
        with_ = base
    else:
        assert value is not None, (f"{command} {flag}: no value for it -- add a Case to tests/test_flags.py "
                                   "with a value and what it changes")
        base = remove(base, {flag, *case.drop})
        without = base
        with_ = base + [flag, *fill(list(value), names)]
    context = fill(list(case.context), names)
    return without + context, with_ + context, case


def check(command: str, flag: str, space) -> None:
    root, names = space
    without_argv, with_argv, case = runs(command, flag, space)
    where = root / command / flag.lstrip("-")
    with_ = run_in_process(command, with_argv, where / "with", terminal=case.terminal)
    if one_line_error(with_, flag):
        return  # a flag it cannot use here is refused, in one line that names it
    without = (run_in_process(command, without_argv, where / "without", terminal=True) if case.terminal
               else run_once(command, without_argv, where / "without"))
    if one_line_error(without) and with_.rc in (0, 1):
        # Its context needs it (--profile-dir without --profile-steps is an error): both
        # against neither.
        without = run_once(command, fill(COMMANDS[command]["base"], names), root / command / "neither")
    assert with_.rc in (0, 1) and without.rc in (0, 1), (with_.stderr[-2000:], without.stderr[-2000:])
    if case.console:
        assert console(with_) != console(without), f"{command} {flag}: nothing it prints changed"
    else:
        assert effects(command, with_) != effects(command, without), \
            f"{command} {flag} changed nothing the run produced (the flag is ignored)"


@pytest.mark.parametrize("command, flag", [(c, f) for c in COMMANDS for f in walk(c)])
def test_every_flag_acts_or_is_refused(command, flag, space):
    check(command, flag, space)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_base_runs_succeed(command, space):
    """Each command's run without the walked flag works, so a refusal in the walk is the flag's."""
    root, names = space
    o = run_in_process(command, fill(COMMANDS[command]["base"], names), root / "base" / command)
    assert o.rc == 0, o.stderr[-3000:]


def test_the_same_run_twice_produces_the_same(space):
    """What the walk compares is deterministic: without any flag changed, nothing differs."""
    root, names = space
    a = run_in_process("train", fill(TRAIN_BASE, names), root / "twice" / "a")
    b = run_in_process("train", fill(TRAIN_BASE, names), root / "twice" / "b")
    assert a.rc == b.rc == 0
    assert effects("train", a) == effects("train", b)


# ---- flags that act before JAX starts: a process each --------------------------------------

SCRIPTS = {"train": "experiments/train.py", "inspect": "experiments/inspect.py",
           "generate": "experiments/generate.py"}


def run_process(command: str, argv: list[str], cwd: Path) -> Outcome:
    cwd.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, str(ROOT / SCRIPTS[command]), *argv], capture_output=True, text=True,
                       timeout=300, cwd=cwd)
    files = tuple(sorted("/".join(p.relative_to(cwd).parts[:2]) for p in cwd.rglob("*")))
    return Outcome(r.returncode, r.stdout, r.stderr, files, cwd, tuple(argv))


@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_process_flags_act_or_are_refused(command, space):
    """--cpu-devices (4 devices, not 8, on --mesh data=-1), --platform (a backend this
    installation lacks: one line) and --compile-cache (a folder the compiled programs land in)."""
    root, names = space
    assert {flag_of(a) for a in options(COMMANDS[command]["parser"]())} >= set(PROCESS)
    base = remove(fill(COMMANDS[command]["base"], names), {"--mesh", "--cpu-devices", "--compile-cache"})
    base += ["--mesh", "data=-1", "--compile-cache", ""]
    where = root / "process" / command
    plain = run_process(command, base + ["--cpu-devices", "8"], where / "plain")
    assert plain.rc == 0, plain.stderr
    four = run_process(command, base + ["--cpu-devices", "4"], where / "four")
    assert four.rc == 0, four.stderr
    assert effects(command, four) != effects(command, plain)
    missing = next(p for p in ("tpu", "gpu") if not any(map(runtime._installed, runtime.PLATFORM_PACKAGES[p])))
    absent = run_process(command, remove(base, {"--platform"}) + ["--cpu-devices", "8", "--platform", missing],
                         where / "absent")
    assert one_line_error(absent, "--platform"), absent.stderr
    cached = run_process(command, remove(base, {"--compile-cache"}) + ["--cpu-devices", "8", "--compile-cache",
                                                                          "xla"], where / "cached")
    assert cached.rc == 0, cached.stderr
    assert any((where / "cached" / "xla").iterdir())
    assert not (where / "plain" / "xla").exists()


@pytest.mark.parametrize("command, argv, message", [
    ("train", ["--mesh", "fsdp=8", "--zero", "1"], "--zero 1 shards state over the data axis, which --mesh does not split"),
    ("train", ["--fsdp-min-size", "1024"], "--fsdp-min-size keeps small params out of ZeRO/FSDP sharding"),
    ("train", ["--rope-theta", "500000"], "--rope-theta sets the base of rotary embeddings; model tiny has learned positions"),
    ("train", ["--keep", "2"], "--save-every, --keep and --resume need --checkpoint-dir"),
    ("train", ["--init-timeout", "5"], "--init-timeout bounds the wait for the processes of a multi-process job"),
    ("train", ["--model", "moe-tiny", "--moe-kernel", "tiled"],
     "--moe-kernel tiled chooses dropless experts' kernel: it needs MoE layers with --moe-capacity-factor 0"),
    ("train", ["--model", "moe-tiny", "--moe-capacity-factor", "0", "--moe-kernel", "triton"],
     "--moe-kernel triton runs on GPUs only, not on cpu"),
    ("inspect", ["--tokenizer", "bpe:300"], "--tokenizer bpe:300: inspect.py compiles the step without reading data"),
    ("inspect", ["--sync-every", "2"], "--sync-every: the verifier covers the DDP-family step, not local SGD's"),
    ("generate", ["--top-k", "5", "--temperature", "0"], "top_k and top_p choose among tokens to sample"),
    ("generate", ["--top-p", "0.9", "--temperature", "0"], "top_k and top_p choose among tokens to sample"),
    ("generate", ["--init-from", "{hf}", "--step", "1"], "--step picks a step of --checkpoint's; --init-from has one"),
    ("plan", ["--inter-bw", "10"], "--inter-bw prices the links between hosts; --hosts is 1"),
    ("plan", ["--remat", "full"], "--remat: for one given configuration, with --mesh"),
    ("plan", ["--mesh", "data=4"], "--mesh data=4 must lay out exactly --devices 8"),
    ("plan", ["--family", "llama"], "--model and --family both name the model: give one"),
])
def test_flags_that_cannot_act_are_one_line_errors(command, argv, message, space):
    """The flags a review found ignored, each with its message."""
    root, names = space
    base = fill(COMMANDS[command]["base"], names)
    if command == "generate" and "--init-from" in argv:
        base = remove(base, {"--checkpoint"})
    o = run_in_process(command, base + fill(argv, names), root / "errors" / f"{command}{len(argv)}{argv[0]}")
    assert one_line_error(o), o.stderr
    assert message in o.stderr, o.stderr
