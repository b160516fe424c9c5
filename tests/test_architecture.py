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
    # (fp8: the float8 numerics, jax alone; the rules gather weights in float8 with them)
    ("vocabulary", {"errors", "options", "axes", "pytree", "mesh", "rules", "rows", "runtime", "distributed",
                    "model", "fp8"}),
    ("kernels", {"parallel", "remat"}),  # what model code calls; choose by the active rules
    ("data", {"data"}),
    ("training", {"training"}),
    ("analysis", {"analysis"}),  # compiles and reads what training runs
    ("mechanics", {"mechanics"}),  # the classic mechanics, beside the core path
    ("commands", {"run", "loop", "cli", "train"}),  # the composition root
)
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}


def imports(path: Path) -> list[tuple[str, int]]:
    """The jaxshard modules ``path`` imports (``from jaxshard import x`` names module x), with lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jaxshard" or node.module.startswith("jaxshard."):
                # from jaxshard.parallel import pipeline: the module jaxshard.parallel.pipeline
                found += sorted({(_module(f"{node.module}.{a.name}") or node.module, node.lineno)
                                 for a in node.names})
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("jaxshard.")]
    return found


def _module(name: str) -> str | None:
    """``name`` if it is a module or package of the repository."""
    path = ROOT.joinpath(*name.split("."))
    return name if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else None


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


def outside_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import from models/ or experiments/."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        lines += [node.lineno for name in names if name.split(".")[0] in ("models", "experiments")]
    return lines


def test_the_library_imports_no_model_or_experiment_outside_the_commands():
    for path in library_modules():
        own = path.relative_to(ROOT / "jaxshard").parts[0].removesuffix(".py")
        outside = outside_imports(path)
        assert not outside or LAYERS[RANK[own]][0] == "commands", (path, outside)


def test_only_the_commands_import_the_cli():
    """The flags are the commands' business: the library (the training loop included) takes the
    run's config tree (jaxshard.run), never the parser. Only the training command reads flags."""
    importers = sorted(str(path.relative_to(ROOT)) for path in library_modules()
                       if any(module == "jaxshard.cli" for module, _ in imports(path)))
    assert importers == ["jaxshard/train.py"], importers


# Kernels that are strategies of their own, applied to a model from outside: no model imports them.
STRATEGY_KERNELS = ("jaxshard.parallel.pipeline", "jaxshard.parallel.staged", "jaxshard.parallel.balance")


def test_models_import_only_the_vocabulary_and_the_kernels_they_call():
    """Model code knows no strategy: it names dims and calls the kernels that read the active
    rules (attention, the vocab-parallel embedding and loss, experts); pipelines are built from
    its pieces outside it. (The CNN's BatchNorm is the classic mechanics' SyncBatchNorm.)"""
    allowed = {"vocabulary", "kernels"}
    for path in sorted((ROOT / "models").glob("*.py")):
        bad = [(module, line) for module, line in imports(path)
               if (LAYERS[RANK[part_of(module)]][0] not in allowed and module != "jaxshard.mechanics.batchnorm")
               or module.startswith(STRATEGY_KERNELS)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader of imports is not blind: a data module importing the loop is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxshard import loop\n    from jaxshard.training.step import build_program\n"
                   "    from jaxshard.training import step, optim\n")
    found = imports(bad)
    assert found == [("jaxshard.loop", 2), ("jaxshard.training.step", 3), ("jaxshard.training.optim", 4),
                     ("jaxshard.training.step", 4)]
    assert all(RANK[part_of(m)] > RANK["data"] for m, _ in found)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "moe-tiny"])
def test_every_model_the_library_takes_provides_the_protocol(name):
    """TransformerLM has every member of jaxshard.model.Stageable (what the library and the
    pipeline adapter read, with no getattr defaults); its staged form every member of
    LanguageModel."""
    from jaxshard.model import LanguageModel, Stageable
    from jaxshard.parallel.pipeline import StageLayout
    from jaxshard.parallel.staged import StagedModel
    from models import TransformerLM, get_preset

    model = TransformerLM(get_preset(name).replace(n_layers=4))
    staged = StagedModel(model, StageLayout.make(4, 2))
    assert isinstance(model, Stageable) and isinstance(staged, LanguageModel)
    assert staged.n_params() == model.n_params() and staged.param_axes() == model.param_axes()
    # A model without one of the members is not one.
    class Partial:
        cfg, remat, unroll, moe_layers, stacks, stage_layout = model.cfg, model.remat, False, (), (), None
    assert not isinstance(Partial(), LanguageModel) and not isinstance(staged, Stageable)


def test_the_library_is_typed_against_the_model_protocol():
    """Every parameter named ``model`` in jaxshard/ is annotated with a protocol of
    jaxshard.model (not Any, not missing), so what a model must provide is written down."""
    loose = []
    for path in library_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "model" and (arg.annotation is None
                                               or not {"LanguageModel", "Stageable"} & set(ast.unparse(arg.annotation).replace("|", " ").split())):
                        loose.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not loose, loose
