"""The policy mismatch's arithmetic (engines/policy_mismatch.py): |log ratio| and the k3 KL of the
tokens the loss counts, summed per rank and combined over the ranks."""

from __future__ import annotations

import math

import pytest
import torch

from gpuscale.engines.policy_mismatch import KL, MAX, MEAN, combined_sums, mismatch_figures, mismatch_sums


def test_a_sampler_off_by_known_amounts_gives_their_mean_max_and_kl():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -9.0, -9.0]])
    # r = trainer - sampler: +0.1, -0.3, 0, +0.2 | 0, -0.1 ; the last two of row 2 are padding
    sampler = torch.tensor([[-1.1, -1.7, -0.5, -3.2], [-0.2, -0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    figures = mismatch_figures(mismatch_sums(trainer, sampler, mask))
    ratios = [0.1, -0.3, 0.0, 0.2, 0.0, -0.1]
    assert figures[MEAN] == pytest.approx(sum(abs(r) for r in ratios) / 6, abs=1e-6)
    assert figures[MAX] == pytest.approx(0.3, abs=1e-6)
    assert figures[KL] == pytest.approx(sum(math.expm1(r) - r for r in ratios) / 6, abs=1e-6)


def test_the_same_log_probs_give_zero_and_nan_or_masked_tokens_count_for_nothing():
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    assert mismatch_figures(mismatch_sums(logps, logps.clone(), torch.ones(1, 3))) == {MEAN: 0.0, MAX: 0.0, KL: 0.0}
    sampler = torch.tensor([[-1.0, float("nan"), -4.5]])  # no log-prob for the 2nd; the 3rd is masked
    sums = mismatch_sums(logps, sampler, torch.tensor([[1, 1, 0]]))
    assert sums.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert mismatch_figures(mismatch_sums(logps, sampler, torch.zeros(1, 3))) == {}  # no token counted


def test_ranks_combine_by_tokens_and_the_largest_difference():
    one = mismatch_sums(torch.zeros(1, 4), torch.full((1, 4), -0.1), torch.ones(1, 4))  # 4 tokens at 0.1
    other = mismatch_sums(torch.zeros(1, 1), torch.full((1, 1), -0.6), torch.ones(1, 1))  # 1 token at 0.6
    figures = mismatch_figures(torch.cat([one, other]))  # as accelerator.gather lays them side by side
    assert figures[MEAN] == pytest.approx((4 * 0.1 + 0.6) / 5) and figures[MAX] == pytest.approx(0.6)


def test_micro_batches_of_a_step_add_up_and_keep_the_largest_difference():
    first = mismatch_sums(torch.zeros(1, 2), torch.full((1, 2), -0.3), torch.ones(1, 2))
    second = mismatch_sums(torch.zeros(1, 2), torch.tensor([[-0.1, 0.2]]), torch.ones(1, 2))
    figures = mismatch_figures(combined_sums(first, second))
    assert figures[MEAN] == pytest.approx(0.9 / 4) and figures[MAX] == pytest.approx(0.3)


def test_the_monitor_s_headline_leads_with_the_mismatch_among_trl_s_sampling_figures():
    """Under the catalogue's label: a GPU run's monitor once read TRL's flattened name,
    `sampling_sampling_logp_difference_mean`."""
    from gpuscale.app.views.runs import figures_text

    latest = {"reward": 0.3, "loss": 0.01, "mfu": 0.2, "entropy": 0.5, "clip_ratio_low_mean": 0.0,
              "sampling_sampling_logp_difference_max": 0.4, "sampling_sampling_logp_difference_mean": 0.0123}
    run = {"status": "running", "progress": {"latest": latest}}
    assert figures_text(run) == "reward 0.3 · loss 0.01 · MFU 20.0% · policy mismatch (mean) 0.0123 nats"
