"""The formatters and the texts about a run that the CLI and the TUI both show, and a check that
both really do show the same (`gpuscale runs` and the TUI's history row)."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from gpuscale.app import cli
from gpuscale.app.views.commands import launch_preview, shell_equivalent
from gpuscale.app.views.export import NothingToExport, export_text
from gpuscale.app.views.runs import (
    compare_runs,
    delta_text,
    figures_text,
    key_figures_text,
    per_rank_text,
    progress_line,
    run_row,
    status_line,
    throughput_text,
)
from gpuscale.app.views.text import (
    axis_ticks,
    fit_columns,
    format_duration,
    format_mib,
    format_number,
    format_rate,
    memory_text,
    setting_text,
    short_gpu_name,
    short_number,
    spark_text,
)
from gpuscale.control.store import Store

NOW = 1_000_000.0


# ---- formatters --------------------------------------------------------------------------------


def test_one_number_format_for_every_figure():
    assert format_number(12345) == "12,345" and format_number(12345.0) == "12,345"  # an int as a float
    assert format_number(261) == "261" and format_number(0.5) == "0.5" and format_number(261.46) == "261.5"
    assert format_number(2261.3) == "2,261" and format_number(2261) == "2,261"  # a float like an int
    assert format_number(True) == "True"  # a bool is no number


def test_rates_durations_and_settings():
    assert format_rate(4210.4) == "4,210" and format_rate(12.0) == "12.0" and format_rate(None) == "0.0"
    assert format_duration(65) == "1:05" and format_duration(3723.9) == "1:02:03" and format_duration(None) == "-"
    assert setting_text([0, 3]) == "0,3" and setting_text(None) == "-" and setting_text("bf16") == "bf16"


def test_sparkline_has_a_fixed_scale_and_keeps_spikes():
    assert spark_text([100.0] * 5, 5) == "█████"
    assert spark_text([0.0] * 5, 5) == "▁▁▁▁▁"
    assert spark_text([97.0, 99.0, 98.0], 3) == "███"  # steady and full, not wild swings
    assert spark_text([50.0], 4) == "   ▅"  # newest on the right, padded on the left
    spiky = [0.0] * 99 + [100.0]
    assert spark_text(spiky, 10)[-1] == "█" and len(spark_text(spiky, 10)) == 10
    assert spark_text([10.0, 20.0], 2, lo=None, hi=None) == "▁█"  # scaled to its own range


def test_memory_and_figure_texts():
    assert memory_text(46_182.4, 81_559.0) == "45.1/79.6 GiB 57%"
    assert memory_text(300.0, 800.0) == "300/800 MiB 38%"
    assert format_mib(357.0) == "357 MiB" and format_mib(None) == "-"
    assert short_gpu_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert format_number(10_412.5) == "10,412" and format_number(0.693147) == "0.6931"
    assert format_number([1.5, 2]) == "1.5 2" and format_number("bf16") == "bf16"


def test_status_and_throughput_lines():
    run = {"status": "running", "started_at": NOW - 90, "ended_at": None,
           "progress": {"t": NOW, "step": 30, "total": 120}}
    assert status_line(run, NOW) == "running · 1:30 elapsed · step 30/120 (25%) · ETA 4:30"
    # Once steps have been timed, their pace: 60 s of loading and evaluation before step 1 left out
    # (20 steps in 20 s, 90 to go), not 30 steps in 90 s.
    paced = {**run, "progress": {**run["progress"], "paced_from_t": NOW - 20, "paced_from_step": 10}}
    assert status_line(paced, NOW) == "running · 1:30 elapsed · step 30/120 (25%) · ETA 1:30"
    progress = {"tokens_per_s": 4210.0, "samples_per_s": 12.0, "tokens_per_s_by_rank": {"1": 2100.0, "0": 2110.0}}
    live = {**run, "progress": progress}
    assert throughput_text(live) == "tokens/s 4,210 · samples/s 12.0 (last 10 s)"
    assert per_rank_text(live) == "tokens/s per rank (last 10 s): 2,110 2,100"
    assert per_rank_text({**run, "progress": {"tokens_per_s_by_rank": {"0": 5.0}}}) == ""
    latest = {"step_time_ms": 12.5, "loss": 1.25, "reward": 0.5}
    assert figures_text({**run, "progress": {"latest": latest}}) == "reward 0.5 · loss 1.25 · step time 12.5 ms"


def test_the_headline_leaves_out_trainer_diagnostics_and_zeros():
    """grpo-mtl's live line read `reward 0.31 · loss 0.02 · clip_ratio_high_max 0 · clip_ratio_high_mean 0`."""
    latest = {"reward": 0.31, "loss": 0.02, "clip_ratio_high_max": 0.0, "clip_ratio_high_mean": 0.0,
              "clip_ratio_low_mean": 0.0, "completions_clipped_ratio": 0.25, "completions_mean_length": 41.0,
              "frac_reward_zero_std": 0.5, "kl": 0.0, "entropy": 0.87, "grad_norm": 1.5, "learning_rate": 1e-4}
    run = {"status": "running", "progress": {"latest": latest}}
    assert figures_text(run) == "reward 0.31 · loss 0.02 · entropy 0.87 · gradient norm 1.5"
    assert figures_text({**run, "progress": {"latest": {"loss": 0.0, "accuracy": 0.0}}}) == "accuracy 0 · loss 0"


