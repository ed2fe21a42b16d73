"""A run's training curve as a markdown table: the mean of chosen metrics over windows of steps.

    python bench/curve.py RUN_ID --names reward,rewards_correctness_arithmetic_mean --window 50

It reads the run's metric records through `gpuscale export RUN_ID --what metrics` (the history in
GPUSCALE_HOME) and averages each metric over every window of --window steps (the last window may be
shorter), over the ranks that logged it. A name that ends in `*` takes every metric it begins.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict


def metric_records(run_id: int) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "export", str(run_id), "--what", "metrics"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def chosen(names: list[str], available: set[str]) -> list[str]:
    picked = []
    for name in names:
        picked += sorted(n for n in available if n.startswith(name[:-1])) if name.endswith("*") else [name]
    return picked


def windows(records: list[dict], names: list[str], window: int) -> list[tuple[int, dict[str, float]]]:
    """[(the window's last step, {name: mean})], in step order."""
    sums: dict[tuple[int, str], list[float]] = defaultdict(list)
    last_step: dict[int, int] = {}
    for record in records:
        if record["name"] in names and record["step"] >= 1:
            index = (record["step"] - 1) // window
            sums[index, record["name"]].append(record["value"])
            last_step[index] = max(last_step.get(index, 0), record["step"])
    return [(last_step[i], {name: sum(v) / len(v) for (j, name), v in sums.items() if j == i})
            for i in sorted(last_step)]


BASELINE = """No baseline: it reads one run's metric records and prints them; nothing is compared."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_id", type=int)
    parser.add_argument("--names", required=True, help="comma-separated metric names (a trailing * matches a prefix)")
    parser.add_argument("--window", type=int, default=50, help="steps per row")
    args = parser.parse_args()
    records = metric_records(args.run_id)
    names = chosen(args.names.split(","), {r["name"] for r in records})
    print("| steps | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for step, means in windows(records, names, args.window):
        print(f"| up to {step} | " + " | ".join(f"{means[n]:.3f}" if n in means else "-" for n in names) + " |")


if __name__ == "__main__":
    main()
