"""Settings whose default depends on the device: one value for a GPU, a smaller one for CPU ranks.

A default chosen for a GPU (sft's 6 epochs, grpo-mtl's 500 steps, eggroll's 2,048 members) makes a
run of half an hour or more on a laptop's CPU; a default chosen for the CPU leaves a GPU idle. Such a
setting is declared with `device_default(gpu, cpu, description)`: it holds the word `auto` unless the
user gives a value, its description (the form's help line, `gpuscale recipes`) says both values, and
`auto` is replaced where the device is known: by the rank before its work and by the tuner before its
trials (`Recipe.for_device`, recipes/shared/contract.py), never by the front end, whose machine need
not be the ranks'. A value the user gave is kept on every device. The rank's log says in one line
which values it took (`device_defaults_line`).

The field's type is written where it is declared, `Literal["auto"] | Annotated[int, Field(ge=1)]`, so
that its bounds stay beside it; a value that is neither is refused naming the number's rule
(runs/settings.py: describe_validation_error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from gpuscale.runs.settings import RunSettings

AUTO = "auto"
_EXTRA_KEY = "device_default"  # where a field's two values are kept (its json_schema_extra)


@dataclass(frozen=True)
class DeviceDefault:
    gpu: Any
    cpu: Any

    def on(self, on_gpu: bool) -> Any:
        return self.gpu if on_gpu else self.cpu


def shown(value: Any) -> str:
    """A default as the description and the log write it: 4,000, 2, 1e-4, none."""
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def device_default(gpu: Any, cpu: Any, description: str) -> Any:
    """The Field of a setting that is `gpu` on a GPU and `cpu` on CPU ranks unless given: `auto` until
    the device is known, with both values in its description."""
    return Field(AUTO, description=f"{description}; auto: {shown(gpu)} on a GPU, {shown(cpu)} on CPU",
                 json_schema_extra={_EXTRA_KEY: {"gpu": gpu, "cpu": cpu}})


def device_defaults(settings_cls: type[RunSettings]) -> dict[str, DeviceDefault]:
    """The settings of `settings_cls` declared with `device_default`, by name, in declaration order."""
    found = {}
    for name, info in settings_cls.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and _EXTRA_KEY in extra:
            found[name] = DeviceDefault(**extra[_EXTRA_KEY])
    return found


def left_to_device(settings: RunSettings) -> dict[str, DeviceDefault]:
    """The device defaults that `settings` leaves at `auto` (those the user gave are not)."""
    return {name: default for name, default in device_defaults(type(settings)).items()
            if getattr(settings, name) == AUTO}


def resolved_for_device(settings: RunSettings, on_gpu: bool) -> RunSettings:
    """`settings` with every device default still `auto` set to the device's value."""
    update = {name: default.on(on_gpu) for name, default in left_to_device(settings).items()}
    return settings.model_copy(update=update) if update else settings


def device_defaults_line(settings: RunSettings, on_gpu: bool) -> str | None:
    """The rank's log line for the device defaults `settings` leaves at `auto`, e.g. "CPU defaults
    (no GPU on this rank): epochs 1 (3 on a GPU); --set NAME=VALUE sets one"; None where there are none."""
    left = left_to_device(settings)
    if not left:
        return None
    device, other = ("GPU", "CPU") if on_gpu else ("CPU", "a GPU")
    values = ", ".join(f"{name} {shown(default.on(on_gpu))} ({shown(default.on(not on_gpu))} on {other})"
                       for name, default in left.items())
    where = "a GPU on this rank" if on_gpu else "no GPU on this rank"
    return f"{device} defaults ({where}): {values}; --set NAME=VALUE sets one"
