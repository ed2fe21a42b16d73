"""The entry point of every rank: `python -m gpuscale.recipes --recipe NAME --settings FILE`.

torchrun or accelerate starts it once per rank (the supervisor itself, for a run of one process:
control/launch.py:launcher_argv); it finds the recipe in the registry and hands its
settings class and `run_on_device` (its `run`, device defaults resolved; `run_side_on_device` on a side
rank) to the rank side of the engines (engines/distributed.run_rank).

The rank starts with Python's cyclic garbage collector off: its imports make hundreds of thousands of
objects that live as long as it does, which the collector would otherwise go over again and again while
they are made. run_rank turns it on again once the rank's world is set up and the recipe's `rank_imports`
are made, with what the imports made frozen (engines/distributed.py:freeze_imports says why)."""

from __future__ import annotations

import argparse
import gc
import sys


def main(argv: list[str] | None = None) -> None:
    gc.disable()
    from gpuscale.recipes.shared.registry import get_recipe

    parser = argparse.ArgumentParser(prog="python -m gpuscale.recipes")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--settings", required=True)
    args = parser.parse_args(argv)
    recipe = get_recipe(args.recipe)

    from gpuscale.engines.distributed import run_rank

    run_rank(recipe.settings_cls, recipe.run_on_device, args.settings, side=recipe.run_side_on_device,
             imports=recipe.rank_imports)


if __name__ == "__main__":
    main(sys.argv[1:])
