"""Tasks: the tiny-math generator (deterministic, disjoint splits, right answers) and the GSM8K loader."""

import json
import re
import sys
from collections import Counter

import pytest

from conftest import python_offline
from gpuscale.data.data_error import DataError
from gpuscale.data.tasks import (
    KNOWN_TASKS,
    check_dataset,
    check_dataset_name,
    gold_answer,
    load_examples,
    parse_dataset,
)
from gpuscale.data.tiny_math import TINY_MATH_DOMAINS, is_test_question

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
    # and the split does not depend on the seed: the test questions of another seed are test questions too
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
    path = _write_jsonl(tmp_path / "mixed.jsonl", [{**GSM8K_ROWS[0], "domain": "eggs"}, GSM8K_ROWS[1]])
    assert [e["domain"] for e in load_examples(str(path))] == ["eggs", "mixed"]  # else the file's stem


def test_the_domain_setting_names_a_file_s_rows_that_name_none(tmp_path):
    """gsm8k's test.jsonl gave accuracy_test: a row without a domain field takes the file's name unless
    the run's `domain` names it; a row's own field still wins. Through the held-out split too."""
    from gpuscale.data.tasks import evaluation_examples, held_out_split

    path = _write_jsonl(tmp_path / "test.jsonl", [{**GSM8K_ROWS[0], "domain": "eggs"}, *GSM8K_ROWS[1:]])
    assert [e["domain"] for e in load_examples(str(path))] == ["eggs", "test", "test"]
    assert [e["domain"] for e in load_examples(str(path), domain="gsm8k")] == ["eggs", "gsm8k", "gsm8k"]
    train, scored = held_out_split(str(path), "test", 1, domain="gsm8k")
    assert [e["domain"] for e in scored] == ["eggs"] and {e["domain"] for e in train} == {"gsm8k"}
    assert {e["domain"] for e in evaluation_examples(str(path), "validation", 1, domain="gsm8k")} == {"gsm8k"}


def test_the_domain_setting_is_for_files_only_and_one_word(tmp_path):
    from gpuscale.recipes.sft import Settings
    from gpuscale.runs.settings import SettingsError, resolve_settings

    path = _write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS)
    named = resolve_settings(Settings, overrides={"dataset": str(path), "domain": " gsm8k "}, environ={})
    assert named.domain == "gsm8k"
    assert resolve_settings(Settings, overrides={"dataset": str(path), "domain": "none"}, environ={}).domain is None
    for overrides, reason in (
        ({"domain": "gsm8k"}, "domain: 'gsm8k': names the domain of JSONL files' rows; the rows of tiny-math "
                              "carry their own"),
        ({"dataset": str(path), "domain": "grade school"},
         "domain: 'grade school': a domain is one word (letters, digits, _ . -): it is part of figure names"),
    ):
        with pytest.raises(SettingsError) as error:
            resolve_settings(Settings, overrides=overrides, environ={})
        assert str(error.value) == reason


def test_the_launch_says_where_a_file_s_domain_comes_from(tmp_path, capsys):
    from gpuscale.app.commands.launching import say_file_domains
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.runs.settings import resolve_settings

    sft = get_recipe("sft")
    path = _write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS)
    say_file_domains(sft, resolve_settings(sft.settings_cls, overrides={"dataset": str(path)}, environ={}))
    assert capsys.readouterr().err == (
        "dataset: a row with no 'domain' field takes its file's name as its domain (test.jsonl: 'test'), which "
        "names its figures (accuracy_greedy_test_after...); --set domain=NAME names it\n")
    say_file_domains(sft, resolve_settings(sft.settings_cls, overrides={"dataset": str(path), "domain": "gsm8k"},
                                           environ={}))
    say_file_domains(sft, resolve_settings(sft.settings_cls, environ={}))  # tiny-math: its own domains
    assert capsys.readouterr().err == ""


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


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    message = _data_error(str(path))
    assert str(path) in message and "no examples" in message


def test_a_domain_that_is_not_a_string_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [GSM8K_ROWS[0], {**GSM8K_ROWS[1], "domain": 3}])
    message = _data_error(str(path))
    assert "line 2" in message and "'domain'" in message


# ---------------------------------------------------------------------------------------------------
# Mixtures: a task's domains, several files, one file with a domain field


