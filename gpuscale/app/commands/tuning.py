"""`gpuscale tune`: a recipe's trials on one device, the table and the choice printed and stored for
`--batch-size auto` (the trials are recipes/shared/device_trials.py's, in this process)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from gpuscale.app.commands.common import BadInput, add_setting_options, print_table, settings_from_args
from gpuscale.app.views.text import format_number
from gpuscale.control import launch
from gpuscale.control.store import Store
from gpuscale.data.precision import RESOLVED_PRECISIONS
from gpuscale.recipes.shared.registry import get_recipe


def cmd_tune(args: argparse.Namespace) -> int:
    """Trials on one device (the first of --gpus; the CPU where there is none), the table and the
    choice printed and stored, for `--batch-size auto` to find later."""
    from gpuscale.app.batch_choice import pick_device

    if not 0 < args.memory_cap <= 1:
        raise BadInput(f"memory-cap: {args.memory_cap}: a share of the card's memory, above 0 and at most 1")
    if (args.max_batch is not None and args.max_batch < 1) or (args.start is not None and args.start < 1):
        raise BadInput(f"max-batch/start: {args.max_batch}/{args.start}: both must be at least 1")
    recipe, settings = tune_settings_from_args(args)
    if recipe.tuning is None:
        raise BadInput(f"recipe: {recipe.name!r}: cannot be tuned (it declares no trial)")
    device = pick_device(launch.plan_devices(settings.gpus).gpu_indices)
    store = Store()
    precisions = [settings.precision]
    if args.precision_search:
        precisions = [p for p in RESOLVED_PRECISIONS
                      if p != "fp16" or device.index is not None]  # fp16 on CPU: slow, never the best
    outcomes = [tune_once(recipe, settings.model_copy(update={"precision": p}), device, store, args)
                for p in precisions]
    best = max((o for o in outcomes if o.result.chosen), key=lambda o: o.result.chosen.throughput, default=None)
    if args.compile_search and best is not None:
        compare_compile(recipe, settings.model_copy(update={"precision": best.key.precision}), device, best, args)
    if args.json:
        print(json.dumps([{**o.key.as_dict(), "chosen": o.result.batch_size, "stopped": o.result.stopped,
                           "seconds": o.seconds, "trials": [t.as_dict() for t in o.result.trials]}
                          for o in outcomes], indent=2))
    return 0 if best is not None else 1


def tune_settings_from_args(args: argparse.Namespace):
    if args.settings_json:  # `--batch-size auto` hands its run's settings over as they are
        recipe = get_recipe(args.recipe)
        return recipe, recipe.settings_cls.model_validate_json(Path(args.settings_json).read_text())
    return settings_from_args(args)


def tune_once(recipe, settings, device, store: Store, args: argparse.Namespace):
    from gpuscale.app.batch_choice import outcome_record, trial_line, trial_rows
    from gpuscale.recipes.shared.device_trials import default_max_batch, tune_recipe

    figure = recipe.tuning.figure
    max_batch = args.max_batch or default_max_batch(recipe, settings, on_gpu=device.index is not None)
    print(f"tuning {recipe.name} ({recipe.tuning.knob}) on {device.name}, precision {settings.precision}, "
          f"memory cap {args.memory_cap:.0%}, batches up to {max_batch}", file=sys.stderr)
    count = {"trials": 0}

    def progress(trial) -> None:
        count["trials"] += 1
        print(trial_line(count["trials"], trial, figure), file=sys.stderr, flush=True)

    outcome = tune_recipe(recipe, settings, device, memory_cap=args.memory_cap, max_batch=max_batch,
                          start=args.start, progress=progress)
    out = sys.stderr if args.json else sys.stdout
    with contextlib.redirect_stdout(out):
        print_table(trial_rows([t.as_dict() for t in outcome.result.trials], figure))
    chosen = outcome.result.chosen
    print(f"doubling stopped: {outcome.result.stopped}; {count['trials']} trials in {outcome.seconds:.1f} s",
          file=out)
    if chosen is None:
        print(f"no batch fitted under {args.memory_cap:.0%} of {device.name}'s memory; nothing stored", file=out)
        return outcome
    if outcome.result.warning:
        print(f"warning: {outcome.result.warning}", file=sys.stderr)
    store.save_tuning(outcome.key.as_dict(), **outcome_record(outcome, figure))
    print(f"chosen: batch {chosen.batch_size}, {format_number(chosen.throughput)} {figure}, "
          f"{chosen.peak_memory_bytes / 1e9:.2f} GB peak of {outcome.memory_total_bytes / 1e9:.1f} GB "
          f"({outcome.key.precision}); stored: `--batch-size auto` uses it for this model and shape", file=out)
    return outcome


def compare_compile(recipe, settings, device, best, args: argparse.Namespace) -> None:
    """The chosen batch measured again with `compile` flipped; the faster one is said (not applied)."""
    from gpuscale.recipes.shared.device_trials import tune_recipe

    batch = best.result.chosen.batch_size
    flipped = tune_recipe(recipe, settings.model_copy(update={"compile": not settings.compile}), device,
                          memory_cap=args.memory_cap, max_batch=batch, start=batch)
    other = flipped.result.chosen
    out = sys.stderr if args.json else sys.stdout
    if other is None:
        print(f"compile={not settings.compile}: batch {batch} did not fit", file=out)
        return
    gain = other.throughput / best.result.chosen.throughput - 1
    print(f"compile={not settings.compile} at batch {batch}: {format_number(other.throughput)} {recipe.tuning.figure} "
          f"({gain:+.0%}); " + (f"add --set compile={str(not settings.compile).lower()}" if gain > 0.05
                                else f"keep compile={str(settings.compile).lower()}"), file=out)


def add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="find the throughput-best batch size on one GPU by short trials; stored "
                                    "for `--batch-size auto`")
    add_setting_options(p, gpus_help="the GPU to tune on, e.g. 3 or 3,4 (its first one); default the first GPU")
    p.add_argument("--max-batch", type=int, help="the largest batch tried (default: the run's work per rank "
                   "where the recipe knows it, e.g. power-sampling's max_examples over its ranks; at most 4096)")
    p.add_argument("--start", type=int, help="the first batch tried (default: the recipe's on a GPU, 1 on CPU)")
    p.add_argument("--memory-cap", type=float, default=0.9,
                   help="a batch whose peak memory passes this share of the card (of RAM on CPU) does not fit "
                        "(default 0.9)")
    *others, last = RESOLVED_PRECISIONS
    p.add_argument("--precision-search", action="store_true",
                   help=f"tune at {', '.join(others)} and {last} and compare")
    p.add_argument("--compile-search", action="store_true", help="measure the chosen batch with compile flipped")
    p.add_argument("--json", action="store_true", help="print the trials as JSON (the table goes to stderr)")
    p.add_argument("--settings-json", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_tune)


PARSERS = {"tune": add_tune_parser}
