"""grpo-mtl's `domain_weights`: more (or less) of a domain's prompts among the rows TRL's sampler draws, the
default leaving them as they were (recipes/grpo_mtl/data.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from gpuscale.recipes.grpo_mtl import GrpoMtl, Settings
from gpuscale.recipes.grpo_mtl.data import (
    domain_quotas,
    domain_shares,
    pool_factor,
    training_and_eval_examples,
    weighted_examples,
)
from gpuscale.recipes.shared.training_data import training_and_eval_examples as split_examples
from gpuscale.runs.settings import SettingsError, resolve_settings

SMALL = {"max_steps": 25, "prompts_per_step": 4, "eval_examples": 20}  # 100 training prompts


def small(**more) -> Settings:
    return Settings(**SMALL, **more)


def test_by_default_the_training_rows_are_the_first_the_run_can_use_as_before():
    """No domain_weights: the rows are the data's first max_steps x prompts_per_step (after the held-out ones), as
    before the setting; TRL's sampler draws a permutation of the rows from the seed and their count alone, so it
    draws the same prompts in the same order. Equal weights, through the weighted path and its larger pool, give the
    same rows back."""
    settings = small()
    rows, held_out = training_and_eval_examples(settings)
    assert (rows, held_out) == split_examples(settings.model_copy(update={"max_examples": 100}))
    assert len(rows) == 100
    for equal in ("comparison=1", "arithmetic=2,comparison=2,counting=2"):
        assert training_and_eval_examples(small(domain_weights=equal)) == (rows, held_out)


def test_quotas_scale_each_domain_s_count_by_its_weight_and_keep_the_total():
    # 6, 3, 3 weighted 1, 3, 1 (counting not named): 6 + 9 + 3 = 18 shares of 12 rows.
    assert domain_quotas({"arithmetic": 6, "comparison": 3, "counting": 3}, {"comparison": 3}) == \
        {"arithmetic": 4, "comparison": 6, "counting": 2}
    # 7 rows weighted 1, 1, 1: counts come back whole; weighted 2, 1, 1 of 3, 2, 2: 6/10, 2/10, 2/10 of 7 = 4.2,
    # 1.4, 1.4, the one row left over going to the first of the tied remainders.
    assert domain_quotas({"a": 3, "b": 2, "c": 2}, {}) == {"a": 3, "b": 2, "c": 2}
    assert domain_quotas({"a": 3, "b": 2, "c": 2}, {"a": 2}) == {"a": 4, "b": 2, "c": 1}
    assert pool_factor({"comparison": 3}) == 3 and pool_factor({"comparison": 0.5}) == 2
    assert pool_factor({"a": 1.5, "b": 0.5}) == 3


def test_a_weight_of_3_raises_its_domain_s_share_of_the_rows_to_its_quota_with_no_problem_repeated():
    """comparison=3 on tiny-math: of the run's 100 rows comparison takes 3c / (100 + 2c), c its count among the
    first 100, from a pool three times larger, so every row is a different problem; the other domains keep
    their first problems, in the data's order."""
    before, _ = training_and_eval_examples(small())
    after, _ = training_and_eval_examples(small(domain_weights="comparison=3"))
    c = Counter(row["domain"] for row in before)["comparison"]
    quotas = domain_quotas(Counter(row["domain"] for row in before), {"comparison": 3})
    assert Counter(row["domain"] for row in after) == quotas and len(after) == 100
    assert abs(quotas["comparison"] - 300 * c / (100 + 2 * c)) < 1
    assert domain_shares(after)["train_share_comparison"] > domain_shares(before)["train_share_comparison"] * 1.5
    assert len({row["question"] for row in after}) == 100
    for domain in ("arithmetic", "counting"):
        kept = [row for row in after if row["domain"] == domain]
        assert kept == [row for row in before if row["domain"] == domain][:len(kept)]


def test_within_max_examples_a_domain_given_more_repeats_its_own_problems():
    """max_examples caps the problems taken: comparison=2 then repeats comparison's, in order."""
    pool = [{"question": f"q{i}", "domain": domain} for i, domain in enumerate("aacbaacb")]  # a 4, c 2, b 2
    rows = weighted_examples(pool, 8, {"c": 2})  # 4 + 4 + 2 = 10 shares of 8: 3.2, 3.2, 1.6 -> 3, 3, 2
    assert Counter(row["domain"] for row in rows) == {"a": 3, "c": 3, "b": 2}
    assert [row["question"] for row in rows if row["domain"] == "c"] == ["q2", "q6", "q2"]
    settings = small(max_examples=16, domain_weights="comparison=2")
    assert len(training_and_eval_examples(settings)[0]) == 16


@pytest.mark.parametrize("value, message", [
    ("comparison", "domain_weights: 'comparison': 'comparison': expected domain=weight"),
    ("=2", "domain_weights: '=2': '=2': expected domain=weight"),
    ("comparison=two", "domain_weights: 'comparison=two': 'comparison=two': the weight is not a number"),
    ("comparison=0", "domain_weights: 'comparison=0': 'comparison=0': the weight must be a finite number above 0"),
    ("comparison=-1", "domain_weights: 'comparison=-1': 'comparison=-1': the weight must be a finite number above 0"),
    ("comparison=inf", "domain_weights: 'comparison=inf': 'comparison=inf': the weight must be a finite number "
                       "above 0"),
    ("comparison=2,comparison=3", "domain_weights: 'comparison=2,comparison=3': 'comparison=3': domain "
                                  "'comparison' is weighted twice"),
])
def test_a_malformed_or_non_positive_weight_is_refused_naming_the_field_the_value_and_the_reason(value, message):
    with pytest.raises(SettingsError) as refused:
        resolve_settings(Settings, overrides={"domain_weights": value}, environ={})
    assert str(refused.value) == message


def test_an_unknown_domain_is_refused_before_launch_naming_the_data_set_s_domains(tmp_path):
    with pytest.raises(SettingsError) as refused:
        GrpoMtl().check(small(domain_weights="comparison=2,algebra=2"))
    assert str(refused.value) == ("domain_weights: 'comparison=2,algebra=2': unknown domain 'algebra' of tiny-math; "
                                  "known domains: arithmetic, comparison, counting")
    with pytest.raises(SettingsError, match="unknown domain 'counting' of tiny-math:arithmetic,comparison; "):
        GrpoMtl().check(small(dataset="tiny-math:arithmetic,comparison", domain_weights="counting=2"))
    # A file's domains are its rows': a `domain` field, else the file's name.
    data = tmp_path / "logic.jsonl"
    data.write_text("".join(f'{{"question": "{i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(200)))
    GrpoMtl().check(small(dataset=str(data), domain_weights="logic=2"))
    with pytest.raises(SettingsError, match="unknown domain 'comparison' of .*logic.jsonl; known domains: logic$"):
        GrpoMtl().check(small(dataset=str(data), domain_weights="comparison=2"))


def test_the_setting_at_its_default_leaves_grpo_mtl_s_defaults_fingerprint_as_it_was():
    """Empty is the behaviour before the setting: named among the neutral additions, it is left out of the
    fingerprint (README's grpo-mtl figures stay current); any other default would count."""
    from gpuscale.recipes.shared.defaults_fingerprint import NEUTRAL_ADDITIONS, recipe_defaults

    assert NEUTRAL_ADDITIONS["grpo-mtl"]["domain_weights"] == Settings().domain_weights == ""
    assert "domain_weights" not in recipe_defaults("grpo-mtl")
