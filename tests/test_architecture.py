"""The package's layers: each module imports only from its own layer and those below it.

Read from the source (every import statement, including those inside functions), so an arrow
that runs back up fails here before anyone has to untangle it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module's layer is named by its first component under jaxshard/.
LAYERS = (
    ("vocabulary", {"errors", "axes", "pytree", "mesh", "rules", "rows", "runtime", "distributed"}),
    ("kernels", {"parallel", "remat"}),  # what model code calls; choose by the active rules
    ("data", {"data"}),
    ("training", {"training"}),
    ("analysis", {"analysis"}),  # compiles and reads what training runs
    ("mechanics", {"mechanics"}),  # the classic mechanics, beside the core path
    ("commands", {"loop", "cli", "train"}),  # the composition root
)
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}


def imports(path: Path) -> list[tuple[str, int]]:
    """The jaxshard modules ``path`` imports (``from jaxshard import x`` names module x), with lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jaxshard":
                found += [(f"jaxshard.{a.name}", node.lineno) for a in node.names]
            elif node.module.startswith("jaxshard."):
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("jaxshard.")]
    return found


def part_of(module: str) -> str:
    return module.split(".")[1]


def library_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "jaxshard").rglob("*.py") if p.name != "__init__.py" or p.parent.name != "jaxshard")


def test_every_module_has_a_layer():
    parts = {p.relative_to(ROOT / "jaxshard").parts[0].removesuffix(".py") for p in library_modules()}
    assert parts <= set(RANK), f"modules without a layer in LAYERS: {sorted(parts - set(RANK))}"


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_up_a_layer(path):
    own = path.relative_to(ROOT / "jaxshard").parts[0].removesuffix(".py")
    upward = [f"line {line}: {module} ({LAYERS[RANK[part_of(module)]][0]})" for module, line in imports(path)
              if RANK[part_of(module)] > RANK[own]]
    assert not upward, f"{path.relative_to(ROOT)} ({LAYERS[RANK[own]][0]}) imports from above: {upward}"


def test_the_library_imports_no_model_or_experiment_outside_the_commands():
    for path in library_modules():
        own = path.relative_to(ROOT / "jaxshard").parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text())
        outside = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for name in ([n.module] if isinstance(n, ast.ImportFrom) and n.module else
                                [a.name for a in getattr(n, "names", [])] if isinstance(n, ast.Import) else [])
                   if name.split(".")[0] in ("models", "experiments")]
        assert not outside or LAYERS[RANK[own]][0] == "commands", (path, outside)


def test_models_import_only_the_vocabulary_and_the_kernels():
    """Model code knows no strategy: it names dims and calls kernels that read the active rules.
    (The CNN's BatchNorm is the classic mechanics' SyncBatchNorm demonstration.)"""
    allowed = {"vocabulary", "kernels"}
    for path in sorted((ROOT / "models").glob("*.py")):
        bad = [(module, line) for module, line in imports(path)
               if LAYERS[RANK[part_of(module)]][0] not in allowed and module != "jaxshard.mechanics.batchnorm"]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader of imports is not blind: a data module importing the loop is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxshard import loop\n    from jaxshard.training.step import build_program\n")
    found = imports(bad)
    assert found == [("jaxshard.loop", 2), ("jaxshard.training.step", 3)]
    assert all(RANK[part_of(m)] > RANK["data"] for m, _ in found)
