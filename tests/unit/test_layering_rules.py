"""DESIGN.md's one-way rule, as a test: the core never imports textual, the app starts without torch."""

import subprocess
import sys

import pytest


def modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("package", ["gpuscale.engines", "gpuscale.recipes", "gpuscale.data"])
def test_core_never_imports_textual(package):
    import pkgutil
    import importlib

    pkg = importlib.import_module(package)
    names = [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    code = "\n".join(f"import {name}" for name in names)
    assert "textual" not in modules_after(code)


def test_app_starts_without_torch():
    loaded = modules_after(
        "import gpuscale.app.cli, gpuscale.app.tui_main\n"
        "from gpuscale.recipes.registry import all_recipes\nall_recipes()"
    )
    assert "gpuscale.app.cli" in loaded and "torch" not in loaded and "transformers" not in loaded
