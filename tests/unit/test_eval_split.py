"""`eval_split`: what a run scores and trains on (data/tasks.py's `held_out_split`, the one rule every
recipe goes through). With validation the scored problems are a generated task's validation split (a
file's or gsm8k's: from the training data), never trained on and never test problems; with test (the
default) the test split. Neither changes with the seed (tests/unit/test_near_duplicates.py)."""

from __future__ import annotations

import json

import pytest

from gpuscale.data.data_error import DataError
from gpuscale.data.gsm8k_hub import GSM8K_TRAIN_SIZE
from gpuscale.data.tasks import evaluation_examples, held_out_split, load_examples
from gpuscale.data.tiny_math import TINY_MATH_SIZES, split_of
from gpuscale.recipes.eggroll import Eggroll
from gpuscale.recipes.eggroll import Settings as EggrollSettings
from gpuscale.recipes.grpo_mtl import GrpoMtl
from gpuscale.recipes.grpo_mtl import Settings as GrpoSettings
from gpuscale.recipes.grpo_mtl.data import training_and_eval_examples as grpo_examples
from gpuscale.recipes.power_sampling import PowerSampling
from gpuscale.recipes.power_sampling import Settings as PowerSettings
from gpuscale.recipes.sft import SFT
from gpuscale.recipes.sft import Settings as SftSettings
from gpuscale.recipes.shared.data_checks import training_count
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.recipes.shared.training_data import training_and_eval_examples
from gpuscale.runs.settings import SettingsError, resolve_settings


def questions(examples: list[dict]) -> list[str]:
    return [example["question"] for example in examples]


def write_jsonl(path, count: int) -> str:
    path.write_text("".join(json.dumps({"question": f"What is {n} plus 1?", "answer": f"#### {n + 1}"}) + "\n"
                            for n in range(count)))
    return str(path)


def rows(numbers) -> list[str]:
    return [f"What is {n} plus 1?" for n in numbers]


# ---- named tasks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["tiny-math", "tiny-math:counting", "tiny-math-conflict"])
def test_validation_problems_are_their_own_split_the_same_for_every_seed_and_neither_trained_on_nor_test(dataset):
    # 15: odd, so that a tiny-math-conflict twin pair is cut in two (its twins share one question).
    train, validation = held_out_split(dataset, "validation", 15, 40, seed=0)
    assert len(validation) == 15 and len(train) == 40
    other_train, other_validation = held_out_split(dataset, "validation", 15, 40, seed=3)
    assert other_validation == validation  # the seed changes what is trained on, never what is scored
    assert questions(other_train) != questions(train)
    assert all(split_of(question) == "validation" for question in questions(validation))
    assert not set(questions(validation)) & (set(questions(train)) | set(questions(other_train)))
    test_split = set(questions(load_examples(dataset, "test", None, seed=0)))
    assert not set(questions(validation)) & test_split
    # The run trains on the first max_examples problems of the training split of its seed.
    assert train == load_examples(dataset, "train", 40, seed=0)


def test_the_test_split_is_unchanged():
    train, test = held_out_split("tiny-math", "test", 20, 50, seed=1)
    assert test == load_examples("tiny-math", "test", 20, seed=1)
    assert train == load_examples("tiny-math", "train", 50, seed=1)
    # The recipes' own entry points: the default eval_split is test, the same split.
    settings = SftSettings(max_examples=50, eval_examples=20, seed=1)
    assert settings.eval_split == "test"
    assert training_and_eval_examples(settings) == (train, test)


def test_every_recipe_that_scores_held_out_problems_splits_through_the_one_rule():
    validation = {"eval_split": "validation", "eval_examples": 6, "max_examples": 10, "seed": 2}
    expected = held_out_split("tiny-math", "validation", 6, 10, seed=2)
    for settings_cls in (SftSettings, EggrollSettings, get_recipe("rft").settings_cls):
        assert training_and_eval_examples(settings_cls(**validation)) == expected
    assert grpo_examples(GrpoSettings(**validation)) == expected
    # power-sampling scores without training: its validation problems are the same ones.
    power = PowerSettings(split="validation", max_examples=6, seed=2)
    assert evaluation_examples(power.dataset, power.split, power.max_examples, seed=2) == expected[1]


# ---- JSONL files ----------------------------------------------------------------------------------


def test_a_file_keeps_its_test_rows_and_takes_validation_from_the_rows_after_them(tmp_path):
    data = write_jsonl(tmp_path / "plus.jsonl", 20)
    train, test = held_out_split(data, "test", 3, 5)
    assert questions(test) == rows(range(3)) and questions(train) == rows(range(3, 8))  # as before
    train, validation = held_out_split(data, "validation", 3, 5)
    assert questions(validation) == rows(range(3, 6))  # the training data: the file less its test rows
    assert questions(train) == rows(range(6, 11))  # neither test nor validation rows trained on
    train, validation = held_out_split(data, "validation", 3, None)
    assert questions(train) == rows(range(6, 20))
    # Scoring only (power-sampling): the same validation rows; the test rows stay the file's first.
    assert questions(evaluation_examples(data, "validation", 3)) == rows(range(3, 6))
    assert questions(evaluation_examples(data, "test", 3)) == rows(range(3))


