"""Collapse warnings: a GRPO run whose reward sits at 0 with its completions at the length cap, whose
entropy fell under the floor, or whose loss turned nan, is pointed out from its stored metrics (rows
written through the Store as the supervisor writes them)."""

from __future__ import annotations

import json
import time

from gpuscale.app.views.collapse import ENTROPY_FLOOR, collapse_warnings, run_collapse_warnings
from gpuscale.control.metrics_tail import RUN_WIDE_RANK, MetricsTailer, Throughput
from gpuscale.control.store import Store

GRPO_SETTINGS = {"max_completion_length": 256, "learning_rate": 1e-5}


def grpo_run(store: Store, steps: list[dict], settings: dict | None = None, recipe: str = "grpo-mtl") -> dict:
    """A running grpo-mtl run (or one of `recipe`) whose rank 0 logged `steps` (one dict of figures
    per step), the way the supervisor stores them: the rank's own rows and the combined rows of
    RUN_WIDE_RANK."""
    run_id = store.create_run(recipe, settings or GRPO_SETTINGS, [], "node001")
    t0 = time.time() - 100
    rows = []
    for step, figures in enumerate(steps, start=1):
        for rank in (0, RUN_WIDE_RANK):
            rows += [{"run_id": run_id, "rank": rank, "t": t0 + step, "step": step, "name": name, "value": value}
                     for name, value in figures.items()]
    store.add_rows(rows, [])
    store.update_run(run_id, status="running", started_at=t0,
                     progress={"t": t0 + len(steps), "step": len(steps), "total": 200, "latest": steps[-1]})
    return store.get_run(run_id)


def healthy(step: int) -> dict:
    return {"reward": 0.3 + step / 100, "completions_mean_length": 80.0, "completions_clipped_ratio": 0.02,
            "entropy": 0.6, "loss": 0.01}


COLLAPSED = {"reward": 0.0, "completions_mean_length": 256.0, "completions_clipped_ratio": 1.0, "entropy": 0.4,
             "loss": 0.0}


def test_reward_at_zero_with_completions_at_the_cap_is_a_collapse(home):
    store = Store(home)
    run = grpo_run(store, [healthy(s) for s in range(20)] + [COLLAPSED] * 5)
    assert run_collapse_warnings(store, run) == [
        "collapse: reward 0.00 and 100% of completions at the 256-token cap over the last 5 steps "
        "— lower learning_rate, check precision"]


def test_a_healthy_run_and_a_short_bad_patch_raise_nothing(home):
    store = Store(home)
    assert run_collapse_warnings(store, grpo_run(store, [healthy(s) for s in range(20)])) == []
    # Four bad steps after good ones: not yet five in a row.
    assert run_collapse_warnings(store, grpo_run(store, [healthy(s) for s in range(20)] + [COLLAPSED] * 4)) == []
    # Reward 0 but the completions end well before the cap: a hard task, not a collapse.
    short = {**COLLAPSED, "completions_mean_length": 40.0, "completions_clipped_ratio": 0.0}
    assert run_collapse_warnings(store, grpo_run(store, [short] * 8)) == []


def test_the_mean_length_stands_in_for_an_unlogged_clipped_ratio(home):
    store = Store(home)
    steps = [{"reward": 0.0, "completions_mean_length": 128.0}] * 6
    run = grpo_run(store, steps, {"max_completion_length": 128})
    assert run_collapse_warnings(store, run) == [
        "collapse: reward 0.00 and 100% of completions at the 128-token cap over the last 5 steps "
        "— lower learning_rate, check precision"]


def test_entropy_under_the_floor_is_a_collapse(home):
    store = Store(home)
    steps = [healthy(s) for s in range(10)] + [{**healthy(10), "entropy": 0.02}] * 5
    assert run_collapse_warnings(store, grpo_run(store, steps)) == [
        f"collapse: entropy 0.02 under {ENTROPY_FLOOR} — the policy stopped exploring"]


def test_a_supervised_runs_low_entropy_is_what_it_trains_for_not_a_collapse(home):
    """A default sft run on CPU ends at entropy 0.04 (TRL's SFTTrainer logs it): fitting one answer a
    question is meant to get there. Only a recipe that trains on its own samples (grpo-mtl) is warned;
    rft's fine-tune on kept answers is supervised too, and a recipe no longer installed is not judged."""
    store = Store(home)
    sft_steps = [{"loss": 0.2, "entropy": 0.04, "mean_token_accuracy": 0.98}] * 8
    for recipe in ("sft", "rft", "no-longer-installed"):
        assert run_collapse_warnings(store, grpo_run(store, sft_steps, {}, recipe=recipe)) == [], recipe
    assert run_collapse_warnings(store, grpo_run(store, sft_steps, {})) == [
        f"collapse: entropy 0.04 under {ENTROPY_FLOOR} — the policy stopped exploring"]


