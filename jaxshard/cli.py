"""Flags -> the run's config tree: one parser for every experiment, and one-line errors.

The flags are generated from :class:`jaxshard.run.RunConfig`'s fields (:mod:`jaxshard.options`):
their names, help, parsers and defaults are written there, once. ``python -m jaxshard.cli``
prints the flag reference (``docs/flags.md``) from the same fields.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Iterator, Sequence

from jaxshard import options
from jaxshard.errors import ConfigError, JaxshardError
from jaxshard.options import Entry, parse_bool
from jaxshard.run import RunConfig

# The help groups, in the order --help and the reference show them.
GROUPS = ("model", "model shape (override the preset's fields)",
          "mixture of experts (override the preset's; see models/moe.py)", "mesh and strategy", "memory",
          "precision", "pipeline", "training", "data", "outputs", "runtime", "checkpoints",
          "multi-process (one process per host)")
DESCRIPTION = ("Train a transformer LM on a device mesh (DDP, ZeRO-1/2/3, FSDP, HSDP, tensor, sequence, "
               "context and pipeline parallelism).")


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown flag, a value of the wrong type) are
    :class:`ConfigError`s: one line on stderr and status 2 under :func:`one_line_errors`, like
    every other bad input, not argparse's usage block."""

    def error(self, message: str):
        raise ConfigError(message)


def entries() -> list[Entry]:
    """The run's flags, in the groups' order."""
    found = list(options.walk(RunConfig))
    unknown = {e.group for e in found} - set(GROUPS)
    assert not unknown, f"help groups missing from cli.GROUPS: {unknown}"
    return sorted(found, key=lambda e: GROUPS.index(e.group))


def _parse(e: Entry):
    if e.option.parse is not None:
        return e.option.parse
    if e.kind == "bool":
        return parse_bool
    return {"int": int, "float": float}.get(e.kind)


