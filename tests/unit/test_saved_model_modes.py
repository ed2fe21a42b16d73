"""A saved model's files all get the modes the user's umask gives new files: the weights too, which
were written 0600 (a temporary file renamed into place) while the tokenizer and config were 0644."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from gpuscale.recipes.shared.models import save_model


@pytest.fixture(params=[0o022, 0o027])
def file_mode(request):
    """The mode new files get under the umask of the test (set for it, then put back)."""
    old = os.umask(request.param)
    yield 0o666 & ~request.param
    os.umask(old)


def test_every_saved_file_follows_the_umask(tmp_path, file_mode):
    from gpuscale.data.models import load_model

    model, tokenizer = load_model("tiny-math")
    ctx = SimpleNamespace(run_dir=str(tmp_path), is_main=True)
    directory = save_model(model, tokenizer, ctx)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir() if path.is_file()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, file_mode), {name: oct(mode) for name, mode in modes.items()}
