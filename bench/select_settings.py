"""Choose learning settings on the validation split, never on the test problems.

Every candidate (a set of settings) runs once per seed through `gpuscale run --set eval_split=validation`: the
run scores eval_examples validation problems, never trained on (tiny-math's validation split: the same for
every seed, none a pretraining problem of the embedded model; other data: the first problems of the training
data, held out of training) (recipes/shared/training_data.py's split; the summary's `eval_split` says so, and a run
whose summary does not is counted as failed). Where the data has a validation split of its own (tiny-math,
tiny-math-conflict) eval_examples is all of it (2,000) unless --set or a candidate gives it, as the
acceptance check scores all of the test split: on the recipes' default 500, grpo-mtl's selection scored 143
comparison problems on which the base model was 11.7 points weaker than on the rest of validation, and saw a
comparison gain of +6.3 where the test saw +0.7 (bench/split_composition.py, RESULTS.md). Scoring is not
learning: it trains on the same problems. Runs share the machine (`--jobs` at a time); with `--one-gpu-
each` each run gets one GPU (`--gpus K,`), round-robin over the GPUs. More runs at once than GPUs share a
card through MPS where it starts (`--share-card`, as bench/acceptance.py: its `card_sharing` says why). Runs
save no model unless `--set save_model=true`: the chosen settings are then run again with eval_split=test,
once, for the figures to report.

The table: per candidate, the seeds that succeeded, and over them the mean ± sd (sample standard
deviation, in points) of validation accuracy greedy and at temperature 1 after training
(`accuracy_greedy_after`, `accuracy_sampled_after`) and of their gains (after - before).

The rule (`choose`): among the candidates whose every seed succeeded and whose mean greedy accuracy
after training is not below its mean before (greedy gain >= 0), overall and in every domain where the
data has domains (grpo-mtl's target asks that of every domain), the one with the highest mean
temperature-1 accuracy after training; a tie goes to the higher mean greedy accuracy after, then to
the candidate listed first. If no candidate passes, none is chosen (the table still says how each did).
Where some of them also reach the recipe's greedy floors on validation (`--floors`, by default
bench/acceptance.py's TARGETS: the mean gain overall, and in every domain where the target has a domain
floor), the choice is among those alone: the greedy target comes first, temperature 1 second. Why: by T=1
alone, grpo-mtl's selection of 2026-11-29 chose 64 prompts x 4 completions over 16 x 16, and the test split's
comparison domain then fell from +4.0 to +0.0-0.8, under its +2 floor (bench/RESULTS.md).

Written with bench/record.py to bench/results/<recipe>/selection-<date>-<card>.json.

Usage: python bench/select_settings.py --recipe eggroll --candidates "precision=bf16;precision=fp32"
       [--seeds 0,1,2] [--gpus N|all|0,1,...] [--one-gpu-each] [--jobs N] [--set key=value ...]

Quick check on CPU (2 candidates x 2 seeds of eggroll at tiny sizes, about a minute on 2 cores; the
figures mean nothing, 2 ES steps change little):
    OMP_NUM_THREADS=1 python bench/select_settings.py --recipe eggroll --candidates "lr=0.3;lr=0.1" \\
        --seeds 0,1 --jobs 2 --set population=4 --set prompts_per_step=2 --set max_new_tokens=48 \\
        --set steps=2 --set eval_examples=8 --set eval_every=0 --set batch_size=8
"""

from __future__ import annotations

import argparse
import math
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance import (  # noqa: E402
    ACCURACIES,
    TARGETS,
    card_sharing,
    domain_figures,
    launch,
    run_label,
    seed_statistics,
    shared_threads,
    stored_runs,
    stored_wall_s,
)
from record import ROOT, parse_card, write_result  # noqa: E402

from gpuscale.data.scoring import NEW_SUBSET  # noqa: E402
from gpuscale.runs.settings import SettingsError, parse_assignments  # noqa: E402

RULE = ("among candidates whose every seed succeeded and whose mean greedy validation accuracy after training is "
        "not below before, overall and in every domain (where the data has domains), the highest mean "
        "temperature-1 validation accuracy after training; ties: the higher mean greedy accuracy after, then the "
        "candidate listed first; where some candidates also reach the greedy floors (mean gain overall and in every "
        "domain), among those alone")