def _help(e: Entry) -> str:
    default = e.default_text()
    text = e.option.help + (f" (default: {default})" if default and not e.switch else "")
    return text.replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of :class:`RunConfig`, in its help group."""
    groups: dict[str, Any] = {}
    for e in entries():
        if e.group not in groups:
            groups[e.group] = parser.add_argument_group(e.group)
        kw: dict[str, Any] = {"dest": e.key, "help": _help(e), "default": e.default}
        if e.switch:
            kw["action"] = "store_true"
        else:
            kw.update(type=_parse(e), choices=e.option.choices, metavar=e.option.metavar)
        groups[e.group].add_argument(e.flag, **kw)


def train_parser() -> argparse.ArgumentParser:
    p = Parser(description=DESCRIPTION)
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="a TOML file of flags (keys are the flags' names, e.g. batch_size = 32); "
                        "flags on the command line override it")
    add_flags(p)
    return p


def parse_train(argv: Sequence[str] | None = None) -> RunConfig:
    return parse_run(train_parser(), argv)[0]


def parse_run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
              compile_only: bool = False) -> tuple[RunConfig, argparse.Namespace]:
    """``parser``'s flags (and a ``--config`` file's) as the run's config, with the namespace
    for a command's own flags. ``compile_only``: a command that compiles a step without
    running it refuses the flags of a training run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, command_line, from_file = parse_with_config(parser, argv)
    if compile_only:
        check_compile_only(args, command_line)
    # A config file describes the whole run (a report's echo is one): its keys at their
    # defaults are not asked for.
    asked = command_line | {k for k in from_file if getattr(args, k) != _default(k)}
    return train_config(args, asked), args


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
                      ) -> tuple[argparse.Namespace, frozenset[str], frozenset[str]]:
    """``parser``'s flags, with ``--config FILE.toml`` giving any of them (flags on the command
    line win), and the keys the command line gave and those the file gave. TOML: typed values
    and comments in the standard library (``tomllib``); keys are the flags' names
    (``batch_size`` or ``batch-size``), at the top or in tables of any name (for grouping). An
    unknown key or a wrong type is an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    from_file = read_config_file(parser, known.config) if known.config else {}
    parser.set_defaults(**from_file)
    args = parser.parse_args(argv)
    given = set(vars(_without_defaults(parser).parse_args(argv))) - {"config"}
    return args, frozenset(given), frozenset(from_file)


def _without_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A copy of ``parser`` that sets only what a command line gives."""
    bare = Parser(add_help=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            kw = {"dest": action.dest, "default": argparse.SUPPRESS}
            if action.nargs == 0:
                kw["action"] = "store_true"
            else:
                kw.update(type=action.type, choices=action.choices)
            bare.add_argument(*action.option_strings, **kw)
    return bare


def read_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """The flag values a TOML file sets, checked against ``parser``'s flags and types."""
    import tomllib

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    flat: dict[str, object] = {}
    for key, value in table.items():
        for k, v in (value.items() if isinstance(value, dict) else [(key, value)]):
            flat[k.replace("-", "_")] = v
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values = {}
    for key, value in flat.items():
        if key not in actions:
            raise ConfigError(f"--config {path}: unknown key '{key}' (keys are the flags' names, "
                              "e.g. batch_size)")
        values[key] = _typed(actions[key], value, f"--config {path}: {key}")
    return values


def _typed(action: argparse.Action, value: object, where: str) -> object:
    """``value`` as the flag would have parsed it; an error if it is of the wrong type. (A
    string for a flag with its own parser stays a string: argparse parses string defaults.)"""
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    kind = action.type or str
    wanted = {int: (int,), float: (int, float), parse_bool: (bool,)}.get(kind, (str,))
    if isinstance(value, bool) and bool not in wanted or not isinstance(value, wanted):
        name = {int: "an integer", float: "a number", parse_bool: "true or false"}.get(kind, "a string")
        raise ConfigError(f"{where} must be {name}, got {value!r}")
    value = float(value) if kind is float else value
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def inspect_parser() -> argparse.ArgumentParser:
    p = train_parser()
    p.description = ("Compile one training step without running it and compare what each device "
                     "holds and sends with the strategy's accounting.")
    g = p.add_argument_group("inspection")
    g.add_argument("--strict", action="store_true", help="exit with status 1 if anything is flagged")
    return p


def training_only() -> tuple[str, ...]:
    """Flags of a training run that compiling one step does not use (data, evaluation, outputs,
    checkpoints, processes), by key."""
    return tuple(e.key for e in entries() if e.option.run_only)


def check_compile_only(a: argparse.Namespace, command_line: frozenset[str]) -> None:
    """One line for a training-only flag given on the command line of a command that compiles a
    step without running it (a --config file may set them: it describes the whole run)."""
    if a.tokenizer not in (None, "bytes"):  # from a config file too: it would change the model
        raise ConfigError(f"--tokenizer {a.tokenizer}: inspect.py compiles the step without reading data; "
                          "give --vocab-size for the tokenizer's vocabulary")
    flags = {e.key: e.flag for e in entries()}
    for key in training_only():
        if key in command_line and getattr(a, key) != _default(key):
            hint = " (give --vocab-size for a tokenizer's vocabulary)" if key in ("data", "tokenizer") else ""
            raise ConfigError(f"{flags[key]} belongs to a training run: inspect.py compiles one step without "
                              f"running it or reading data{hint}")


def _default(key: str) -> Any:
    return next(e.default for e in entries() if e.key == key)


def train_config(a: argparse.Namespace, given: frozenset[str] = frozenset()) -> RunConfig:
    """The run's config from parsed flags; ``given``: the keys the command line or a config file
    gave (a flag that would do nothing with the others is an error)."""
    cfg = options.build(RunConfig, {e.key: getattr(a, e.key) for e in entries()})
    if "bucket_mb" in given and cfg.step.reducer != "explicit":
        raise ConfigError("--bucket-mb sizes the buckets of --strategy explicit; add it")
    if given & {"loss_scale", "loss_scale_period"} and not cfg.step.scaled:
        raise ConfigError("--loss-scale and --loss-scale-period apply to float16 training only "
                          "(--compute-dtype or --param-dtype float16)")
    return cfg


def reference() -> str:
    """The flag reference (``docs/flags.md``), generated from the config tree."""
    lines = ["# Flags", "",
             "The flags of `experiments/train.py` (and `scripts/train.sh`, `python -m jaxshard.train`), "
             "generated from the config tree by `python -m jaxshard.cli > docs/flags.md`; a test checks "
             "that this page is what the code generates. Each flag is defined once, as a field of the "
             "config that reads it (the last column); a `--config FILE.toml` takes the same settings "
             "as keys (the flag's name with underscores: `batch_size = 32`), at the top level or in "
             "tables of any name. `experiments/inspect.py` takes the same flags, refuses those of a "
             "training run (data, outputs, checkpoints, processes), and adds `--strict`. What a run does around its step (the flags it refuses, the report, the "
             "data order, bad input): [The training run](training-run.md).", ""]
    flags = entries()
    for i, e in enumerate(flags):
        if i == 0 or e.group != flags[i - 1].group:
            lines += [f"## {e.group[0].upper()}{e.group[1:]}", "",
                      "| flag | default | what it sets | field |", "|---|---|---|---|"]
        value = {"int": "N", "float": "X", "str": "TEXT"}.get(e.kind, "VALUE")
        name = e.flag if e.switch else f"{e.flag} {e.option.metavar or value}"
        default = "off" if e.switch else e.default_text() or "none"
        where = f"`{e.owner.__name__}.{e.path[-1]}` in `{e.owner.__module__.replace('.', '/')}.py`"
        cells = [f"`{name}`", default, e.option.help, where]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if i + 1 == len(flags) or flags[i + 1].group != e.group:
            lines.append("")
    return "\n".join(lines)


def int_list(text: str, flag: str) -> list[int]:
    """A flag's comma-separated integers (the benchmark scripts' value lists)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Bad input -> ``error: ...`` on stderr and exit status 2; Ctrl-C -> status 130."""
    try:
        yield
    except JaxshardError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:  # a backend the machine lacks (--platform), found at the first device query
        if not str(e).startswith("Unable to initialize backend"):
            raise
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.stdout.write(reference())