def test_a_domain_subset_is_the_same_problems_in_the_same_order(tiny_test):
    subset = load_examples("tiny-math:arithmetic,counting", "test", max_examples=100)
    expected = [e for e in tiny_test if e["domain"] in ("arithmetic", "counting")][:100]
    assert subset == expected
    assert {e["domain"] for e in subset} == {"arithmetic", "counting"}
    only_counting = load_examples("tiny-math:counting", "test")
    assert only_counting and {e["domain"] for e in only_counting} == {"counting"}
    # the split's 2000 problems, of one domain: about a quarter of them
    assert 300 < len(only_counting) < 700


def test_plain_tiny_math_holds_every_domain_on_every_row(tiny_test):
    assert load_examples("tiny-math:" + ",".join(TINY_MATH_DOMAINS), "test", max_examples=600) == tiny_test
    assert all(e["domain"] in TINY_MATH_DOMAINS for e in tiny_test)


def test_an_unknown_domain_names_the_known_ones():
    message = _data_error("tiny-math:arithmetic,algebra")
    assert "'algebra'" in message and all(domain in message for domain in TINY_MATH_DOMAINS)
    assert "no domain" in _data_error("tiny-math:")
    assert "twice" in _data_error("tiny-math:counting,counting")


def _rows(prefix: str, count: int, **fields) -> list[dict]:
    return [{"question": f"{prefix} {i}?", "answer": f"#### {i}", **fields} for i in range(count)]


def test_several_files_are_interleaved_by_domain(tmp_path):
    """Each file's stem is its rows' domain; the rows alternate so that the first N hold every domain."""
    first = _write_jsonl(tmp_path / "first.jsonl", _rows("a", 4))
    second = _write_jsonl(tmp_path / "second.jsonl", _rows("b", 2))
    examples = load_examples(f"{first},{second}")
    assert [e["question"] for e in examples] == ["a 0?", "b 0?", "a 1?", "b 1?", "a 2?", "a 3?"]
    assert [e["domain"] for e in examples[:2]] == ["first", "second"]
    # max_examples takes the first N of that order, as for any data set
    assert load_examples(f"{first}, {second}", max_examples=3) == examples[:3]


def test_one_file_with_a_domain_field_is_interleaved_by_domain(tmp_path):
    path = _write_jsonl(tmp_path / "mix.jsonl", _rows("m", 3, domain="math") + _rows("l", 3, domain="logic"))
    examples = load_examples(str(path), max_examples=4)
    assert [(e["domain"], e["question"]) for e in examples] == [
        ("math", "m 0?"), ("logic", "l 0?"), ("math", "m 1?"), ("logic", "l 1?")]


def test_a_value_holding_jsonl_is_always_files(tmp_path):
    spec = parse_dataset("data:v2/a.jsonl,b.jsonl")  # a colon in a path is not the domain syntax
    assert spec.task is None and [p.name for p in spec.paths] == ["a.jsonl", "b.jsonl"]
    assert parse_dataset("tiny-math:counting").domains == ("counting",)
    assert parse_dataset("gsm8k").task == "gsm8k"


@pytest.mark.parametrize("value, reason", [
    ("a.jsonl,,b.jsonl", "an empty entry"),
    ("a.jsonl,tiny-math", "'tiny-math' is not a .jsonl file"),
    ("a.jsonl,a.jsonl", "listed twice"),
    ("tiny-maths", "unknown data set"),
])
def test_bad_values_are_one_line_naming_value_and_reason(value, reason):
    message = _data_error(value)
    assert message.startswith(repr(value)) and reason in message and "\n" not in message


def test_check_dataset_name_accepts_the_new_forms_and_names_a_missing_file(tmp_path):
    first = _write_jsonl(tmp_path / "first.jsonl", _rows("a", 1))
    second = _write_jsonl(tmp_path / "second.jsonl", _rows("b", 1))
    for value in ("tiny-math", "tiny-math:comparison", "gsm8k", str(first), f"{first},{second}"):
        assert check_dataset_name(value) == value
    with pytest.raises(DataError, match="no such file: .*absent.jsonl"):
        check_dataset_name(f"{first},{tmp_path / 'absent.jsonl'}")
    with pytest.raises(DataError, match="unknown domain 'algebra'"):
        check_dataset_name("tiny-math:algebra")


def test_the_settings_validator_refuses_a_bad_domain():
    from gpuscale.runs.settings import RunSettings

    assert RunSettings(dataset="tiny-math:arithmetic,counting").dataset == "tiny-math:arithmetic,counting"
    with pytest.raises(ValueError, match="unknown domain 'algebra' of tiny-math; known domains: arithmetic"):
        RunSettings(dataset="tiny-math:algebra")


# ---------------------------------------------------------------------------------------------------
# check_dataset: what a run would fail on, refused before launch


