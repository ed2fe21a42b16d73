"""The catalogue of figures (data/figures.py) and how the views write a figure from it: a label, a
unit, a direction and a format for every figure it knows, its families (per domain, first/last,
before/after), and a figure it does not know shown plainly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import gpuscale.recipes
from gpuscale.app import cli
from gpuscale.app.views.runs import figure_text, figures_text, key_figures, labelled_text
from gpuscale.control.store import Store
from gpuscale.data.figures import (
    FIGURES,
    HIGHER,
    LOWER,
    NEITHER,
    Figure,
    _figures,
    accuracy_name,
    better,
    figure,
    label,
)
from gpuscale.recipes.shared.contract import Recipe
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.recipes.shared.summary import summary_opening
from gpuscale.runs.settings import RunSettings


def test_a_figure_of_each_direction():
    assert figure("tokens_per_s").direction == HIGHER and figure("tokens_per_s").unit == "tokens/s"
    assert figure("step_seconds_median").direction == LOWER and figure("step_seconds_median").unit == "s"
    assert figure("world_size").direction == NEITHER
    assert better("tokens_per_s", 100.0, 120.0) == "b" and better("train_loss", 0.5, 0.7) == "a"
    assert better("world_size", 2, 8) is None and better("tokens_per_s", 5.0, 5.0) is None
    assert better("frobs", 1.0, 2.0) is None  # not catalogued: no direction to judge by


def test_families_stand_for_their_qualified_names():
    every_accuracy = [accuracy_name("greedy", "", "before"), accuracy_name("sampled", "math", "after"), "accuracy",
                      "accuracy_greedy"]
    assert every_accuracy[:2] == ["accuracy_greedy_before", "accuracy_sampled_math_after"]
    for name in every_accuracy:
        assert figure(name).direction == HIGHER and figure(name).name == name
    assert label("accuracy_sampled_math_after") == "accuracy (sampled math after)"
    assert label("reward_first") == "reward (first)" and figure("fitness_mean_last").direction == HIGHER
    assert label("yield_math") == "questions with a correct answer (math)"
    # The longest family wins: a steady-state samples/s is a samples/s, not a bare samples count.
    assert figure("samples_per_s_steady").unit == "samples/s"
    # Its own entry beats a family: a gain in points is not an accuracy share.
    assert figure("accuracy_greedy_gain_points").unit == "points"
    # eggroll's per-phase medians are times by their end.
    assert figure("perturb_seconds_median").unit == "s" and figure("perturb_seconds_median").direction == LOWER


def test_every_entry_is_well_formed():
    for name, entry in FIGURES.items():
        assert entry.name == name and entry.label and entry.direction in (HIGHER, LOWER, NEITHER)
        assert entry.format in ("number", "percent", "text"), name
        assert figure(name) is entry


def test_a_figure_catalogued_twice_is_refused_at_import():
    """A second entry of a name (a newcomer adding one that is there) would silently replace the first."""
    with pytest.raises(ValueError, match="figure 'grad_norm': catalogued twice"):
        _figures(*FIGURES.values(), Figure("grad_norm", "gradient norm", direction=LOWER))


def test_values_are_written_with_their_format_and_unit():
    assert figure_text("mfu", 0.2824) == "28.2%" and figure_text("mfu", None) == "—"
    assert figure_text("tokens_per_s", 12_750.4) == "12,750 tokens/s"
    assert figure_text("step_time_ms_median", 24.6) == "24.6 ms"
    assert figure_text("generation_seconds", 12.345) == "12.35 s"
    assert figure_text("peak_mem_mb_per_rank", [1341.0, 1778.0]) == "1,341 1,778 MiB"  # one unit for the list
    assert figure_text("dtype", "bfloat16") == "bfloat16" and figure_text("eval_split", "test") == "test"
    assert figure_text("accuracy_greedy_after", 0.48) == "0.48"  # a share of answers, as always
    assert labelled_text("tokens_per_s", 5219.0) == "tokens/s 5,219"  # a label that is its unit says it once
    assert labelled_text("step_seconds_median", 0.52) == "step time (median) 0.52 s"
    assert key_figures({"tokens_per_s": 5219.0, "samples_per_s": 40.0}) == ["tokens/s 5,219", "samples/s 40"]


def test_a_figure_not_in_the_catalogue_still_shows_plainly(home, capsys):
    assert figure("frobs_per_widget") is None and label("frobs_per_widget") == "frobs_per_widget"
    assert figure_text("frobs_per_widget", 12_345.6) == "12,346" and figure_text("frobs_per_widget", None) == "—"
    assert labelled_text("frobs_per_widget", 2.0) == "frobs_per_widget 2"
    run = {"status": "running", "progress": {"latest": {"loss": 1.5, "frobs_per_widget": 2.0}}}
    assert figures_text(run) == "loss 1.5 · frobs_per_widget 2"
    store = Store(home)
    run_id = store.create_run("probe", {}, [], "h")
    store.finish_run(run_id, "succeeded", summary={"frobs_per_widget": 12_345.6, "tokens_per_s": 900.0})
    assert cli.main(["show", str(run_id)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  frobs_per_widget: 12,346" in lines
    # The probe's tokens/s, with what the probe counts in it (its Recipe.figure_notes).
    assert "  tokens_per_s: 900 tokens/s  (decode steps alone, all ranks together, through transformers' " \
        "forward with its KV cache; the prefill and warm-up steps untimed)" in lines


def test_the_contract_finds_a_promise_outside_the_catalogue():
    class Frobs(Recipe):
        name = "frobs"
        summary = "a recipe that promises a figure nobody catalogued"
        settings_cls = RunSettings
        promised_figures = ("world_size", "frobs_per_widget", "accuracy_greedy_after")

        def run(self, settings, ctx, reporter):
            raise NotImplementedError

    assert Frobs.uncatalogued_figures() == ["frobs_per_widget"]


@pytest.mark.parametrize("name", sorted(all_recipes()))
def test_every_recipe_promises_catalogued_figures(name):
    assert all_recipes()[name].uncatalogued_figures() == []


def test_the_catalogue_imports_no_torch():
    code = "import sys, gpuscale.data.figures; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_every_summary_opens_the_same_way():
    ctx = SimpleNamespace(world_size=2, dtype="torch.bfloat16")
    settings = SimpleNamespace(eval_split="validation", dataset="tiny-math")
    assert summary_opening(ctx) == {"world_size": 2, "dtype": "bfloat16"}
    assert summary_opening(ctx, settings, train=[{}] * 3, held_out=[{}] * 2) == {
        "world_size": 2, "dtype": "bfloat16", "train_examples": 3, "eval_split": "validation", "eval_examples": 2}
    # A tiny-math test figure names its test split; another data set's has one test split.
    scored = {"eval_split": "test", "test_split": "test-v2"}
    assert summary_opening(ctx, SimpleNamespace(eval_split="test", dataset="tiny-math:counting"), held_out=[]) == {
        "world_size": 2, "dtype": "bfloat16", **scored, "eval_examples": 0}
    old = SimpleNamespace(eval_split="test-v1", dataset="tiny-math")
    assert summary_opening(ctx, old, held_out=[])["test_split"] == "test-v1"
    assert "test_split" not in summary_opening(ctx, SimpleNamespace(eval_split="test", dataset="gsm8k"), held_out=[])
    assert "test_split" not in summary_opening(ctx, SimpleNamespace(eval_split="test", dataset="a.jsonl"), held_out=[])
    assert all(figure(name) for name in summary_opening(ctx, old, train=[], held_out=[]))
    # Written there once: no recipe spells the opening out by hand.
    by_hand = [str(path) for path in Path(gpuscale.recipes.__file__).parent.rglob("*.py")
               if path.name != "summary.py" and "str(ctx.dtype)" in path.read_text()]
    assert by_hand == []


def test_a_table_that_names_the_figure_leaves_the_unit_out():
    assert figure_text("mfu", 0.2824, unit=False) == "28.2%"  # still a percentage
    assert figure_text("tokens_per_s", 5219.0, unit=False) == "5,219"
    assert figure_text("frobs_per_widget", 2.5, unit=False) == "2.5"
