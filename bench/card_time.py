"""Which runs a shared card's time went to, from `nvidia-smi pmon` beside a check (a call of
bench/acceptance.py, say), before runs recorded it themselves (the summary's `gpu_busy_s`, since
2026-11-30, from the same NVML per-process utilization).

    python bench/card_time.py --pmon pmon0.txt --history HOME/runs.db --partial acc.partial.jsonl

(`--pids FILE`, a JSON {run id: launcher pid} that --out writes as `launcher_pids`, in place of --history:
the history of a call is tens of MB, its pids are what this needs.)

Each pmon line is one process's SM utilization (%) over one sampling interval (`-d 1`: a second), so a
process's card-seconds are the sum of its lines' % / 100. A run's process is its rank, which the history
records as the run's launcher pid where one rank runs without a launcher (every 1-GPU run); the rest
(the GPU-marked tests' runs, other processes) is counted as `other`. Prints card-seconds per job and run,
and writes them with --out.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import Counter
from pathlib import Path


def card_seconds_by_pid(pmon: Path, interval_s: float) -> Counter:
    seconds: Counter = Counter()
    for line in pmon.read_text().splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 4 or not fields[1].isdigit() or not fields[3].isdigit():
            continue
        seconds[int(fields[1])] += int(fields[3]) / 100 * interval_s
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " No baseline: it times nothing, it "
                                     "reads what a check's call recorded.")
    parser.add_argument("--pmon", type=Path, required=True, help="`nvidia-smi pmon -s um -d 1` output")
    parser.add_argument("--interval", type=float, default=1.0, help="pmon's -d, seconds")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--history", type=Path, help="the check's GPUSCALE_HOME/runs.db")
    where.add_argument("--pids", type=Path, help="a JSON {run id: launcher pid}, as --out writes it")
    parser.add_argument("--partial", type=Path, required=True, help="the check's rows (--partial of acceptance.py)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    by_pid = card_seconds_by_pid(args.pmon, args.interval)
    if args.history:
        with sqlite3.connect(args.history) as db:
            launcher_pids = {run: pid for run, pid in db.execute("SELECT id, launcher_pid FROM runs")}
    else:
        launcher_pids = {int(run): pid for run, pid in json.loads(args.pids.read_text()).items()}
    run_of_pid = {pid: run for run, pid in launcher_pids.items()}
    jobs = {}
    for line in args.partial.read_text().splitlines():
        row = json.loads(line)
        jobs[row["run_id"]] = (row["label"], row["seed"], row["status"])
    by_run: Counter = Counter()
    for pid, seconds in by_pid.items():
        by_run[run_of_pid.get(pid, "other")] += seconds
    runs = [{"run_id": run, "label": jobs.get(run, ("?", None, None))[0], "seed": jobs.get(run, (None, None))[1],
             "status": jobs.get(run, (None, None, None))[2], "card_s": round(seconds, 1)}
            for run, seconds in by_run.most_common() if run != "other"]
    by_job: Counter = Counter()
    for run in runs:
        by_job[run["label"]] += run["card_s"]
    result = {"total_card_s": round(sum(by_pid.values()), 1), "other_card_s": round(by_run["other"], 1),
              "by_job": {label: round(seconds, 1) for label, seconds in by_job.most_common()}, "runs": runs,
              "launcher_pids": launcher_pids}
    for label, seconds in result["by_job"].items():
        print(f"{seconds:8.1f} s  {label}")
    print(f"{result['other_card_s']:8.1f} s  other processes (the GPU-marked tests' runs)")
    print(f"{result['total_card_s']:8.1f} s  in all")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