def _check_error(*args, **kwargs) -> str:
    with pytest.raises(DataError) as error:
        check_dataset(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message and message.startswith("dataset: ")
    return message


def test_check_reads_every_line_of_every_file(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", _rows("a", 3))
    bad = _write_jsonl(tmp_path / "bad.jsonl", _rows("b", 3) + ['{"question": "cut'])
    check_dataset(str(good), "test", max_examples=1)
    # the bad line is the fourth, past max_examples: the run would still read it, so it is refused
    message = _check_error(f"{good},{bad}", "test", max_examples=1)
    assert f"{bad}, line 4: not valid JSON" in message
    missing = _write_jsonl(tmp_path / "missing.jsonl", [{"question": "q"}])
    assert f"{missing}, line 1: missing field 'answer'" in _check_error(str(missing))
    words = _write_jsonl(tmp_path / "words.jsonl", [{"question": "q", "answer": "seven"}])
    assert "line 1: answer has no '#### N' line and is not a number" in _check_error(str(words))


def test_check_refuses_empty_data_and_empty_selections(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"{empty}: no examples" in _check_error(str(empty))
    assert "no examples" in _check_error("tiny-math", "test", max_examples=0)
    assert "unknown split" in _check_error("tiny-math", "validation")
    assert "unknown domain" in _check_error("tiny-math:algebra")


def test_check_leaves_generated_and_hub_data_sets_alone(monkeypatch):
    """tiny-math is valid by construction; gsm8k from the hub is not loaded (no network before launch)."""
    datasets = pytest.importorskip("datasets")

    def no_network(*args, **kwargs):
        raise AssertionError("check_dataset must not load a hub data set")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    check_dataset("tiny-math", "train")
    check_dataset("tiny-math:counting", "test", max_examples=5)
    check_dataset("gsm8k", "test")


def test_check_says_when_the_hub_package_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    message = _check_error("gsm8k")
    assert "'datasets' package" in message and ".jsonl" in message


# ---------------------------------------------------------------------------------------------------
# tiny-math-conflict: every counting question twice, answered N (counting) and N - 1 (repeats)


@pytest.fixture(scope="module")
def conflict_test():
    return load_examples("tiny-math-conflict", "test", max_examples=400, seed=0)


def test_conflict_rows_are_twins_of_the_two_domains(conflict_test):
    assert "tiny-math-conflict" in KNOWN_TASKS and len(conflict_test) == 400
    assert [e["domain"] for e in conflict_test] == ["counting", "repeats"] * 200
    for counting, repeats in zip(conflict_test[::2], conflict_test[1::2]):
        assert repeats["question"] == counting["question"]
    # Distinct problems: every question once per domain.
    assert len({e["question"] for e in conflict_test}) == 200


def test_conflict_answers_count_occurrences_and_repeats(conflict_test):
    for example in conflict_test:
        match = re.fullmatch(COUNTING_QUESTION, example["question"])
        words, target = match.group(1).split(", "), match.group(2)
        expected = words.count(target) - (example["domain"] == "repeats")
        assert int(gold_answer(example)) == expected, example
        assert example["answer"].splitlines()[-1] == f"#### {expected}"
    # Repeats can be 0 (a word that occurs once), never negative.
    assert min(int(gold_answer(e)) for e in conflict_test if e["domain"] == "repeats") == 0


def test_conflict_train_and_test_never_share_a_question(conflict_test):
    train = load_examples("tiny-math-conflict", "train", max_examples=4000, seed=0)
    assert {e["question"] for e in train}.isdisjoint({e["question"] for e in conflict_test})
    assert all(is_test_question(e["question"]) for e in load_examples("tiny-math-conflict", "test", 50, seed=5))
    assert not any(is_test_question(e["question"]) for e in train)
    other_seed = load_examples("tiny-math-conflict", "train", max_examples=100, seed=1)
    assert len({e["question"] for e in train[:100]} & {e["question"] for e in other_seed}) < 10


def test_conflict_domain_subsets_and_names(conflict_test):
    repeats = load_examples("tiny-math-conflict:repeats", "test", max_examples=200)
    assert repeats == conflict_test[1::2]
    for value in ("tiny-math-conflict", "tiny-math-conflict:counting,repeats"):
        assert check_dataset_name(value) == value
    message = _data_error("tiny-math-conflict:arithmetic")
    assert "'arithmetic'" in message and "counting" in message and "repeats" in message
    check_dataset("tiny-math-conflict", "train", max_examples=8)
