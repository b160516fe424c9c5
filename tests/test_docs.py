"""Every runnable command in README.md and docs/*.md runs, at tiny sizes, so the docs cannot rot.

The convention (docs/testing.md): the info string of a fenced shell block says whether it runs.

* ```` ```bash run ````: the test runs every command of the block, in order, in one fresh folder
  (so outputs such as ``--report``, ``--metrics`` and checkpoint folders land there, and a later
  command reads what an earlier one wrote), and each must exit with status 0.
* ```` ```bash norun ````: shown, not run; the block's first line is ``# not run: <reason>``
  (a SLURM job, a GPU cluster, a download, ...).

Every other fenced block names a language that is not a shell (``text``, ``toml``, ...), so a
new command cannot slip past unmarked. GitHub highlights a block by the first word of its info
string, so both markers render as bash.

Tiny sizes: the test appends flags to each command, and argparse keeps a flag's last value, so
they win. They shrink what a run does (steps, batch, sequence, evaluation batches, generated
tokens, a small text file as the data) and never what the command means (mesh, ZeRO stage,
schedule, recompute policy, model family). Commands on 8 devices run in this process -- sharing
the 8 fake CPU devices and the compilation cache tests/conftest.py set up -- through the
scripts' ``main(argv)``; a command that fakes another number of devices, starts processes of
its own, or is not Python runs as a subprocess. ``scripts/train.sh`` runs as the
``experiments/train.py`` command it executes, its arguments read from the script.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from jaxshard import runtime

ROOT = Path(__file__).resolve().parents[1]
CACHE = str(ROOT / ".cache" / "xla-tests")  # conftest's: the in-process runs share it
RUNTIME = ["--cpu-devices", "8", "--platform", "cpu", "--compile-cache", CACHE]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
MARKERS = {"run", "norun"}
NORUN_REASON = re.compile(r"# not run: \S")


# ---- the blocks ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    info: str
    text: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def marker(self) -> str:
        words = self.info.split()
        return words[1] if len(words) > 1 else ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[list[str]]:
        """The block's commands as argument lists: continuation lines joined, comments dropped."""
        return [words for line in self.text.replace("\\\n", " ").splitlines()
                if (words := shlex.split(line, comments=True))]


def read_blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        fence, start = opening.group(2), i
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        blocks.append(Block(str(page.relative_to(ROOT)), start + 1, opening.group(3).strip(),
                            "\n".join(lines[start + 1:i])))
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in read_blocks(page)]
RUNNABLE = [b for b in BLOCKS if b.language in SHELLS and b.marker == "run"]


# ---- the workspace ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """What the commands are given or assume the reader has: a small text corpus (their
    ``--data``) and ``my-gpt2/``, a GPT-2 folder as Hugging Face's save_pretrained writes it."""
    root = tmp_path_factory.mktemp("docs")
    words = "alpha beta gamma delta def return class import self print".split()
    lines = [" ".join(words[(i + j * 7) % len(words)] for j in range(12)) for i in range(2000)]
    (root / "corpus.txt").write_text("\n".join(lines))
    space = {"root": root, "corpus": str(root / "corpus.txt")}
    o = call("experiments/train.py", ["--model", "tiny", "--mesh", "data=8", "--steps", "1", "--seq-len", "16",
                                      "--no-progress", "--data", space["corpus"], "--export-hf", "my-gpt2",
                                      *RUNTIME], root)
    assert o.rc == 0, o.err
    space["my-gpt2/"] = root / "my-gpt2"
    return space


# ---- the commands ----------------------------------------------------------------------------

@dataclass
class Outcome:
    rc: int | str | None
    out: str = ""
    err: str = ""


def _train_sh_args() -> list[str]:
    """The arguments scripts/train.sh gives experiments/train.py (before the reader's own)."""
    text = (ROOT / "scripts" / "train.sh").read_text().replace("\\\n", " ")
    line = next((l for l in text.splitlines() if "experiments/train.py" in l and l.lstrip().startswith("exec")), None)
    assert line is not None, "scripts/train.sh no longer execs experiments/train.py: update tests/test_docs.py"
    words = shlex.split(line, comments=True)
    return [w for w in words[words.index("experiments/train.py") + 1:] if w != "$@"]


def _in_checkout(word: str) -> str:
    """A ``--data``/``--eval-data`` value whose every path is a file of the repository (the
    shipped samples, the docs) with those paths made absolute; any other word as it is."""
    items = [re.fullmatch(r"((?:[\w.-]+=)?)(.+?)((?::[0-9.]+)?)", item) for item in word.split(",")]
    if not all(m and m[2] not in (".", "..") and (ROOT / m[2]).exists() and not Path(m[2]).is_absolute()
               for m in items):
        return word
    return ",".join(f"{m[1]}{ROOT / m[2]}{m[3]}" for m in items)


