"""A 2-rank DDP PCGrad step gives the same weights as one process on the same data.

pcgrad_step.py (next to this file) is one rank of grpo-mtl's MultiTaskGRPOTrainer taking one SGD step
with mtl=pcgrad on a fixed 8-row batch of two conflicting domains, fp32 on CPU. It runs under the real
`torch.distributed.run`, once with 1 rank (all 8 rows) and once with 2 (gloo, DDP, 4 rows each: rank
1 holds no row of the first domain). If the ranks did not all-reduce their per-domain gradients,
each would project and step on its own rows' gradients and end about 0.05 away from one process's
weights (checked by making the all-reduce a no-op); fp32 summation order leaves about 1e-7.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # every test here starts real runs

STEP_SCRIPT = Path(__file__).with_name("pcgrad_step.py")


def start_step(ranks: int, out_dir: Path) -> subprocess.Popen:
    """One step with `ranks` ranks under torchrun, started (`step_outcome` waits for it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
         str(STEP_SCRIPT), str(out_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def step_outcome(step: subprocess.Popen, ranks: int, out_dir: Path) -> list[dict]:
    """Every rank's {"before", "after", "log"} of a step `start_step` started."""
    out, err = step.communicate(timeout=180)
    assert step.returncode == 0, out[-3000:] + err[-3000:]
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(ranks)]


def test_two_ranks_take_the_same_pcgrad_step_as_one_process(tmp_path):
    # Both at once (three ranks on the cores): neither reads the other.
    one, two = start_step(1, tmp_path / "one"), start_step(2, tmp_path / "two")
    (single,) = step_outcome(one, 1, tmp_path / "one")
    ranks = step_outcome(two, 2, tmp_path / "two")

    # The step moved the weights well beyond the tolerance, and PCGrad had a conflict to project.
    moved = max((single["after"][name] - single["before"][name]).abs().max().item() for name in single["after"])
    assert moved > 1e-2
    assert single["log"]["pcgrad/conflict_share"] == 1.0
    for rank in ranks:
        assert rank["log"]["pcgrad/conflict_share"] == 1.0
        # The cosine is that of the all-reduced gradients: the whole batch's, as one process sees it.
        cosine = single["log"]["pcgrad/cosine_first_second"]
        assert cosine < 0 and rank["log"]["pcgrad/cosine_first_second"] == pytest.approx(cosine, abs=1e-5)
        for name, weight in single["after"].items():
            torch.testing.assert_close(rank["before"][name], single["before"][name], rtol=0, atol=0)
            torch.testing.assert_close(rank["after"][name], weight, rtol=0, atol=1e-6,
                                       msg=lambda message, name=name: f"{name}: {message}")
