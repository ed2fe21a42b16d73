"""What a new user meets first: a bare `gpuscale`, `--version`, `compare` without ids, and runs
known by a label as well as by their number."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from conftest import gpuscale, run_json
from gpuscale.control.store import Store

FAST = ["--recipe", "probe", "--set", "steps=100000", "--set", "prompt_tokens=8", "--batch-size", "2", "--gpus", "1"]


def test_bare_gpuscale_prints_the_usage_and_the_commands(home):
    result = gpuscale()
    assert result.returncode == 2
    assert "usage: gpuscale" in result.stderr
    for command in ("run", "runs", "show", "compare", "export", "doctor"):
        assert f"\n    {command} " in result.stderr, result.stderr


def test_version(home):
    result = gpuscale("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"gpuscale {version('gpuscale')}"


def test_the_tuis_version_names_the_tui(home):
    result = gpuscale("--version", entry="gpuscale.app.tui_main")
    assert result.returncode == 0 and result.stdout.strip() == f"gpuscale-tui {version('gpuscale')}"
    wrong = gpuscale("--no-such-flag", entry="gpuscale.app.tui_main")
    assert wrong.returncode == 2 and wrong.stderr.startswith("gpuscale-tui: error: unrecognized arguments")


def test_reading_the_history_creates_no_home(home):
    """`runs`, `show`, `compare`, `export`, `logs` and `recipes` read: before any run there is
    nothing to read, and no folder is made for it."""
    assert not home.exists()
    runs = gpuscale("runs")
    assert runs.returncode == 0 and runs.stdout.split() == ["ID", "RECIPE", "STATUS", "DURATION", "FIGURES", "STARTED"]
    assert gpuscale("runs", "--json").stdout.strip() == "[]"
    for args in (("show", "1"), ("compare", "1", "2"), ("export", "1"), ("logs", "1")):
        result = gpuscale(*args)
        assert result.returncode == 2 and "'1': no such run" in result.stderr, result.stderr
    assert gpuscale("recipes").returncode == 0
    assert not home.exists()


def test_recipes_lists_every_setting_in_text(home):
    from gpuscale.recipes.shared.registry import all_recipes

    shown = gpuscale("recipes").stdout
    for recipe in all_recipes().values():
        part = shown.split(f"\n{recipe.name} settings (--set NAME=VALUE):\n", 1)[1].split("\n\n", 1)[0]
        names = [line.split()[0] for line in part.splitlines()[1:]]
        assert names == list(recipe.settings_cls.model_fields), recipe.name
    rft = shown.split("\nrft settings", 1)[1]
    # A setting left to the device reads auto, its line saying both values (recipes/shared/device_defaults.py).
    assert any(line.split()[:2] == ["samples_per_question", "auto"] and "16 on a GPU" in line
               for line in rft.splitlines())
    assert any(line.split()[:2] == ["include_gold", "true"] for line in rft.splitlines())  # as typed after --set


def test_compare_without_ids_says_what_it_wants(home):
    for args in ((), ("3",)):
        result = gpuscale("compare", *args)
        assert result.returncode == 2
        assert "compare needs two run ids, e.g. gpuscale compare 12 15; `gpuscale runs` lists them" in result.stderr


def labelled_runs(home) -> tuple[int, int]:
    store = Store(home)
    ids = []
    for batch, label in ((2, "baseline"), (4, "bigger batch")):
        run_id = store.create_run("probe", {"batch_size": batch}, [], "h")
        store.update_run(run_id, status="succeeded", started_at=1.0, ended_at=2.0, label=label,
                         summary={"tokens_per_s": 100.0 * batch})
        ids.append(run_id)
    store.close()
    return tuple(ids)


def test_runs_are_found_by_label(home):
    a, b = labelled_runs(home)
    runs = gpuscale("runs")
    assert runs.returncode == 0
    header, *rows = runs.stdout.splitlines()
    assert "LABEL" in header.split()
    assert any(row.split()[0] == str(b) and "bigger batch" in row for row in rows), runs.stdout
    shown = gpuscale("show", "bigger batch")
    assert shown.returncode == 0 and "label: bigger batch" in shown.stdout and f"run {b} probe" in shown.stdout
    compared = gpuscale("compare", "baseline", "bigger batch", "--json")
    assert compared.returncode == 0
    assert json.loads(compared.stdout)["settings"] == {"batch_size": [2, 4]}
    exported = json.loads(gpuscale("export", "baseline").stdout)
    assert exported["run"]["id"] == a
    missing = gpuscale("show", "nope")
    assert missing.returncode == 2 and "'nope': no such run" in missing.stderr


def test_runs_lists_only_the_runs_a_label_matches(home):
    """`gpuscale runs --label`: a plain label lists exactly its runs (case counts), a pattern a family."""
    a, b = labelled_runs(home)
    unlabelled = Store(home).create_run("probe", {}, [], "h")

    def listed(*args: str) -> list[int]:
        result = gpuscale("runs", "--json", *args)
        assert result.returncode == 0, result.stderr
        return [run["id"] for run in json.loads(result.stdout)]

    assert listed() == [unlabelled, b, a]
    assert listed("--label", "baseline") == [a]
    assert listed("--label", "bigger batch") == [b]
    assert listed("--label", "bigger") == listed("--label", "Baseline") == []
    assert listed("--label", "b*") == [b, a] and listed("--label", "*batch") == [b]
    assert listed("--label", "b*", "--status", "succeeded", "--recipe", "probe", "--limit", "1") == [b]
    table = gpuscale("runs", "--label", "baseline").stdout.splitlines()
    assert len(table) == 2 and table[1].split()[:2] == [str(a), "baseline"]


def test_an_ambiguous_label_names_the_runs(home):
    a, b = labelled_runs(home)
    Store(home).update_run(b, label="baseline")
    result = gpuscale("show", "baseline")
    assert result.returncode == 2 and f"the label is on runs {a}, {b}" in result.stderr


@pytest.mark.e2e
def test_run_with_a_label_then_stop_it_by_label(home):
    run_id = int(gpuscale("run", *FAST, "--label", "first try", "--detach").stdout)
    assert run_json("show", "first try")["label"] == "first try"
    stopped = gpuscale("stop", "first try")
    assert stopped.returncode == 0 and f"run {run_id}: stopped" in stopped.stdout
    assert gpuscale("run", *FAST, "--label", "12", "--detach").returncode == 2  # a number is an id