def test_shell_equivalent_and_preview(tmp_path):
    from gpuscale.control.launch import DevicePlan
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.runs.settings import resolve_settings

    recipe = get_recipe("probe")
    overrides = {"gpus": "0,3", "batch_size": "4", "steps": "9"}
    settings = resolve_settings(recipe.settings_cls, overrides=overrides, environ={})
    assert shell_equivalent("probe", settings) == \
        "gpuscale run --recipe probe --gpus 0,3 --batch-size 4 --set steps=9"
    preview = launch_preview(recipe, settings, DevicePlan(2, (0, 3)), tmp_path,
                                     environ={"GPUSCALE_HOME": str(tmp_path)})
    assert preview == ("torchrun --nproc-per-node 2 --standalone --max-restarts 0 -m gpuscale.recipes "
                       "--recipe probe --settings $GPUSCALE_HOME/runs/NEW/settings.json")


# ---- one run in words ----------------------------------------------------------------------------


def finished_run(**fields) -> dict:
    run = {"id": 7, "recipe": "probe", "status": "succeeded", "started_at": NOW - 100, "ended_at": NOW,
           "settings": {"gpus": [0, 1], "batch_size": 8}, "summary": {"tokens_per_s": 12345, "loss": 0.693147},
           "progress": {"t": NOW, "step": 40, "total": 40, "tokens_per_s": 12345.0, "samples_per_s": 3.25,
                        "latest": {"loss": 0.693147}}}
    return {**run, **fields}


def test_progress_line_has_status_rates_and_figures():
    assert progress_line(finished_run(), NOW + 50) == (
        "run 7 probe · succeeded · 1:40 elapsed · step 40/40 (100%) · tokens/s 12,345 · samples/s 3.2 (run average) "
        "· loss 0.6931"
    )
    queued = {"id": 8, "recipe": "probe", "status": "queued", "started_at": None, "progress": {},
              "settings": {"queue": True}}
    assert progress_line(queued, NOW) == "run 8 probe · queued"  # no rates before any are reported, no stray dash
    # Recorded without --queue, its supervisor not yet started: it waits for nothing.
    starting = {**queued, "settings": {}}
    assert progress_line(starting, NOW) == "run 8 probe · starting"


