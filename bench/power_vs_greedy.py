"""Power sampling against greedy decoding on the same problems, compared problem by problem (paired).

The runs, one after another, each a real `gpuscale run --recipe power-sampling` into one GPUSCALE_HOME:
- greedy decoding once (method=greedy, 1 chain, at the first of --seeds: it is deterministic);
- power sampling (method=power) at each alpha of --alphas with --chains chains, at each seed of --seeds;
all on the first --problems problems of --split (validation by default) with the same model and run settings
(--gpus, --model, --set). A power run is paired with the greedy run through the runs' stored per-problem
results (RUN_DIR/results.jsonl, one row an answer, read with Store.results):
- per problem: power's share of its chains correct minus greedy's 0 or 1;
- `power_minus_greedy`: their mean over the problems, which is power's accuracy minus greedy's (every problem has
  the same number of chains);
- `standard_error`: the sample standard deviation of the per-problem differences over sqrt(problems);
  `standard_error_at`: the same deviation over sqrt(N) for each N of --noise-at, the noise a verdict on N such
  problems would have (the problems' spread, not the seeds');
- per alpha, over the seeds whose run succeeded: the mean and the sample standard deviation (None for one seed) of
  the accuracy and of power_minus_greedy.
The runs must have scored the same problems (the same question at every index) and differ in nothing but
method, alpha, chains and seed (and the batch, which changes how the work is split, not the answers): anything
else is refused, naming the setting.

Settings are chosen on validation (bench/README.md): `--split test` runs, and the result says that it is a
test-split reading, not a choice.

Usage: python bench/power_vs_greedy.py [--alphas 4,16] [--seeds 0,1,2] [--chains 4] [--problems 500]
       [--split validation] [--gpus N] [--model M] [--set KEY=VALUE ...] [--noise-at 128,500,2000]
       [--home DIR] [--json PATH]
       python bench/power_vs_greedy.py --from-home DIR [the same selection] [--card 'N x NAME']: run nothing, pair
       the newest runs the home holds of each setting (a comparison cut by a time limit, or runs made by hand)
On 2 CPU ranks 500 problems took 16 s greedy and about 280 s a power run at 4 chains (tiny-math, fp32). Written
with bench/record.py to bench/results/power_sampling/power-vs-greedy-<date>-<card>.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance import launch  # noqa: E402
from record import ROOT, parse_card, write_result  # noqa: E402
from select_settings import parse_set_items  # noqa: E402

from gpuscale.data.splits import TEST_SPLITS  # noqa: E402

RECIPE = "power-sampling"
# What a power run and its greedy run differ in; the batch is how the work is cut, not what is computed.
PAIRED_KEYS = ("method", "alpha", "chains", "seed")
NOT_COMPARED = (*PAIRED_KEYS, "batch_size", "batch_size_source")
NOISE_AT = "128,500,2000"  # the acceptance's problem counts, before and since 2026-11-29, and the whole split

BASELINE = """Baseline: greedy decoding (method=greedy) of the same model on the same problems, with the same run
settings (model, precision, ranks, answer budget), run once: it is deterministic. It is the rival power sampling
claims to beat; nothing is timed."""


def reading_of(split: str) -> str:
    """What the result's figures can be used for: a choice only where they were read on validation."""
    if split == "test" or split in TEST_SPLITS:
        return "a test-split reading, not a choice: settings are chosen on validation (bench/README.md)"
    return f"a {split} reading"


def numbers(text: str, kind, where: str) -> list:
    """"4,16" -> [4.0, 16.0] (kind float); SystemExit naming the option `where` on anything else."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{where}: {text!r} is not a comma-separated list of numbers") from None


def per_problem(rows: list[dict]) -> dict[int, tuple[str, float]]:
    """Each problem's question and share of its answers correct (one result row an answer)."""
    answers: dict[int, list[bool]] = {}
    questions: dict[int, str] = {}
    for row in rows:
        answers.setdefault(row["index"], []).append(bool(row["correct"]))
        questions[row["index"]] = row["question"]
    return {index: (questions[index], sum(hits) / len(hits)) for index, hits in answers.items()}


