"""What a stored tuning is found by, and where trials run: `tuning_key(...)` names a result by recipe,
model, device name, precision and the recipe's shape-changing settings; `Device` is the card (or the
CPU) the trials ran on. No torch: the front ends look results up through it (app/batch_choice.py)
without loading it; the trials themselves are recipes/shared/device_trials.py."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpuscale.recipes.shared.contract import Recipe
from gpuscale.runs.settings import RunSettings, SettingsError

CPU_DEVICE_NAME = "cpu"


@dataclass(frozen=True)
class TuningKey:
    recipe: str
    model: str
    device: str  # the GPU's name (NVML's), or "cpu"
    precision: str  # resolved: bf16, fp16 or fp32
    shape: str  # JSON of the recipe's shape-changing settings, keys sorted

    def as_dict(self) -> dict:
        return {"recipe": self.recipe, "model": self.model, "device": self.device, "precision": self.precision,
                "shape": self.shape}


def tuning_key(recipe: Recipe, settings: RunSettings, device_name: str, precision: str) -> TuningKey:
    if recipe.tuning is None:
        raise SettingsError(f"recipe: {recipe.name!r}: cannot be tuned (it declares no trial)")
    shape = {name: getattr(settings, name) for name in recipe.tuning.shape_settings}
    if settings.compile:  # compiled kernels take other memory and time; uncompiled keys stay as stored before
        shape["compile"] = True
    return TuningKey(recipe.name, settings.model, device_name, precision, json.dumps(shape, sort_keys=True))


@dataclass(frozen=True)
class Device:
    """Where trials run: `index` None is the CPU."""

    index: int | None
    name: str
    compute_capability: tuple[int, int] | None

    @property
    def torch_name(self) -> str:
        return "cpu" if self.index is None else f"cuda:{self.index}"
