"""bench/power_sampling.py's accuracy comparison without starting runs: which runs it makes (every rival on
the same problems; T = 1/alpha; 16 chains with --pass-at-k, greedy one) and the table it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_loader import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_bench("power_sampling.py")


def test_every_rival_runs_on_the_same_problems_with_its_own_temperature_and_chains(bench, monkeypatch):
    made = []

    def recorded(method, gpus, problems, args, extra=(), chains=None):
        settings = dict(item.split("=", 1) for item in extra[1::2])  # the "--set", "k=v" pairs
        made.append((method, gpus, problems, chains, settings))
        return {"method": method}

    monkeypatch.setattr(bench, "run", recorded)
    args = SimpleNamespace(alpha=4.0, gpus=1, accuracy=300, chains=1, pass_at_k=True, pass_at_k_chains=16)
    results = bench.accuracy(args)
    assert list(results) == ["greedy", "sample_t1", "sample_low_t", "power"]
    assert made == [("greedy", 1, 300, 1, {"compile": "false"}),
                    ("sample", 1, 300, 16, {"temperature": "1.0", "compile": "false"}),
                    ("sample", 1, 300, 16, {"temperature": "0.25", "compile": "false"}),
                    ("power", 1, 300, 16, {"compile": "false"})]
    made.clear()
    bench.accuracy(SimpleNamespace(**{**vars(args), "pass_at_k": False, "alpha": 2.0}))
    assert [(chains, settings.get("temperature")) for _, _, _, chains, settings in made] == [
        (1, None), (1, "1.0"), (1, "0.5"), (1, None)]


def summary(accuracy: float, chains: int = 16, **pass_at_k) -> dict:
    figures = {"accuracy": accuracy, "accuracy_arithmetic": accuracy / 2, "chains": chains}
    return {**figures, "pass_at_k": {k.removeprefix("k"): v for k, v in pass_at_k.items()}} if pass_at_k else figures


def test_the_table_gives_pass_at_k_for_every_method_and_greedy_flat(bench):
    ks = {f"k{k}": 0.3 + 0.02 * k for k in range(1, 17)}
    results = {"greedy": summary(0.6, chains=1), "sample_t1": summary(0.32, **ks),
               "sample_low_t": summary(0.5, **ks), "power": summary(0.55, **ks)}
    lines = bench.accuracy_lines(results, alpha=4.0)
    assert lines[0].split()[:7] == ["method", "accuracy", "pass@1", "pass@2", "pass@4", "pass@8", "pass@16"]
    rows = {line[:18].strip(): line[18:].split() for line in lines[1:5]}
    assert rows["greedy"][:6] == ["0.600"] * 6  # deterministic: the same answer however many are drawn
    assert rows["T=1/alpha (0.25)"][:6] == ["0.500", "0.320", "0.340", "0.380", "0.460", "0.620"]
    assert rows["T=1"][0] == "0.320" and rows["power"][0] == "0.550"
    assert "pass@1" in lines[-1] and "greedy" in lines[-1]
    # One chain a problem: no pass@k columns, only accuracy and the domains.
    single = bench.accuracy_lines({name: summary(0.5, chains=1) for name in results}, alpha=4.0)
    assert "pass@" not in single[0] and len(single) == 5 and "'arithmetic': 0.25" in single[1]


def test_pass_at_k_without_problems_is_refused():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "power_sampling.py"), "--pass-at-k"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--pass-at-k: needs --accuracy N" in done.stderr


def test_help_names_every_baseline_and_how_it_is_set():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "power_sampling.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    help_text = " ".join(done.stdout.split())
    for baseline in ("method=reference", "method=greedy", "method=sample temperature=1/alpha",
                     "method=sample temperature=1.0", "same problems, seed and token budget"):
        assert baseline in help_text.replace("`", ""), baseline