def paired(greedy_rows: list[dict], power_rows: list[dict], noise_at: list[int]) -> dict:
    """Power against greedy problem by problem: the mean difference and its standard error (the module's
    docstring). SystemExit where the two runs did not score the same problems."""
    greedy, power = per_problem(greedy_rows), per_problem(power_rows)
    if greedy.keys() != power.keys() or any(greedy[i][0] != power[i][0] for i in greedy):
        raise SystemExit("the power and greedy runs did not score the same problems: nothing to pair")
    differences = [power[i][1] - greedy[i][1] for i in sorted(greedy)]
    sd = statistics.stdev(differences) if len(differences) > 1 else None
    return {"problems": len(differences), "power_minus_greedy": statistics.mean(differences),
            "standard_error": None if sd is None else sd / math.sqrt(len(differences)),
            "standard_error_at": {str(n): None if sd is None else sd / math.sqrt(n) for n in noise_at}}


def mean_and_sd(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None: nothing, or one value, has no spread)."""
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def by_alpha(rows: list[dict]) -> dict:
    """Per alpha, over its paired runs: the seeds, and mean and sample sd of accuracy and power_minus_greedy."""
    found = {}
    for alpha in dict.fromkeys(row["alpha"] for row in rows if "power_minus_greedy" in row):
        mine = [row for row in rows if row["alpha"] == alpha and "power_minus_greedy" in row]
        entry = {"seeds": [row["seed"] for row in mine]}
        for name in ("accuracy", "power_minus_greedy"):
            entry[f"{name}_mean"], entry[f"{name}_sd"] = mean_and_sd([row[name] for row in mine])
        found[str(alpha)] = entry
    return found


def run_row(run: dict) -> dict:
    """A run's line: which run, its settings that vary, its status and figures (its summary's)."""
    settings, summary = run.get("settings") or {}, run.get("summary") or {}
    method = settings.get("method")
    return {"run": run.get("id"), "status": run.get("status"), "error": run.get("error"), "method": method,
            "alpha": settings.get("alpha") if method == "power" else None, "chains": settings.get("chains"),
            "seed": settings.get("seed"), "precision": settings.get("precision"),
            "accuracy": summary.get("accuracy"), "pass_at_k": summary.get("pass_at_k")}


def settings_differences(greedy: dict, power: dict) -> list[str]:
    """The settings two runs differ in besides NOT_COMPARED, as 'name (greedy's, power's)'."""
    a, b = greedy.get("settings") or {}, power.get("settings") or {}
    return [f"{key} ({a.get(key)}, {b.get(key)})" for key in sorted(set(a) | set(b))
            if key not in NOT_COMPARED and a.get(key) != b.get(key)]


def compared(greedy: dict, powers: list[dict], results, noise_at: list[int]) -> list[dict]:
    """The greedy run's row, then each power run's, paired with greedy where it succeeded. `results`: a run id's
    stored result rows."""
    if greedy.get("status") != "succeeded":
        raise SystemExit(f"the greedy run {greedy.get('id')} {greedy.get('status')}: {greedy.get('error')}")
    greedy_rows = results(greedy["id"])
    rows = [run_row(greedy)]
    for run in powers:
        row = run_row(run)
        if run.get("status") == "succeeded":
            differences = settings_differences(greedy, run)
            if differences:
                raise SystemExit(f"run {run['id']} and greedy run {greedy['id']} differ in {', '.join(differences)}:"
                                 " give the setting with --set")
            row.update(greedy_run=greedy["id"], **paired(greedy_rows, results(run["id"]), noise_at))
        rows.append(row)
    return rows


def same_value(stored, text: str) -> bool:
    """Whether a stored setting is the value typed (4 is 4.0; gpus 0,1 is [0, 1])."""
    if isinstance(stored, list):
        stored = ",".join(map(str, stored))
    if str(stored).lower() == text.lower():
        return True
    try:
        return float(stored) == float(text)
    except (TypeError, ValueError):
        return False


def newest(runs: list[dict], wanted: dict[str, str]) -> dict | None:
    """The newest power-sampling run (runs: newest first) whose settings are `wanted`'s."""
    return next((run for run in runs if run.get("recipe") == RECIPE
                 and all(same_value((run.get("settings") or {}).get(k), v) for k, v in wanted.items())), None)


