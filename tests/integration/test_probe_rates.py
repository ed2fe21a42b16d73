"""One figure, one value: a real probe run on CPU ends with a progress line whose tokens/s is its
summary's (the decode loop's), not the supervisor's average over the whole run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import gpuscale
from gpuscale.app.views.text import format_rate
from gpuscale.control.store import Store

pytestmark = pytest.mark.e2e  # every test here starts real runs


def test_the_final_line_of_a_probe_run_gives_the_summarys_tokens_per_s(home):
    result = gpuscale("run", "--recipe", "probe", "--gpus", "1", "--batch-size", "2", "--set", "steps=6",
                      "--set", "prompt_tokens=8")
    assert result.returncode == 0, result.stderr
    run = Store(home).list_runs()[0]
    final = [line for line in result.stderr.splitlines() if line.startswith(f"run {run['id']} probe · succeeded")]
    assert final, result.stderr
    shown = re.search(r"tokens/s ([\d,.]+)", final[-1])
    assert shown and shown.group(1) == format_rate(run["summary"]["tokens_per_s"]), (final[-1], run["summary"])
    # The supervisor's own figure for the run is another number (it counts loading and warm-up).
    assert run["progress"]["tokens_per_s"] != run["summary"]["tokens_per_s"]
    # The output ends in the node check's one table: a row for the one rank, no all-reduce, no peers.
    output = result.stdout.splitlines()
    table = output[output.index("node check:"):]
    summary = run["summary"]
    assert table[1].split()[:2] == ["GPU", "device"] and "decode b=2 tokens/s" in table[1], table
    assert table[2].split()[:3] == [*summary["node_check_gpus"][0].split(), summary["devices"][0].split()[0]], table
    assert table[3].startswith(f"  decode: {summary['node_check_decode']}; the summary's tokens_per_s"), table
    assert table[4].startswith("  b=1 of floor: "), table
    assert table[5:] == ["  all-reduce: one rank, nothing to measure",
                         *(["  no data-sheet figures for cpu (not in gpuscale/data/cards.py)"]
                           if summary["devices"] == ["cpu"] else []),
                         "  slow: none (no GPU more than 15% below its peers)"], table
    # The decode loop passes its KV cache as `cache`: transformers' "`past_key_values` ... deprecated"
    # warning reaches neither the output nor the rank's log.
    rank_log = (Path(run["run_dir"]) / "logs" / "rank0.log").read_text()
    assert "deprecated" not in rank_log and "deprecated" not in result.stderr, rank_log
