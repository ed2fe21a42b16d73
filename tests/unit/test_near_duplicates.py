"""What a run is scored on: one fixed test set for every seed, a validation split the base
model never saw, tiny-math's structurally new subset (data/near_duplicates.py), its two test splits
(test-v1 kept for history, test-v2 drawn apart from every problem scored before), and one strict
answer rule for every recipe's held-out figure."""

from __future__ import annotations

import collections
import hashlib
import json

import pytest

from gpuscale.data import tiny_math
from gpuscale.data.models import model_path
from gpuscale.data.near_duplicates import structure_key
from gpuscale.data.scoring import HELD_OUT_ANSWER_MODE, NO_NEW_SUBSET, held_out_figures, new_subset_size
from gpuscale.data.splits import FRESH_TEST_SPLIT, OLD_TEST_SPLIT, TEST_SPLIT_EDITION
from gpuscale.data.tasks import evaluation_examples, held_out_split, load_examples
from gpuscale.data.tiny_math import (
    HELD_OUT_SPLITS,
    PRETRAINING_COUNT,
    PRETRAINING_SEED,
    TINY_MATH_DOMAINS,
    TINY_MATH_SIZES,
    TINY_MATH_WEIGHTS,
    held_out_new_keys,
    is_structurally_new,
    is_test_question,
    pretraining_examples,
    pretraining_keys,
    pretraining_questions,
    split_of,
    tiny_math_examples,
)
from gpuscale.recipes.sft import Settings as SftSettings
from gpuscale.recipes.shared.training_data import training_and_eval_examples

# How many questions of the training split (for each seed) the tests read: enough that every question
# template of gpuscale/data/tiny_math.py occurs many times (structure_key, gpuscale/data/near_duplicates.py).
TRAINING_LOOKED_AT = 20_000
TRAINING_SEEDS = (0, 1, 2)
# sha256 of test-v1's rows (`rows_digest`), computed on main at 7753205, before test-v1 had a name: the
# 2,000 problems `test` gave every figure until 2026-11-29.
OLD_TEST_DIGEST = "37d130299dae166ad4b78652b455f19daf719fe5458017c192cca6256c7d4e16"
# sha256 of test-v2's rows, computed when it was drawn (2026-11-29): it must never change either, or the
# figures scored on it stop comparing.
FRESH_TEST_DIGEST = "3fbc1fd02e6b9bab4b14892a030ef71eae136d044deae1f84af2de28cead7a8e"


def questions(examples) -> list[str]:
    return [example["question"] for example in examples]


def keys(examples) -> set[str]:
    return {structure_key(question) for question in questions(examples)}