def run_one(job: tuple[str, dict, int], home: Path) -> dict:
    """One run to its end: `gpuscale run --json`'s record, or, where it could not start, its status and error
    with the settings it was given."""
    label, settings, seed = job
    made = launch(label, RECIPE, settings, seed, home, prefix="power-vs-greedy")["run"]
    print(f"{label} seed {seed}: run {made.get('id')} {made.get('status')}", flush=True)
    return made if made.get("id") else {**made, "settings": {**settings, "seed": seed}}


def run_jobs(home: Path, greedy_job: tuple, power_jobs: list[tuple]) -> tuple:
    """Greedy, then (where it succeeded: else compared() says why, before the power runs' time is spent) every
    power run, into `home`: (its store, the greedy run, the power runs), each as the store holds it."""
    from gpuscale.control.store import Store

    made = [run_one(greedy_job, home)]
    if made[0].get("status") == "succeeded":
        made += [run_one(job, home) for job in power_jobs]
    store = Store.for_reading(home)
    greedy, *powers = [store.get_run(run["id"]) if run.get("id") else run for run in made]
    return store, greedy, powers


def stored_jobs(home: Path, greedy_job: tuple, power_jobs: list[tuple]) -> tuple:
    """The newest run of each job that `home` holds, run_jobs' answer without running (a job missing is said
    and left out); greedy's seed changes nothing, so any greedy run of the same settings will do."""
    from gpuscale.control.store import Store

    store = Store.for_reading(home)
    runs = store.list_runs(recipe=RECIPE)
    greedy = newest(runs, greedy_job[1])
    if greedy is None:
        raise SystemExit(f"{home}: no greedy run of {greedy_job[1]}")
    powers = [newest(runs, {**settings, "seed": str(seed)}) for _label, settings, seed in power_jobs]
    missing = [f"{label} seed {seed}" for (label, _settings, seed), run in zip(power_jobs, powers) if run is None]
    if missing:
        print(f"not in the home: {', '.join(missing)}", flush=True)
    return store, greedy, [run for run in powers if run is not None]


def parse_sets(items: list[str]) -> dict[str, str]:
    """--set's KEY=VALUE items, the script's own keys refused."""
    fixed = parse_set_items(items)
    own = sorted(set(fixed) & {*PAIRED_KEYS, "split", "eval_split", "max_examples", "model", "gpus"})
    if own:
        raise SystemExit(f"--set {', '.join(own)}: set by the script's own options (--alphas, --seeds, --chains, "
                         "--split, --problems, --model, --gpus); leave it out")
    return fixed


