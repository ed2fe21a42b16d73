"""The front ends' side of tuning: `gpuscale tune`, and the batch a run gets from
`--batch-size auto`, shared by the CLI and the TUI. No torch here: trials run in `gpuscale tune`
(recipes/shared/device_trials.py imports torch inside it), and `auto` on a GPU with nothing stored runs that
command as a child process, so that the memory its trials held goes back before the run starts.

Where a run's batch comes from, recorded in its settings as `batch_size_source`:
- a number the user gave: "given";
- `auto`: a stored result for (recipe, model, GPU, precision, shape) -> "stored (tuned DATE)"; with
  none on a GPU, `gpuscale tune` first -> "tuned DATE"; on CPU the recipe's CPU default -> "default";
- nothing given on a GPU: a stored result if there is one, else the recipe's default.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscale.app.views.text import format_number
from gpuscale.control import telemetry
from gpuscale.control.launch import plan_devices
from gpuscale.control.store import Store
from gpuscale.recipes.shared.contract import Recipe
from gpuscale.recipes.shared.rank_split import FITTED_TO_RANKS
from gpuscale.recipes.shared.tuning_key import CPU_DEVICE_NAME, Device, tuning_key
from gpuscale.runs.settings import RunSettings, SettingsError, resolve_settings, resolved_precision


def pick_device(gpu_indices: tuple[int, ...] | list[int], listing: list[dict] | None = None) -> Device:
    """The tuner's device, picked on the front end (NVML's listing is the login node's, the tuner's
    child only runs on it): the first GPU the run would use (NVML's name and capability), or the CPU
    where there is none. `listing`: the GPUs as telemetry.list_gpus gives them, where the caller has
    read them already."""
    if not gpu_indices:
        return Device(None, CPU_DEVICE_NAME, None)
    gpus = {gpu["index"]: gpu for gpu in (telemetry.list_gpus() if listing is None else listing)}
    gpu = gpus.get(gpu_indices[0], {})
    capability = tuple(gpu.get("compute_capability") or ()) or None
    return Device(gpu_indices[0], gpu.get("name", f"GPU {gpu_indices[0]}"), capability)


def wants_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def tuned_date(row: dict) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(row["created_at"]))


@dataclass
class BatchChoice:
    batch_size: int | None  # None: the settings' own default (power sampling sizes it in the rank)
    source: str
    stored: dict | None = None


def stored_tuning(store: Store, recipe: Recipe, settings: RunSettings, device: Device) -> dict | None:
    """The stored result for this recipe, model, shape, device and precision, or None."""
    if recipe.tuning is None:
        return None
    precision = resolved_precision(settings.precision, device.compute_capability)
    return store.find_tuning(tuning_key(recipe, settings, device.name, precision).as_dict())


def choose_batch(recipe: Recipe, settings: RunSettings, device: Device, store: Store, auto: bool,
                 on_tune_line: Callable[[str], None] | None = None) -> BatchChoice:
    """The batch for a run whose batch_size is `auto` (or, `auto` False, not given) on `device`."""
    stored = stored_tuning(store, recipe, settings, device)
    if stored:
        return BatchChoice(stored["batch_size"], f"stored (tuned {tuned_date(stored)})", stored)
    if not auto or recipe.tuning is None:
        return BatchChoice(None, "default")
    if device.index is None:
        return BatchChoice(recipe.tuning.cpu_batch_size, "default")
    tune_in_child(recipe, settings, on_tune_line)
    stored = stored_tuning(store, recipe, settings, device)
    if not stored:
        raise SettingsError(f"batch_size: 'auto': no batch of {recipe.name} fitted on {device.name} "
                            f"(see the trials above); give a number")
    return BatchChoice(stored["batch_size"], f"tuned {tuned_date(stored)}", stored)


def tune_in_child(recipe: Recipe, settings: RunSettings, on_line: Callable[[str], None] | None = None) -> None:
    """`gpuscale tune` for these settings in a child process (its GPU memory goes back when it ends).
    Its output goes to stderr, or line by line to `on_line` (the TUI, which has no terminal to print on)."""
    with tempfile.TemporaryDirectory(prefix="gpuscale-tune-") as scratch:
        path = Path(scratch) / "settings.json"
        path.write_text(settings.model_dump_json())
        say = on_line or (lambda line: print(line, file=sys.stderr))
        say(f"batch_size auto: nothing stored for {recipe.name} on this GPU; tuning first")
        argv = [sys.executable, "-m", "gpuscale.app.cli", "tune", "--recipe", recipe.name, "--settings-json", str(path)]
        if on_line is None:
            returncode = subprocess.run(argv, stdout=sys.stderr).returncode
        else:
            with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  text=True) as child:
                for line in child.stdout:
                    on_line(line.rstrip("\n"))
            returncode = child.returncode
    if returncode != 0:
        raise SettingsError(f"batch_size: 'auto': tuning {recipe.name} failed (exit {returncode}); "
                            "give a number, or run `gpuscale tune` to see why")


def given_values(recipe: Recipe, values: dict[str, Any]) -> dict[str, Any]:
    """Of a form's values (every setting), those a launch takes as the user's: the ones that differ from
    the recipe's defaults, and batch_size whatever it says (`auto` is the launch's to resolve). A setting
    left at its default may then be fitted to the ranks (`Recipe.fit_to_ranks`), as `gpuscale run` fits
    one that no --set names. SettingsError for a value that does not validate."""
    checked = {name: value for name, value in values.items() if not (name == "batch_size" and wants_auto(value))}
    settings, defaults = validated(recipe, checked), recipe.settings_cls()
    return {name: value for name, value in values.items()
            if name == "batch_size" or getattr(settings, name) != getattr(defaults, name)}


def validated(recipe: Recipe, merged: dict[str, Any]) -> RunSettings:
    """`merged` (settings by field name) validated; SettingsError naming field, value and reason."""
    return resolve_settings(recipe.settings_cls, overrides=merged, environ={})


def settings_with_batch(recipe: Recipe, merged: dict[str, Any], store: Store | None = None,
                        validate=validated, on_tune_line: Callable[[str], None] | None = None
                        ) -> tuple[RunSettings, dict]:
    """Validate `merged` (the layers of a run's settings: what the user gave), fit it to the run's ranks
    (`Recipe.fit_to_ranks`: a default the ranks cannot share moved, a given value refused) and resolve
    its batch; returns the settings and the notes recorded with the run (`batch_size_source`, and
    `fitted_to_ranks` where a default moved). `on_tune_line` gets the output of `gpuscale tune` where
    `auto` must tune first (else it goes to stderr)."""
    requested = merged.get("batch_size")
    auto = wants_auto(requested)
    if auto and recipe.tuning is None:
        raise SettingsError(f"batch_size: 'auto': recipe {recipe.name} cannot be tuned; give a number")
    given_batch = requested is not None and not auto
    settings, fitted = recipe.fit_to_ranks(
        validate(recipe, {key: value for key, value in merged.items() if given_batch or key != "batch_size"}))
    notes = {FITTED_TO_RANKS: "; ".join(fitted)} if fitted else {}
    if given_batch:
        return settings, {"batch_size_source": "given", **notes}
    device = pick_device(plan_devices(settings.gpus).gpu_indices)
    if recipe.tuning is None or (not auto and device.index is None):
        return settings, {"batch_size_source": "default", **notes}
    choice = choose_batch(recipe, settings, device, store or Store(), auto, on_tune_line)
    if choice.batch_size is not None:
        settings = recipe.with_batch_size(settings, choice.batch_size)
    return settings, {"batch_size_source": choice.source, **notes}


# ---- what `gpuscale tune` prints --------------------------------------------------------------------


def memory_gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def trial_line(number: int, trial, figure: str) -> str:
    if trial.failure:
        return f"trial {number}: batch {trial.batch_size}: {trial.failure}"
    cap = ", over the memory cap" if trial.over_cap else ""
    return (f"trial {number}: batch {trial.batch_size}: {format_number(trial.throughput)} {figure}, "
            f"{memory_gb(trial.peak_memory_bytes)} peak, {trial.step_seconds:.3g} s/step ({trial.phase}){cap}")


def trial_rows(trials: list[dict], figure: str) -> list[list[str]]:
    rows = [["BATCH", figure.upper(), "PEAK MEMORY", "STEP S", "PHASE", "NOTE"]]
    for trial in trials:
        note = trial["failure"] or ("over the memory cap" if trial["over_cap"] else "")
        rows.append([str(trial["batch_size"]), format_number(trial["throughput"]),
                     memory_gb(trial["peak_memory_bytes"]),
                     "-" if trial["step_seconds"] is None else f"{trial['step_seconds']:.3g}", trial["phase"], note])
    return rows


def tuning_summary(row: dict) -> str:
    """One line for the TUI's form and the CLI: the tuned batch, its throughput and memory."""
    share = (f" ({row['peak_memory_bytes'] / row['memory_total_bytes']:.0%} of {memory_gb(row['memory_total_bytes'])})"
             if row.get("memory_total_bytes") else "")
    return (f"tuned batch {row['batch_size']}: {format_number(row['throughput'])} {row['figure']}, "
            f"{memory_gb(row['peak_memory_bytes'])}{share} on {row['device']} {row['precision']}, {tuned_date(row)}")


def outcome_record(outcome, figure: str) -> dict:
    """The store's fields for a TuneOutcome (recipes/shared/device_trials.py)."""
    chosen = outcome.result.chosen
    return {"batch_size": chosen.batch_size, "throughput": chosen.throughput, "figure": figure,
            "peak_memory_bytes": chosen.peak_memory_bytes, "memory_total_bytes": outcome.memory_total_bytes,
            "memory_cap": outcome.memory_cap, "compile": outcome.compile, "stopped": outcome.result.stopped,
            "trials": [trial.as_dict() for trial in outcome.result.trials], "seconds": outcome.seconds}