def parse_pairs(text: str, where: str) -> dict[str, str]:
    """"a=1,b=2" -> {"a": "1", "b": "2"}; SystemExit naming `where` on a malformed pair."""
    pairs = {}
    for part in text.split(","):
        key, equals, value = part.strip().partition("=")
        if not equals or not key.strip():
            raise SystemExit(f"{where}: {part.strip()!r} is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def parse_set_items(items: list[str]) -> dict[str, str]:
    """--set's items, one key=value each (a value may hold commas: lora_targets=q_proj,v_proj), read as
    `gpuscale run --set` reads them; a bad one ends the script with its line."""
    try:
        return parse_assignments(items)
    except SettingsError as error:
        raise SystemExit(str(error)) from None


def parse_candidates(text: str) -> list[tuple[str, dict[str, str]]]:
    """"a=1,b=2;a=3" -> [("a=1,b=2", {...}), ("a=3", {...})]: the label is the candidate as written."""
    candidates = []
    for part in text.split(";"):
        if part.strip():
            settings = parse_pairs(part, "--candidates")
            candidates.append((",".join(f"{k}={v}" for k, v in settings.items()), settings))
    if not candidates:
        raise SystemExit("--candidates: give at least one, e.g. \"lr=0.3;lr=0.1\"")
    if len({label for label, _ in candidates}) != len(candidates):
        raise SystemExit("--candidates: a candidate is listed twice")
    return candidates


def whole_validation(settings: dict[str, str], default_dataset: str) -> dict[str, str]:
    """A run's settings with eval_examples, where neither --set nor the candidate gives it, every problem of
    its data's own validation split (data/tasks.py's `validation_split_size`: the module's docstring says why);
    data whose validation is carved from its training data keeps the recipe's default."""
    from gpuscale.data.tasks import validation_split_size

    size = validation_split_size(settings.get("dataset", default_dataset))
    return settings if "eval_examples" in settings or size is None else {**settings, "eval_examples": str(size)}


def row_of(result: dict) -> dict:
    """One run's line: its status (a run not scored on validation counts as failed) and figures."""
    run = result["run"]
    summary = run.get("summary") or {}
    status = run.get("status")
    error = run.get("error")
    if status == "succeeded" and summary.get("eval_split") != "validation":
        status, error = "not-validation", f"the summary's eval_split is {summary.get('eval_split')!r}"
    return {"label": result["label"], "seed": result["seed"], "run_id": run.get("id"), "status": status,
            "error": error, "wall_s": round(result["wall_s"], 1), "eval_split": summary.get("eval_split"),
            "eval_examples": summary.get("eval_examples"),
            **{name: summary.get(name) for name in ACCURACIES}, "domains": domain_figures(summary), "accuracy": None}


def stored_rows(home: Path, candidates: list[tuple[str, dict]], seeds: list[int]) -> list[dict]:
    """The rows of a selection's runs as its GPUSCALE_HOME holds them, found by the label each run was
    given (the newest of each); a run that did not end keeps its status (`running`, `lost`)."""
    newest = stored_runs(home)
    return [row_of({"label": label, "seed": seed, "wall_s": stored_wall_s(run), "run": run})
            for seed in seeds for label, _settings in candidates
            if (run := newest.get(run_label("select", label, seed))) is not None]


def candidate_table(candidates: list[tuple[str, dict]], rows: list[dict], seeds: list[int]) -> list[dict]:
    """Per candidate: its settings, the seeds that succeeded, and mean ± sd over them (seed_statistics
    of bench/acceptance.py, on the succeeded runs only)."""
    ok = [row for row in rows if row["status"] == "succeeded"]
    stats = seed_statistics(ok)
    return [{"candidate": label, "settings": settings,
             "seeds_ok": sorted(row["seed"] for row in ok if row["label"] == label), "seeds": seeds,
             "statistics": stats.get(label, {})} for label, settings in candidates]


def choose(table: list[dict], floors: tuple[float, float | None] | None = None) -> str | None:
    """The candidate the rule of the module's docstring picks (RULE), or None. `floors`: (overall, per domain or
    None) greedy gains in points, as TARGETS gives them."""
    def mean(entry: dict, name: str) -> float | None:
        figure = entry["statistics"].get(name) or {}
        return figure.get("mean") if figure.get("n") == len(entry["seeds"]) else None

    eligible = []
    for entry in table:
        sampled, greedy, gain = (mean(entry, name) for name in ("accuracy_sampled_after", "accuracy_greedy_after",
                                                                 "gain_greedy"))
        domain_gains = {name: mean(entry, name) for name in entry["statistics"] if name.startswith("gain_greedy_")}
        gains = [gain, *domain_gains.values()]
        if len(entry["seeds_ok"]) == len(entry["seeds"]) and None not in (sampled, greedy, *gains) and min(gains) >= 0:
            # The structurally new subset is no domain (acceptance.py's greedy_verdict): no floor of its own.
            in_domains = [value for name, value in domain_gains.items() if name != f"gain_greedy_{NEW_SUBSET}"]
            eligible.append((sampled, greedy, entry["candidate"], reaches(gain, in_domains, floors)))
    if not eligible:
        return None
    at_floors = [item for item in eligible if item[3]]
    return max(at_floors or eligible, key=lambda item: (item[0], item[1]))[2]


def over_first(table: list[dict]) -> dict[str, dict]:
    """Per candidate after the first (today's default, where the call lists it first): its mean T=1 accuracy after
    training minus the first's, in points, and that difference over its standard error from the seeds' spreads
    (sqrt(sd_a^2/n_a + sd_b^2/n_b)): how far 3 seeds tell the two apart. The rule does not read it; the table shows it
    (bench/RESULTS.md: most defaults moved on less than 2 standard errors)."""
    def figure(entry: dict) -> dict | None:
        found = entry["statistics"].get("accuracy_sampled_after") or {}
        return found if found.get("n") else None

    first = figure(table[0]) if table else None
    apart = {}
    for entry in table[1:]:
        mine = figure(entry)
        if first is None or mine is None:
            continue
        error = math.sqrt(first["sd"] ** 2 / first["n"] + mine["sd"] ** 2 / mine["n"])
        difference = mine["mean"] - first["mean"]
        apart[entry["candidate"]] = {"t1_points": round(100 * difference, 1),
                                     "standard_errors": round(difference / error, 1) if error else None}
    return apart


def reaches(gain: float, domain_gains: list[float], floors: tuple[float, float | None] | None) -> bool:
    """Whether mean greedy gains (fractions) reach floors given in points, rounded as shown (as acceptance.py)."""
    if floors is None:
        return False
    overall, per_domain = floors
    return (round(100 * gain, 1) >= overall
            and (per_domain is None or all(round(100 * value, 1) >= per_domain for value in domain_gains)))


def print_table(table: list[dict], rows: list[dict], chosen: str | None,
                floors: tuple[float, float | None] | None = None) -> None:
    def figure(entry: dict, name: str, signed: bool = False) -> str:
        found = entry["statistics"].get(name) or {}
        if not found.get("n"):
            return "—"
        return f"{100 * found['mean']:{'+' if signed else ''}.1f} ± {100 * found['sd']:.1f}"

    width = max(len("candidate"), *(len(entry["candidate"]) for entry in table)) + 2
    apart = over_first(table)

    def versus_first(entry: dict) -> str:
        found = apart.get(entry["candidate"])
        if found is None:
            return "—"
        errors = "" if found["standard_errors"] is None else f" ({found['standard_errors']:+.1f} se)"
        return f"{found['t1_points']:+.1f}{errors}"

    print(f"\n{'candidate':<{width}}{'seeds ok':>9}{'greedy after':>16}{'greedy gain':>16}"
          f"{'T=1 after':>16}{'T=1 gain':>16}{'T=1 vs first':>18}")
    for entry in table:
        mark = "  <- chosen" if entry["candidate"] == chosen else ""
        print(f"{entry['candidate']:<{width}}{len(entry['seeds_ok']):>5}/{len(entry['seeds']):<3}"
              f"{figure(entry, 'accuracy_greedy_after'):>16}{figure(entry, 'gain_greedy', True):>16}"
              f"{figure(entry, 'accuracy_sampled_after'):>16}{figure(entry, 'gain_sampled', True):>16}"
              f"{versus_first(entry):>18}{mark}")
        domains = [name for name in entry["statistics"] if name.startswith("gain_greedy_")]
        if domains:
            print("    greedy gain by domain: " + ", ".join(
                f"{name.removeprefix('gain_greedy_')} {figure(entry, name, True)}" for name in domains))
    for row in rows:
        if row["status"] != "succeeded":
            print(f"  {row['label']} seed {row['seed']}: {row['status']}: {row['error']}")
    print("\nvalidation accuracy in %, mean ± sd over the seeds that succeeded; T=1 vs first: points over the first "
          "candidate, and in standard errors of that difference (se) from the seeds' spreads")
    print(f"rule: {RULE}; floors (points): {floors or 'none'}")
    print(f"chosen: {chosen}" if chosen else "chosen: none (no candidate passes the rule)")


def parse_floors(text: str | None, recipe: str) -> tuple[float, float | None] | None:
    """--floors: 'none', 'OVERALL' or 'OVERALL,DOMAIN' in points; None: the recipe's TARGETS entry."""
    if text is None:
        return TARGETS.get(recipe)
    if text == "none":
        return None
    try:
        parts = [float(part) for part in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise SystemExit(f"--floors: {text!r}: not OVERALL, OVERALL,DOMAIN (points) nor none")
    return (parts[0], parts[1] if len(parts) == 2 else None)


def gpu_indices(gpus: str | None) -> list[int]:
    """`--one-gpu-each`: the GPUs to spread the runs over: those --gpus lists, else every GPU found."""
    if gpus and "," in gpus:
        indices = [int(part) for part in gpus.split(",") if part.strip()]
    elif gpus and gpus.strip().isdigit():
        indices = list(range(int(gpus)))
    else:
        import torch

        indices = list(range(torch.cuda.device_count()))
    if not indices:
        raise SystemExit("--one-gpu-each: no GPU found (give indices with --gpus 0,1,...)")
    return indices


BASELINE = """No baseline: it chooses among candidate settings on the validation split; nothing is compared with
other code."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="a training recipe: sft, rft, grpo-mtl or eggroll")
    parser.add_argument("--candidates", required=True,
                        help="';'-separated candidates, each key=value[,key=value] (so no value with a comma: "
                        "put such a setting in --set)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--gpus", default=None, help="GPUs per run (default: every GPU found; CPU: 1 rank); "
                        "with --one-gpu-each, indices to spread the runs over")
    parser.add_argument("--one-gpu-each", action="store_true",
                        help="pin each run to one GPU (--gpus K,), round-robin over the GPUs")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs at once (default: one per GPU with --one-gpu-each, else 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every run (a candidate's own settings may not repeat it)")
    parser.add_argument("--share-card", choices=("auto", "mps", "time-slicing"), default="auto",
                        help="how runs that share a card share it (default auto: through MPS where runs share a card "
                        "and nvidia-cuda-mps-control starts; bench/acceptance.py's `card_sharing` says why)")
    parser.add_argument("--floors", default=None, metavar="OVERALL[,DOMAIN]|none",
                        help="greedy-gain floors in points that the rule prefers (default: the recipe's target in "
                        "bench/acceptance.py's TARGETS; none: T=1 alone among the eligible)")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a fresh folder)")
    parser.add_argument("--out", default=None, help="the result file (default: bench/results/<recipe>/selection-...)")
    parser.add_argument("--from-home", default=None, metavar="HOME",
                        help="run nothing: the table and choice of the runs a selection's GPUSCALE_HOME holds (a "
                        "selection cut by a time limit: a run that did not end counts as not succeeded)")
    parser.add_argument("--card", default=None, metavar="'N x NAME'",
                        help="with --from-home: the cards the home's runs ran on, recorded as the result's "
                        "card (default: this machine's)")
    args = parser.parse_args()

    from gpuscale.recipes.shared.registry import get_recipe

    try:
        recipe = get_recipe(args.recipe)
    except Exception as error:  # an unknown name: the registry's message lists the known ones
        raise SystemExit(f"--recipe: {error}") from None
    if "eval_split" not in recipe.settings_cls.model_fields or \
            "accuracy_sampled_after" not in recipe.promised_figures:
        raise SystemExit(f"--recipe {args.recipe}: chooses learning settings, which needs a recipe that trains and "
                         "scores held-out problems before and after (sft, rft, grpo-mtl, eggroll)")
    candidates = parse_candidates(args.candidates)
    floors = parse_floors(args.floors, args.recipe)
    fixed = parse_set_items(args.set)
    for key in ("eval_split", "seed"):  # what the script sets in every run itself
        if key in fixed or any(key in settings for _, settings in candidates):
            raise SystemExit(f"{key}: set by the script (eval_split=validation, seed from --seeds); leave it out")
    if args.jobs is not None and args.jobs < 1:
        raise SystemExit("--jobs: at least 1")
    for label, settings in candidates:
        if set(settings) & set(fixed):
            raise SystemExit(f"--candidates {label}: {', '.join(sorted(set(settings) & set(fixed)))} is also in --set")
    fixed.setdefault("save_model", "false")
    seeds = [int(seed) for seed in args.seeds.split(",")]

    cards = 1  # the GPUs the runs at once are spread over: more runs than that share a card
    if args.one_gpu_each:  # slot s runs on GPU indices[s % count]: `--gpus K,`, one GPU as a list of indices
        indices = gpu_indices(args.gpus)
        jobs = args.jobs or len(indices)
        slots = [f"{indices[slot % len(indices)]}," for slot in range(jobs)]
        cards = len(indices)
    else:
        jobs = args.jobs or 1
        if args.gpus:
            gpus = args.gpus
        else:
            import torch

            gpus = str(torch.cuda.device_count() or 1)
        slots = [gpus] * jobs
    free: queue.Queue[str] = queue.Queue()
    for slot in slots:
        free.put(slot)
    home = Path(args.home or ROOT / ".selection" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    dataset = recipe.settings_cls.model_fields["dataset"].default
    runs = [(label, whole_validation({**fixed, **settings, "eval_split": "validation"}, dataset), seed)
            for seed in seeds for label, settings in candidates]

    def run_one(job) -> dict:
        label, settings, seed = job
        gpus = free.get()  # a slot (with --one-gpu-each: a GPU) for this run alone
        try:
            row = row_of(launch(label, args.recipe, {**settings, "gpus": gpus}, seed, home, prefix="select"))
        finally:
            free.put(gpus)
        print(f"{label} seed {seed}: {row['status']} ({row['wall_s']:.0f} s)", flush=True)
        return {**row, "gpus": gpus}

    started = time.perf_counter()
    sharing = None
    if args.from_home:
        home = Path(args.from_home).resolve()
        rows = stored_rows(home, candidates, seeds)
    else:
        import torch

        shared_threads(jobs)
        with card_sharing(args.share_card, shared=torch.cuda.is_available() and jobs > cards) as sharing:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                rows = list(pool.map(run_one, runs))
    rows.sort(key=lambda row: ([c for c, _ in candidates].index(row["label"]), row["seed"]))
    table = candidate_table(candidates, rows, seeds)
    chosen = choose(table, floors)
    print_table(table, rows, chosen, floors)
    total = time.perf_counter() - started
    if args.from_home:  # the runs' own wall times are in the table; the script timed nothing
        print(f"\nselection: {len(rows)} runs read from GPUSCALE_HOME {home}")
    else:
        print(f"\nselection: {len(rows)} runs in {total:.0f} s, {jobs} at a time (GPUSCALE_HOME {home})")
    write_result(args.recipe.replace("-", "_"), "selection",
                 {"recipe": args.recipe, "candidates": args.candidates, "seeds": args.seeds, "set": args.set,
                  "gpus": args.gpus, "one_gpu_each": args.one_gpu_each, "jobs": jobs, "eval_split": "validation",
                  "rule": RULE, "floors": floors, "card_sharing": sharing},
                 {"candidates": table, "chosen": chosen, "t1_over_first": over_first(table), "runs": rows,
                  "seconds": None if args.from_home else total,
                  "home": str(home)},
                 out=args.out, card=parse_card(args.card))



if __name__ == "__main__":
    main()
