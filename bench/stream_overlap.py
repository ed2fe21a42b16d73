"""How much a GPU's streams overlap, from torch.profiler's Chrome trace of a training run's steps.

grpo-mtl's rollout=async decodes the next step's completions on a stream of its own while the trainer
trains on the default stream; this tells how much of the GPU's time the two actually share. Per trace:

- the window: the first device event's start to the last one's end (device events: kernels, copies and
  memsets, bench/step_phases.py's DEVICE_WORK, each on its args.stream);
- per stream: its events, busy seconds (the union of their intervals), summed seconds (their durations
  added: more than busy where a stream's events overlap one another), busy share of the window, and its
  top 10 kernels by GPU time (name cut to 100 characters, count, seconds);
- union (any stream busy), overlap (two streams or more busy at once) and idle (window - union), each also
  as a share of the window;
- a timeline: per --bin-ms bin from the window's start, each stream's busy share of the bin (the last bin
  is as long as what is left of the window);
- the phase annotations (`gpuscale.phase/<phase>`, step_phases' SITECUSTOMIZE) in order, with their time
  from the window's start (CPU time: negative where the CPU marked a phase before the window's first device
  work; the device runs behind the CPU that launches its work).

    python bench/stream_overlap.py --from-trace FILE [FILE ...] [--bin-ms 25] [--card 'N x NAME'] [--out JSON]
    python bench/stream_overlap.py [--profile-after 3] [--profile-steps 2] [--traces DIR] -- GPUSCALE RUN ARGS...

The second form runs `gpuscale run ARGS` with the ranks under step_phases' SITECUSTOMIZE (logged steps
AFTER+1 ... AFTER+STEPS profiled), keeps each rank's trace in --traces (default: a new temporary folder)
and analyses them. A trace needs a GPU's events: a run on CPU ranks has none. The result (bench/record.py's
schema) goes to bench/results/grpo_mtl/stream-overlap-<date>-<card>.json; each trace's `made_on` holds the
devices and CUDA versions the trace itself names, and the card is theirs (--card overrides it; where the
traces name none or differ, this machine's). The result's `versions` are the analysing machine's.

    python bench/stream_overlap.py --from-trace async/rank0.trace.json.gz sync/rank0.trace.json.gz
    python bench/stream_overlap.py -- --recipe grpo-mtl --gpus 1 --model random-qwen2.5-0.5b \\
        --set rollout=async --set max_steps=8 --set eval_examples=0 --set save_model=false
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import ROOT, parse_card, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))  # gpuscale from this checkout when run as a script
from profile_rollout import rank_sitecustomize, run_with_sitecustomize  # noqa: E402
from step_phases import DEVICE_WORK, SITECUSTOMIZE, phase_marks, profile_env  # noqa: E402

BASELINE = ("No baseline: the streams of one profiled run are set against each other (the share of the window "
            "two or more are busy at once). Compare an async trace with the synchronous run's (one stream).")

TOP_KERNELS, NAME_CHARS = 10, 100
SHADES = " .:-=+*#%@"  # a bin's busy share, 0 to 1, as one character of the printed timeline


# ---- intervals (microseconds, the trace's unit) -----------------------------------------------------


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals: sorted, disjoint (touching ones joined)."""
    union: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def shared(unions: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Where two or more of the (each disjoint) unions cover at once: a sweep over their ends."""
    edges = sorted([(start, 1) for union in unions for start, _ in union]
                   + [(end, -1) for union in unions for _, end in union])  # at a tie an end comes first
    found, depth, opened = [], 0, 0.0
    for at, step in edges:
        if depth < 2 <= depth + step:
            opened = at
        elif depth >= 2 > depth + step and at > opened:
            found.append((opened, at))
        depth += step
    return found


# ---- a trace's figures ------------------------------------------------------------------------------


def load(path: Path) -> dict:
    with (gzip.open(path) if path.suffix == ".gz" else open(path, "rb")) as raw:
        return json.load(raw)


def device_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK]


def by_stream(events: list[dict]) -> dict[str, list[dict]]:
    """Stream (its number, as text: a JSON key) -> its events, the streams in number order."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        grouped[str(e["args"]["stream"])].append(e)
    return dict(sorted(grouped.items(), key=lambda item: int(item[0])))


def spans(events: list[dict]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def top_kernels(events: list[dict]) -> list[dict]:
    """The kernels (copies and memsets too) with the most GPU time, by full name."""
    count: dict[str, int] = defaultdict(int)
    microseconds: dict[str, float] = defaultdict(float)
    for e in events:
        count[e["name"]] += 1
        microseconds[e["name"]] += e["dur"]
    names = sorted(microseconds, key=microseconds.get, reverse=True)[:TOP_KERNELS]
    return [{"name": name[:NAME_CHARS], "count": count[name], "seconds": microseconds[name] / 1e6} for name in names]


def streams(grouped: dict[str, list[dict]], unions: dict[str, list], window_us: float) -> dict[str, dict]:
    return {stream: {"events": len(events), "busy_s": length(unions[stream]) / 1e6,
                     "busy_share": length(unions[stream]) / window_us, "summed_s": length(spans(events)) / 1e6,
                     "top_kernels": top_kernels(events)}
            for stream, events in grouped.items()}


def coverage(unions: dict[str, list], window_us: float) -> dict:
    """Union, overlap (two streams or more at once) and idle, in seconds and as shares of the window."""
    union = length(merged([span for spans in unions.values() for span in spans]))
    overlap = length(shared(list(unions.values())))
    figures = {"union": union, "overlap": overlap, "idle": window_us - union}
    return {**{f"{name}_s": us / 1e6 for name, us in figures.items()},
            **{f"{name}_share": us / window_us for name, us in figures.items()}}


def timeline(unions: dict[str, list], start: float, end: float, bin_us: float) -> dict:
    """Per stream, its busy share of each bin from the window's start."""
    bins = max(1, int(-(-(end - start) // bin_us)))  # ceil
    widths = [min(bin_us, end - start - i * bin_us) for i in range(bins)]
    shares = {}
    for stream, union in unions.items():
        busy = [0.0] * bins
        for span_start, span_end in union:
            for i in range(int((span_start - start) // bin_us), min(bins, int((span_end - start) // bin_us) + 1)):
                low, high = start + i * bin_us, start + i * bin_us + widths[i]
                busy[i] += max(0.0, min(span_end, high) - max(span_start, low))
        shares[stream] = [b / w for b, w in zip(busy, widths)]
    return {"bin_s": bin_us / 1e6, "bins": bins, "streams": shares}


def phases(trace: dict, start: float) -> list[dict]:
    """The phase marks in order (step_phases.phase_marks), each at its seconds from the window's start."""
    return [{"phase": name, "at_s": (at - start) / 1e6} for at, name in phase_marks(trace)]


def made_on(trace: dict) -> dict:
    """What the trace itself says of the machine that made it (torch.profiler's own fields): its CUDA
    devices and versions. The result's `versions` are the analysing machine's."""
    return {"devices": [device.get("name") for device in trace.get("deviceProperties", [])],
            **{key: trace[key] for key in ("cuda_runtime_version", "cuda_driver_version") if key in trace}}


def traces_card(results: dict) -> dict | None:
    """The card the traces were made on, from their own device names where they all name the same ones."""
    named = {tuple(result["made_on"]["devices"]) for result in results.values()}
    if len(named) != 1 or not next(iter(named)):
        return None
    devices = list(next(iter(named)))
    return {"names": devices, "count": len(devices)}


def analyse(trace: dict, bin_ms: float) -> dict:
    events = device_events(trace)
    if not events:
        raise ValueError("no device events (kernels, copies, memsets): a run on CPU ranks?")
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    if end <= start:
        raise ValueError("the device events take no time")
    grouped = by_stream(events)
    unions = {stream: merged(spans(stream_events)) for stream, stream_events in grouped.items()}
    return {"made_on": made_on(trace), "window_s": (end - start) / 1e6,
            "streams": streams(grouped, unions, end - start), **coverage(unions, end - start),
            "timeline": timeline(unions, start, end, bin_ms * 1000), "phases": phases(trace, start)}


# ---- printing ---------------------------------------------------------------------------------------


def printed(label: str, f: dict) -> list[str]:
    lines = [f"{label}: window {f['window_s']:.3f} s; union {f['union_s']:.3f} s ({f['union_share']:.1%}), "
             f"overlap {f['overlap_s']:.3f} s ({f['overlap_share']:.1%}), idle {f['idle_s']:.3f} s "
             f"({f['idle_share']:.1%})"]
    for stream, s in f["streams"].items():
        top = s["top_kernels"][0]  # a stream is listed for its events: it has one
        lines.append(f"  stream {stream:>3}: {s['events']:>7} events, busy {s['busy_s']:.3f} s ({s['busy_share']:.1%})"
                     f", summed {s['summed_s']:.3f} s; most GPU time: {top['name'][:48]} {top['seconds']:.3f} s")
    bin_ms = 1000 * f["timeline"]["bin_s"]
    for stream, shares in f["timeline"]["streams"].items():
        lines.append(f"  stream {stream:>3} by {bin_ms:g} ms |{''.join(SHADES[round(s * 9)] for s in shares)}|")
    lines.append("  phases: " + ", ".join(f"{p['phase']} {p['at_s']:+.3f}" for p in f["phases"]))
    return lines


def label_of(path: Path) -> str:
    """rank0.trace.json.gz in async-1gpu/ -> async-1gpu/rank0."""
    return f"{path.parent.name}/{path.name.split('.')[0]}"


# ---- the second form: a run of its own --------------------------------------------------------------


def profiled_run(run: list[str], folder: Path, after: int, steps: int) -> list[Path]:
    """`gpuscale run RUN`, its ranks' logged steps after+1 ... after+steps profiled; their traces."""
    sitecustomize = rank_sitecustomize(SITECUSTOMIZE, "GPUSCALE_PHASES_PROFILE_OUT")
    code = run_with_sitecustomize(sitecustomize, run, profile_env(str(folder), after, steps))
    traces = sorted(folder.glob("rank*.trace.json.gz"))
    if not traces:
        raise SystemExit(f"no trace written to {folder} (run exit {code}; fewer than {after + steps} logged steps?)")
    return traces


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-trace", nargs="+", type=Path, default=[], metavar="FILE",
                        help="Chrome traces (.json or .json.gz) to analyse; no run")
    parser.add_argument("--bin-ms", type=float, default=25.0, help="the timeline's bin")
    parser.add_argument("--card", default=None, metavar="'N x NAME'",
                        help="with --from-trace: the cards the traces were made on (default: the devices the "
                        "traces name, else this machine's)")
    parser.add_argument("--profile-after", type=int, default=3, help="logged steps before the profiled ones")
    parser.add_argument("--profile-steps", type=int, default=2, help="logged steps profiled")
    parser.add_argument("--traces", type=Path, default=None, help="where a run's traces are kept")
    parser.add_argument("--out", default=None, help="default: bench/results/grpo_mtl/stream-overlap-<date>-<card>.json")
    parser.add_argument("run", nargs=argparse.REMAINDER, help="-- then `gpuscale run` arguments")
    opts = parser.parse_args(argv)
    opts.run = opts.run[1:] if opts.run[:1] == ["--"] else opts.run
    if bool(opts.from_trace) == bool(opts.run):
        parser.error("give --from-trace FILE ... or -- GPUSCALE RUN ARGS (one of them)")
    if opts.bin_ms <= 0 or opts.profile_after < 1 or opts.profile_steps < 1:
        parser.error("--bin-ms above 0, --profile-after and --profile-steps at least 1")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    paths = opts.from_trace
    if opts.run:
        opts.traces = (opts.traces or Path(tempfile.mkdtemp(prefix="gpuscale-stream-overlap-"))).resolve()
        opts.traces.mkdir(parents=True, exist_ok=True)
        paths = profiled_run(opts.run, opts.traces, opts.profile_after, opts.profile_steps)
    results = {}
    for path in paths:
        try:
            results[label_of(path)] = {"trace": str(path), **analyse(load(path), opts.bin_ms)}
        except ValueError as problem:
            raise SystemExit(f"{path}: {problem}") from None
        print("\n".join(printed(label_of(path), results[label_of(path)])), flush=True)
    settings = {**vars(opts), "from_trace": [str(p) for p in opts.from_trace], "traces": str(opts.traces or "")}
    card = parse_card(opts.card) or (traces_card(results) if opts.from_trace else None)
    write_result("grpo_mtl", "stream-overlap", settings, {"traces": results}, out=opts.out, card=card)


if __name__ == "__main__":
    main()
