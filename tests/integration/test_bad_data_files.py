"""Files that are not what the user thinks: bytes that are not UTF-8, a directory, a symbolic link
loop. Each is one line with exit code 2, before anything is recorded or started (the real CLI)."""

from __future__ import annotations

import json

import pytest

from conftest import gpuscale, run_json

GOOD_LINE = json.dumps({"question": "How much is 2 + 2?", "answer": "2 + 2 = 4.\n#### 4"})


def refused(*args: str) -> str:
    """The one line `gpuscale run ARGS` refuses with (exit code 2), nothing recorded."""
    result = gpuscale("run", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert run_json("runs") == []
    return lines[0]


@pytest.mark.parametrize("recipe", ["power-sampling", "sft"])
def test_a_line_that_is_not_utf8_is_named_with_its_file_and_line(home, tmp_path, recipe):
    """Before: a UnicodeDecodeError traceback from data/tasks.py, exit code 1."""
    data = tmp_path / "latin1.jsonl"
    latin1 = json.dumps({"question": "Combien font 2 + 2 ?", "answer": "#### 4"}).replace("font", "f\u00e9nt")
    data.write_bytes(b"".join(line + b"\n" for line in [GOOD_LINE.encode()] * 30 + [latin1.encode("latin-1")]))
    assert refused("--recipe", recipe, "--dataset", str(data)) == (
        f"gpuscale: error: dataset: {data}, line 31: not UTF-8 (byte 0xe9 at byte 24 of the line); "
        "save the file as UTF-8")


@pytest.mark.parametrize("name", ["problems", "problems.jsonl"])
def test_a_dataset_that_is_a_directory_says_so(home, tmp_path, name):
    """Before: "no such file" for a directory named like a .jsonl file, "unknown data set" otherwise."""
    folder = tmp_path / name
    folder.mkdir()
    assert refused("--recipe", "power-sampling", "--dataset", str(folder)) == (
        f"gpuscale: error: dataset: '{folder}': {folder} is a directory, not a .jsonl file (name the files in it, "
        "separated by commas)")


def test_a_dataset_that_is_a_symlink_loop_says_so(home, tmp_path):
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    assert refused("--recipe", "power-sampling", "--dataset", str(loop)) == (
        f"gpuscale: error: dataset: '{loop}': {loop} is a symbolic link loop (it leads back to itself), not a file")


@pytest.mark.parametrize("name", ["model", "models/loop"])
def test_a_model_that_is_a_symlink_loop_says_so(home, tmp_path, monkeypatch, name):
    """Before: "unknown model"; `models/loop`, shaped like a hub id, would have been asked of the hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).symlink_to(tmp_path / name)
    assert refused("--recipe", "power-sampling", "--model", name) == (
        f"gpuscale: error: model: '{name}': {name} is a symbolic link loop (it leads back to itself), "
        "not a model directory")