def rows_digest(rows) -> str:
    return hashlib.sha256(json.dumps(list(rows), sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    """The held-out splits whole (test, and each by its name), and the first TRAINING_LOOKED_AT training
    problems of each of TRAINING_SEEDS."""
    return {"test": load_examples("tiny-math", "test", None, seed=0),
            **{split: tiny_math_examples(split, None, seed=0) for split in HELD_OUT_SPLITS},
            **{f"train{seed}": load_examples("tiny-math", "train", TRAINING_LOOKED_AT, seed=seed)
               for seed in TRAINING_SEEDS}}


# ---- the near-duplicate rule ----------------------------------------------------------------------


def test_the_same_problem_with_another_name_and_noun_is_a_near_duplicate_and_other_numbers_are_not():
    ann = "Ann has 3 apples. Ann gets 4 more. How many apples does Ann have now?"
    raj = "Raj has 3 coins. Raj gets 4 more. How many coins does Raj have now?"
    assert structure_key(ann) == structure_key(raj) == (
        "<name1> has 3 <thing1>. <name1> gets 4 more. How many <thing1> does <name1> have now?")
    assert structure_key(ann) != structure_key(ann.replace("3", "5"))


def test_placeholders_keep_who_is_who_and_the_list_s_pattern():
    # Comparison: the people renamed is a near-duplicate; the amounts given to other people is not.
    first = "Ann has 3 coins, Ben has 9 coins and Cara has 5 coins. How many coins does the one with the most have?"
    renamed = first.replace("Ann", "X").replace("Ben", "Ann").replace("X", "Ben").replace("coins", "shells")
    swapped = "Ann has 9 coins, Ben has 3 coins and Cara has 5 coins. How many coins does the one with the most have?"
    assert structure_key(first) == structure_key(renamed) != structure_key(swapped)
    # Counting: other words in the same pattern are a near-duplicate; another pattern is not.
    listed = "Here is a list: apple, pear, apple, plum. How many times does apple appear in it?"
    assert structure_key(listed) == structure_key(
        "Here is a list: fig, kiwi, fig, lime. How many times does fig appear in it?")
    assert structure_key(listed) != structure_key(
        "Here is a list: apple, apple, pear, plum. How many times does apple appear in it?")
    # Whole words only: the list's "apple" is not the noun "apples".
    assert structure_key("apples and apple") == "<thing1> and <word1>"


# ---- one fixed test set, a validation split the base never saw ------------------------------------


def test_the_test_problems_are_the_same_for_every_seed():
    assert load_examples("tiny-math", "test", None, seed=0) == load_examples("tiny-math", "test", None, seed=1)
    assert load_examples("tiny-math-conflict", "test", 60, seed=0) == load_examples("tiny-math-conflict", "test", 60,
                                                                                  seed=1)
    # Every recipe's held-out rows: the seed changes the training problems only.
    runs = [training_and_eval_examples(SftSettings(max_examples=30, eval_examples=40, seed=seed)) for seed in (0, 1)]
    assert runs[0][1] == runs[1][1] == load_examples("tiny-math", "test", 40)
    assert questions(runs[0][0]) != questions(runs[1][0])


def test_the_pretraining_problems_are_the_embedded_model_s():
    info = json.loads((model_path("tiny-math") / "training.json").read_text())  # what train_tiny.py wrote
    assert (info["seed"], info["steps"] * info["batch_size"]) == (PRETRAINING_SEED, PRETRAINING_COUNT)
    first = questions(pretraining_examples(200))
    assert first == questions(pretraining_examples())[:200] and len(pretraining_questions()) == PRETRAINING_COUNT
    # Drawn before validation had a bucket: they hold validation questions, which validation leaves out.
    assert "test" not in {split_of(q) for q in first} and "validation" in {split_of(q) for q in first}


def test_train_validation_and_test_are_disjoint_and_validation_holds_no_pretraining_problem(splits):
    validation, test = set(questions(splits["validation"])), set(questions(splits["test"]))
    assert len(validation) == TINY_MATH_SIZES["validation"] and len(test) == TINY_MATH_SIZES["test"]
    assert not validation & pretraining_questions()
    assert not validation & test
    for seed in (0, 1):
        assert not set(questions(splits[f"train{seed}"])) & (validation | test)
    assert {split_of(q) for q in validation} == {"validation"} and {split_of(q) for q in test} == {"test"}
    # The same validation problems whatever the seed (eval_split=validation).
    assert held_out_split("tiny-math", "validation", 50, 0, seed=4)[1] == splits["validation"][:50]


# ---- two test splits: test-v1 kept for history, test-v2 scored by no selection --------------------


def test_the_old_test_split_is_test_v1_with_exactly_the_problems_test_gave_before(splits):
    assert rows_digest(splits[OLD_TEST_SPLIT]) == OLD_TEST_DIGEST
    assert splits["test"] == splits[TEST_SPLIT_EDITION]  # `test` is the edition's, one constant
    # Every way a run names it: a data set's split, a training recipe's eval_split, power-sampling's split.
    old = splits[OLD_TEST_SPLIT]
    assert load_examples("tiny-math", OLD_TEST_SPLIT, 30, seed=3) == old[:30]
    assert held_out_split("tiny-math", OLD_TEST_SPLIT, 30, 20, seed=3) == (load_examples("tiny-math", "train", 20,
                                                                                         seed=3), old[:30])
    run = training_and_eval_examples(SftSettings(eval_split=OLD_TEST_SPLIT, eval_examples=30, max_examples=20))
    assert run[1] == old[:30]
    assert evaluation_examples("tiny-math", OLD_TEST_SPLIT, 30) == old[:30]
    counting = [example for example in old if example["domain"] == "counting"]
    assert load_examples("tiny-math:counting", OLD_TEST_SPLIT, 25) == counting[:25]


def test_only_tiny_math_s_test_split_was_drawn_again(tmp_path):
    assert load_examples("tiny-math-conflict", OLD_TEST_SPLIT, 40) == load_examples("tiny-math-conflict", "test", 40)
    data = tmp_path / "plus.jsonl"
    data.write_text("".join(json.dumps({"question": f"{n} + 1?", "answer": f"#### {n + 1}"}) + "\n" for n in range(9)))
    assert held_out_split(str(data), OLD_TEST_SPLIT, 3, None) == held_out_split(str(data), "test", 3, None)


def test_the_fresh_test_split_shares_no_problem_with_anything_scored_or_trained_on(splits):
    fresh = splits[FRESH_TEST_SPLIT]
    assert TEST_SPLIT_EDITION == FRESH_TEST_SPLIT  # `test` is test-v2's since 2026-11-29
    assert len(set(questions(fresh))) == len(fresh) == TINY_MATH_SIZES["test"]
    assert all(is_test_question(question) for question in questions(fresh))
    scored = splits[OLD_TEST_SPLIT] + splits["validation"]
    trained = set().union(*(questions(splits[f"train{seed}"]) for seed in TRAINING_SEEDS))
    assert not set(questions(fresh)) & (set(questions(scored)) | pretraining_questions() | trained)
    assert not keys(fresh) & keys(scored)  # no near-duplicate of a problem a selection was made on
    # Like test-v1, it holds structurally new problems and near-duplicates of pretraining problems.
    assert {example["structurally_new"] for example in fresh} == {True, False}


def test_the_fresh_test_split_is_fixed(splits):
    assert rows_digest(splits[FRESH_TEST_SPLIT]) == FRESH_TEST_DIGEST
    # the run's seed chooses no test problem
    assert tiny_math_examples(FRESH_TEST_SPLIT, None, seed=5) == splits[FRESH_TEST_SPLIT]


def test_the_fresh_test_split_keeps_the_domains_shares(splits):
    fresh = splits[FRESH_TEST_SPLIT]
    for count in (500, len(fresh)):  # a run's eval_examples, and the whole split
        shares = collections.Counter(example["domain"] for example in fresh[:count])
        for domain, weight in zip(TINY_MATH_DOMAINS, TINY_MATH_WEIGHTS):
            assert shares[domain] / count == pytest.approx(weight, abs=0.03), (count, domain)


# ---- the structurally new subset ------------------------------------------------------------------


def test_held_out_problems_are_marked_and_no_training_problem_is_a_near_duplicate_of_a_new_one(splits):
    for split in HELD_OUT_SPLITS:
        marked = splits[split]
        assert all(example["structurally_new"] == is_structurally_new(example["question"]) for example in marked)
        new_keys = keys(example for example in marked if example["structurally_new"])
        assert not new_keys & pretraining_keys() and new_keys <= held_out_new_keys()
        for seed in TRAINING_SEEDS:
            assert not new_keys & keys(splits[f"train{seed}"])
    # Most arithmetic problems of test-v1 are a pretraining problem with other names and numbers (the
    # structure_key of data/near_duplicates.py); nearly every comparison problem is structurally new.
    counts = collections.Counter((e["domain"], e["structurally_new"]) for e in splits[OLD_TEST_SPLIT])
    arithmetic_new = counts["arithmetic", True] / (counts["arithmetic", True] + counts["arithmetic", False])
    assert 0.1 < arithmetic_new < 0.35
    assert counts["comparison", True] > 0.9 * (counts["comparison", True] + counts["comparison", False])


def test_held_out_figures_report_the_new_subset_only_where_the_rows_are_marked():
    rows = [{"domain": "a", "correct": True, "structurally_new": True},
            {"domain": "a", "correct": False, "structurally_new": True},
            {"domain": "b", "correct": True, "structurally_new": False}]
    figures = held_out_figures(rows)
    assert figures["accuracy_new"] == 0.5 and figures["accuracy"] == pytest.approx(2 / 3)
    assert held_out_figures([{**row, "structurally_new": False} for row in rows])["accuracy_new"] is None
    unmarked = [{**row, "structurally_new": None} for row in rows]
    assert "accuracy_new" not in held_out_figures(unmarked)
    assert new_subset_size(rows) == {"eval_examples_new": 2}
    assert new_subset_size([{"question": "q"}]) == {"eval_examples_new": None,
                                                    "structurally_new_unavailable": NO_NEW_SUBSET}
    assert new_subset_size([]) == {}


# ---- one answer rule ------------------------------------------------------------------------------


class ScriptedEngine:
    """A generation engine that answers every prompt with the next of `ScriptedEngine.answers`."""

    answers: list[list[int]] = []

    def __init__(self, *args, **kwargs):
        pass

    def generate(self, prompts, max_new_tokens, sampling, generator):
        answers = ScriptedEngine.answers[: len(prompts)]
        return type("Generation", (), {"sequences": lambda self: answers})()


def test_every_recipe_s_held_out_figure_is_strict(monkeypatch, tmp_path):
    import torch

    from gpuscale.data.models import load_model
    from gpuscale.engines import generation
    from gpuscale.engines.distributed import RankContext
    from gpuscale.recipes.shared.evaluation import held_out_evaluation

    assert HELD_OUT_ANSWER_MODE == "strict"
    model, tokenizer = load_model("tiny-math", dtype=torch.float32, device=torch.device("cpu"))
    examples = [{"question": f"What is {n} + 4?", "answer": f"#### {n + 4}", "domain": "arithmetic"} for n in (3, 5)]
    # The first answer states the right number without the `#### N` line a lenient rule would credit.
    texts = ["3 + 4 = 7.", "5 + 4 = 9.\n#### 9"]
    ScriptedEngine.answers = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    monkeypatch.setattr(generation, "GenerationEngine", ScriptedEngine)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    figures = held_out_evaluation(model, tokenizer, examples, ctx, "before", max_new_tokens=8, memory_share=0.5)
    assert figures["accuracy_greedy_before"] == figures["accuracy_sampled_before"] == 0.5
    assert figures["eval_examples_new"] is None and "tiny-math" in figures["structurally_new_unavailable"]


def test_the_held_out_splits_are_read_from_the_user_s_cache_and_a_broken_file_is_made_again(monkeypatch, tmp_path):

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tiny_math.held_out_cache_path()
    assert path.parent == tmp_path / "gpuscale"
    # Both test splits by name in one file: `test` is whichever TEST_SPLIT_EDITION names, never the
    # file's guess, so no cache is read as the other edition.
    whole = {"test-v1": [{"question": "old"}], "test-v2": [{"question": "new"}], "validation": [], "new_keys": ["k"]}
    path.parent.mkdir()
    path.write_text(json.dumps(whole))
    tiny_math._held_out.cache_clear()
    try:
        assert tiny_math.held_out_problems(OLD_TEST_SPLIT) == ({"question": "old"},)
        for edition, question in ((FRESH_TEST_SPLIT, "new"), (OLD_TEST_SPLIT, "old")):
            monkeypatch.setattr(tiny_math, "TEST_SPLIT_EDITION", edition)
            assert tiny_math.held_out_problems("test") == ({"question": question},)
        assert tiny_math.held_out_new_keys() == {"k"}
        path.write_text('{"test": [')  # a write cut short: computed again and written whole
        monkeypatch.setattr(tiny_math, "_computed_held_out", lambda: {**whole, "new_keys": ["again"]})
        tiny_math._held_out.cache_clear()
        assert tiny_math.held_out_new_keys() == {"again"}
        assert json.loads(path.read_text())["new_keys"] == ["again"]
    finally:
        tiny_math._held_out.cache_clear()  # the other tests read the real splits


def test_a_whole_training_split_is_generated_once_and_read_from_the_cache_after(monkeypatch, tmp_path):
    """grpo-mtl and eggroll train on the whole split: every rank of every run generated its 200,000
    problems (5.6 s on 2 cores) before the cache."""

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(tiny_math.TINY_MATH_SIZES, "train", 300)  # a small "whole split" for the test
    monkeypatch.setattr(tiny_math, "CACHED_TRAINING_FROM", 100)
    generated = tiny_math.first_of_split(tiny_math._training_stream(7), 300, None, None)
    path = tiny_math._cache_path("train-seed7")
    older = path.with_name("tiny-math-train-seed7-0123456789abcdef.json")  # another code version's
    older.parent.mkdir(exist_ok=True)  # the held-out splits' cache may be there already
    older.write_text("[]")
    assert tiny_math.tiny_math_examples("train", None, seed=7) == generated and path.exists() and not older.exists()
    # Read back from the file, not generated again; a subset and a domain filter take the same rows.
    monkeypatch.setattr(tiny_math, "_training_stream", lambda seed: pytest.fail("generated again"))
    assert tiny_math.tiny_math_examples("train", None, seed=7) == generated
    assert tiny_math.tiny_math_examples("train", 200, seed=7) == generated[:200]
    counting = [row for row in generated if row["domain"] == "counting"][:150]
    assert tiny_math.tiny_math_examples("train", 150, seed=7, domains=("counting",)) == counting
    rows = tiny_math.tiny_math_examples("train", None, seed=7)
    rows[0]["question"] = "changed"  # the caller owns its rows: the next call reads them afresh
    assert tiny_math.tiny_math_examples("train", None, seed=7)[0] == generated[0]

