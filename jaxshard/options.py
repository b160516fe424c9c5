"""Config fields that are also flags: one definition per setting.

A field made with :func:`option` carries, beside its default, what the command line needs: the
flag's name (``--`` and the field's name with dashes unless given), its help, how its text
parses and prints, and the help group it sits in. The flag parser, the TOML keys of
``--config``, the report's echo of the flags and the flag reference in ``docs/flags.md`` are all
generated from these fields (:mod:`jaxshard.cli`), so a default is written once: here, on the
field that the code reads. A field made with :func:`section` nests another config (its own
module's dataclass); :func:`walk` goes through the tree.

levanter builds its command line from nested dataclasses the same way; torchtitan keeps each
concern's config beside the code that reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class Option:
    help: str
    flag: str | None = None  # None: "--" + the field's name with dashes
    parse: Callable[[str], Any] | None = None  # the flag's text -> the value; None: from the annotation
    show: Callable[[Any], str] | None = None  # the value -> the flag's text (echo and reference); None: str
    choices: tuple | None = None
    metavar: str | None = None
    default_text: str | None = None  # how help and reference state a default chosen by context (a None default)
    group: str | None = None  # the help group; None: its section's
    run_only: bool = False  # belongs to a training run (data, outputs, checkpoints, processes), not to compiling a step


def parse_bool(text: str) -> bool:
    """A true|false flag's text."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


parse_bool.__name__ = "true|false"  # what argparse names in its error for a bad value


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           **kw: Any) -> Any:
    """A dataclass field that is also a flag (see :class:`Option` for ``kw``)."""
    meta = {"option": Option(help, **kw)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, title: str) -> Any:
    """A dataclass field holding the config ``cls`` (defaults: its fields'), whose flags are
    shown under ``title`` unless a field names its own group."""
    return dataclasses.field(default_factory=cls, metadata={"section": title})


@dataclass(frozen=True)
class Entry:
    """One flag of a config tree: where its value lives and how it is spelt."""

    path: tuple[str, ...]  # field names from the root, e.g. ("step", "bucket_mb")
    option: Option
    default: Any
    kind: str  # the annotation's first type: int, float, str, bool, or another name
    group: str
    owner: type  # the dataclass whose field it is

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.path[-1].replace("_", "-")

    @property
    def key(self) -> str:
        """The flag's name as a TOML key and as the report echoes it (``batch_size``)."""
        return self.flag[2:].replace("-", "_")

    @property
    def switch(self) -> bool:
        """A flag without a value that turns on what defaults to off."""
        return self.kind == "bool" and self.default is False

    def show(self, value: Any) -> Any:
        """``value`` as the echo and the reference print it (numbers and switches as they are)."""
        if self.option.show is not None:
            return self.option.show(value)
        return value

    def default_text(self) -> str:
        if self.option.default_text is not None:
            return self.option.default_text
        shown = self.show(self.default)
        return "" if shown is None else str(shown).lower() if isinstance(shown, bool) else str(shown)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _kind(f: dataclasses.Field) -> str:
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return annotation.split("|")[0].split("[")[0].strip()


def walk(cls: type, path: tuple[str, ...] = (), group: str = "") -> Iterator[Entry]:
    """Every flag of the config tree rooted at ``cls``, in field order (sections in place)."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from walk(f.default_factory, (*path, f.name), f.metadata["section"])
        elif "option" in f.metadata:
            opt = f.metadata["option"]
            yield Entry((*path, f.name), opt, _default(f), _kind(f), opt.group or group, cls)


def flag(cls: type, name: str) -> str:
    """The flag of ``cls``'s field ``name``, for error messages (``flag(StepConfig, "bucket_mb")``
    is ``--bucket-mb``)."""
    for f in dataclasses.fields(cls):
        if f.name == name and "option" in f.metadata:
            return f.metadata["option"].flag or "--" + name.replace("_", "-")
    raise KeyError(f"{cls.__name__} has no flag field {name!r}")


def build(cls: type, values: dict[str, Any], path: tuple[str, ...] = ()) -> Any:
    """``cls`` with each flag field set from ``values`` (keyed by :attr:`Entry.key`; a key not
    there keeps the field's default) and each section built likewise; fields that are not flags
    keep their defaults. A class with a ``from_flags`` classmethod builds itself from the
    fields' values (to resolve what depends on several of them)."""
    kw = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            kw[f.name] = build(f.default_factory, values, (*path, f.name))
        elif "option" in f.metadata:
            opt = f.metadata["option"]
            key = (opt.flag or "--" + f.name)[2:].replace("-", "_")
            if key in values:
                kw[f.name] = values[key]
    make = getattr(cls, "from_flags", None)
    return make(**kw) if make is not None else cls(**kw)


def echo(config: Any, root: type | None = None) -> dict[str, Any]:
    """Every flag's effective value in ``config`` by key, sorted: the report's record of a run."""
    out = {}
    for e in walk(root or type(config)):
        value = config
        for name in e.path:
            value = getattr(value, name)
        out[e.key] = e.show(value)
    return dict(sorted(out.items()))
