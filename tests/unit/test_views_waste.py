"""The waste rules on plain sample dicts: idle GPUs, unused memory, GPUs left out, stragglers."""

from __future__ import annotations

from gpuscale.app.views.waste import waste_warnings

NOW = 1_000_000.0


def gpu(idx: int, t: float, used: float, util: float, total: float = 80_000.0) -> dict:
    return {"kind": "gpu", "idx": idx, "t": t, "name": "NVIDIA H100 80GB HBM3", "mem_used_mb": used,
            "mem_total_mb": total, "util": util, "power_w": 300.0, "temp_c": 60.0, "run_mem_mb": used}


def ticks(gpus: dict[int, tuple[float, float]], seconds: int = 10) -> list[dict]:
    """`seconds` ticks of samples: GPU index -> (memory used MB, utilization %)."""
    return [gpu(idx, NOW - s, used, util) for s in range(seconds) for idx, (used, util) in gpus.items()]


def test_one_gpu_with_little_memory_in_use_is_told_to_raise_batch_size():
    samples = ticks({0: (60_000, 95), 1: (62_000, 97), 2: (58_000, 96), 3: (4_800, 94)})
    assert waste_warnings(samples, NOW, working_since=NOW - 60) == [
        "GPU 3: 6% of memory in use — raise batch_size (`gpuscale tune` finds it)"
    ]


def test_idle_gpus_are_counted_and_named():
    busy = {i: (60_000, 95) for i in range(4)}
    idle = {i: (60_000, 0) for i in range(4, 8)}
    warnings = waste_warnings(ticks({**busy, **idle}), NOW, working_since=NOW - 60)
    assert warnings == ["4 of 8 GPUs idle (GPU 4-7)"]


def test_many_low_memory_gpus_share_one_line():
    samples = ticks({i: (4_000 + 1_000 * i, 95) for i in range(8)})  # 5% .. 14%
    assert waste_warnings(samples, NOW, working_since=NOW - 60) == [
        "GPU 0-7: 5-14% of memory in use — raise batch_size (`gpuscale tune` finds it)"
    ]


def test_every_gpu_idle_says_so():
    warnings = waste_warnings(ticks({0: (50_000, 1), 1: (50_000, 2)}), NOW, working_since=NOW - 60)
    assert warnings == ["all 2 GPU(s) idle: the ranks wait on the CPU, data or each other"]


def test_no_warning_while_the_run_loads_or_on_too_few_samples():
    idle = ticks({0: (1_000, 0)})
    assert waste_warnings(idle, NOW, working_since=None) == []  # no token counted yet: loading
    assert waste_warnings(idle, NOW, working_since=NOW - 1) == []  # 2 samples since: too few
    old = [dict(s, t=s["t"] - 600) for s in idle]  # outside the window
    assert waste_warnings(old, NOW, working_since=NOW - 3600) == []


def test_a_short_pause_does_not_raise_an_idle_alarm():
    samples = ticks({0: (60_000, 95)}, seconds=30)
    for sample in samples[:3]:  # three seconds of a checkpoint
        sample["util"] = 0.0
    assert waste_warnings(samples, NOW, working_since=NOW - 60) == []


def test_idle_gpus_of_the_machine_outside_the_run():
    machine = [{"index": i, "mem_used_mb": 60_000.0 if i < 2 else 500.0, "mem_total_mb": 80_000.0,
                "util": 95 if i < 2 else 0} for i in range(8)]
    samples = ticks({0: (60_000, 95), 1: (60_000, 95)})
    assert waste_warnings(samples, NOW, NOW - 60, machine_gpus=machine) == [
        "the run uses 2 of 8 GPUs; GPU 2-7 idle — set gpus=all"
    ]


def test_stragglers():
    one = waste_warnings([], NOW, NOW - 60, tokens_by_rank={"0": 1000.0, "1": 990.0, "2": 500.0})
    assert one == ["rank 2 at 50% of the top rank's speed — every rank waits for it"]
    many = waste_warnings([], NOW, NOW - 60, tokens_by_rank={str(r): 1000.0 if r < 4 else 100.0 for r in range(8)})
    assert many == ["ranks 4-7 at 10% of the top rank's speed — every rank waits for them"]
    assert waste_warnings([], NOW, NOW - 60, tokens_by_rank={"0": 1000.0, "1": 800.0}) == []