def test_a_finished_runs_rates_are_its_summarys():
    """The supervisor's rate of a finished run counts loading and warm-up (probe: 2,399 tokens/s, or
    1,828 as 914 + 914 per rank); the summary times the decode loop (5,219): once the run ended, its
    lines show the summary's figure, and a rate the summary lacks is labelled as the run's average."""
    run = finished_run(summary={"tokens_per_s": 5219.0, "tokens_per_s_per_rank": [2609.6, 2609.4]},
                       progress={"t": NOW, "step": 40, "total": 40, "tokens_per_s": 2399.0, "samples_per_s": 0.0,
                                 "tokens_per_s_by_rank": {"0": 1199.5, "1": 1199.5}})
    assert throughput_text(run) == "tokens/s 5,219"  # no samples/s: zero, and not the summary's
    assert per_rank_text(run) == "tokens/s per rank: 2,610 2,609"
    no_summary = {**run, "status": "stopped", "summary": {"partial": True}}
    assert throughput_text(no_summary) == "tokens/s 2,399 (run average)"
    assert per_rank_text(no_summary) == "tokens/s per rank (run average): 1,200 1,200"


def test_a_finished_runs_headline_is_its_summary():
    """The last progress record can lag the ranks' summary (rank 0's running value, an older run):
    once a run has ended, the headline shows the summary's figure."""
    run = finished_run(summary={"accuracy": 0.4583, "problems": 24},
                       progress={"t": NOW, "step": 4, "total": 4, "latest": {"accuracy": 0.5833, "forward_passes": 9}})
    assert figures_text(run) == "accuracy 0.4583 · forward passes 9"
    assert "accuracy 0.5833" in figures_text({**run, "status": "running"})  # live: the progress record's


def test_stopping_and_stopped_runs_show_no_eta():
    progress = {"t": NOW, "step": 8, "total": 25}
    running = {"status": "running", "started_at": NOW - 80, "ended_at": None, "progress": progress}
    assert "ETA" in status_line(running, NOW)
    assert status_line({**running, "progress": {**progress, "stopping": True}}, NOW) == \
        "stopping · 1:20 elapsed · step 8/25 (32%)"
    assert "ETA" not in status_line({**running, "status": "stopped", "ended_at": NOW}, NOW)


def test_run_row_and_key_figures():
    assert run_row(finished_run(), NOW)[1:3] == ("probe", "succeeded")
    assert run_row(finished_run(), NOW)[3:5] == ("1:40", "loss 0.6931, tokens/s 12,345")
    assert key_figures_text(finished_run(summary={"accuracy": 0.25, "reward": 1, "loss": 2.0}), limit=2) == \
        "accuracy 0.25, reward 1"


def test_compare_keeps_settings_apart_from_figures_and_drops_equal_ones():
    """A summary that echoes settings (`chains`, `method`) and has figures equal in both runs."""
    a = finished_run(settings={"chains": 1, "method": "power", "seed": 0},
                     summary={"chains": 1, "method": "power", "accuracy": 0.5, "problems": 24})
    b = finished_run(id=8, settings={"chains": 1, "method": "plain", "seed": 0},
                     summary={"chains": 1, "method": "plain", "accuracy": 0.25, "problems": 24})
    result = compare_runs(a, b)
    assert result["settings"] == {"method": ["power", "plain"]}  # no `chains: 1 -> 1`, no seed
    assert list(result["figures"]) == ["accuracy"] and result["same"] == {"problems": 24}


def test_compare_two_runs():
    a = finished_run()
    b = finished_run(id=8, settings={"gpus": [0, 1], "batch_size": 16, "seed": 1},
                     summary={"tokens_per_s": 24690, "loss": 0.5, "precision": "bf16", "ok": True})
    result = compare_runs(a, b)
    assert result["settings"] == {"batch_size": [8, 16], "seed": [None, 1]}
    assert list(result["figures"]) == ["loss", "tokens_per_s"]  # numbers both runs have, no bools or texts
    assert result["same"] == {}
    assert result["figures"]["tokens_per_s"] == {"a": 12345, "b": 24690, "delta": 12345, "better": "b"}
    assert result["figures"]["loss"]["better"] == "b"  # lower is better (data/figures.py)
    assert delta_text(12345, 12345) == "+12,345 (+100.0%)"
    assert delta_text(12345, 12345, "b") == "+12,345 (+100.0%) better"
    assert delta_text(-0.19, 0.69, "a") == "-0.19 (-27.5%) worse"
    assert delta_text(-0.25, 0.0) == "-0.25"  # no percentage of zero


