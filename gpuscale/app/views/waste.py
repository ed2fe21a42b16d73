"""The waste rules: the waste the seeds complain about ("we used 1 GPU of 8", "5 GB of 80 GB"),
pointed out while it happens: idle GPUs, GPUs with most of their memory unused, GPUs of the machine
the run does not use, a straggling rank. Plain sample dicts in (rows of the store's `samples`), one
line of text per warning out.
"""

from __future__ import annotations

from collections.abc import Iterable

# A GPU below IDLE_UTIL_PERCENT on average over WASTE_WINDOW_S is idle; one whose memory in use stays
# below LOW_MEMORY_FRACTION could take a larger batch. Averages over a window (and only once the ranks
# do work) keep a checkpoint, an eval pass or model loading from raising false alarms.
IDLE_UTIL_PERCENT = 5.0
LOW_MEMORY_FRACTION = 0.25
WASTE_WINDOW_S = 30.0
MIN_SAMPLES = 3
# A rank below this fraction of the fastest rank's tokens/s holds every other rank up.
STRAGGLER_RATIO = 0.7


def waste_warnings(
    samples: list[dict],
    now: float,
    working_since: float | None,
    tokens_by_rank: dict | None = None,
    machine_gpus: list[dict] | None = None,
    window_s: float = WASTE_WINDOW_S,
) -> list[str]:
    """Waste worth pointing out now, one line each, from plain sample dicts (rows of `samples`).

    `working_since` is when the ranks first counted tokens or samples: before that the run is
    loading, and an idle GPU is no waste yet (None: no warning at all).
    """
    if working_since is None:
        return []
    since = max(now - window_s, working_since)
    recent = [s for s in samples if s["kind"] == "gpu" and s["t"] >= since]
    by_gpu: dict[int, list[dict]] = {}
    for sample in recent:
        by_gpu.setdefault(sample["idx"], []).append(sample)
    judged = {idx: rows for idx, rows in sorted(by_gpu.items()) if len(rows) >= MIN_SAMPLES}
    warnings = []
    warnings += _idle_gpus(judged)
    warnings += _low_memory_gpus(judged)
    warnings += _unused_gpus(judged, machine_gpus)
    warnings += _stragglers(tokens_by_rank or {})
    return warnings


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _idle_gpus(judged: dict[int, list[dict]]) -> list[str]:
    idle = [idx for idx, rows in judged.items() if (_mean(r["util"] for r in rows) or 0.0) < IDLE_UTIL_PERCENT]
    if not idle:
        return []
    if len(idle) == len(judged):
        return [f"all {len(judged)} GPU(s) idle: the ranks wait on the CPU, data or each other"]
    return [f"{len(idle)} of {len(judged)} GPUs idle ({_gpu_list(idle)})"]


# What to do about it: `gpuscale tune` finds the fastest batch that fits (app/batch_choice.py).
RAISE_BATCH = "raise batch_size (`gpuscale tune` finds it)"


def _low_memory_gpus(judged: dict[int, list[dict]]) -> list[str]:
    low = {}
    for idx, rows in judged.items():
        fraction = _mean(r["mem_used_mb"] / r["mem_total_mb"] for r in rows
                         if r["mem_total_mb"] and r["mem_used_mb"] is not None)
        if fraction is not None and fraction < LOW_MEMORY_FRACTION:
            low[idx] = fraction
    if len(low) <= 2:  # one line per GPU while that stays short ...
        return [f"GPU {idx}: {100 * f:.0f}% of memory in use — {RAISE_BATCH}" for idx, f in low.items()]
    spread = _percent_range([100 * f for f in low.values()])
    return [f"{_gpu_list(list(low))}: {spread} of memory in use — {RAISE_BATCH}"]


def _percent_range(percents: list[float]) -> str:
    """`6%`, or `4-9%` when they differ."""
    lowest, highest = round(min(percents)), round(max(percents))
    return f"{lowest}%" if lowest == highest else f"{lowest}-{highest}%"


def _unused_gpus(judged: dict[int, list[dict]], machine_gpus: list[dict] | None) -> list[str]:
    """GPUs of this machine that sit idle outside the run: the "1 GPU of 8" of the seeds."""
    if not machine_gpus or not judged:
        return []
    others = [g for g in machine_gpus if g["index"] not in judged]
    idle = [g["index"] for g in others if (g.get("util") or 0) < IDLE_UTIL_PERCENT
            and g["mem_used_mb"] < LOW_MEMORY_FRACTION * g["mem_total_mb"]]
    if not idle:
        return []
    return [f"the run uses {len(judged)} of {len(machine_gpus)} GPUs; {_gpu_list(idle)} idle — set gpus=all"]


def _stragglers(tokens_by_rank: dict) -> list[str]:
    """Ranks well below the fastest: in a synchronous job every rank waits for them."""
    rates = {int(rank): rate for rank, rate in tokens_by_rank.items() if rate is not None}
    if len(rates) < 2 or max(rates.values()) <= 0:
        return []
    fastest = max(rates.values())
    slow = {rank: 100 * rate / fastest for rank, rate in sorted(rates.items()) if rate < STRAGGLER_RATIO * fastest}
    if not slow:
        return []
    if len(slow) == 1:
        (rank, percent), = slow.items()
        return [f"rank {rank} at {percent:.0f}% of the top rank's speed — every rank waits for it"]
    names = _gpu_list(list(slow), noun="ranks")
    return [f"{names} at {_percent_range(list(slow.values()))} of the top rank's speed — every rank waits for them"]


def _gpu_list(indices: list[int], noun: str = "GPU") -> str:
    """`GPU 3` or `GPU 1,4,5`; a run of 3 or more as `GPU 4-7`."""
    indices = sorted(indices)
    parts, start = [], 0
    while start < len(indices):
        end = start
        while end + 1 < len(indices) and indices[end + 1] == indices[end] + 1:
            end += 1
        span = indices[start: end + 1]
        parts.append(f"{span[0]}-{span[-1]}" if len(span) >= 3 else ",".join(map(str, span)))
        start = end + 1
    return f"{noun} " + ",".join(parts)
