"""Tuning a recipe on one device: its trials, run by the pure search of engines/batch_search.py.

`tune_recipe(recipe, settings, device)` opens the recipe's trial session (model and data loaded
once, in this process), runs `search_batch_size` with it, and measures each trial's peak memory
around the call: on a GPU the allocator's peak reserved bytes (what runs out), on CPU the process's
peak resident memory (VmHWM, reset before each trial through /proc/self/clear_refs), against
`memory_cap` of the card's memory or of the host's RAM. An out-of-memory error is a failed trial,
not the end of the tuning.

What a result is stored by (`tuning_key`, `Device`) is recipes/shared/tuning_key.py; how many ranks a run
starts and a rank's micro-batches are recipes/shared/rank_batches.py. Nothing here imports torch at module
level: the recipes' light modules import `timed_steps` and `out_of_memory_names` from here.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpuscale.engines.batch_search import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MEMORY_CAP,
    OUT_OF_MEMORY,
    Trial,
    TuneResult,
    search_batch_size,
)
from gpuscale.recipes.shared.contract import Recipe
from gpuscale.recipes.shared.rank_batches import run_ranks
from gpuscale.recipes.shared.tuning_key import Device, TuningKey, tuning_key
from gpuscale.runs.settings import RunSettings, SettingsError


@dataclass
class TuneOutcome:
    key: TuningKey
    result: TuneResult
    memory_total_bytes: int
    memory_cap: float
    seconds: float
    compile: bool = False


def default_max_batch(recipe: Recipe, settings: RunSettings, ranks: int | None = None, on_gpu: bool = True) -> int:
    """The largest batch `gpuscale tune` tries when not told: the run's work per rank where the
    recipe knows it (a larger batch would be padding), at most DEFAULT_MAX_BATCH."""
    ranks = run_ranks(settings) if ranks is None else ranks
    work = recipe.tune_max_batch(recipe.for_device(settings, on_gpu, ranks), ranks)
    return max(1, min(work, DEFAULT_MAX_BATCH)) if work else DEFAULT_MAX_BATCH


def tune_recipe(recipe: Recipe, settings: RunSettings, device: Device, *, memory_cap: float = DEFAULT_MEMORY_CAP,
                max_batch: int | None = None, start: int | None = None,
                progress: Callable[[Trial], None] | None = None) -> TuneOutcome:
    """Search the batch size of `recipe` at `settings` on `device`, trials in this process.
    `max_batch` None: the run's work per rank where the recipe knows it (default_max_batch)."""
    import torch

    from gpuscale.data.precision import device_precision, torch_dtype
    from gpuscale.engines.distributed import RankContext, use_cuda_device

    if recipe.tuning is None:
        raise SettingsError(f"recipe: {recipe.name!r}: cannot be tuned (it declares no trial)")
    torch_device = torch.device(device.torch_name)
    if torch_device.type == "cuda":
        use_cuda_device(torch_device)  # as a rank does: the trials time the run's kernels
    precision = device_precision(settings.precision, torch_device)  # the ranks' rule, on the trial's device
    dtype = torch_dtype(precision)
    total = device_memory_bytes(torch_device)
    if start is None:
        start = 1 if torch_device.type == "cpu" else recipe.tuning.start
    ranks = run_ranks(settings)
    # The trials run what a run would (a setting left to the device resolved for this one); the stored
    # result keeps the settings as given, which is what a run's `auto` looks up.
    sized = recipe.for_device(settings, torch_device.type == "cuda", ranks)
    if max_batch is None:
        max_batch = default_max_batch(recipe, sized, ranks, torch_device.type == "cuda")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuscale-tune-") as scratch:
        ctx = RankContext(0, 0, 1, torch_device, dtype, Path(scratch))
        torch.manual_seed(settings.seed)
        with recipe.trial_session(sized, ctx) as trial:
            result = search_batch_size(
                lambda size: measured(trial, size, torch_device), memory_limit_bytes=memory_cap * total,
                start=start, max_batch=max_batch, allowed=recipe.tune_batch_sizes(sized, ranks), progress=progress)
    key = tuning_key(recipe, settings, device.name, precision)
    return TuneOutcome(key, result, total, memory_cap, time.perf_counter() - started, settings.compile)


def device_memory_bytes(device) -> int:
    import psutil
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return psutil.virtual_memory().total


def measured(trial: Callable[[int], Trial], batch_size: int, device) -> Trial:
    """One trial with its peak memory; out of memory gives a failed trial and the memory back."""
    import torch

    release_memory(device)
    peak = PeakMemory(device)
    try:
        outcome = trial(batch_size)
    except torch.cuda.OutOfMemoryError:
        outcome = Trial(batch_size, failure=OUT_OF_MEMORY)
    except RuntimeError as error:  # CPU allocators and some CUDA paths say it in a plain RuntimeError
        if "out of memory" not in str(error).lower():
            raise
        outcome = Trial(batch_size, failure=OUT_OF_MEMORY)
    if outcome.failure:
        release_memory(device)
        return outcome
    return Trial(**{**outcome.as_dict(), "peak_memory_bytes": outcome.peak_memory_bytes or peak.bytes()})


def release_memory(device) -> None:
    """What the last trial held goes back (its engine, KV cache, graphs), so trials do not add up."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class PeakMemory:
    """Peak memory from now on: the CUDA allocator's peak reserved bytes, or on CPU the process's
    peak resident set (VmHWM), reset by writing 5 to /proc/self/clear_refs (Linux); where that is
    not allowed, the resident set when read (a lower bound)."""

    def __init__(self, device):
        import torch

        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.high_water_mark = True
        except OSError:
            self.high_water_mark = False

    def bytes(self) -> int:
        import psutil
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        if self.high_water_mark:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return psutil.Process().memory_info().rss


def timed_steps(step: Callable[[], int], steps: int, synchronize: Callable[[], None],
                warm_up: int = 1) -> tuple[float, float]:
    """Run `step` (returning the work it did: problems, tokens...) `warm_up` times untimed, then
    `steps` times timed; returns (work per second, median seconds of a step)."""
    import statistics

    work, seconds = timed_calls(step, steps, synchronize, warm_up)
    return work / sum(seconds), statistics.median(seconds)


def timed_calls(step: Callable[[], int], calls: int, synchronize: Callable[[], None],
                warm_up: int = 1) -> tuple[int, list[float]]:
    """`step` run `warm_up` times untimed, then `calls` times timed: (the work the timed calls did,
    the seconds of each)."""
    for _ in range(warm_up):
        step()
        synchronize()
    seconds, work = [], 0
    for _ in range(calls):
        started = time.perf_counter()
        work += step()
        synchronize()
        seconds.append(time.perf_counter() - started)
    return work, seconds


@contextmanager
def out_of_memory_names(batch_size: int, step: int, steps: int):
    """An out-of-memory error of a real run says at which batch size and step memory ran out."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as error:
        message = (f"out of memory at step {step} of {steps} with batch_size {batch_size}; lower it, or "
                   f"`gpuscale tune` finds the largest batch that fits and is fastest")
        print(message, flush=True)
        raise torch.cuda.OutOfMemoryError(message) from error
