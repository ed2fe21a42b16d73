"""The README's first command is a real recipe on the embedded default. It runs
here as the README gives it, with fewer problems."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import gpuscale, run_json

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_starts_with_the_demo_not_probe():
    set_up = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in set_up.splitlines() if line.startswith("    ")]
    assert commands[0] == "pip install -e . && gpuscale demo"


@pytest.mark.e2e
def test_demo_runs_power_against_plain_sampling_and_compares_them(home):
    result = gpuscale("demo", "--problems", "6", timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    accuracies = re.findall(r"^(plain|power) sampling .* accuracy +([\d.]+)% +\(6 problems", out, re.M)
    assert [method for method, _ in accuracies] == ["plain", "power"]
    ids = re.search(r"^\$ gpuscale compare (\d+) (\d+)$", out, re.M)
    assert ids and "method: sample -> power" in out and "accuracy" in out.split("$ gpuscale compare")[1]
    runs = {run["id"]: run for run in run_json("runs")}
    plain, power = runs[int(ids[1])], runs[int(ids[2])]
    assert plain["summary"]["method"] == "sample" and power["summary"]["method"] == "power"
    assert power["summary"]["problems"] == plain["summary"]["problems"] == 6
    for method, shown in accuracies:  # the table shows each run's own summary
        run = plain if method == "plain" else power
        assert float(shown) == round(100 * run["summary"]["accuracy"], 1)
