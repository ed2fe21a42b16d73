"""What every recipe's run summary opens with (`summary_opening`)."""

from __future__ import annotations

from gpuscale.data.tasks import test_split_scored


def summary_opening(ctx, settings=None, *, train: list | None = None, held_out: list | None = None) -> dict:
    """The figures a run's summary opens with, written here once for every recipe: its ranks
    (`world_size`) and `dtype`; with `train`, the `train_examples` it trains on; with `held_out`, the
    `eval_split` (of `settings`), tiny-math's `test_split` by name where it is a test split, and the
    `eval_examples` it is scored on. Each is a figure of the catalogue, data/figures.py."""

    opening = {"world_size": ctx.world_size, "dtype": str(ctx.dtype).removeprefix("torch.")}
    if train is not None:
        opening["train_examples"] = len(train)
    if held_out is not None:
        opening.update(eval_split=settings.eval_split, **test_split_scored(settings.dataset, settings.eval_split),
                       eval_examples=len(held_out))
    return opening
