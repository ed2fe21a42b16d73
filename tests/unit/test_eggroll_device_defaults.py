"""Eggroll's population, steps and batch left to the device: resolved where the device is known (the rank,
the tuner), never by the front end, and never over a value the user gave."""

from __future__ import annotations

import pytest

from gpuscale.recipes.eggroll import (
    CPU_POPULATION,
    CPU_STEPS,
    GPU_POPULATION,
    GPU_STEPS,
    MAX_ROWS_PER_CALL,
    Eggroll,
    Settings,
)
from gpuscale.runs.settings import SettingsError, resolve_settings


def test_auto_population_and_steps_are_the_gpu_choice_on_a_gpu_and_the_small_ones_on_cpu():
    settings = Settings()
    assert settings.population == settings.steps == "auto" and settings.batch_size is None
    on_gpu = Eggroll().for_device(settings, on_gpu=True, ranks=1)
    on_cpu = Eggroll().for_device(settings, on_gpu=False, ranks=1)
    assert (on_gpu.population, on_cpu.population) == (GPU_POPULATION, CPU_POPULATION) == (2048, 64)
    assert (on_gpu.steps, on_cpu.steps) == (GPU_STEPS, CPU_STEPS) == (200, 60)
    # The unset batch is a rank's step in one call, capped: 2,048 x 16 rows is over 8,192, 64 x 16 is 1,024.
    assert on_gpu.batch_size == MAX_ROWS_PER_CALL == 8192
    assert on_cpu.batch_size == 64 * 16
    # Over 64 ranks each holds 32 members: 512 rows, under the cap.
    assert Eggroll().for_device(settings, on_gpu=True, ranks=64).batch_size == 32 * 16


def test_values_the_user_gave_are_kept_on_every_device():
    given = resolve_settings(Settings, overrides={"population": "100", "batch_size": "300", "steps": "7"})
    for on_gpu in (True, False):
        sized = Eggroll().for_device(given, on_gpu=on_gpu, ranks=2)
        assert (sized.population, sized.batch_size, sized.steps) == (100, 300, 7)


def test_an_odd_population_is_still_refused_with_its_field_and_auto_is_not():
    with pytest.raises(SettingsError, match=r"population: '7': must be even with antithetic pairs"):
        resolve_settings(Settings, overrides={"population": "7"})
    with pytest.raises(SettingsError, match=r"population: 'many': Input should be a valid integer.* \(or 'auto'\)$"):
        resolve_settings(Settings, overrides={"population": "many"})
    with pytest.raises(SettingsError, match=r"steps: 'ten': Input should be a valid integer.* \(or 'auto'\)$"):
        resolve_settings(Settings, overrides={"steps": "ten"})
    with pytest.raises(SettingsError, match=r"steps: '0': Input should be greater than or equal to 1 \(or 'auto'\)$"):
        resolve_settings(Settings, overrides={"steps": "0"})
    assert resolve_settings(Settings, overrides={"population": "auto"}).population == "auto"
