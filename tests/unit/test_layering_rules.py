"""The one-way rule between the floors (ARCHITECTURE.md), as a test: app -> recipes -> engines -> runs
(every process's part) -> data, and app -> runs (the login node's part); data imports no floor above
it. The control plane (runs/) imports neither torch, transformers nor textual, nor anything from
engines/, recipes/ or app/; engines/ and recipes/ import none of runs/' login-node modules (all but
`gpuscale.runs.EVERY_PROCESS`); nothing under engines/ imports recipes/ or app/; no recipe imports
another one (the recipes are found, not listed: every package under recipes/ but shared/, and every
module there defining a Recipe; what they share is in recipes/shared/ alone); the core never imports
textual; the app starts without torch; the views the CLI and the TUI share import neither textual
nor torch, and run no SQL.

Each rule is checked twice where it can be: by importing every module in a fresh interpreter (what
really gets loaded) and by reading every import statement (which also catches an import inside a
function that the first check never runs). One interpreter does all the importing (`loaded_by`): each
package in a forked child of its own, so a package sees only what it loads itself."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuscale
from gpuscale.runs import EVERY_PROCESS

PACKAGE_ROOT = Path(gpuscale.__file__).parent
HEAVY = ("torch", "transformers", "textual")


def defines_a_recipe(path: Path) -> bool:
    """The file defines a class on `Recipe` (recipes/shared/contract.py), read from its source."""
    bases = (base for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
             for base in node.bases)
    return any(getattr(base, "id", getattr(base, "attr", None)) == "Recipe" for base in bases)


# recipes/shared/: the pieces the recipes share (contract, registry, training, common...), the one
# package under recipes/ that is no recipe.
SHARED = "shared"


def recipes_under(folder: Path) -> tuple[str, ...]:
    """The recipes, found where they live: every package under recipes/ but shared/, and every
    module directly there that defines a Recipe (probe.py). A new recipes/dpo/ is a recipe from its
    first file."""
    packages = [entry.name for entry in folder.iterdir() if (entry / "__init__.py").is_file() and entry.name != SHARED]
    modules = [entry.stem for entry in folder.glob("*.py")
               if not entry.stem.startswith("__") and defines_a_recipe(entry)]
    return tuple(sorted(packages + modules))


RECIPE_PACKAGES = recipes_under(PACKAGE_ROOT / "recipes")
# runs/' modules only the login node uses: all but those every process may use (runs/__init__.py).
LOGIN_NODE = tuple(sorted(f"gpuscale.runs.{path.stem}" for path in (PACKAGE_ROOT / "runs").glob("*.py")
                          if not path.stem.startswith("__") and path.stem not in EVERY_PROCESS))


# Run in one fresh interpreter: each group's code in a forked child that writes the modules it ended
# with. The groups that must not load torch fork from the bare interpreter; then the third-party
# libraries the rank side loads anyway (never textual, nor gpuscale) are imported once before the
# other groups fork: a fresh interpreter per package, each importing torch and TRL, took 22 s.
LOADER = r"""
import importlib, json, os, sys, traceback

def modules_after(code, path):
    pid = os.fork()
    if pid == 0:
        try:
            exec(code, {})
            result, status = sorted(sys.modules), 0
        except BaseException:
            result, status = traceback.format_exc(), 1
        with open(path, "w") as out:
            json.dump(result, out)
        os._exit(status)
    os.waitpid(pid, 0)
    with open(path) as found:
        return json.load(found)

light, heavy, preload, folder = json.loads(sys.argv[1])
loaded = {label: modules_after(code, os.path.join(folder, f"{number}.json"))
          for number, (label, code) in enumerate(light.items())}
for name in preload:
    importlib.import_module(name)
loaded.update({label: modules_after(code, os.path.join(folder, f"h{number}.json"))
               for number, (label, code) in enumerate(heavy.items())})
