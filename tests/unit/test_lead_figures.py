"""What a training run is for leads its figures: held-out accuracy before -> after and, for RL, the
reward first -> last, in `gpuscale runs` and `gpuscale show` (older names accepted)."""

from __future__ import annotations

import time

from gpuscale.app import cli
from gpuscale.app.views import collapse, node_check, runs
from gpuscale.app.views.runs import key_figures
from gpuscale.control.store import Store
from gpuscale.data.figures import figure
from gpuscale.data.node_check import NODE_FIGURES

GRPO = {"tokens_per_s": 2_783.0, "samples_per_s": 3.5, "accuracy_greedy_before": 0.125,
        "accuracy_greedy_after": 0.5, "accuracy_sampled_before": 0.1, "accuracy_sampled_after": 0.375,
        "reward_first": 0.05, "reward_last": 0.61}
OLD_SFT = {"tokens_per_s": 900.0, "accuracy_before": 0.2, "accuracy_after": 0.3, "sampled_accuracy_before": 0.1,
           "sampled_accuracy_after": 0.25}
PROBE = {"tokens_per_s": 5_219.0, "samples_per_s": 40.0}


def finished(store: Store, recipe: str, summary: dict) -> int:
    run_id = store.create_run(recipe, {}, [], "node001")
    store.update_run(run_id, started_at=time.time() - 60)
    store.finish_run(run_id, "succeeded", summary=summary)
    return run_id


def test_accuracy_and_reward_lead_and_old_names_are_accepted():
    assert key_figures(GRPO, limit=3) == ["accuracy 0.125 -> 0.5", "sampled accuracy 0.1 -> 0.375",
                                          "reward 0.05 -> 0.61"]
    assert key_figures(OLD_SFT) == ["accuracy 0.2 -> 0.3", "sampled accuracy 0.1 -> 0.25"]
    assert key_figures({"accuracy_after": 0.3, "tokens_per_s": 900.0}) == ["tokens/s 900"]  # half a pair
    assert key_figures(PROBE) == ["tokens/s 5,219", "samples/s 40"]  # a benchmark keeps its rates


def test_runs_and_show_lead_with_them(home, capsys):
    store = Store(home)
    grpo, sft = finished(store, "grpo-mtl", GRPO), finished(store, "sft", OLD_SFT)
    probe = finished(store, "probe", PROBE)
    assert cli.main(["runs"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "accuracy 0.125 -> 0.5, sampled accuracy 0.1 -> 0.375" in rows[str(grpo)]
    assert "accuracy 0.2 -> 0.3, sampled accuracy 0.1 -> 0.25" in rows[str(sft)]
    assert "tokens/s 5,219, samples/s 40" in rows[str(probe)]
    assert cli.main(["show", str(grpo)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[1] == ("figures: accuracy 0.125 -> 0.5 · sampled accuracy 0.1 -> 0.375 · reward 0.05 -> 0.61 · "
                        "tokens/s 2,783")


# Every figure a view names to lead with, to watch or to lay out, by where it is named.
NAMED_BY_VIEWS = {
    "runs.LEAD_FIGURES": [name for _, pairs in runs.LEAD_FIGURES for pair in pairs for name in pair],
    "runs.KEY_FIGURES": list(runs.KEY_FIGURES),
    "runs.PREFERRED_FIGURES": list(runs.PREFERRED_FIGURES),
    "collapse's watched figures": [*collapse.WATCHED, collapse.MFU, collapse.MISMATCH],
    "node_check's table": [*node_check.TABLE_FIGURES, *(f.name for f in NODE_FIGURES)],
}


def test_every_figure_a_view_names_is_catalogued():
    """A lead figure's label, unit and format are the catalogue's (data/figures.py), families included:
    a name a view leads with must not fall back to the plain `name number`."""
    missing = [f"{where}: {name}" for where, names in NAMED_BY_VIEWS.items() for name in names if figure(name) is None]
    assert missing == []
    assert figure("sampled_accuracy_before").label == "sampled accuracy (before)"  # an older run's name
    assert figure("completions_clipped_ratio").format == "percent"  # a share, as collapse.py writes it
