"""How much the strict answer rule of 2026-11-28 moves the figures of finished runs.

Before that day the strict rule took the *first* `#### N` and ignored what followed it on the line
(`#### 9 - 1 = 15.` read 9, `#### 5 apples` read 5, `#### 12` then `#### 13` read 12). Now the answer
is the last `####` line with nothing after its number (data/answers.py). This script re-reads what
finished runs wrote, under both rules, with the same completions, so the difference is the rule's alone:

- every held-out answer a run kept: power sampling's result rows (RUN_DIR/results.jsonl, all of them),
  the training recipes' evaluations before and after training (RUN_DIR/held_out.jsonl, up to 256
  answers a temperature: runs/generations.py): accuracy under the old rule and the new, per evaluation;
- every generation record a run kept (RUN_DIR/generations.jsonl; rft's `generate` phase are the answers
  its filter chose from): how many have a `####` the two rules read differently.

Baseline: the rule before 2026-11-28 (OLD_STRICT below), on the very same completions; nothing is run
again, so there is nothing to put at its best.

    python bench/answer_rule.py RUN_DIR [RUN_DIR ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from gpuscale.data.answers import answers_match, clean_number_text, extract_strict
from gpuscale.runs.generations import read_generations
from gpuscale.runs.run_dir import RunDir

# The rule before 2026-11-28, kept here only to measure the change: the first `####` and the number
# that starts after it.
OLD_STRICT = re.compile(r"####\s*(-?\$?-?[0-9.,]*[0-9])")


def old_extract_strict(text: str) -> str | None:
    match = OLD_STRICT.search(text)
    return clean_number_text(match.group(1)) if match else None


def gold_value(gold: str) -> str | None:
    return extract_strict(gold) if "####" in gold else clean_number_text(gold)


def held_out_rows(run_dir: Path) -> list[tuple[str, dict]]:
    """(evaluation's name, row with `completion` and `gold`) of every held-out answer the run kept."""
    run = RunDir(run_dir)
    rows = []
    for path, name_of in ((run.results, lambda row: "results"),
                          (run.held_out_answers, lambda row: f"step{row['step']} {row['phase']}")):
        if path.exists():
            rows += [(name_of(row), row) for row in map(json.loads, path.read_text().splitlines())]
    return [(name, row) for name, row in rows if "gold" in row]  # rft's results.jsonl: its kept answers


def held_out_under_both(run_dir: Path) -> dict[str, dict]:
    """{evaluation: {"rows", "old", "new", "flips_to_wrong", "flips_to_right", ...}}."""
    figures: dict[str, dict] = defaultdict(lambda: {"rows": 0, "old": 0, "new": 0, "flips_to_wrong": 0,
                                                      "flips_to_right": 0, "examples": []})
    for name, row in held_out_rows(run_dir):
        gold = gold_value(str(row["gold"]))
        old = answers_match(old_extract_strict(row["completion"]), gold)
        new = answers_match(extract_strict(row["completion"]), gold)
        figure = figures[name]
        figure["rows"] += 1
        figure["old"] += old
        figure["new"] += new
        figure["flips_to_wrong"] += old and not new
        figure["flips_to_right"] += new and not old
        if old != new and len(figure["examples"]) < 3:
            figure["examples"].append(row["completion"][-200:])
    return {when: {**figure, "accuracy_old": figure["old"] / figure["rows"],
                   "accuracy_new": figure["new"] / figure["rows"]} for when, figure in figures.items()}


def generations_read_differently(run_dir: Path) -> dict[str, int]:
    """Per phase: records kept, and those with a `####` that the two rules read differently; rft's
    kept answers (its results.jsonl, the rows it trains on) as the phase `kept for training`."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"records": 0, "read_differently": 0})
    results = RunDir(run_dir).results
    kept = [row for row in map(json.loads, results.read_text().splitlines()) if "gold" not in row] \
        if results.exists() else []
    for record in read_generations(run_dir) + [{**row, "phase": "kept for training"} for row in kept]:
        text = record.get("completion") or ""
        phase = counts[str(record.get("phase"))]
        phase["records"] += 1
        phase["read_differently"] += "####" in text and old_extract_strict(text) != extract_strict(text)
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write the figures here as well")
    args = parser.parse_args(argv)
    report = {}
    for run_dir in args.run_dirs:
        report[str(run_dir)] = {"held_out": held_out_under_both(run_dir),
                                "generations": generations_read_differently(run_dir)}
        for when, figure in report[str(run_dir)]["held_out"].items():
            print(f"{run_dir.name} {when}: {figure['rows']} rows, accuracy {figure['accuracy_old']:.4f} (old rule) -> "
                  f"{figure['accuracy_new']:.4f} (new); {figure['flips_to_wrong']} right -> wrong, "
                  f"{figure['flips_to_right']} wrong -> right")
        for phase, counts in report[str(run_dir)]["generations"].items():
            print(f"{run_dir.name} generations, phase {phase}: {counts['read_differently']} of {counts['records']} "
                  "read differently")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