def test_compare_shows_the_figures_only_one_run_has():
    """Two runs over different domains: each one's per-domain accuracy, the other side missing."""
    a = finished_run(summary={"accuracy_greedy_after": 0.5, "accuracy_greedy_algebra_after": 0.4, "dtype": "fp32"})
    b = finished_run(id=8, summary={"accuracy_greedy_after": 0.6, "accuracy_greedy_geometry_after": 0.7})
    result = compare_runs(a, b)
    assert list(result["figures"]) == ["accuracy_greedy_after"]
    assert result["only"] == {"accuracy_greedy_algebra_after": {"a": 0.4, "b": None},
                              "accuracy_greedy_geometry_after": {"a": None, "b": 0.7}}  # not dtype: not a number


def test_fit_columns_cuts_the_widest_with_an_ellipsis():
    rows = [("figure", "run 3", "run 1"), ("tokens_per_s", "10,412", "61.3"),
            ("dataset", "/data/a-very-long-path/of/questions.jsonl", "tiny-math")]
    fitted = fit_columns(rows, 40)
    assert sum(max(len(row[i]) for row in fitted) + 2 for i in range(3)) <= 40
    assert fitted[2][1].endswith("…") and fitted[2][1].startswith("/data/a-very")
    assert fitted[1] == rows[1] and fitted[2][2] == "tiny-math"  # what fits is left whole
    assert fit_columns(rows, 200) == rows


def test_a_finished_runs_rates_per_rank_add_up_to_its_rate():
    """A training run's summary has the run's tokens/s but not each rank's: each rank's share of it,
    by the tokens the rank counted, so that the ranks' figures add up to the figure above them (a CPU
    sft run showed 969 + 993 per rank under a total of 2,107)."""
    run = finished_run(summary={"tokens_per_s": 2107.0},
                       progress={"t": NOW, "tokens_per_s": 1962.0, "tokens_per_s_by_rank": {"0": 969.0, "1": 993.0}})
    assert throughput_text(run) == "tokens/s 2,107"
    shown = per_rank_text(run).removeprefix("tokens/s per rank: ")
    rates = [float(value.replace(",", "")) for value in shown.split()]
    assert rates == [1041.0, 1066.0] and sum(rates) == 2107.0  # 2,107 x 969 / 1,962 and x 993 / 1,962


# ---- export, on a real store ---------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path)


def stored_run(store: Store) -> int:
    run_id = store.create_run("probe", {"batch_size": 8}, ["torchrun"], "host")
    store.update_run(run_id, status="running", started_at=NOW - 100)
    store.finish_run(run_id, "succeeded", summary={"tokens_per_s": 12345, "loss": 0.693147})
    store.update_run(run_id, ended_at=NOW)
    store.add_rows([{"run_id": run_id, "rank": 0, "t": NOW - 50, "step": 1, "name": "loss", "value": 0.5}],
                   [{"run_id": run_id, "t": NOW - 50, "kind": "host", "idx": -1, "name": "cpu", "util": 50.0}])
    return run_id


