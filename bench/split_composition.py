"""What a settings selection scores on tiny-math beside what the acceptance check scores, and whether a
selection's gain can predict the check's.

Three sets of problems, every one of them answered greedily by the embedded model (tiny-math, untrained)
through the recipes' own held-out evaluation (recipes/shared/evaluation.py's `held_out_rows`, its strict
answer rule) on the CPU in fp32:
- `selection`: the first `eval_examples` validation problems, what each run of bench/select_settings.py
  scores (the count its runs recorded in --selection's JSON);
- `validation rest`: the validation problems after them, scored by no selection;
- `test`: the first --test-examples problems of the test split (data/splits.py's TEST_SPLIT_EDITION), what
  each training run of bench/acceptance.py scores (its EVAL_PROBLEMS: the whole split).

For each set and domain: how many problems, the share structurally new (data/near_duplicates.py), the
question's mean length in words, the numbers in the questions and the answers, the base model's greedy
accuracy; per sub-kind (the generator's templates in data/tiny_math.py: arithmetic's six kinds,
comparison's asks (most, fewest, middle, range) of 3 or 4 amounts, counting's list lengths) the count
and the base accuracy, and what the selection's base accuracy would be at the test's per-kind accuracy
(its mix alone).

Then the recorded gains (after - before, greedy, mean over the seeds) of --candidate in the --selection
JSON and of --label in the --acceptance JSON, per domain, each beside the spread a gain has by chance
from which n problems were drawn (one standard deviation; the seeds of a selection all score the same
problems, so their sd says nothing of it). A gain g on n problems is (fixed - broken) / n; its variance
from drawing the problems is ((fixed + broken) / n - g^2) / n, and fixed + broken is not recorded (the
runs keep too few answers), so two bounds: `least churn` (no problem broken: fixed + broken = g n) and
`independent` (the trained model right on a problem independently of the base: fixed + broken =
(1 - before) after + before (1 - after) of n). The selection's and the test's gains differ by chance
when their difference is within about two of the combined spreads.

Baseline: none; it measures splits and the untrained model's answers, no speed, and compares with no
other code.

Usage: python bench/split_composition.py [--selection JSON --candidate LABEL] [--acceptance JSON
       --label LABEL] [--test-examples N] [--validation-examples N] [--threads N]
About 4 minutes on 2 CPU cores (the 4,000 problems of both splits, answered once each). Written with
bench/record.py to bench/results/splits/split-composition-<date>-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance import EVAL_PROBLEMS, EVAL_TOKENS, seed_statistics  # noqa: E402
from record import ROOT, figures_of, write_result  # noqa: E402

from gpuscale.data.tiny_math import TINY_MATH_DOMAINS, TINY_MATH_SIZES, tiny_math_examples  # noqa: E402

SELECTION = ROOT / "bench/results/grpo_mtl/selection-domain-weights-2026-11-29-h200.json"
ACCEPTANCE = ROOT / "bench/results/acceptance/acceptance-1gpu-3seeds-grpo-64x4-2026-11-29-h200.json"
SETS = ("selection", "validation rest", "test")

# Arithmetic's kinds by their template's words (data/tiny_math.py's _ARITHMETIC_KINDS), the first match
# wins: "gets ... and then gives away" is add-then-subtract before it is subtract.
ARITHMETIC_KINDS = (("temperature drop", "degrees"), ("multiply-then-add", "already has"),
                    ("multiply", "bags with"), ("add-then-subtract", "then gives away"),
                    ("subtract", "gives away"), ("add", "more"))
COMPARISON_ASKS = (("range", "than the one with the fewest"), ("most", "with the most have?"),
                   ("fewest", "with the fewest have?"), ("middle", "in the middle"))


def kind_of(example: dict) -> str:
    """The sub-kind of a tiny-math problem, read from the words of its generator's template."""
    question, domain = example["question"], example["domain"]
    if domain == "arithmetic":
        kinds = ARITHMETIC_KINDS
    elif domain == "comparison":
        amounts = len(re.findall(r" has \d+ ", question))
        return f"{first_kind(question, COMPARISON_ASKS)} of {amounts}"
    else:  # counting: the list's length sets the difficulty
        length = len(question.split(": ", 1)[1].split(". ", 1)[0].split(", "))
        return "list of 4-6" if length <= 6 else "list of 7-10"
    return first_kind(question, kinds)


def first_kind(question: str, kinds: tuple[tuple[str, str], ...]) -> str:
    found = next((kind for kind, words in kinds if words in question), None)
    if found is None:  # a template this script does not know: its figures would be wrong
        raise SystemExit(f"no known sub-kind for {question!r}: update the kinds to data/tiny_math.py's templates")
    return found


def scored_sets(selection_examples: int, validation_examples: int, test_examples: int) -> dict[str, list[dict]]:
    validation = tiny_math_examples("validation", validation_examples)
    return {"selection": validation[:selection_examples], "validation rest": validation[selection_examples:],
            "test": tiny_math_examples("test", test_examples)}


