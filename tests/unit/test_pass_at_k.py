"""pass@k of power-sampling's summary (recipes/power_sampling/pass_at_k.py): the unbiased estimator
against counting every draw of k answers, pass@1 as the plain accuracy, and the summary's figures."""

from __future__ import annotations

import itertools

import pytest

from gpuscale.data.scoring import accuracy_by_domain
from gpuscale.recipes.power_sampling import Settings
from gpuscale.recipes.power_sampling.pass_at_k import pass_at_k, pass_at_k_figures, reported_ks
from gpuscale.recipes.power_sampling.sampler import summarise


def drawn_with_a_correct_one(samples: int, correct: int, k: int) -> float:
    """The definition itself: of every set of k answers out of n (c correct), the share holding a correct one."""
    answers = [True] * correct + [False] * (samples - correct)
    draws = list(itertools.combinations(answers, k))
    return sum(any(draw) for draw in draws) / len(draws)


@pytest.mark.parametrize("samples", [1, 2, 5, 8])
def test_the_estimator_is_the_share_of_draws_with_a_correct_answer(samples):
    for correct in range(samples + 1):
        for k in range(1, samples + 1):
            assert pass_at_k(samples, correct, k) == pytest.approx(drawn_with_a_correct_one(samples, correct, k))
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 is the share correct
    assert pass_at_k(16, 3, 14) == 1.0 and pass_at_k(16, 0, 16) == 0.0  # fewer wrong answers than k; none right


def test_impossible_counts_are_refused():
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct must be in"):
        pass_at_k(4, 5, 1)


def test_the_k_reported():
    assert reported_ks(1) == [1] and reported_ks(3) == [1, 2, 3] and reported_ks(16) == list(range(1, 17))
    assert reported_ks(40) == [*range(1, 17), 32, 40]


def made_up_rows(chains: int) -> list[dict]:
    """Five problems in two domains, each with a different number of its `chains` answers correct."""
    rows = []
    for index, (domain, correct) in enumerate([("arithmetic", 0), ("arithmetic", 1), ("comparison", chains),
                                               ("comparison", 2), (None, 3)]):
        rows += [{"index": index, "chain": chain, "domain": domain, "correct": chain < correct, "tokens": 5}
                 for chain in range(chains)]
    return rows


def test_pass_at_1_is_the_accuracy_and_pass_at_k_rises_with_k():
    rows = made_up_rows(chains=16)
    figures, accuracy = pass_at_k_figures(rows), accuracy_by_domain(rows)
    assert set(figures) == {"pass_at_k", "pass_at_k_arithmetic", "pass_at_k_comparison"}
    for name, by_k in figures.items():
        assert list(by_k) == [str(k) for k in range(1, 17)]
        assert by_k["1"] == pytest.approx(accuracy[name.replace("pass_at_k", "accuracy")])
        values = list(by_k.values())
        assert all(a <= b for a, b in zip(values, values[1:])) and values[0] < values[-1], (name, values)
    # At k = n a problem counts as solved iff any answer was right: 4 of the 5 problems.
    assert figures["pass_at_k"]["16"] == pytest.approx(4 / 5)
    assert figures["pass_at_k_arithmetic"] == {str(k): pytest.approx(k / 16 / 2) for k in range(1, 17)}


def test_the_summary_has_pass_at_k_with_several_chains_only():
    every_rank = [{"results": made_up_rows(chains=4), "elapsed": 1.0, "warm_up": 0.1, "proposals": 0, "accepted": 0,
                   "decoded_tokens": 100, "sampling_calls": 1}]
    several = summarise(Settings(chains=4, method="sample"), every_rank)
    assert several["accuracy"] == pytest.approx(several["pass_at_k"]["1"]) and several["problems"] == 5
    assert list(several["pass_at_k"]) == ["1", "2", "3", "4"] and "pass_at_k_comparison" in several
    assert "every chain's answer" in several["counted_in_accuracy"]
    one = summarise(Settings(chains=1), [{**every_rank[0], "results": made_up_rows(chains=1)}])
    assert not {"pass_at_k", "counted_in_accuracy"} & set(one)
