"""What a training run is for leads its figures: held-out accuracy before -> after and, for RL, the
reward first -> last, in `gpuscale runs` and `gpuscale show` (older names accepted)."""

from __future__ import annotations

import time

from gpuscale.app import cli
from gpuscale.app.views.runs import key_figures
from gpuscale.control.store import Store

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
