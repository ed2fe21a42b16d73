"""Tasks: the tiny-math generator (deterministic, disjoint splits, right answers) and the GSM8K loader."""

import json
import re
from collections import Counter

import pytest

from conftest import python_offline
from gpuscale.data.tasks import (
    KNOWN_TASKS,
    TINY_MATH_DOMAINS,
    DataError,
    gold_answer,
    is_test_question,
    load_examples,
)

NUMBER = re.compile(r"-?\d+")
COUNTING_QUESTION = re.compile(r"Here is a list: (.*)\. How many times does (\w+) appear in it\?")


@pytest.fixture(scope="module")
def tiny_test():
    return load_examples("tiny-math", "test", max_examples=600, seed=0)


# ---------------------------------------------------------------------------------------------------
# tiny-math


def test_same_seed_same_problems_other_seed_other_problems():
    first = load_examples("tiny-math", "train", max_examples=100, seed=0)
    assert first == load_examples("tiny-math", "train", max_examples=100, seed=0)
    other = load_examples("tiny-math", "train", max_examples=100, seed=1)
    assert len({e["question"] for e in first} & {e["question"] for e in other}) < 10


def test_train_and_test_never_share_a_question(tiny_test):
    train = load_examples("tiny-math", "train", max_examples=5000, seed=0)
    assert {e["question"] for e in train}.isdisjoint({e["question"] for e in tiny_test})
    # and the split does not depend on the seed: another seed's test questions are test questions too
    assert all(is_test_question(e["question"]) for e in load_examples("tiny-math", "test", 50, seed=7))


def test_problems_within_a_split_are_distinct(tiny_test):
    assert len({e["question"] for e in tiny_test}) == len(tiny_test)


def test_every_domain_appears_and_is_labelled(tiny_test):
    counts = Counter(e["domain"] for e in tiny_test)
    assert set(counts) == set(TINY_MATH_DOMAINS)
    assert min(counts.values()) >= 60


def test_answers_are_in_gsm8k_format(tiny_test):
    for example in tiny_test:
        *steps, last = example["answer"].split("\n")
        assert steps, "worked steps come before the answer"
        assert re.fullmatch(r"#### -?\d+", last)
        assert gold_answer(example) == last.removeprefix("#### ")


def _evaluate_left_to_right(expression: str) -> int:
    """Evaluate '(a op b) op c' without trusting Python's eval of generator output."""
    tokens = re.findall(r"\d+|[+\-*]", expression)
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
    return value


def test_arithmetic_answers_are_right(tiny_test):
    for example in (e for e in tiny_test if e["domain"] == "arithmetic"):
        expression = example["expression"]
        # The expression uses the question's numbers, in the question's order.
        assert NUMBER.findall(expression) == NUMBER.findall(example["question"])
        assert int(gold_answer(example)) == _evaluate_left_to_right(expression)
        for step in example["answer"].split("\n")[:-1]:  # each worked step is true arithmetic
            left, right = step.rstrip(".").split(" = ")
            assert _evaluate_left_to_right(left) == int(right), step


def test_comparison_answers_are_right(tiny_test):
    for example in (e for e in tiny_test if e["domain"] == "comparison"):
        question = example["question"]
        values = sorted(int(n) for n in NUMBER.findall(question))
        if " more " in question:
            expected = values[-1] - values[0]
        elif "the most" in question:
            expected = values[-1]
        elif "the fewest" in question:
            expected = values[0]
        else:
            assert "in the middle" in question and len(values) == 3
            expected = values[1]
        assert int(gold_answer(example)) == expected, question
        assert example["answer"].startswith("In order: " + ", ".join(map(str, values)) + ".")


def test_counting_answers_are_right(tiny_test):
    for example in (e for e in tiny_test if e["domain"] == "counting"):
        match = re.fullmatch(COUNTING_QUESTION, example["question"])
        words, target = match.group(1).split(", "), match.group(2)
        assert int(gold_answer(example)) == words.count(target)


def test_max_examples_keeps_the_first_ones():
    ten = load_examples("tiny-math", "test", max_examples=10)
    assert len(ten) == 10
    assert ten == load_examples("tiny-math", "test", max_examples=25)[:10]
    assert load_examples("tiny-math", "test", max_examples=0) == []


# ---------------------------------------------------------------------------------------------------
# GSM8K format from a local JSONL file

GSM8K_ROWS = [
    {"question": "Janet has 16 eggs and eats 3. How many are left?", "answer": "16 - 3 = <<16-3=13>>13\n#### 13"},
    {"question": "A shirt costs $1,200 and a hat $300. Total?", "answer": "1200 + 300 = 1500\n#### 1,500"},
    {"question": "How much is 2 * 3?", "answer": "6"},  # a bare number is accepted as the answer
]


def _write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_local_jsonl_loads_in_order(tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K_ROWS)
    examples = load_examples(str(path))
    assert [e["question"] for e in examples] == [row["question"] for row in GSM8K_ROWS]
    assert [gold_answer(e) for e in examples] == ["13", "1500", "6"]
    assert examples[2]["answer"] == "#### 6"
    assert load_examples(str(path), max_examples=2) == examples[:2]


def test_local_jsonl_keeps_a_domain_field(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [{**GSM8K_ROWS[0], "domain": "eggs"}])
    assert load_examples(str(path))[0]["domain"] == "eggs"


def _data_error(*args, **kwargs) -> str:
    with pytest.raises(DataError) as error:
        load_examples(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message, "the message is one line"
    return message


def test_missing_field_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], {"question": "no answer here"}])
    message = _data_error(str(path))
    assert str(path) in message and "line 2" in message and "'answer'" in message


def test_broken_line_names_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "broken.jsonl", [GSM8K_ROWS[0], "", '{"question": "cut off', GSM8K_ROWS[1]])
    message = _data_error(str(path))
    assert str(path) in message and "line 3" in message and "JSON" in message


def test_answer_without_a_final_number_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "words.jsonl", [{"question": "q", "answer": "it is seven"}])
    assert "line 1" in _data_error(str(path))


def test_missing_file(tmp_path):
    assert "no such file" in _data_error(str(tmp_path / "absent.jsonl"))


def test_unknown_task_lists_the_known_ones():
    message = _data_error("tiny-maths")
    assert "'tiny-maths'" in message
    assert all(name in message for name in KNOWN_TASKS)


def test_unknown_split_and_negative_max_examples():
    assert "train, test" in _data_error("tiny-math", split="validation")
    assert "max_examples" in _data_error("tiny-math", max_examples=-1)


def test_gold_answer_needs_the_final_line():
    assert gold_answer({"answer": "steps\n#### 1,000"}) == "1000"
    assert gold_answer("#### -4") == "-4"
    with pytest.raises(DataError):
        gold_answer({"answer": "no final line"})


def test_gsm8k_without_the_hub_is_one_clear_line(tmp_path):
    """Offline with an empty cache: DataError saying so and pointing to a local JSONL file."""
    pytest.importorskip("datasets")
    code = (
        "from gpuscale.data.tasks import load_examples, DataError\n"
        "try:\n    load_examples('gsm8k', max_examples=5)\n"
        "except DataError as error:\n    print('DataError:', error)\n"
    )
    result = python_offline(code, tmp_path / "hf")
    lines = [line for line in result.stdout.splitlines() if line.startswith("DataError:")]
    assert len(lines) == 1, result.stdout + result.stderr
    assert "openai/gsm8k" in lines[0] and "hub" in lines[0] and ".jsonl" in lines[0]
