"""Finding the throughput-best batch size by short trials: the search, as a pure function.

`search_batch_size(measure, ...)` calls `measure(batch_size) -> Trial` and decides what to try next:

1. Doubling from `start` until a trial runs out of memory, its peak memory passes `memory_limit_bytes`
   (a share of the card, 90% by default), throughput gains less than `min_gain` (5%) over the best so
   far, or `max_batch` is reached. Peers stop at "it fits"; the curve of throughput against batch
   flattens long before memory runs out (so it did when measured on an H200), so flattening stops it too.
2. Bisection near the best: the midpoint between the best and its tried neighbour above (which
   failed, passed the cap or was slower), and below too where the one above fitted but was slower
   (a peak between them), at most `refine_trials` trials, never twice at one batch.
3. Confirmation: the chosen batch is measured once more. A batch that fitted on its first trial can
   run out of memory on the next (the allocator's cache is fragmented by then, and a real run also
   keeps what earlier batches left): such a batch counts as not fitting, and the next best smaller
   one is chosen and confirmed in turn. A confirming trial well below the best smaller batch's
   measured throughput (CONFIRM_SLOWER_BY) means the first figure was luck or the machine got busy:
   the smaller batch, measured faster, is chosen instead and `TuneResult.warning` says so.

No torch here: `measure` is the recipe's trial (recipes/shared/device_trials.py turns an out-of-memory error into a
failed Trial), so the logic is tested against a simulated curve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

DEFAULT_MEMORY_CAP = 0.9  # of the card's memory (of the host's RAM on CPU)
DEFAULT_MIN_GAIN = 0.05  # doubling stops when throughput grows by less than this
DEFAULT_REFINE_TRIALS = 2
DEFAULT_MAX_BATCH = 4096
OUT_OF_MEMORY = "out of memory"
# A confirming trial this much slower than a smaller batch's trial contradicts the choice: trials on a
# busy machine swing by a few percent between runs, so below 10% it is noise and the larger batch stays.
CONFIRM_SLOWER_BY = 0.10


@dataclass(frozen=True)
class Trial:
    """One short trial at one batch size: throughput in the recipe's figure (problems/s, tokens/s...),
    the peak memory it took, the median seconds of a timed step; `failure` says why it did not run
    (out of memory) and then the figures are None. `phase` is the search phase it belongs to."""

    batch_size: int
    throughput: float | None = None
    peak_memory_bytes: int | None = None
    step_seconds: float | None = None
    failure: str | None = None
    phase: str = "double"
    over_cap: bool = False

    @property
    def fits(self) -> bool:
        return self.failure is None and not self.over_cap

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> Trial:
        return cls(**{key: row.get(key) for key in cls.__dataclass_fields__ if key in row})


@dataclass
class TuneResult:
    """Every trial in the order run, the chosen one (None when nothing fitted), and why doubling stopped."""

    trials: list[Trial] = field(default_factory=list)
    chosen: Trial | None = None
    stopped: str = ""
    warning: str | None = None  # one line when the confirmation contradicted the first choice

    @property
    def batch_size(self) -> int | None:
        return self.chosen.batch_size if self.chosen else None


def search_batch_size(
    measure: Callable[[int], Trial],
    *,
    memory_limit_bytes: float | None,
    start: int = 1,
    max_batch: int = DEFAULT_MAX_BATCH,
    min_gain: float = DEFAULT_MIN_GAIN,
    refine_trials: int = DEFAULT_REFINE_TRIALS,
    allowed: Sequence[int] | None = None,
    progress: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """The batch with the highest throughput that fits under `memory_limit_bytes` (None: no cap),
    found by doubling, bisection and one confirming trial (see the module's docstring). `allowed`
    restricts the batch sizes tried (a training recipe's divisors of its global batch); otherwise
    every integer from `start` to `max_batch`."""
    search = _Search(measure, memory_limit_bytes, min_gain, progress, max(1, start), max_batch,
                     _choices(allowed, start, max_batch))
    search.double()
    search.refine(refine_trials)
    search.confirm()
    return search.result


def _choices(allowed: Sequence[int] | None, start: int, max_batch: int) -> list[int] | None:
    if allowed is None:
        return None
    choices = sorted({size for size in allowed if 1 <= size <= max_batch})
    if not choices:
        raise ValueError(f"no allowed batch size up to {max_batch}")
    return choices


class _Search:
    def __init__(self, measure, memory_limit, min_gain, progress, start, max_batch, choices):
        self.measure, self.memory_limit, self.min_gain = measure, memory_limit, min_gain
        self.progress, self.start, self.max_batch, self.choices = progress, start, max_batch, choices
        self.result = TuneResult()
        self.failed_from: int | None = None  # the smallest batch seen not to fit

    # ---- one trial ----

    def run(self, batch_size: int, phase: str) -> Trial:
        trial = self.measure(batch_size)
        over = (self.memory_limit is not None and trial.failure is None and trial.peak_memory_bytes is not None
                and trial.peak_memory_bytes > self.memory_limit)
        trial = Trial(**{**trial.as_dict(), "batch_size": batch_size, "phase": phase, "over_cap": over})
        self.result.trials.append(trial)
        if not trial.fits:
            self.failed_from = min(batch_size, self.failed_from or batch_size)
        if self.progress:
            self.progress(trial)
        return trial

    def fitting(self) -> dict[int, Trial]:
        """The best fitting trial of each batch size never seen failing (nor any larger one failing)."""
        best: dict[int, Trial] = {}
        for trial in self.result.trials:
            if self.failed_from is not None and trial.batch_size >= self.failed_from:
                continue
            if trial.fits and (trial.batch_size not in best or trial.throughput > best[trial.batch_size].throughput):
                best[trial.batch_size] = trial
        return best

    def best(self) -> Trial | None:
        fitting = self.fitting()
        return max(fitting.values(), key=lambda t: t.throughput) if fitting else None

    # ---- the phases ----

    def double(self) -> None:
        size = self.first_size()
        while size is not None:
            previous = self.best()
            trial = self.run(size, "double")
            if not trial.fits:
                self.result.stopped = f"batch {size}: {trial.failure or 'over the memory cap'}"
                return
            if previous and trial.throughput < previous.throughput * (1 + self.min_gain):
                self.result.stopped = (f"batch {size}: throughput gained less than {self.min_gain:.0%} "
                                       f"over batch {previous.batch_size}")
                return
            size = self.next_double(size)
        self.result.stopped = "the largest batch allowed"

    def first_size(self) -> int:
        if self.choices:
            return next((c for c in self.choices if c >= self.start), self.choices[-1])
        return min(self.start, self.max_batch)

    def next_double(self, size: int) -> int | None:
        if self.choices:
            larger = [c for c in self.choices if c >= 2 * size] or [c for c in self.choices if c > size]
            return larger[0] if larger else None
        return None if size >= self.max_batch else min(2 * size, self.max_batch)

    def refine(self, trials: int) -> None:
        for _ in range(trials):
            candidate = self.next_midpoint()
            if candidate is None:
                return
            self.run(candidate, "refine")

    def next_midpoint(self) -> int | None:
        """The untried midpoint between the best and its nearest tried neighbour above; below it only
        where the neighbour above fitted but was slower (a peak between them). With nothing tried
        above (the largest batch allowed) there is nothing to refine."""
        best = self.best()
        if best is None:
            return None
        tried = sorted({t.batch_size for t in self.result.trials})
        above = [size for size in tried if size > best.batch_size]
        below = [size for size in tried if size < best.batch_size]
        neighbours = [above[0]] if above else []
        if above and below and above[0] in self.fitting():
            neighbours.append(below[-1])
        for neighbour in neighbours:
            middle = self.snap((best.batch_size + neighbour) / 2, best.batch_size, neighbour)
            if middle is not None and middle not in tried:
                return middle
        return None

    def snap(self, middle: float, a: int, b: int) -> int | None:
        """The allowed batch nearest `middle`, strictly between a and b; None when there is none."""
        low, high = min(a, b), max(a, b)
        inside = [c for c in (self.choices or range(low + 1, high)) if low < c < high]
        if not inside:
            return None
        step = 8 if low >= 16 else 1  # round shapes: GPU kernels like multiples of 8
        rounded = [c for c in inside if c % step == 0] or inside
        return min(rounded, key=lambda c: abs(c - middle))

    def confirm(self) -> None:
        """Measure the choice again; a batch that no longer fits is dropped, and so on, downwards."""
        while (best := self.best()) is not None:
            again = self.run(best.batch_size, "confirm")
            if again.fits:
                self.result.chosen = min((best, again), key=lambda t: t.throughput)  # the cautious figure
                self.prefer_faster_smaller(again)
                return
        self.result.chosen = None

    def prefer_faster_smaller(self, again: Trial) -> None:
        """A confirming trial slower than a smaller batch's measured throughput by more than
        CONFIRM_SLOWER_BY: the smaller batch is the faster one measured, so it is chosen, with a warning."""
        smaller = [t for size, t in self.fitting().items() if size < again.batch_size]
        if not smaller:
            return
        faster = max(smaller, key=lambda t: t.throughput)
        if again.throughput >= faster.throughput * (1 - CONFIRM_SLOWER_BY):
            return
        self.result.chosen = faster
        self.result.warning = (
            f"batch {again.batch_size} measured {again.throughput:.4g} on confirmation, "
            f"{1 - again.throughput / faster.throughput:.0%} below batch {faster.batch_size}'s "
            f"{faster.throughput:.4g} (a busy machine?): batch {faster.batch_size} chosen instead")
