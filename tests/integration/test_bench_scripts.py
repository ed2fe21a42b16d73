"""The bench scripts end to end on CPU at tiny sizes: real `gpuscale run`s (CLI, supervisor, ranks as CPU
processes, runs.db), the script's JSON checked against the runs it made. Speeds on CPU mean nothing;
what is checked is that every run happens with the settings the script promises and that its figures
and ratios are computed from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscale.engines.store import Store

ROOT = Path(__file__).resolve().parents[2]


def bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_grpo_mtl_bench_times_every_generator_and_two_ranks(home, tmp_path):
    out = tmp_path / "grpo.json"
    prompts, generations = 2, 2
    done = bench("grpo_mtl.py", "--model", "tiny-math", "--gpus", "2", "--prompts-per-step", str(prompts),
                 "--generations", str(generations), "--max-completion-length", "6", "--batch-size", "2",
                 "--steps", "2", "--precision", "auto", "--home", str(home), "--out", str(out))
    results = json.loads(out.read_text())
    runs = results["runs"]
    assert set(runs) == {"transformers_1gpu", "continuous_1gpu", "engine_1gpu", "engine_2gpu"}
    store = Store(home, read_only=True)  # the runs are over; reading takes no write lock
    for name, run in runs.items():
        generator, gpus = name.split("_")[0], int(name.split("_")[1].removesuffix("gpu"))
        stored = store.get_run(run["run"])
        assert stored["status"] == "succeeded" and stored["summary"]["generator"] == generator
        assert stored["summary"]["world_size"] == gpus and run["steps"] == 2
        # Weak scaling: each rank gets the same prompts per step at every count.
        assert f"prompts_per_step={prompts * gpus}" in run["command"]
        assert run["completions_per_step"] == prompts * generations * gpus
        # A median step lies within the training time, and its generation part within the step.
        assert 0 < run["generation_seconds_per_step"] < run["step_seconds"] <= run["train_seconds"]
        assert run["completions_per_s"] == pytest.approx(run["completions_per_step"] / run["step_seconds"])
        assert run["tokens_per_s_steady"] > 0 and run["mfu"] is None  # CPU: no peak to compare with
    ratios = results["ratios"]
    engine, transformers = runs["engine_1gpu"], runs["transformers_1gpu"]
    assert ratios["step_transformers_over_engine"] == pytest.approx(
        transformers["step_seconds"] / engine["step_seconds"])
    assert ratios["generation_transformers_over_engine"] == pytest.approx(
        transformers["generation_seconds_per_step"] / engine["generation_seconds_per_step"])
    assert ratios["step_continuous_over_engine"] == pytest.approx(
        runs["continuous_1gpu"]["step_seconds"] / engine["step_seconds"])
    scaling = runs["engine_2gpu"]["completions_per_s"] / engine["completions_per_s"]
    assert ratios["engine_gpus"] == 2 and ratios["engine_scaling"] == pytest.approx(scaling)
    assert ratios["scaling_efficiency"] == pytest.approx(scaling / 2)
    assert "step_transformers_over_engine" in done.stdout and "engine_2gpu" in done.stdout
