"""Write the small record corpora shipped in ``data/samples/``: the docstrings of the Python
standard library's modules, classes and functions, one document each, as JSONL and as Parquet
(the same records in the same order), for tests, the docs and a first try of ``--data``.

    python scripts/make_samples.py            # rewrites data/samples/docstrings.{jsonl,parquet}
    python scripts/make_samples.py --max-kb 100

Records are ``{"text": ..., "source": "module:qualified.name"}``, in the order of the sorted
module files and of the definitions in each (at most six a module); docstrings shorter than 40
characters are left out, and the total stops at ``--max-kb`` of text. The output depends on the Python version that reads
the standard library (the committed files were made with the one in their ``source`` field).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "samples"
MIN_CHARS = 40
PER_MODULE = 6  # docstrings kept of each module at most: many modules, not the first few


def docstrings(max_bytes: int) -> list[dict[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(stdlib.glob("*.py")):  # the top-level modules: no tests, no vendored code
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        kept = 0
        for name, node in _definitions(tree, path.stem):
            text = ast.get_docstring(node, clean=True)
            if not text or len(text) < MIN_CHARS:
                continue
            if kept == PER_MODULE:
                break
            kept += 1
            size = len(text.encode("utf-8"))
            if total + size > max_bytes:
                return out
            out.append({"text": text, "source": f"{path.stem}:{name}"})
            total += size
    return out


def _definitions(tree: ast.Module, module: str):
    yield module, tree
    stack = [(node, node.name) for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))]
    while stack:
        node, name = stack.pop(0)
        yield name, node
        if isinstance(node, ast.ClassDef):
            stack[:0] = [(child, f"{name}.{child.name}") for child in node.body
                         if isinstance(child, (ast.ClassDef, ast.FunctionDef))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kb", type=int, default=200, help="text to keep, in KiB (default 200)")
    args = parser.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = docstrings(args.max_kb << 10)
    if not records:
        print("error: found no docstrings in the standard library", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for r in records:
        r["source"] = f"{version}/{r['source']}"
    jsonl = OUT / "docstrings.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    table = pa.table({"text": [r["text"] for r in records], "source": [r["source"] for r in records]})
    pq.write_table(table, OUT / "docstrings.parquet", compression="zstd", row_group_size=500)
    size = sum(len(r["text"].encode("utf-8")) for r in records)
    print(f"{len(records):,} docstrings, {size:,} bytes of text -> {jsonl} ({jsonl.stat().st_size:,} B), "
          f"{OUT / 'docstrings.parquet'} ({(OUT / 'docstrings.parquet').stat().st_size:,} B)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