json.dump(loaded, sys.stdout)
"""
# Imported before the rank-side groups fork; their own imports never reach gpuscale or textual.
RANK_SIDE_LIBRARIES = ("torch", "transformers", "accelerate", "peft", "datasets", "trl")


def importing(package: str) -> str:
    return "\n".join(f"import {name}" for name in all_modules(package))


@pytest.fixture(scope="module")
def loaded_by(tmp_path_factory) -> dict[str, set[str]]:
    """What each package loads when imported in a fresh interpreter: label -> module names."""
    light = {"runs": importing("gpuscale.runs"), "views": importing("gpuscale.app.views"),
             "app start-up": "import gpuscale.app.cli, gpuscale.app.tui_main\n"
                             "from gpuscale.recipes.shared.registry import all_recipes\nall_recipes()"}
    heavy = {package: importing(f"gpuscale.{package}") for package in ("engines", "recipes", "data")}
    heavy.update({f"recipes.{own}": importing(f"gpuscale.recipes.{own}") for own in RECIPE_PACKAGES})
    groups = json.dumps([light, heavy, RANK_SIDE_LIBRARIES, str(tmp_path_factory.mktemp("loaded"))])
    done = subprocess.run([sys.executable, "-c", LOADER, groups], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    failed = {label: modules for label, modules in found.items() if isinstance(modules, str)}
    assert not failed, failed  # an import that raised: its traceback
    return {label: set(modules) for label, modules in found.items()}


def all_modules(package: str) -> list[str]:
    """`package` and every module under it, subpackages included (`__main__` modules left out:
    importing one runs a program)."""
    pkg = importlib.import_module(package)
    if not hasattr(pkg, "__path__"):  # a plain module (recipes/probe.py)
        return [package]
    names = [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")]
    return [name for name in names if not name.endswith(".__main__")]


def imported_by(path: Path, module: str) -> set[str]:
    """Every module an import statement anywhere in the file names, at the top or inside a function,
    relative imports resolved; `importlib.import_module("...")` with a literal name counts too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
    return found


def source_files(package: str) -> dict[str, Path]:
    """Module name -> file, for every .py file under the package's folder."""
    folder = PACKAGE_ROOT.joinpath(*package.split(".")[1:])
    files = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def forbidden_imports(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{name} imports {imported}" for name, path in source_files(package).items()
            for imported in sorted(imported_by(path, name))
            if imported.split(".")[0] in forbidden or imported.startswith(tuple(f"{f}." for f in forbidden))
            or imported in forbidden]


# ---- the checker checks ---------------------------------------------------------------------------


def test_the_import_scanner_sees_lazy_relative_and_dynamic_imports(tmp_path):
    path = tmp_path / "module.py"
    path.write_text(
        "import os\n"
        "def later():\n"
        "    from gpuscale.recipes.shared.registry import all_recipes\n"
        "    from ..app import views\n"
        "    import importlib\n"
        "    return importlib.import_module('gpuscale.app.cli')\n"
    )
    found = imported_by(path, "gpuscale.engines.module")
    assert {"os", "gpuscale.recipes.shared.registry", "gpuscale.app", "gpuscale.app.views", "gpuscale.app.cli"} <= found
    assert "gpuscale.engines.generation" in all_modules("gpuscale.engines")  # subpackages are walked
    # On a package that does break the rule it is checking, the rule says so (the widgets use textual).
    assert "gpuscale.app.widgets.charts imports textual.widgets" in forbidden_imports("gpuscale.app.widgets", HEAVY)


# ---- the rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize("package", ["gpuscale.engines", "gpuscale.recipes", "gpuscale.data"])
def test_what_a_rank_runs_imports_no_login_node_module(package, loaded_by):
    """A rank (engines/, recipes/: on a multi-node job, on a node without the front end's home) and
    the tuner's child use only runs/' plain modules: never the history, the launcher, the supervisor
    nor NVML's telemetry. A run id the user gave (rft's data_from) is a run folder by launch."""
    assert "gpuscale.runs.store" in LOGIN_NODE and "gpuscale.runs.launch" in LOGIN_NODE
    assert "gpuscale.runs.run_dir" not in LOGIN_NODE
    label = package.removeprefix("gpuscale.")
    assert sorted(m for m in loaded_by[label] if m.startswith(LOGIN_NODE)) == []
    assert forbidden_imports(package, LOGIN_NODE) == []


def test_every_process_modules_import_no_login_node_module():
    shared = {name: path for name, path in source_files("gpuscale.runs").items()
              if name.rpartition(".")[2] in EVERY_PROCESS}
    assert len(shared) == len(EVERY_PROCESS)  # each name in EVERY_PROCESS is a module of runs/
    assert sorted(f"{name} imports {m}" for name, path in shared.items() for m in imported_by(path, name)
                  if m.startswith(LOGIN_NODE)) == []


@pytest.mark.parametrize("package", ["gpuscale.engines", "gpuscale.recipes", "gpuscale.data"])
def test_core_never_imports_textual(package, loaded_by):
    assert "textual" not in loaded_by[package.removeprefix("gpuscale.")]
    assert forbidden_imports(package, ("textual",)) == []


def test_engines_never_import_recipes_or_the_app(loaded_by):
    loaded = loaded_by["engines"]
    assert "gpuscale.engines.reporter" in loaded
    assert sorted(m for m in loaded if m.startswith(("gpuscale.recipes", "gpuscale.app"))) == []
    assert forbidden_imports("gpuscale.engines", ("gpuscale.recipes", "gpuscale.app")) == []