def train_small(argv: list[str], space) -> list[str]:
    """Training at tiny sizes; a sample, if the command asks for one, of a few tokens. The
    command's ``--data`` is kept where it names the repository's own files, else replaced by
    the workspace's small corpus."""
    data = _value(argv, "--data")
    own = data is not None and data.startswith(str(ROOT))
    small = ["--steps", "2", "--batch-size", "16", "--seq-len", "16", "--eval-batches", "1", "--no-progress",
             *(() if own else ("--data", space["corpus"]))]
    if "--sample-tokens" in argv:
        small += ["--sample-tokens", "4"]
    return small + SHAPES.get(_value(argv, "--model"), [])


# A preset too large for a test, shrunk where the command does not depend on its size (the GPT-2
# vocabulary, which is what the command pads, stays).
SHAPES = {"gpt2-small": ["--n-layers", "1", "--d-model", "64", "--n-heads", "4", "--d-mlp", "256"],
          # 4 layers and 4 heads kept (stage layouts, tensor=4): a quarter of the width, ~10x fewer FLOPs
          "llama-tiny": ["--d-model", "64", "--d-mlp", "256"]}


@dataclass(frozen=True)
class Kind:
    """How a script runs in the test: ``main`` (a module name or a path) in this process, the
    flags that make it small, and whether it must be a process of its own."""
    target: str
    small: tuple[str, ...] | Callable[[list[str], dict], list[str]] = ()
    process: bool = False
    runtime: tuple[str, ...] = tuple(RUNTIME)  # appended when it runs in this process
    process_runtime: tuple[str, ...] = ("--platform", "cpu", "--compile-cache", CACHE)

    def small_flags(self, argv, space) -> list[str]:
        return list(self.small(argv, space) if callable(self.small) else self.small)


EIGHT = ("--cpu-devices", "8")
BENCH = ("--warmup", "1", "--steps", "1", "--seq-len", "16")  # one timed step of short sequences
KINDS = {
    "experiments/train.py": Kind("jaxshard.train", train_small),
    "experiments/inspect.py": Kind("experiments.inspect"),
    "experiments/plan.py": Kind("experiments.plan", runtime=()),
    "experiments/generate.py": Kind("experiments.generate", ("--max-new-tokens", "4")),
    "experiments/compare_strategies.py": Kind("experiments.compare_strategies",
                                              ("--batch-size", "16", "--seq-len", "16"), runtime=EIGHT),
    "experiments/collectives_demo.py": Kind("experiments.collectives_demo", runtime=(*EIGHT, "--platform", "cpu")),
    "experiments/data_parallel_demo.py": Kind("experiments.data_parallel_demo", ("--steps", "2", "--seq-len", "16")),
    "experiments/batchnorm_demo.py": Kind("experiments.batchnorm_demo", ("--steps", "2", "--eval-size", "64"),
                                          runtime=EIGHT),
    "experiments/plot.py": Kind("experiments.plot", runtime=()),
    "scripts/convert_checkpoint.py": Kind("scripts/convert_checkpoint.py", runtime=(*EIGHT, "--platform", "cpu")),
    # The benchmarks: a few of their configurations, each timed once (they fake 8 devices themselves).
    "scripts/bench.py": Kind("scripts/bench.py", ("--models", "tiny", "--strategies", "ddp,fsdp,tp+sp",
                                                  "--no-scaling", *BENCH), runtime=EIGHT),
    "scripts/bench_data.py": Kind("scripts/bench_data.py", ("--size-mb", "1", "--vocab", "300", "--steps", "2"),
                                  runtime=()),
    "scripts/bench_moe.py": Kind("scripts/bench_moe.py", (*BENCH, "--rounds", "1"), runtime=()),
    "scripts/bench_zero_bubble_memory.py": Kind("scripts/bench_zero_bubble_memory.py",
                                                ("--models", "tiny", "--meshes", "stage=2,data=4", "--remats",
                                                 "dots", "--microbatches", "2"), runtime=()),
    "scripts/bench_plan.py": Kind("scripts/bench_plan.py", process=True, process_runtime=()),  # analysis only
    "scripts/bench_reducer.py": Kind("scripts/bench_reducer.py", ("--buckets", "1", *BENCH,
                                                                  "--rounds", "1"), runtime=()),
    "scripts/bench_local_sgd.py": Kind("scripts/bench_local_sgd.py", ("--sync-every", "1,2", "--steps", "2",
                                                                      "--seq-len", "16", "--batch-size", "16",
                                                                      "--eval-every", "1", "--eval-batches", "1"),
                                       runtime=EIGHT),
    # Processes of their own: the launcher's (its train.py flags are added in run()), and the suite's.
    "scripts/launch_local.py": Kind("scripts/launch_local.py", process=True, process_runtime=()),
    "scripts/test.sh": Kind("scripts/test.sh", ("tests/test_mesh.py", "-n", "0", "-q"), process=True,
                            process_runtime=()),
}