def test_a_file_question_written_twice_is_not_trained_on_when_scored(tmp_path):
    data = tmp_path / "twice.jsonl"
    lines = [{"question": f"q{n % 4}", "answer": f"#### {n}"} for n in range(12)]  # q0..q3, three times
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    train, validation = held_out_split(str(data), "validation", 1, None)
    assert questions(validation) == ["q1"]  # q0 is the test row
    assert set(questions(train)) == {"q2", "q3"}


def test_an_unknown_eval_split_is_refused():
    with pytest.raises(DataError, match="unknown eval_split 'valid'; known: test, validation, test-v1"):
        held_out_split("tiny-math", "valid", 2, 2)
    with pytest.raises(DataError, match="needs a count"):
        evaluation_examples("tiny-math", "validation", None)


# ---- settings and the checks before launch ---------------------------------------------------------


@pytest.mark.parametrize("recipe", ["sft", "rft", "grpo-mtl", "eggroll"])
def test_a_bad_value_is_refused_naming_the_field(recipe):
    settings_cls = get_recipe(recipe).settings_cls
    with pytest.raises(SettingsError, match=r"eval_split: 'valid': Input should be 'test', 'validation' or 'test-v1'"):
        resolve_settings(settings_cls, overrides={"eval_split": "valid"}, environ={})
    for split in ("validation", "test-v1"):
        assert resolve_settings(settings_cls, overrides={"eval_split": split}, environ={}).eval_split == split
    description = settings_cls.model_fields["eval_split"].description
    assert "validation" in description and "test-v1 = tiny-math's test split before 2026-11-29" in description


def test_power_sampling_takes_eval_split_as_its_split_and_needs_a_count():
    settings = resolve_settings(PowerSettings, overrides={"eval_split": "validation", "max_examples": 4}, environ={})
    assert settings.split == "validation"
    PowerSampling().check(settings)
    with pytest.raises(SettingsError, match="split: validation: needs max_examples"):
        PowerSampling().check(settings.model_copy(update={"max_examples": None}))
    old = resolve_settings(PowerSettings, overrides={"eval_split": "test-v1"}, environ={})
    assert old.split == "test-v1"
    assert "test-v1 = tiny-math's test split before 2026-11-29" in PowerSettings.model_fields["split"].description
    PowerSampling().check(old)


def test_checks_count_the_validation_rows_out_of_a_file(tmp_path):
    data = write_jsonl(tmp_path / "plus.jsonl", 10)
    settings = SftSettings(dataset=data, eval_examples=4, max_examples=None)
    SFT().check(settings)  # 6 rows to train on
    SFT().check(settings.model_copy(update={"eval_split": "validation"}))  # 2 rows left
    with pytest.raises(SettingsError, match="eval_examples: 5: holds out every example"):
        SFT().check(settings.model_copy(update={"eval_split": "validation", "eval_examples": 5}))

    grpo = GrpoSettings(dataset=data, eval_examples=2, prompts_per_step=4, num_generations=2, batch_size=4,
                        eval_split="validation", max_examples=None)
    GrpoMtl().check(grpo)  # 10 - 2 test - 2 validation = 6 rows
    with pytest.raises(SettingsError, match=r"prompts_per_step: 8: needs at least 8 training examples, the run "
                       r"has 6 \(dataset=.*, after eval_examples=2 held out for test and 2 for validation\)"):
        GrpoMtl().check(grpo.model_copy(update={"prompts_per_step": 8}))

    # eggroll holds its scored rows out of training as the other recipes do.
    eggroll = EggrollSettings(dataset=data, eval_examples=3, prompts_per_step=4, population=4)
    Eggroll().check(eggroll)  # 7 rows
    with pytest.raises(SettingsError, match="the run has 4"):
        Eggroll().check(eggroll.model_copy(update={"eval_split": "validation", "prompts_per_step": 5}))


def test_a_named_split_of_known_size_counts_what_validation_leaves():
    size = GSM8K_TRAIN_SIZE
    settings = GrpoSettings(dataset="gsm8k", eval_split="validation", eval_examples=100, max_examples=None)
    count, source = training_count(settings, lambda s: [])
    assert count == size - 100 and "after eval_examples=100 held out for validation" in source
    # tiny-math's validation problems are a split of their own: its training split stays whole.
    tiny = settings.model_copy(update={"dataset": "tiny-math", "max_examples": TINY_MATH_SIZES["train"]})
    assert training_count(tiny, lambda s: [])[0] == TINY_MATH_SIZES["train"]
    # max_examples within what is left: the validation problems are loaded on top of it.
    assert training_count(settings.model_copy(update={"max_examples": 50}), lambda s: [])[0] == 50
    assert training_count(settings.model_copy(update={"eval_split": "test"}), lambda s: [])[0] is None
