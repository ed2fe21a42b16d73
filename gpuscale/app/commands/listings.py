"""`gpuscale recipes`, `gpus`, `models` and `data export`: what this machine and gpuscale offer."""

from __future__ import annotations

import argparse
import json

from gpuscale.app.commands.common import JSON_HELP, BadInput, Parser, print_table
from gpuscale.app.views.text import format_number, memory_text, setting_text
from gpuscale.control import telemetry
from gpuscale.data.splits import OLD_TEST_SPLIT_HELP, SPLITS
from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.runs.devices import usable_cores


def cmd_recipes(args: argparse.Namespace) -> int:
    recipes = all_recipes()
    if args.json:
        print(json.dumps([
            {"name": r.name, "summary": r.summary, "launcher": r.launcher,
             "settings": r.settings_cls.model_json_schema()}
            for r in recipes.values()
        ], indent=2))
        return 0
    print_table([["RECIPE", "SUMMARY"]] + [[r.name, r.summary] for r in recipes.values()])
    for recipe in recipes.values():
        print(f"\n{recipe.name} settings (--set NAME=VALUE):")
        print_table([["  NAME", "DEFAULT", "DESCRIPTION"]] + [
            [f"  {name}", default_text(field.default), field.description or ""]
            for name, field in recipe.settings_cls.model_fields.items()])
    return 0


def default_text(value) -> str:
    """A setting's default as it is typed after --set (`true`, not `True`)."""
    return str(value).lower() if isinstance(value, bool) else setting_text(value)


def cmd_gpus(args: argparse.Namespace) -> int:
    gpus = telemetry.list_gpus()
    if args.json:
        print(json.dumps(gpus, indent=2))
        return 0
    if not gpus:
        print(f"no NVIDIA GPU found (NVML unavailable); runs use CPU ranks on gloo ({usable_cores()} cores)")
        return 0
    rows = [["GPU", "NAME", "MEMORY USED / TOTAL", "UTIL"]]
    for g in gpus:
        rows.append([str(g["index"]), g["name"], memory_text(g["mem_used_mb"], g["mem_total_mb"]),
                     f"{g['util']}%" if g["util"] is not None else "-"])
    print_table(rows)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from gpuscale.data.models import describe_models

    models = describe_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print_table([["MODEL", "ARCHITECTURE", "PARAMETERS", "PATH"]] + [
        [m["name"], str(m["architecture"] or "-"), format_number(m["parameters"]) if m["parameters"] else "-",
         str(m["path"] or "(built from its config)")]
        for m in models
    ])
    return 0


def cmd_data_export(args: argparse.Namespace) -> int:
    from gpuscale.data.tasks import load_examples

    if args.limit is not None and args.limit < 0:
        raise BadInput(f"limit: {args.limit}: must be 0 or more")
    for example in load_examples(args.name, args.split, args.limit, seed=args.seed):
        print(json.dumps({"question": example["question"], "answer": example["answer"],
                          **({"domain": example["domain"]} if example.get("domain") else {})}))
    return 0


def add_recipes_parser(sub) -> None:
    p = sub.add_parser("recipes", help="the recipes and their settings")
    p.add_argument("--json", action="store_true", help="print them as JSON, with every setting's schema")
    p.set_defaults(func=cmd_recipes)


def add_gpus_parser(sub) -> None:
    p = sub.add_parser("gpus", help="this machine's GPUs now")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_gpus)


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="the models known by name (and any hub id or local path works)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_models)


def add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="data sets")
    data = p.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    p = data.add_parser("export", help="a data set as JSON lines (question, answer)")
    p.add_argument("name", help="tiny-math[:DOMAIN,...], tiny-math-conflict, gsm8k, or a .jsonl file")
    p.add_argument("--split", default="test", choices=SPLITS,
                   help=f"which split (default test; {OLD_TEST_SPLIT_HELP})")
    p.add_argument("--limit", type=int, help="at most this many examples")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed, as a run's `seed` setting (default 0)")
    p.set_defaults(func=cmd_data_export)


PARSERS = {"recipes": add_recipes_parser, "gpus": add_gpus_parser, "models": add_models_parser,
           "data": add_data_parser}