def _main(target: str):
    """The ``main`` of a module (``experiments.plan``) or of a script by path."""
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"docs_{Path(target).stem}", ROOT / target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main
    return importlib.import_module(target).main


def call(script: str, argv: list[str], cwd: Path) -> Outcome:
    """``script``'s main(argv) in this process, in ``cwd``, its sys.path edits undone after. It
    compiles into the suite's cache (conftest's), whatever cache the script would choose."""
    out, err = io.StringIO(), io.StringIO()
    saved = list(sys.path)
    with pytest.MonkeyPatch.context() as mp, contextlib.chdir(cwd), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setattr(runtime, "enable_compile_cache", lambda path: None)
        try:
            rc = _main(KINDS[script].target)(argv) or 0
        except SystemExit as e:
            rc = e.code
        finally:
            sys.path[:] = saved
    return Outcome(rc, out.getvalue(), err.getvalue())


def execute(code: str, cwd: Path) -> Outcome:
    """``python -c code``, in this process (its imports, transformers' say, are then made once)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            rc = 0
        except SystemExit as e:
            rc = e.code
    return Outcome(rc, out.getvalue(), err.getvalue())


def spawn(argv: list[str], cwd: Path) -> Outcome:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd)
    return Outcome(r.returncode, r.stdout, r.stderr)


def _value(argv: list[str], flag: str) -> str | None:
    """The value argparse keeps for ``flag``: the last one given."""
    at = [i for i, a in enumerate(argv[:-1]) if a == flag]
    return argv[at[-1] + 1] if at else None


def run(words: list[str], cwd: Path, space) -> Outcome:
    """One documented command, at tiny sizes."""
    if words[:2] == ["python", "-c"]:
        return execute(words[2], cwd)
    assert words[0] in ("python", "bash") and len(words) > 1, f"not a command the docs test knows: {words}"
    script, argv = words[1], words[2:]
    if script == "scripts/train.sh":
        script, argv = "experiments/train.py", _train_sh_args() + argv
    assert script in KINDS, f"{script}: add it to KINDS in tests/test_docs.py with the flags that make it small"
    kind = KINDS[script]
    argv = [_in_checkout(w) for w in argv]
    argv = argv + kind.small_flags(argv, space)
    devices = _value(argv, "--cpu-devices")
    if script == "scripts/launch_local.py":  # the flags go to each process's train.py
        argv += train_small(argv, space) + ["--compile-cache", CACHE]
    if kind.process or devices not in (None, "8"):
        program = ["bash", str(ROOT / script)] if script.endswith(".sh") else [sys.executable, str(ROOT / script)]
        return spawn(program + argv + list(kind.process_runtime), cwd)
    return call(script, argv + list(kind.runtime), cwd)


# ---- the tests -------------------------------------------------------------------------------

def test_the_readme_stays_short():
    """The README says what jaxshard is, how to set it up, a tour and where to read on; the
    rest lives in docs/ (a newcomer reads it in a few minutes)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to a page under docs/"
    linked = {m for m in re.findall(r"\(docs/([\w-]+\.md)\)", "\n".join(lines))}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_the_pages_have_runnable_blocks():
    """The parser finds what it guards (a README without fenced blocks would pass vacuously)."""
    assert any(b.page == "README.md" for b in RUNNABLE)
    assert len(RUNNABLE) >= 10


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_block_says_whether_it_runs(block):
    """A shell block is ``bash run`` or ``bash norun`` with a reason; any other block names its
    language (so a shell block cannot hide behind a bare fence)."""
    assert block.language, f"{block.where}: a fenced block without a language; name it (text, toml, bash run, ...)"
    if block.language not in SHELLS:
        return
    assert block.marker in MARKERS, (f"{block.where}: mark the block '{block.language} run' (the docs test runs it) "
                                     f"or '{block.language} norun' with a first line '# not run: <reason>'")
    if block.marker == "norun":
        first = block.text.strip().splitlines()[0] if block.text.strip() else ""
        assert NORUN_REASON.match(first), f"{block.where}: a norun block starts with '# not run: <reason>'"
    else:
        assert block.commands(), f"{block.where}: a runnable block without a command"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_every_runnable_command_runs(block, space, tmp_path):
    """The block's commands, in order, in one fresh folder, at tiny sizes: each exits with 0."""
    for name in re.findall(r"\S+/", block.text):  # inputs the reader is assumed to have
        if name in space:
            shutil.copytree(space[name], tmp_path / name)
    for words in block.commands():
        o = run(words, tmp_path, space)
        assert o.rc == 0, f"{block.where}: `{shlex.join(words)}` exited with {o.rc}:\n{(o.out + o.err)[-3000:]}"