def base_correct(problems: list[dict], threads: int, batch_size: int) -> list[bool]:
    """Whether the embedded model's greedy answer to each problem is right (the recipes' evaluation)."""
    import torch

    from gpuscale.engines.distributed import RankContext
    from gpuscale.recipes.shared.evaluation import held_out_rows
    from gpuscale.recipes.shared.models import load_generation_model

    torch.set_num_threads(threads)
    ctx = RankContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                      run_dir=Path("."))
    loaded = load_generation_model("tiny-math", ctx)
    rows = held_out_rows(loaded.model, loaded.tokenizer, problems, ctx, max_new_tokens=EVAL_TOKENS,
                         batch_size=batch_size)
    return [bool(row["correct"]) for row in sorted(rows, key=lambda row: row["index"])]


def numbers(values: list[int]) -> dict | None:
    if not values:  # counting's questions hold no number
        return None
    return {"min": min(values), "max": max(values), "mean": round(statistics.mean(values), 1)}


def domain_composition(problems: list[dict], correct: list[bool]) -> dict:
    """One domain's problems of one set: counts, shares, numbers and the base accuracy, per sub-kind too."""
    kinds = defaultdict(list)
    for example, right in zip(problems, correct):
        kinds[kind_of(example)].append(right)
    answers = [int(example["answer"].rsplit("####", 1)[1]) for example in problems]
    return {"problems": len(problems),
            "structurally_new": round(sum(example["structurally_new"] for example in problems) / len(problems), 3),
            "question_words": round(statistics.mean(len(example["question"].split()) for example in problems), 1),
            "question_numbers": numbers([int(n) for e in problems for n in re.findall(r"\d+", e["question"])]),
            "answers": {**numbers(answers), "negative": sum(answer < 0 for answer in answers)},
            "base_accuracy": round(sum(correct) / len(correct), 4),
            "kinds": {kind: {"problems": len(hits), "share": round(len(hits) / len(problems), 3),
                             "base_accuracy": round(sum(hits) / len(hits), 4)} for kind, hits in sorted(kinds.items())}}


def composition(problems: list[dict], correct: list[bool]) -> dict:
    return {domain: domain_composition([e for e in problems if e["domain"] == domain],
                                       [c for e, c in zip(problems, correct) if e["domain"] == domain])
            for domain in TINY_MATH_DOMAINS}


def at_rates_of(mix: dict, rates: dict) -> float | None:
    """A domain's base accuracy with `mix`'s kinds at `rates`' per-kind accuracies (None where a kind of the
    mix is missing from `rates`)."""
    if any(kind not in rates["kinds"] for kind in mix["kinds"]):
        return None
    return round(sum(entry["problems"] * rates["kinds"][kind]["base_accuracy"] for kind, entry in mix["kinds"].items())
                 / mix["problems"], 4)


def proportion_z(a: dict, b: dict) -> float:
    """Two base accuracies' difference in standard errors (pooled two-proportion z)."""
    n1, n2 = a["problems"], b["problems"]
    pooled = (a["base_accuracy"] * n1 + b["base_accuracy"] * n2) / (n1 + n2)
    return round((a["base_accuracy"] - b["base_accuracy"]) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2)), 2)


def base_checks(found: dict, domain: str) -> dict:
    """Whether the selection's base accuracy differs from the others' by its mix of kinds or by chance."""
    selection, rest, test = (found[name][domain] for name in SETS)
    return {"selection at the test's per-kind accuracy": at_rates_of(selection, test),
            "selection vs validation rest, z": proportion_z(selection, rest),
            "selection vs test, z": proportion_z(selection, test)}


def gain_spread(problems: int, before: float, after: float) -> dict:
    """A gain's standard deviation from drawing `problems` problems, at both bounds of the module's docstring."""
    gain = after - before
    churn = {"least churn": abs(gain), "independent": (1 - before) * after + before * (1 - after)}
    return {name: round(math.sqrt(max(changed - gain**2, 0) / problems), 4) for name, changed in churn.items()}


def recorded_gains(path: Path, label: str) -> dict:
    """The greedy accuracies before and after, mean over the succeeded seeds of `label`'s runs in a selection's
    or an acceptance's JSON, overall and per domain."""
    rows = [row for row in figures_of(json.loads(path.read_text()))["runs"]
            if row["label"] == label and row["status"] == "succeeded"]
    if not rows:
        raise SystemExit(f"{path}: no succeeded run labelled {label!r}")
    stats = seed_statistics(rows)[label]
    found = {"seeds": len(rows), "eval_examples": sorted({row.get("eval_examples") for row in rows} - {None})}
    for domain in ("", *TINY_MATH_DOMAINS):
        suffix = f"_{domain}" if domain else ""
        before = statistics.mean((row["domains"] if domain else row)[f"accuracy_greedy{suffix}_before"] for row in rows)
        gain = stats[f"gain_greedy{suffix}"]
        found[domain or "overall"] = {"before": round(before, 4), "gain": round(gain["mean"], 4),
                                      "gain_sd_over_seeds": round(gain["sd"], 4)}
    return found


