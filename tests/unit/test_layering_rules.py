"""The floors of ARCHITECTURE.md, declared once (`FLOORS`, bottom to top) and every rule between them
derived from that declaration: a module of a floor imports its own floor and the floors it stands on
(and what they stand on), never another; `EXCEPTIONS` lists the crossings made on purpose, each with
its reason. Beside the floors, what a floor must never load (`NEVER_LOADED`: torch out of the login
node's floors, textual out of everything a rank runs) and the rules inside the recipes floor (no
recipe imports another; what they share is in recipes/shared/ and names no recipe) and inside the app
(the views the CLI and the TUI share load neither textual nor torch and run no SQL; the app starts
without torch).

Each rule is checked twice: by importing every module of a floor in a fresh interpreter (what really
gets loaded) and by reading every import statement (which also catches an import inside a function
that the first check never runs). One interpreter does all the importing (`loaded_by`): each floor in
a forked child of its own, so a floor sees only what it loads itself. Each derived rule is also shown
to fail on a violation planted in a scratch file (`test_a_planted_crossing_fails`)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import json
import pkgutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpuscale

PACKAGE_ROOT = Path(gpuscale.__file__).parent


@dataclass(frozen=True)
class Floor:
    name: str  # the folder under gpuscale/
    on: tuple[str, ...] = ()  # the floors right below it; what they stand on it may import too


# ARCHITECTURE.md's picture, bottom to top. `control` and the rank side (`engines`, `recipes`) both
# stand on `runs` and never on each other: a rank runs on nodes without the login node's history.
FLOORS = (
    Floor("data"),
    Floor("runs", on=("data",)),
    Floor("engines", on=("runs",)),
    Floor("recipes", on=("engines",)),
    Floor("control", on=("runs",)),
    Floor("app", on=("recipes", "control")),
)

# Crossings made on purpose: (importing module, imported module) -> why. None today: a crossing the
# floors forbid is moved to the floor it belongs on, not listed here, unless moving it costs more.
EXCEPTIONS: dict[tuple[str, str], str] = {}

# What a floor must never load, whatever the floors allow: the control plane stays light (it runs
# on the login node beside the TUI), and nothing a rank runs needs textual.
HEAVY = ("torch", "transformers", "textual")
NEVER_LOADED = {
    "data": ("textual",),
    "runs": HEAVY,
    "engines": ("textual",),
    "recipes": ("textual",),
    "control": HEAVY,
}


def floor_of(module: str) -> str | None:
    """The floor a gpuscale module lives on (gpuscale.control.store -> control); None outside gpuscale
    and for the package's own `__init__`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gpuscale" and len(parts) > 1 else None


def reachable(floor: str) -> set[str]:
    """The floors `floor` may import: itself and everything it stands on, transitively."""
    by_name = {f.name: f for f in FLOORS}
    seen, todo = set(), [floor]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += by_name[name].on
    return seen


def crossings(imports: dict[str, set[str]]) -> list[str]:
    """Every import of the `imports` map (module -> modules it imports) that reaches a floor its own
    floor does not stand on, less EXCEPTIONS."""
    found = []
    for module, imported in sorted(imports.items()):
        allowed = reachable(floor_of(module))
        found += [f"{module} ({floor_of(module)}) imports {other} ({floor_of(other)})" for other in sorted(imported)
                  if floor_of(other) not in (None, *allowed) and (module, other) not in EXCEPTIONS]
    return found


def never_loaded(floor: str, modules: set[str]) -> list[str]:
    """The libraries of NEVER_LOADED[floor] among `modules` (a library or any of its submodules)."""
    return sorted(m for m in modules if m.split(".")[0] in NEVER_LOADED.get(floor, ()))


# ---- reading imports ----------------------------------------------------------------------------


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


def statements_of(package: str) -> dict[str, set[str]]:
    """Module -> what its import statements name, for every module under `package`."""
    return {name: imported_by(path, name) for name, path in source_files(package).items()}


# Modules that only import where an optional package is installed (their importers check first), by that package.
NEEDS_OPTIONAL = {"gpuscale.engines.generation.triton_kernels": "triton"}


