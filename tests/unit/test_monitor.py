"""The monitor's logic without any UI: waste warnings from plain sample dicts, chart series from a
real store, sparklines, log tails and the texts around them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuscale.engines import monitor
from gpuscale.engines.monitor import LogTail, RunFeed
from gpuscale.engines.store import Store

NOW = 1_000_000.0


def gpu(idx: int, t: float, used: float, util: float, total: float = 80_000.0) -> dict:
    return {"kind": "gpu", "idx": idx, "t": t, "name": "NVIDIA H100 80GB HBM3", "mem_used_mb": used,
            "mem_total_mb": total, "util": util, "power_w": 300.0, "temp_c": 60.0, "run_mem_mb": used}


def ticks(gpus: dict[int, tuple[float, float]], seconds: int = 10) -> list[dict]:
    """`seconds` ticks of samples: GPU index -> (memory used MB, utilization %)."""
    return [gpu(idx, NOW - s, used, util) for s in range(seconds) for idx, (used, util) in gpus.items()]


# ---- waste ---------------------------------------------------------------------------------------


def test_one_gpu_with_little_memory_in_use_is_told_to_raise_batch_size():
    samples = ticks({0: (60_000, 95), 1: (62_000, 97), 2: (58_000, 96), 3: (4_800, 94)})
    assert monitor.waste_warnings(samples, NOW, working_since=NOW - 60) == [
        "GPU 3: 6% of memory in use — raise batch_size"
    ]


def test_idle_gpus_are_counted_and_named():
    busy = {i: (60_000, 95) for i in range(4)}
    idle = {i: (60_000, 0) for i in range(4, 8)}
    warnings = monitor.waste_warnings(ticks({**busy, **idle}), NOW, working_since=NOW - 60)
    assert warnings == ["4 of 8 GPUs idle (GPU 4-7)"]


def test_many_low_memory_gpus_share_one_line():
    samples = ticks({i: (4_000 + 1_000 * i, 95) for i in range(8)})  # 5% .. 14%
    assert monitor.waste_warnings(samples, NOW, working_since=NOW - 60) == [
        "GPU 0-7: 5-14% of memory in use — raise batch_size"
    ]


def test_every_gpu_idle_says_so():
    warnings = monitor.waste_warnings(ticks({0: (50_000, 1), 1: (50_000, 2)}), NOW, working_since=NOW - 60)
    assert warnings == ["all 2 GPU(s) idle: the ranks wait on the CPU, data or each other"]


def test_no_warning_while_the_run_loads_or_on_too_few_samples():
    idle = ticks({0: (1_000, 0)})
    assert monitor.waste_warnings(idle, NOW, working_since=None) == []  # no token counted yet: loading
    assert monitor.waste_warnings(idle, NOW, working_since=NOW - 1) == []  # 2 samples since: too few
    old = [dict(s, t=s["t"] - 600) for s in idle]  # outside the window
    assert monitor.waste_warnings(old, NOW, working_since=NOW - 3600) == []


def test_a_short_pause_does_not_raise_an_idle_alarm():
    samples = ticks({0: (60_000, 95)}, seconds=30)
    for sample in samples[:3]:  # three seconds of a checkpoint
        sample["util"] = 0.0
    assert monitor.waste_warnings(samples, NOW, working_since=NOW - 60) == []


def test_idle_gpus_of_the_machine_outside_the_run():
    machine = [{"index": i, "mem_used_mb": 60_000.0 if i < 2 else 500.0, "mem_total_mb": 80_000.0,
                "util": 95 if i < 2 else 0} for i in range(8)]
    samples = ticks({0: (60_000, 95), 1: (60_000, 95)})
    assert monitor.waste_warnings(samples, NOW, NOW - 60, machine_gpus=machine) == [
        "the run uses 2 of 8 GPUs; GPU 2-7 idle — set gpus=all"
    ]


def test_stragglers():
    one = monitor.waste_warnings([], NOW, NOW - 60, tokens_by_rank={"0": 1000.0, "1": 990.0, "2": 500.0})
    assert one == ["rank 2 at 50% of the top rank's speed — every rank waits for it"]
    many = monitor.waste_warnings([], NOW, NOW - 60, tokens_by_rank={str(r): 1000.0 if r < 4 else 100.0 for r in range(8)})
    assert many == ["ranks 4-7 at 10% of the top rank's speed — every rank waits for them"]
    assert monitor.waste_warnings([], NOW, NOW - 60, tokens_by_rank={"0": 1000.0, "1": 800.0}) == []


# ---- small texts ---------------------------------------------------------------------------------


def test_sparkline_has_a_fixed_scale_and_keeps_spikes():
    assert monitor.spark_text([100.0] * 5, 5) == "█████"
    assert monitor.spark_text([0.0] * 5, 5) == "▁▁▁▁▁"
    assert monitor.spark_text([97.0, 99.0, 98.0], 3) == "███"  # steady and full, not wild swings
    assert monitor.spark_text([50.0], 4) == "   ▅"  # newest on the right, padded on the left
    spiky = [0.0] * 99 + [100.0]
    assert monitor.spark_text(spiky, 10)[-1] == "█" and len(monitor.spark_text(spiky, 10)) == 10
    assert monitor.spark_text([10.0, 20.0], 2, lo=None, hi=None) == "▁█"  # scaled to its own range


def test_memory_and_figure_texts():
    assert monitor.memory_text(46_182.4, 81_559.0) == "45.1/79.6 GiB 57%"
    assert monitor.memory_text(300.0, 800.0) == "300/800 MiB 38%"
    assert monitor.format_mib(357.0) == "357 MiB" and monitor.format_mib(None) == "-"
    assert monitor.short_gpu_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert monitor.format_figure(10_412.5) == "10,412" and monitor.format_figure(0.693147) == "0.6931"
    assert monitor.format_figure([1.5, 2]) == "[1.5, 2]" and monitor.format_figure("bf16") == "bf16"


def test_status_and_throughput_lines():
    run = {"status": "running", "started_at": NOW - 90, "ended_at": None,
           "progress": {"t": NOW, "step": 30, "total": 120}}
    assert monitor.status_line(run, NOW) == "running · 1:30 elapsed · step 30/120 (25%) · ETA 4:30"
    progress = {"tokens_per_s": 4210.0, "samples_per_s": 12.0, "tokens_per_s_by_rank": {"1": 2100.0, "0": 2110.0}}
    assert monitor.throughput_text(progress) == "tokens/s 4,210 · samples/s 12.0"
    assert monitor.per_rank_text(progress) == "tokens/s per rank: 2,110 2,100"
    assert monitor.per_rank_text({"tokens_per_s_by_rank": {"0": 5.0}}) == ""
    assert monitor.figures_text({"latest": {"step_time_ms": 12.5, "loss": 1.25, "reward": 0.5}}) == \
        "reward 0.5 · loss 1.25 · step_time_ms 12.5"


def test_shell_equivalent_and_preview(tmp_path):
    from gpuscale.engines.launch import DevicePlan
    from gpuscale.engines.settings import resolve_settings
    from gpuscale.recipes.registry import get_recipe

    recipe = get_recipe("probe")
    settings = resolve_settings(recipe.settings_cls, overrides={"gpus": "0,3", "batch_size": "4", "steps": "9"}, environ={})
    assert monitor.shell_equivalent("probe", settings) == \
        "gpuscale run --recipe probe --gpus 0,3 --batch-size 4 --set steps=9"
    preview = monitor.launch_preview(recipe, settings, DevicePlan(2, (0, 3)), tmp_path,
                                     environ={"GPUSCALE_HOME": str(tmp_path)})
    assert preview == ("torchrun --nproc-per-node 2 --standalone --max-restarts 0 -m gpuscale.recipes "
                       "--recipe probe --settings $GPUSCALE_HOME/runs/NEW/settings.json")


# ---- the feed, on a real store -------------------------------------------------------------------


def metric(run_id: int, rank: int, t: float, name: str, value: float, step: int = 1) -> dict:
    return {"run_id": run_id, "rank": rank, "t": t, "step": step, "name": name, "value": value}


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path)


def test_feed_reads_only_new_rows_and_never_misses_a_late_rank(store):
    run = store.create_run("probe", {}, [], "host")
    other = store.create_run("probe", {}, [], "host")
    feed = RunFeed(run)
    store.add_rows([metric(run, 0, NOW - 5.5, "tokens", 100.0), metric(other, 0, NOW - 5.5, "tokens", 7.0)], [])
    assert feed.poll(store, NOW)
    store.add_rows([metric(run, 0, NOW - 2.5, "tokens", 100.0)], [])
    assert feed.poll(store, NOW)
    # Rank 1's line for an earlier second reaches the store after rank 0's later one.
    store.add_rows([metric(run, 1, NOW - 5.2, "tokens", 50.0)], [])
    assert feed.poll(store, NOW)
    assert not feed.poll(store, NOW)  # nothing new
    assert feed.counts[("tokens", 0)] == {int(NOW - 6): 100.0, int(NOW - 3): 100.0}
    assert feed.counts[("tokens", 1)] == {int(NOW - 6): 50.0}
    assert feed.ranks() == [0, 1] and feed.first_work_t == NOW - 5.5
    series = monitor.rate_series(feed, "tokens", NOW, window_s=10, points=10)
    assert series.ys[-6:] == (150.0, 0.0, 0.0, 100.0, 0.0, 0.0)  # per second, both ranks
    assert series.xs == tuple(float(x) for x in range(-9, 1))  # each bucket's end, relative to now
    assert monitor.rate_series(feed, "tokens", NOW, 10, 10, rank=1).ys[4] == 50.0
    assert monitor.rate_series(feed, "tokens", NOW, 10, 5).ys[2] == 75.0  # 2 s buckets: 150 tokens / 2 s


def test_feed_figures_are_means_and_old_buckets_are_forgotten(store):
    run = store.create_run("probe", {}, [], "host")
    feed = RunFeed(run, keep_s=60)
    store.add_rows([metric(run, 0, NOW - 1.5, "loss", 1.0), metric(run, 1, NOW - 1.5, "loss", 3.0),
                    metric(run, 0, NOW - 1.5, "reward", 0.5), metric(run, 0, NOW - 1.5, "total", 9.0),
                    metric(run, 0, NOW - 300, "loss", 9.0)], [])
    feed.poll(store, NOW)
    assert feed.figure_names() == ["reward", "loss"]  # the usual ones first; counts and totals are no figures
    assert monitor.figure_series(feed, "loss", NOW, 10, 10).ys == (2.0,)
    assert int(NOW - 300) not in feed.figures["loss"]


def test_device_views_on_gpu_and_on_cpu(store):
    run = store.create_run("probe", {}, [], "host")
    rows = []
    for s in range(5):
        t = NOW - 5 + s
        rows.append({**gpu(1, t, 40_000.0, 90.0 + s), "run_id": run})
        rows.append({**gpu(0, t, 20_000.0, 50.0), "run_id": run})
        rows.append({"run_id": run, "t": t, "kind": "rank", "idx": 0, "name": "rank 0", "run_mem_mb": 300.0 + s,
                     "mem_total_mb": 16_000.0})
        rows.append({"run_id": run, "t": t, "kind": "host", "idx": -1, "name": "cpu", "mem_used_mb": 4_000.0,
                     "mem_total_mb": 16_000.0, "util": 75.0, "run_mem_mb": 600.0})
    store.add_rows([], rows)
    feed = RunFeed(run)
    feed.poll(store, NOW)
    views = monitor.device_views(feed, NOW, window_s=60)
    assert [v.label for v in views] == ["GPU 0 H100 80GB HBM3", "GPU 1 H100 80GB HBM3", "host CPU", "rank 0"]
    gpu1, host, rank0 = views[1], views[2], views[3]
    assert gpu1.util_series == (90.0, 91.0, 92.0, 93.0, 94.0) and gpu1.mem_series[0] == 50.0
    assert gpu1.mem_text == "39.1/78.1 GiB 50%" and gpu1.detail_text == " 94%  300 W  60°C"
    assert host.mem_text == "3.9/15.6 GiB 25%" and host.detail_text == " 75%"
    assert rank0.mem_text == "RSS 304 MiB" and rank0.mem_series == (300.0, 301.0, 302.0, 303.0, 304.0)
    assert len(feed.samples_since(NOW - 2)) == 2 * 4


def test_stored_resolution_gives_a_few_hundred_buckets():
    assert monitor.stored_resolution(60) == 1.0
    assert monitor.stored_resolution(36_000) == 120.0


# ---- logs ----------------------------------------------------------------------------------------


def test_log_tail_reads_the_end_then_only_what_is_new(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("x" * 40_000 + "\nfirst\nsecond\n")
    (logs / "rank10.log").write_text("ten\n")
    (logs / "rank2.log").write_text("two\npartial")
    (logs / "supervisor.log").write_text("not shown\n")
    tail = LogTail(logs, keep_lines=3)
    assert tail.read_new() == 4
    assert tail.sources() == ["rank0", "rank2", "rank10"]
    assert tail.lines("rank0") == ["first", "second"]  # the cut first line is dropped
    with open(logs / "rank2.log", "a") as handle:
        handle.write(" line\nthree\nfour\n")
    assert tail.read_new() == 3
    assert tail.lines("rank2") == ["partial line", "three", "four"]  # the last 3 kept
    assert tail.lines()[0] == "[rank0] first"


def test_monitor_module_needs_neither_textual_nor_torch():
    code = "import gpuscale.engines.monitor, sys; print(' '.join(sys.modules))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert not {"textual", "torch"} & loaded