def test_a_loss_that_turned_nan_is_named_with_its_first_step(home, tmp_path):
    """The ranks write NaN to their metric files; the tailer keeps it out of the store (SQLite has no
    NaN) but remembers it, the supervisor puts it in the run's progress, and the warning says since when."""
    store = Store(home)
    run_id = store.create_run("grpo-mtl", GRPO_SETTINGS, [], "node001")
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    lines = [{"t": 1000.0 + s, "rank": 0, "step": s, "loss": 0.1 if s < 168 else float("nan"), "reward": 0.4}
             for s in range(160, 175)]
    (metrics / "rank0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tailer, throughput = MetricsTailer(metrics, run_id), Throughput()
    rows = tailer.read_new()
    throughput.add(rows)
    store.add_rows(rows, [])
    progress = {**throughput.progress(1100.0), "nonfinite": tailer.nonfinite()}  # as Supervisor.tick
    store.update_run(run_id, status="running", progress=progress)
    assert run_collapse_warnings(store, store.get_run(run_id)) == [
        "loss is nan since step 168 — lower learning_rate, check precision"]
    # A finite loss again clears it.
    with open(metrics / "rank0.jsonl", "a") as handle:
        handle.write(json.dumps({"t": 1200.0, "rank": 0, "step": 175, "loss": 0.2}) + "\n")
    tailer.read_new()
    assert tailer.nonfinite() == {}


def test_the_rule_on_plain_lists_cuts_to_the_last_steps():
    history = {"reward": [(s, 0.0) for s in range(1, 9)], "completions_clipped_ratio": [(s, 0.95) for s in range(1, 9)]}
    assert collapse_warnings(history, {}) == [
        "collapse: reward 0.00 and 95% of completions at the length cap over the last 5 steps "
        "— lower learning_rate, check precision"]
    history["reward"][-1] = (8, 0.2)  # the latest step scored: recovering
    assert collapse_warnings(history, {}) == []


def test_a_training_run_whose_mfu_stays_low_is_told_what_to_try(tmp_path):
    store = Store(tmp_path)
    starved = grpo_run(store, [{"loss": 1.0, "mfu": 0.04 + 0.001 * step} for step in range(6)])
    (warning,) = run_collapse_warnings(store, starved)
    assert warning.startswith("MFU 4% (under 10%) over the last 5 steps")
    assert "rows_per_step" in warning and "packing=true" in warning
    one_good_step = grpo_run(store, [{"mfu": 0.04}] * 4 + [{"mfu": 0.3}])
    assert run_collapse_warnings(store, one_good_step) == []  # "stays under": every one of the last 5
    too_early = grpo_run(store, [{"mfu": 0.04}] * 4)
    assert run_collapse_warnings(store, too_early) == []  # fewer than 5 steps logged: not judged yet
    no_peak_known = grpo_run(store, [{"loss": 1.0}] * 6)  # CPU or an unknown card: no MFU, no warning
    assert run_collapse_warnings(store, no_peak_known) == []


def test_mfu_is_shown_as_a_percentage():
    from gpuscale.app.views.runs import figure_text, figures_text

    assert figure_text("mfu", 0.2824) == "28.2%" and figure_text("loss", 0.2824) == "0.2824"
    run = {"status": "running", "progress": {"latest": {"loss": 1.5, "mfu": 0.31, "grad_norm": 2.0}}}
    assert figures_text(run) == "loss 1.5 · MFU 31.0% · gradient norm 2"


def test_a_policy_mismatch_beyond_its_bound_step_after_step_warns():
    from gpuscale.app.views.collapse import MISMATCH, MISMATCH_BOUND, MISMATCH_STEPS, policy_mismatch_warnings

    drifting = {MISMATCH: [(1, 0.01), (2, 0.06), (3, 0.07), (4, 0.0812)]}
    assert policy_mismatch_warnings(drifting) == [
        "policy mismatch: the trainer's log-probs of the sampled tokens are 0.081 nats from the sampler's "
        f"(over {MISMATCH_BOUND}) over the last {MISMATCH_STEPS} steps — the loss trains on another policy's "
        "completions; compare a run with --precision fp32"]
    # rollout=async samples with weights up to max_staleness steps old: the gap holds that drift, not
    # a matter of precision; at max_staleness=0 it samples with the trainer's own weights again.
    [stale] = policy_mismatch_warnings(drifting, settings={"rollout": "async", "max_staleness": 1})
    assert "drift over max_staleness steps" in stale and "precision" not in stale
    [fresh] = policy_mismatch_warnings(drifting, settings={"rollout": "async", "max_staleness": 0})
    assert fresh.endswith("compare a run with --precision fp32")
    drifting[MISMATCH][-2] = (3, MISMATCH_BOUND)  # at the bound is within it
    assert policy_mismatch_warnings(drifting) == []
    assert policy_mismatch_warnings({MISMATCH: [(1, 0.2), (2, 0.2)]}) == []  # too few steps to judge
    assert policy_mismatch_warnings({}) == []  # a recipe that samples nothing (or TRL's own generation)


def test_a_straggler_is_a_live_warning_while_the_run_runs_and_only_advice_once_it_has_ended(home):
    # A finished run's summary gives the advice over the whole run (`gpuscale show`'s `advice:` lines):
    # the last live lines of its progress would say it a second time.
    store = Store(home)
    run = grpo_run(store, [healthy(s) for s in range(20)])
    progress = {**run["progress"], "step_phases": {"0": {"forward_backward": 1.0},
                                                   "1": {"forward_backward": 1.6}}}
    store.update_run(run["id"], progress=progress)
    live = run_collapse_warnings(store, store.get_run(run["id"]))
    assert [line for line in live if line.startswith("rank 1") and "straggler" in line], live
    store.update_run(run["id"], status="succeeded")
    assert not [line for line in run_collapse_warnings(store, store.get_run(run["id"])) if "straggler" in line]