def all_modules(package: str) -> list[str]:
    """`package` and every module under it, subpackages included (`__main__` modules left out:
    importing one runs a program; so are NEEDS_OPTIONAL's where their package is missing)."""
    pkg = importlib.import_module(package)
    if not hasattr(pkg, "__path__"):  # a plain module (recipes/probe.py)
        return [package]
    names = [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")]
    return [name for name in names if not name.endswith(".__main__")
            and (name not in NEEDS_OPTIONAL or importlib.util.find_spec(NEEDS_OPTIONAL[name]) is not None)]


# ---- what a fresh interpreter loads -------------------------------------------------------------

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
LIGHT_FLOORS = tuple(floor for floor, never in NEVER_LOADED.items() if "torch" in never)


def importing(package: str) -> str:
    return "\n".join(f"import {name}" for name in all_modules(package))


@pytest.fixture(scope="module")
def loaded_by(tmp_path_factory) -> dict[str, set[str]]:
    """What each floor (and each recipe, and the app's start-up and views) loads when imported in a
    fresh interpreter: label -> module names."""
    light = {floor: importing(f"gpuscale.{floor}") for floor in LIGHT_FLOORS}
    light.update({"views": importing("gpuscale.app.views"),
                  "app start-up": "import gpuscale.app.cli, gpuscale.app.tui_main\n"
                                  "from gpuscale.recipes.shared.registry import all_recipes\nall_recipes()"})
    heavy = {floor.name: importing(f"gpuscale.{floor.name}") for floor in FLOORS if floor.name not in LIGHT_FLOORS}
    heavy.update({f"recipes.{own}": importing(f"gpuscale.recipes.{own}") for own in RECIPE_PACKAGES})
    groups = json.dumps([light, heavy, RANK_SIDE_LIBRARIES, str(tmp_path_factory.mktemp("loaded"))])
    done = subprocess.run([sys.executable, "-c", LOADER, groups], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    failed = {label: modules for label, modules in found.items() if isinstance(modules, str)}
    assert not failed, failed  # an import that raised: its traceback
    return {label: set(modules) for label, modules in found.items()}


# ---- the floors ---------------------------------------------------------------------------------


def test_the_floors_are_the_folders():
    """Every folder under gpuscale/ is a declared floor and every floor a folder: a new folder is
    placed in the picture before anything may import it."""
    folders = {entry.name for entry in PACKAGE_ROOT.iterdir() if (entry / "__init__.py").is_file()}
    assert folders == {floor.name for floor in FLOORS}
    names = [floor.name for floor in FLOORS]
    assert all(below in names[:names.index(floor.name)] for floor in FLOORS for below in floor.on)  # bottom to top


@pytest.mark.parametrize("floor", [floor.name for floor in FLOORS])
def test_no_import_statement_reaches_a_floor_not_below(floor):
    assert crossings(statements_of(f"gpuscale.{floor}")) == []


@pytest.mark.parametrize("floor", [floor.name for floor in FLOORS])
def test_what_a_floor_loads_stays_on_the_floors_below(floor, loaded_by):
    loaded = loaded_by[floor]
    assert f"gpuscale.{floor}" in loaded
    assert crossings({f"gpuscale.{floor}": {m for m in loaded if m.startswith("gpuscale.")}}) == []
    assert never_loaded(floor, loaded) == []
    assert [f"{name} imports {m}" for name, imported in statements_of(f"gpuscale.{floor}").items()
            for m in sorted(imported) if m.split(".")[0] in NEVER_LOADED.get(floor, ())] == []


def test_every_line_of_the_picture_is_an_import_made():
    """The picture is the import graph, not a wish: each floor imports each floor it is drawn on."""
    imports = statements_of("gpuscale")
    made = {(floor_of(module), floor_of(other)) for module, imported in imports.items() for other in imported
            if floor_of(other) not in (None, floor_of(module))}
    drawn = {(floor.name, below) for floor in FLOORS for below in floor.on}
    assert sorted(drawn - made) == []


def test_every_exception_is_a_crossing_still_made():
    """A listed exception is a real import the floors would refuse: one no longer made, or one the
    floors allow anyway, is taken off the list."""
    imports = statements_of("gpuscale")
    for (module, other), reason in EXCEPTIONS.items():
        assert reason and other in imports.get(module, ()), (module, other)
        assert floor_of(other) not in reachable(floor_of(module)), (module, other)


# Every pair of floors the declaration forbids, each planted once below.
FORBIDDEN = [(low, high) for low, high in itertools.permutations([f.name for f in FLOORS], 2)
             if high not in reachable(low)]


@pytest.mark.parametrize(("floor", "above"), FORBIDDEN)
def test_a_planted_crossing_fails(floor, above, tmp_path):
    """A module of `floor` importing one of `above`, in any of the forms the scanner reads, is
    reported; so is a library its floor must never load."""
    assert {("recipes", "app"), ("recipes", "control"), ("control", "engines"), ("data", "runs")} <= set(FORBIDDEN)
    planted = tmp_path / "planted.py"
    planted.write_text(f"import os\ndef later():\n    import importlib\n"
                       f"    return importlib.import_module('gpuscale.{above}.anything')\n")
    module = f"gpuscale.{floor}.planted"
    assert crossings({module: imported_by(planted, module)}) == [
        f"{module} ({floor}) imports gpuscale.{above}.anything ({above})"]
    if floor in NEVER_LOADED:
        assert never_loaded(floor, {"os", f"{NEVER_LOADED[floor][0]}.widgets"}) == [f"{NEVER_LOADED[floor][0]}.widgets"]


def test_an_exception_lets_one_crossing_through(monkeypatch):
    planted = {"gpuscale.recipes.planted": {"gpuscale.app.batch_choice", "gpuscale.control.store"}}
    monkeypatch.setitem(EXCEPTIONS, ("gpuscale.recipes.planted", "gpuscale.app.batch_choice"), "a planted reason")
    assert crossings(planted) == ["gpuscale.recipes.planted (recipes) imports gpuscale.control.store (control)"]


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


# ---- inside the recipes floor -------------------------------------------------------------------


def defines_a_recipe(path: Path) -> bool:
    """The file defines a class on `Recipe` (recipes/shared/contract.py), read from its source."""
    bases = (base for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
             for base in node.bases)
    return any(getattr(base, "id", getattr(base, "attr", None)) == "Recipe" for base in bases)


# recipes/shared/: the pieces the recipes share (contract, registry, training...), the one package
# under recipes/ that is no recipe.
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


def recipe_package(module: str) -> str | None:
    """The recipe package a module belongs to (gpuscale.recipes.sft.trainer -> sft), None for the
    shared modules under recipes/."""
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


def recipe_crossings(imports: dict[str, set[str]]) -> list[str]:
    """Imports from one recipe into another, and from what the recipes share into any recipe (else a
    recipe would reach another through it; the registry loads them by name, at run time)."""
    return [f"{name} imports {m}" for name, imported in sorted(imports.items()) for m in sorted(imported)
            if recipe_package(m) not in (None, recipe_package(name))]


def test_no_recipe_imports_another_nor_does_what_they_share(loaded_by):
    imports = statements_of("gpuscale.recipes")
    assert "gpuscale.recipes.shared.training" in imports and recipe_package("gpuscale.recipes.shared.training") is None
    assert recipe_crossings(imports) == []
    assert recipe_crossings({f"gpuscale.recipes.{own}": {m for m in loaded_by[f"recipes.{own}"]}
                             for own in RECIPE_PACKAGES}) == []


def test_a_planted_recipe_crossing_fails():
    planted = {"gpuscale.recipes.sft.planted": {"gpuscale.recipes.rft.filtering", "gpuscale.recipes.shared.models"},
               "gpuscale.recipes.shared.planted": {"gpuscale.recipes.eggroll"}}
    assert recipe_crossings(planted) == [
        "gpuscale.recipes.sft.planted imports gpuscale.recipes.rft.filtering",
        "gpuscale.recipes.shared.planted imports gpuscale.recipes.eggroll"]


def test_what_the_recipes_share_is_in_one_place():
    """Every module directly under recipes/ is a recipe (probe.py) or the package's own (`__init__`,
    `__main__`, the ranks' entry point): a piece the recipes share goes in recipes/shared/."""
    loose = [path.name for path in (PACKAGE_ROOT / "recipes").glob("*.py")
             if not path.stem.startswith("__") and not defines_a_recipe(path)]
    assert loose == []


# ---- inside the app floor -----------------------------------------------------------------------


def sql_in(imports: dict[str, set[str]], files: dict[str, Path]) -> list[str]:
    """A connection held or a statement run, or sqlite imported: all SQL goes through Store's methods."""
    offending = []
    for name, path in files.items():
        offending += [f"{name}:{node.lineno} .{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Attribute) and node.attr in ("execute", "executemany", "db", "conn")]
        offending += [f"{name} imports {m}" for m in sorted(imports[name]) if m.startswith(("sqlite3", "sqlite_utils"))]
    return offending


def test_views_load_neither_textual_nor_torch_and_run_no_sql(loaded_by, tmp_path):
    """The formatting the CLI and the TUI share (app/views/) is plain Python over the store's rows."""
    files = source_files("gpuscale.app.views")
    imports = {name: imported_by(path, name) for name, path in files.items()}
    assert "gpuscale.app.views.feed" in imports
    assert [name for name in HEAVY if name in loaded_by["views"]] == []
    assert [f"{name} imports {m}" for name, imported in imports.items() for m in imported
            if m.split(".")[0] in HEAVY] == []
    assert sql_in(imports, files) == []
    planted = tmp_path / "planted.py"
    planted.write_text("import sqlite3\ndef rows(store):\n    return store.db.execute('select 1')\n")
    assert sql_in({"planted": imported_by(planted, "planted")}, {"planted": planted}) == [
        "planted:3 .execute", "planted:3 .db", "planted imports sqlite3"]


def test_app_starts_without_torch(loaded_by):
    loaded = loaded_by["app start-up"]
    assert "gpuscale.app.cli" in loaded and "torch" not in loaded and "transformers" not in loaded