def print_rows(rows: list[dict], alphas: dict, noise_at: list[int]) -> None:
    def points(value, signed: bool = False) -> str:
        return "—" if value is None else f"{100 * value:{'+' if signed else ''}.2f}"

    print(f"\n{'run':>5} {'method':<7}{'alpha':>6}{'seed':>5}  {'status':<10}{'accuracy':>9}  "
          f"{'power - greedy ± SE':<20}  SE at {'/'.join(map(str, noise_at))} problems")
    for row in rows:
        alpha = "" if row["alpha"] is None else f"{row['alpha']:g}"
        gap, at = "", ""
        if "power_minus_greedy" in row:
            gap = f"{points(row['power_minus_greedy'], True)} ± {points(row['standard_error'])}"
            at = "/".join(points(value) for value in row["standard_error_at"].values())
        print(f"{row['run'] or '—':>5} {row['method'] or '—':<7}{alpha:>6}{row['seed']!s:>5}  {row['status']!s:<10}"
              f"{points(row['accuracy']):>9}  {gap:<20}  {at}")
    for alpha, entry in alphas.items():
        spread = {name: "" if entry[f"{name}_sd"] is None else f" ± {points(entry[f'{name}_sd'])}"
                  for name in ("accuracy", "power_minus_greedy")}
        print(f"alpha {float(alpha):g}, seeds {entry['seeds']}: accuracy {points(entry['accuracy_mean'])}"
              f"{spread['accuracy']}, power - greedy {points(entry['power_minus_greedy_mean'], True)}"
              f"{spread['power_minus_greedy']}")
    print("in points; SE: the standard error from the per-problem differences; ± over the seeds: their sample "
          "standard deviation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__ + "\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alphas", default="4,16", help="power sampling's alphas (p^alpha)")
    parser.add_argument("--seeds", default="0,1,2", help="the power runs' seeds (greedy runs at the first)")
    parser.add_argument("--chains", type=int, default=4, help="power sampling's chains (answers) a problem")
    parser.add_argument("--problems", type=int, default=500, help="problems scored (max_examples)")
    parser.add_argument("--split", default="validation", help="validation (default), or test: a reading, not a choice")
    parser.add_argument("--gpus", default=None, help="every run's gpus setting (default: gpuscale's, all)")
    parser.add_argument("--model", default=None, help="every run's model (default: the recipe's, tiny-math)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of every run")
    parser.add_argument("--noise-at", default=NOISE_AT, help="problem counts to give the standard error at")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a fresh folder)")
    parser.add_argument("--json", "--out", dest="out", default=None,
                        help="the result file (default: bench/results/power_sampling/power-vs-greedy-DATE-CARD.json)")
    parser.add_argument("--from-home", default=None, metavar="HOME", help="run nothing: pair the home's runs")
    parser.add_argument("--card", default=None, metavar="'N x NAME'",
                        help="with --from-home: the cards the runs ran on (default: this machine's)")
    args = parser.parse_args()

    alphas = numbers(args.alphas, float, "--alphas")
    seeds = numbers(args.seeds, int, "--seeds")
    noise_at = numbers(args.noise_at, int, "--noise-at")
    if not alphas or not seeds:
        raise SystemExit("--alphas and --seeds: give at least one each")
    fixed = parse_sets(args.set)
    common = {"split": args.split, "max_examples": str(args.problems), **fixed,
              **({"model": args.model} if args.model else {}), **({"gpus": args.gpus} if args.gpus else {})}
    greedy_job = ("greedy", {**common, "method": "greedy"}, seeds[0])
    power_jobs = [(f"power-alpha{alpha:g}", {**common, "method": "power", "alpha": f"{alpha:g}",
                                             "chains": str(args.chains)}, seed) for seed in seeds for alpha in alphas]
    reading = reading_of(args.split)
    print(f"power sampling against greedy on {args.problems} {args.split} problems: {reading}", flush=True)

    started = time.perf_counter()
    if args.from_home:
        home = Path(args.from_home).resolve()
        store, greedy, powers = stored_jobs(home, greedy_job, power_jobs)
    else:
        home = Path(args.home or ROOT / ".power-vs-greedy" / time.strftime("%Y%m%d-%H%M%S")).resolve()
        store, greedy, powers = run_jobs(home, greedy_job, power_jobs)
    rows = compared(greedy, powers, store.results, noise_at)
    alpha_figures = by_alpha(rows)
    print_rows(rows, alpha_figures, noise_at)
    seconds = None if args.from_home else time.perf_counter() - started
    write_result("power_sampling", "power-vs-greedy",
                 {"problems": args.problems, "split": args.split, "reading": reading, "alphas": alphas,
                  "chains": args.chains, "seeds": seeds, "gpus": args.gpus, "model": args.model, "set": args.set,
                  "noise_at": noise_at, "from_home": args.from_home,
                  "run_settings": {k: v for k, v in (greedy.get("settings") or {}).items() if k not in NOT_COMPARED}},
                 {"greedy": rows[0], "runs": rows, "by_alpha": alpha_figures, "seconds": seconds, "home": str(home),
                  "note": f"per problem: power's share of its {args.chains} chains correct minus greedy's 0/1; "
                          "power_minus_greedy their mean over the problems (= the accuracies' difference), "
                          "standard_error their sample sd / sqrt(problems), standard_error_at the same sd / sqrt(N); "
                          "by_alpha: mean and sample sd over the seeds. Greedy is deterministic (one run)."},
                 out=args.out, card=parse_card(args.card))


if __name__ == "__main__":
    main()