def test_export_json_and_csv(store):
    run_id = stored_run(store)
    run_dir = Path(store.get_run(run_id)["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "results.jsonl").write_text('{"question": "1+1", "correct": true}\n\n')
    record = json.loads(export_text(store, run_id, "json"))
    assert record["run"]["summary"]["tokens_per_s"] == 12345
    assert [m["value"] for m in record["metrics"]] == [0.5] and record["samples"][0]["util"] == 50.0
    assert record["results"] == [{"question": "1+1", "correct": True}]
    rows = list(csv.DictReader(io.StringIO(export_text(store, run_id, "csv"))))
    assert list(rows[0]) == ["run_id", "rank", "t", "step", "name", "value"] and rows[0]["name"] == "loss"
    with pytest.raises(ValueError, match="format"):
        export_text(store, run_id, "xml")


def test_a_training_runs_whole_run_and_steady_rates_are_each_said_for_what_they_are(home, capsys):
    """A 24-step sft run of a 0.5B model: 46k tokens/s and 13.9% MFU over its whole training time, 109k
    and 38% at its steady steps. The run's line, `gpuscale show` and an export name each."""
    summary = {"tokens_per_s": 46_210.0, "tokens_per_s_steady": 109_000.0, "mfu": 0.139, "mfu_steady": 0.38}
    run = finished_run(recipe="sft", summary=summary)
    assert throughput_text(run) == ("tokens/s 46,210 (warm-up included) · tokens/s 109,000 (steady) · "
                                    "samples/s 3.2 (run average)")
    store = Store(home)
    run_id = store.create_run("sft", {}, [], "host")
    store.finish_run(run_id, "succeeded", summary=summary)
    assert cli.main(["show", str(run_id)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert ("  tokens_per_s: 46,210 tokens/s  (whole run: the trainer's tokens, all ranks, over its whole training "
            "time, warm-up included)") in shown
    assert ("  tokens_per_s_steady: 109,000 tokens/s  (steady: the median optimizer step's rate, all ranks, the "
            "first step left out)") in shown
    assert "  mfu: 13.9%  (whole run: over the trainer's whole training time, warm-up included)" in shown
    assert "  mfu_steady: 38.0%  (steady: at the median optimizer step's rate, the first step left out)" in shown
    exported = {row["name"]: row for row in csv.DictReader(io.StringIO(export_text(store, run_id, "csv", "summary")))}
    assert exported["tokens_per_s_steady"]["note"].startswith("steady: the median optimizer step's rate")
    assert exported["tokens_per_s"]["note"].startswith("whole run: ") and exported["mfu"]["value"] == "0.139"
    record = json.loads(export_text(store, run_id, "json"))
    assert record["figure_notes"]["mfu_steady"].startswith("steady: ") and set(record["figure_notes"]) == set(summary)


def test_export_csv_of_the_summary_and_of_the_results(store):
    run_id = stored_run(store)
    store.update_run(run_id, summary={"accuracy": 0.5, "method": "power", "per_rank": [1.5, 2], "none": None})
    run_dir = Path(store.get_run(run_id)["run_dir"])
    run_dir.mkdir(parents=True)
    rows = [{"index": 0, "correct": True, "token_ids": [5, 6]}, {"index": 1, "correct": False, "acceptance_rate": 0.25}]
    (run_dir / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = list(csv.reader(io.StringIO(export_text(store, run_id, "csv", what="summary"))))
    assert summary == [["name", "value", "note"], ["accuracy", "0.5", ""], ["method", "power", ""],
                       ["per_rank", "[1.5, 2]", ""], ["none", "", ""]]
    results = list(csv.DictReader(io.StringIO(export_text(store, run_id, "csv", what="results"))))
    assert list(results[0]) == ["index", "correct", "token_ids", "acceptance_rate"]  # every key, first seen first
    assert json.loads(results[0]["token_ids"]) == [5, 6] and results[1]["acceptance_rate"] == "0.25"
    assert json.loads(export_text(store, run_id, "json", what="results")) == rows
    assert json.loads(export_text(store, run_id, "json", what="summary"))["accuracy"] == 0.5
    with pytest.raises(ValueError, match="what"):
        export_text(store, run_id, "csv", what="everything")


def test_an_empty_part_is_nothing_to_export_whichever_the_format(store):
    """A run that logged nothing and kept no results: each empty part is refused with the run and why;
    the whole JSON record is never empty."""
    run_id = store.create_run("probe", {}, [], "host")
    store.finish_run(run_id, "failed")
    for what, why in (("metrics", "its ranks logged no metrics"), ("summary", "its summary is empty"),
                      ("results", "it has no per-item results")):
        for fmt in ("csv", "json"):
            with pytest.raises(NothingToExport, match=f"^run {run_id}: nothing to export: {why}"):
                export_text(store, run_id, fmt, what)
    with pytest.raises(NothingToExport, match="no metrics"):
        export_text(store, run_id, "csv")  # metrics, unless told
    assert json.loads(export_text(store, run_id, "json"))["run"]["id"] == run_id


# ---- the CLI and the TUI say the same -------------------------------------------------------------


def test_cli_runs_and_tui_history_show_the_same_row(tmp_path, monkeypatch, capsys):
    from gpuscale.app.screens.history import history_row

    monkeypatch.setenv("GPUSCALE_HOME", str(tmp_path))
    store = Store(tmp_path)
    run = store.get_run(stored_run(store))
    assert cli.main(["runs"]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "RECIPE", "STATUS", "DURATION", "FIGURES", "STARTED"]
    row = history_row(run, NOW, marked=False)
    assert [cell.strip() for cell in re.split(r"\s{2,}", line)] == list(row)  # the same cells, in the same order
    assert row[4] == "loss 0.6931, tokens/s 12,345"  # not 12345 in one and 12,345 in the other


def test_cli_show_and_compare_use_the_views(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPUSCALE_HOME", str(tmp_path))
    store = Store(tmp_path)
    a, b = stored_run(store), stored_run(store)
    store.update_run(b, settings={"batch_size": 16}, summary={"tokens_per_s": 24690})
    assert cli.main(["show", str(a)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"run {a} probe · succeeded · 1:40 elapsed") and "  tokens_per_s: 12,345 tokens/s" in shown
    assert cli.main(["compare", str(a), str(b)]) == 0
    compared = capsys.readouterr().out.splitlines()
    assert "  batch_size: 8 -> 16" in compared
    assert "  tokens_per_s: 12,345 tokens/s -> 24,690 tokens/s, +12,345 (+100.0%) better" in compared
    assert compared.index("figures that differ:") > compared.index("  batch_size: 8 -> 16")


def test_a_training_run_s_row_shows_its_held_out_accuracy_after_training():
    run = finished_run(summary={"accuracy_greedy_before": 0.25, "accuracy_greedy_after": 0.5, "tokens_per_s": 12.0},
                       progress={"t": NOW, "step": 4, "total": 4})
    assert key_figures_text(run).startswith("accuracy 0.25 -> 0.5")


@pytest.mark.parametrize("value, label", [(489825.6, "490k"), (999.9, "1k"), (1_234_567, "1.23M"), (12.345, "12.3"),
                                          (0.25, "0.25"), (0, "0"), (-2500, "-2.5k"), (3.2e9, "3.2G")])
def test_a_chart_label_is_short_and_si_style(value, label):
    """Plotext's own labels read `489825.6`: the monitor's axis is labelled round and short instead."""
    assert short_number(value) == label


@pytest.mark.parametrize("lo, hi, most, ticks, labels", [
    (0, 538_808, 4, [0, 200_000, 400_000], ["0", "200k", "400k"]),
    (480_000, 500_000, 5, [480_000, 485_000, 490_000, 495_000, 500_000], ["480k", "485k", "490k", "495k", "500k"]),
    (0.21, 0.7, 5, [0.3, 0.4, 0.5, 0.6, 0.7], ["0.3", "0.4", "0.5", "0.6", "0.7"]),
    (0, 1, 5, [0, 0.25, 0.5, 0.75, 1], ["0", "0.25", "0.5", "0.75", "1"]),
    (0, 1.3e6, 3, [0, 500_000, 1_000_000], ["0", "500k", "1M"]),
    (485_000, 492_500, 5, [486_000, 488_000, 490_000, 492_000], ["486k", "488k", "490k", "492k"]),
    (0, 12_700, 6, [0, 2500, 5000, 7500, 10_000, 12_500], ["0", "2.5k", "5k", "7.5k", "10k", "12.5k"]),
])
def test_axis_ticks_are_round_and_their_labels_tell_them_apart(lo, hi, most, ticks, labels):
    shown = axis_ticks(lo, hi, most)
    assert shown == pytest.approx(ticks)
    step = shown[1] - shown[0]
    assert [short_number(tick, step) for tick in shown] == labels
    assert lo <= shown[0] and shown[-1] <= hi
