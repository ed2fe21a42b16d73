"""Scoring: one result row per completion (with the embedded model's real tokenizer), and accuracy per domain."""

import pytest

from gpuscale.data.models import load_model
from gpuscale.data.prompts import eos_token_ids
from gpuscale.data.scoring import accuracy_by_domain, score_completion
from gpuscale.data.tasks import load_examples


@pytest.fixture(scope="module")
def tiny_math():
    model, tokenizer = load_model("tiny-math")
    return tokenizer, eos_token_ids(model, tokenizer)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_right_answer_scores_as_correct(tiny_math):
    tokenizer, eos = tiny_math
    example = {"question": "Ann has 3 apples and gets 4 more. How many?", "answer": "3 + 4 = 7.\n#### 7",
               "domain": "arithmetic"}
    tokens = _tokens(tokenizer, "3 + 4 = 7.\n#### 7") + [eos[0]]
    row = score_completion(5, 2, example, tokens, tokenizer, eos, answer_mode="strict")
    assert (row["index"], row["chain"], row["domain"], row["question"]) == (5, 2, "arithmetic", example["question"])
    assert row["completion"] == "3 + 4 = 7.\n#### 7"  # the end-of-sequence token is not part of the text
    assert (row["gold"], row["extracted"], row["correct"]) == ("7", "7", True)
    assert row["token_ids"] == tokens and row["tokens"] == len(tokens)


def test_a_wrong_or_missing_answer_does_not(tiny_math):
    tokenizer, eos = tiny_math
    example = load_examples("tiny-math", "test", max_examples=1)[0]
    wrong = int(example["answer"].rsplit("#### ", 1)[1]) + 1
    row = score_completion(0, 0, example, _tokens(tokenizer, f"#### {wrong}"), tokenizer, eos)
    assert row["extracted"] == str(wrong) and row["correct"] is False
    row = score_completion(0, 0, example, _tokens(tokenizer, "no idea"), tokenizer, eos, answer_mode="strict")
    assert row["extracted"] is None and row["correct"] is False


def test_ids_beyond_the_vocabulary_are_dropped(tiny_math):
    """A random model at a real model's shape samples ids its stand-in tokenizer does not have."""
    tokenizer, eos = tiny_math
    example = {"question": "q", "answer": "#### 7"}
    tokens = _tokens(tokenizer, "#### 7") + [len(tokenizer) + 100]
    row = score_completion(0, 0, example, tokens, tokenizer, eos)
    assert row["completion"] == "#### 7" and row["correct"] and row["tokens"] == len(tokens)
    assert row["domain"] is None


def test_accuracy_overall_and_per_domain():
    rows = [{"correct": True, "domain": "counting"}, {"correct": False, "domain": "counting"},
            {"correct": True, "domain": "arithmetic"}, {"correct": False, "domain": None}]
    assert accuracy_by_domain(rows) == {"accuracy": 0.5, "accuracy_arithmetic": 1.0, "accuracy_counting": 0.5}
    assert list(accuracy_by_domain(rows)) == ["accuracy", "accuracy_arithmetic", "accuracy_counting"]
    assert accuracy_by_domain([]) == {"accuracy": None}  # nothing measured is not 0%


def test_decoding_many_rows_at_once_equals_decoding_each():
    from gpuscale.data.models import load_model
    from gpuscale.data.scoring import decode_completion, decode_completions

    _model, tokenizer = load_model("tiny-math")
    eos = [tokenizer.eos_token_id]
    rows = [tokenizer("1 + 2 = 3\n#### 3")["input_ids"] + eos, [5, 6, 7, 10**6], []]
    assert decode_completions(rows, tokenizer, eos) == [decode_completion(r, tokenizer, eos) for r in rows]
    assert decode_completions(rows, tokenizer, eos)[0].endswith("#### 3")
