"""A count that a step shares out equally over the ranks, and what to do where it does not split.

Each rank takes an equal share of a step: sft's and rft's `rows_per_step`, grpo-mtl's completions
(`prompts_per_step x num_generations`), eggroll's `population` (in antithetic pairs). DDP pairs the ranks'
micro-batches and TRL's GRPO needs every rank's share of completions whole, so a count that does not split
would fail on the ranks, after the model is loaded. Before launch, each recipe states its counts as
`Split`s (`Recipe.rank_splits`) and `fit_splits` decides, for the run's rank count:

- a count that splits: nothing to do;
- a value the user gave (`settings.model_fields_set`: a `--set`, a preset, a changed form field): refused,
  one line naming the setting, its value and the nearest values that split, and the nearest rank counts
  that split it as it is, e.g. `prompts_per_step: 16: 16 prompts x 16 generations = 256 completions do
  not split over 3 GPUs (each takes an equal share of a step); use prompts_per_step 15 or 18, or 2 or 4
  GPUs`;
- a default the user did not give (a run asked for with nothing but `--gpus 3`): moved to the nearest value
  that splits (the lower on a tie), and said in one line, which the launch prints and the run's summary
  keeps (`fitted_to_ranks`). A count the rank resolves itself (eggroll's `population auto`) is fitted by
  the rank with the same rule (`Recipe.device_values_fitted`).

Pure arithmetic, no torch: the front end calls it (recipes' `check` and the launch), the ranks too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gpuscale.runs.settings import RunSettings, SettingsError

FITTED_TO_RANKS = "fitted_to_ranks"  # the summary's figure, and the run's note, of the defaults moved
MOST_RANKS_SUGGESTED = 8  # rank counts suggested instead go up to a full node's GPUs, or twice the asked


@dataclass(frozen=True)
class Split:
    """`field`'s value times `per_value` items, shared out over the ranks: the items must be a multiple of
    `multiple(ranks)` (the rank count; twice it, rounded to the least common multiple, for pairs).
    `items(value)` says what the items are, for the lines: "16 x num_generations 16 = 256 completions"."""

    field: str
    items: Callable[[int], str]
    per_value: int = 1
    multiple: Callable[[int], int] = lambda ranks: ranks

    def splits(self, value: int, ranks: int) -> bool:
        return (value * self.per_value) % self.multiple(ranks) == 0

    def step(self, ranks: int) -> int:
        """The spacing of the values that split: the multiple over what `per_value` already holds of it."""
        multiple = self.multiple(ranks)
        return multiple // math.gcd(self.per_value, multiple)


def ranks_text(count: int, on_gpu: bool) -> str:
    """`3 GPUs`, `1 GPU`, `2 ranks`: how a line names the ranks of a run."""
    noun = "GPU" if on_gpu else "rank"
    return f"{count} {noun}{'' if count == 1 else 's'}"


def each_rank(count: int) -> str:
    """`each of the 3 ranks`, `the one rank`: who takes a share, in a line."""
    return "the one rank" if count == 1 else f"each of the {count} ranks"


def nearest_fit(value: int, step: int) -> list[int]:
    """The multiples of `step` nearest to `value`, below (where one is at least `step`) and above."""
    below, above = (value // step) * step, -(-value // step) * step
    return sorted({v for v in (below, above) if v >= step})


def nearest_divisors(total: int, value: int) -> list[int]:
    """The divisors of `total` nearest to `value`, below and above (a micro-batch that divides a share)."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    below = [d for d in divisors if d < value][-1:]
    above = [d for d in divisors if d > value][:1]
    return below + above


def closest(value: int, candidates: list[int]) -> int:
    """The candidate nearest to `value`, the lower on a tie (a step no larger than asked)."""
    return min(candidates, key=lambda candidate: (abs(candidate - value), candidate))


def splitting_rank_counts(split: Split, value: int, ranks: int) -> list[int]:
    """The rank counts nearest to `ranks`, below and above, over which `value` splits as it is."""
    most = max(MOST_RANKS_SUGGESTED, 2 * ranks)
    below = [count for count in range(ranks - 1, 0, -1) if split.splits(value, count)][:1]
    above = [count for count in range(ranks + 1, most + 1) if split.splits(value, count)][:1]
    return below + above


def refusal(split: Split, value: int, ranks: int, on_gpu: bool) -> SettingsError:
    """`field: value: <items> do not split over <ranks>; use field A or B, or C or D <ranks>`."""
    uses = [f"{split.field} {' or '.join(map(str, nearest_fit(value, split.step(ranks))))}"]
    if counts := splitting_rank_counts(split, value, ranks):
        uses.append(" or ".join(map(str, counts[:-1])) + (" or " if counts[:-1] else "")
                    + ranks_text(counts[-1], on_gpu))
    return SettingsError(f"{split.field}: {value}: {split.items(value)} do not split over "
                         f"{ranks_text(ranks, on_gpu)} (each takes an equal share of a step); use {', or '.join(uses)}")


def fit_splits(settings: RunSettings, splits: list[Split], ranks: int, on_gpu: bool, adapt: bool = True,
               given: set[str] | None = None) -> tuple[RunSettings, list[str]]:
    """The settings with every split count fitted to `ranks`, and a line for each default moved. A value
    the user gave (`given`, by default `settings.model_fields_set`; or any value, with `adapt=False`: a
    run's check, where nothing may change any more) that does not split is refused (SettingsError,
    `refusal`). A count left at `auto` is the rank's to fit (`Recipe.device_values_fitted`)."""
    given = settings.model_fields_set if given is None else given
    lines = []
    for split in splits:
        value = getattr(settings, split.field)
        if not isinstance(value, int) or split.splits(value, ranks):
            continue
        if not adapt or split.field in given:
            raise refusal(split, value, ranks, on_gpu)
        fitted = closest(value, nearest_fit(value, split.step(ranks)))
        settings = settings.model_copy(update={split.field: fitted})
        lines.append(f"{split.field} {value} -> {fitted}: the default's {split.items(value)} do not split over "
                     f"{ranks_text(ranks, on_gpu)}; --set {split.field}=N chooses")
    return settings, lines