def gain_comparison(selection: dict, test: dict, sizes: dict) -> dict:
    """Per domain: each gain with its spread from the problems drawn, and their difference in those spreads."""
    compared = {}
    for domain in ("overall", *TINY_MATH_DOMAINS):
        sides = {}
        for name, gains in (("selection", selection), ("test", test)):
            entry = gains[domain]
            sides[name] = {**entry, "problems": sizes[name][domain],
                           "spread": gain_spread(sizes[name][domain], entry["before"], entry["before"] + entry["gain"])}
        difference = sides["selection"]["gain"] - sides["test"]["gain"]
        spreads = sides["selection"]["spread"], sides["test"]["spread"]
        z = {bound: round(difference / math.hypot(spreads[0][bound], spreads[1][bound]), 2) for bound in spreads[0]}
        compared[domain] = {**sides, "difference": round(difference, 4), "difference_in_spreads": z}
    return compared


def print_composition(found: dict) -> None:
    for domain in TINY_MATH_DOMAINS:
        print(f"\n{domain}: problems, structurally new, words, base greedy accuracy; "
              "per sub-kind: problems (share) accuracy")
        for name in SETS:
            entry = found[name][domain]
            print(f"  {name:<16}{entry['problems']:>5}{100 * entry['structurally_new']:>7.1f}%"
                  f"{entry['question_words']:>6.1f}{100 * entry['base_accuracy']:>7.1f}%   answers {entry['answers']}")
        kinds = sorted({kind for name in SETS for kind in found[name][domain]["kinds"]})
        for kind in kinds:
            cells = []
            for name in SETS:
                entry = found[name][domain]["kinds"].get(kind)
                cells.append(f"{entry['problems']:>4} ({100 * entry['share']:4.1f}%) "
                             f"{100 * entry['base_accuracy']:5.1f}%" if entry else f"{'—':>23}")
            print(f"    {kind:<20}" + "  ".join(cells))


def print_gains(compared: dict) -> None:
    print("\ngreedy gain in points (mean over seeds) ± its spread from the problems drawn (least churn .. independent)")
    for domain, entry in compared.items():
        cells = [f"{name} {100 * side['gain']:+.1f} on {side['problems']} "
                 f"(± {100 * side['spread']['least churn']:.1f} .. {100 * side['spread']['independent']:.1f}; "
                 f"base {100 * side['before']:.1f})" for name in ("selection", "test") for side in [entry[name]]]
        z = entry["difference_in_spreads"]
        print(f"  {domain:<11}" + "; ".join(cells) + f"; difference {100 * entry['difference']:+.1f} = "
              f"{z['least churn']:.1f} .. {z['independent']:.1f} spreads")


def shown(path: Path) -> str:
    """A path as the result records it: from the repository root where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selection", type=Path, default=SELECTION, help="a bench/select_settings.py JSON")
    parser.add_argument("--candidate", default="domain_weights=", help="its candidate (the defaults' row)")
    parser.add_argument("--acceptance", type=Path, default=ACCEPTANCE, help="a bench/acceptance.py JSON")
    parser.add_argument("--label", default="grpo-mtl", help="its row's label")
    parser.add_argument("--test-examples", type=int, default=EVAL_PROBLEMS,
                        help="test problems an acceptance run scores")
    parser.add_argument("--validation-examples", type=int, default=TINY_MATH_SIZES["validation"],
                        help="validation problems answered (the selection's and the rest)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--batch-size", type=int, default=256, help="problems a generation batch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    selection, test = recorded_gains(args.selection, args.candidate), recorded_gains(args.acceptance, args.label)
    if len(selection["eval_examples"]) != 1:
        raise SystemExit(f"{args.selection}: the runs scored {selection['eval_examples']} problems, not one count")
    selection_examples = selection["eval_examples"][0]
    sets = scored_sets(selection_examples, args.validation_examples, args.test_examples)
    everything = [example for name in SETS for example in sets[name]]
    correct = iter(base_correct(everything, args.threads, args.batch_size))
    found = {name: composition(problems, [next(correct) for _ in problems]) for name, problems in sets.items()}
    sizes = {name: {"overall": len(sets[name]), **{d: found[name][d]["problems"] for d in TINY_MATH_DOMAINS}}
             for name in ("selection", "test")}
    compared = gain_comparison(selection, test, sizes)
    checks = {domain: base_checks(found, domain) for domain in TINY_MATH_DOMAINS}
    print_composition(found)
    print("\nthe base accuracy's differences: " + "; ".join(f"{domain} {entry}" for domain, entry in checks.items()))
    print_gains(compared)
    write_result("splits", "split-composition",
                 {"selection": shown(args.selection), "candidate": args.candidate,
                  "selection_examples": selection_examples, "acceptance": shown(args.acceptance), "label": args.label,
                  "test_examples": args.test_examples,
                  "validation_examples": args.validation_examples, "max_new_tokens": EVAL_TOKENS,
                  "model": "tiny-math (embedded, untrained), greedy, CPU fp32"},
                 {"sets": found, "base_checks": checks, "recorded": {"selection": selection, "test": test},
                  "gains": compared},
                 out=args.out, card="cpu")


if __name__ == "__main__":
    main()