def test_the_control_plane_imports_no_torch_textual_nor_the_upper_floors(loaded_by):
    """runs/ is what the login node runs (launch, supervisor, store, telemetry): it stays light and
    never reaches up into the rank side, the recipes or the front ends."""
    names = all_modules("gpuscale.runs")
    assert "gpuscale.runs.supervisor" in names and "gpuscale.runs.store" in names
    loaded = loaded_by["runs"]
    assert [name for name in HEAVY if name in loaded] == []
    assert sorted(m for m in loaded if m.startswith(("gpuscale.engines", "gpuscale.recipes", "gpuscale.app"))) == []
    assert forbidden_imports("gpuscale.runs", HEAVY + ("gpuscale.engines", "gpuscale.recipes", "gpuscale.app")) == []


def test_data_is_the_lowest_floor(loaded_by):
    """data/ imports nothing of gpuscale's above it: the control plane (runs/) and the rank side both
    build on it, so what both need (data/precision.py, the one precision rule) lives there."""
    upper = ("gpuscale.runs", "gpuscale.engines", "gpuscale.recipes", "gpuscale.app")
    loaded = loaded_by["data"]
    assert "gpuscale.data.precision" in loaded
    assert sorted(m for m in loaded if m.startswith(upper)) == []
    assert forbidden_imports("gpuscale.data", upper) == []


def recipe_package(module: str) -> str | None:
    """The recipe package a module belongs to (gpuscale.recipes.sft.trainer -> sft), None for the
    shared modules directly under recipes/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["gpuscale", "recipes"] and parts[2] in RECIPE_PACKAGES \
        else None


def test_the_recipes_found_are_the_registered_ones(tmp_path):
    """The recipes the layering rules see are the ones the registry starts; a recipe is found by
    where it lives, so a new package counts as a recipe before anyone lists it."""
    from gpuscale.recipes.shared.registry import BUILTIN

    registered = {reference.partition(":")[0].removeprefix("gpuscale.recipes.") for reference in BUILTIN.values()}
    assert set(RECIPE_PACKAGES) == registered and "probe" in RECIPE_PACKAGES
    assert SHARED not in RECIPE_PACKAGES
    for package in ("dpo", SHARED):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "helper.py").write_text("class Helper:\n    pass\n")
    (tmp_path / "solo.py").write_text("from gpuscale.recipes.shared import contract\n"
                                      "class Solo(contract.Recipe):\n    pass\n")
    assert recipes_under(tmp_path) == ("dpo", "solo")


def test_no_recipe_imports_another_recipe(loaded_by):
    crossings = []
    for name, path in source_files("gpuscale.recipes").items():
        own = recipe_package(name)
        if own is not None:
            crossings += [f"{name} imports {m}" for m in sorted(imported_by(path, name))
                          if recipe_package(m) not in (None, own)]
    for own in RECIPE_PACKAGES:
        crossings += [f"{own} loads {m}" for m in sorted(loaded_by[f"recipes.{own}"])
                      if recipe_package(m) not in (None, own)]
    assert crossings == []


def test_what_the_recipes_share_is_in_one_place():
    """Every module directly under recipes/ is a recipe (probe.py) or the package's own (`__init__`,
    `__main__`, the ranks' entry point): a piece the recipes share goes in recipes/shared/."""
    loose = [path.name for path in (PACKAGE_ROOT / "recipes").glob("*.py")
             if not path.stem.startswith("__") and not defines_a_recipe(path)]
    assert loose == []


def test_the_shared_recipe_pieces_import_no_recipe():
    """What the recipes share (recipes/shared/, and the package's `__init__` and `__main__`) names no
    recipe: else a recipe would reach another through it. The registry loads them by name, at run time."""
    shared = {name: path for name, path in source_files("gpuscale.recipes").items() if recipe_package(name) is None}
    assert "gpuscale.recipes.shared.training" in shared and "gpuscale.recipes.probe" not in shared
    assert sorted(f"{name} imports {m}" for name, path in shared.items() for m in imported_by(path, name)
                  if recipe_package(m) is not None) == []


def test_views_import_neither_textual_nor_torch(loaded_by):
    names = all_modules("gpuscale.app.views")
    assert "gpuscale.app.views.feed" in names and "gpuscale.app.views.text" in names
    loaded = loaded_by["views"]
    assert [name for name in HEAVY if name in loaded] == []
    assert forbidden_imports("gpuscale.app.views", HEAVY) == []


def test_views_run_no_sql():
    """All SQL goes through Store's methods: a view never holds a connection or runs a statement."""
    offending = []
    for name, path in source_files("gpuscale.app.views").items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("execute", "executemany", "db", "conn"):
                offending.append(f"{name}:{node.lineno} .{node.attr}")
        offending += [f"{name} imports {m}" for m in imported_by(path, name)
                      if m.startswith(("sqlite3", "sqlite_utils"))]
    assert offending == []


def test_app_starts_without_torch(loaded_by):
    loaded = loaded_by["app start-up"]
    assert "gpuscale.app.cli" in loaded and "torch" not in loaded and "transformers" not in loaded

