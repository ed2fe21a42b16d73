"""The one rule for a question longer than the model's context (data/question_length.py), on the
embedded model's real tokenizer and config."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from gpuscale.data.data_error import DataError
from gpuscale.data.jsonl_files import read_jsonl
from gpuscale.data.models import model_context, model_path
from gpuscale.data.prompts import prompt_ids
from gpuscale.data.question_length import (
    MEASURED,
    MEASURED_AT_ONCE,
    QuestionLimit,
    counting_tokenizer,
    progress_after_s,
    questions_too_long,
)
from gpuscale.data.tasks import held_out_split
from gsm8k_shaped import gsm8k_rows, write_jsonl

CONTEXT = 256  # the embedded model's max_position_embeddings


def test_the_context_comes_from_the_models_config(tmp_path):
    assert model_context("tiny-math") == CONTEXT
    assert model_context("random-tiny") == 2048
    assert model_context(str(model_path())) == CONTEXT
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    assert model_context(str(tmp_path)) == 1024
    assert model_context(str(tmp_path / "absent")) is None


def test_a_short_question_is_admitted_without_loading_the_tokenizer():
    limit = QuestionLimit("tiny-math")
    assert limit.admits("x" * (CONTEXT // 2), "a.jsonl, line 1")
    assert not limit._tokenizer_loaded  # at most half the context in bytes: no tokenizer needed


def test_the_boundary_is_the_whole_context_in_prompt_tokens():
    """A prompt of context - 1 tokens leaves room for one answer token; one of context tokens does not."""
    limit = QuestionLimit("tiny-math")
    tokenizer = limit.tokenizer()
    overhead = len(prompt_ids(tokenizer, ""))
    fits = "x" * (CONTEXT - 1 - overhead)  # the embedded tokenizer: one token per x
    assert len(prompt_ids(tokenizer, fits)) == CONTEXT - 1
    assert limit.admits(fits, "here")
    with pytest.raises(DataError, match=r"^there: the question is too long for the model: .* 256 tokens as a prompt"):
        limit.admits(fits + "x", "there")


def test_refusing_names_the_place_the_length_and_the_context():
    question = "What is " + "1 + " * 2_500_000 + "1?"
    started = time.perf_counter()
    with pytest.raises(DataError) as refused:
        QuestionLimit("tiny-math").admits(question, "big.jsonl, line 42")
    assert time.perf_counter() - started < 5  # a prefix is measured, never the 10 MB
    assert re.fullmatch(
        r"big\.jsonl, line 42: the question is too long for the model: 10,000,010 characters, [\d,]+ or more "
        r"tokens as a prompt, and tiny-math's context is 256 tokens \(the prompt and its answer must fit\); "
        r"remove the line, or set too_long=skip to leave such questions out", str(refused.value))


def test_a_model_without_a_tokenizer_counts_bytes():
    limit = QuestionLimit("random-tiny", "skip")
    assert limit.admits("x" * 2047, "a") and not limit.admits("x" * 2048, "b")
    assert limit.skipped == ["b"]


@pytest.fixture
def bigline(tmp_path):
    path = tmp_path / "bigline.jsonl"
    rows = [{"question": f"How much is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(8)]
    rows.insert(3, {"question": "x" * 100_000, "answer": "#### 1"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_skipping_leaves_the_row_out_before_the_first_rows_are_taken(bigline):
    limit = QuestionLimit("tiny-math", "skip")
    rows = read_jsonl(bigline, limit)
    assert len(rows) == 8 and all(len(row["question"]) < 40 for row in rows)
    assert limit.skipped == [f"{bigline}, line 4"]
    train, test = held_out_split(str(bigline), "test", 2, 4, question_limit=QuestionLimit("tiny-math", "skip"))
    assert [r["question"] for r in test + train] == [f"How much is {i} + 1?" for i in range(6)]


def test_before_launch_a_file_is_refused_or_its_skipped_rows_counted(bigline):
    with pytest.raises(DataError, match=rf"^dataset: {bigline}, line 4: the question is too long"):
        questions_too_long(str(bigline), QuestionLimit("tiny-math"))
    assert questions_too_long(str(bigline), QuestionLimit("tiny-math", "skip")) == [f"{bigline}, line 4"]
    assert questions_too_long("tiny-math", QuestionLimit("tiny-math")) == []  # generated: nothing to read


# ---- a file of GSM8K's size: decided in batches, as row by row, saying how far it got --------------


class CountingCalls:
    """The tokenizer, counting the calls that encode text (on one text or a list)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, texts, **kwargs):
        self.calls.append(len(texts) if isinstance(texts, list) else 1)
        return self.tokenizer(texts, **kwargs)


def row_by_row(questions: list[str], tokenizer) -> list[bool]:
    """The rule as it was decided before batches, one prompt_ids call a question (GSM8K-sized
    questions are shorter than the prefix first measured, so whole)."""
    return [len(question.encode()) <= CONTEXT // 2 or len(prompt_ids(tokenizer, question)) < CONTEXT
            for question in questions]


@pytest.fixture
def gsm8k_file(tmp_path):
    rows = gsm8k_rows(7_000)
    return write_jsonl(tmp_path / "train.jsonl", rows), [row["question"] for row in rows]


def test_a_gsm8k_sized_file_is_decided_in_batches_as_row_by_row(gsm8k_file):
    path, questions = gsm8k_file
    MEASURED.clear()  # measured by another test of this process: it would not be measured again
    tokenizer = CountingCalls(counting_tokenizer("tiny-math"))
    fits = row_by_row(questions, tokenizer.tokenizer)
    assert 0 < fits.count(False) < len(questions) // 2  # some too long: the comparison can fail
    limit = QuestionLimit("tiny-math", "skip", tokenizer=tokenizer)
    rows = read_jsonl(path, limit)
    assert [row["question"] for row in rows] == [q for q, fit in zip(questions, fits) if fit]
    assert limit.skipped == [f"{path}, line {number}" for number, fit in enumerate(fits, start=1) if not fit]
    unsure = sum(len(question.encode()) > CONTEXT // 2 for question in questions)
    assert len(tokenizer.calls) <= -(-unsure // MEASURED_AT_ONCE)  # the tokenizer called on lists
    assert sum(tokenizer.calls) < unsure  # and not on the prompts whose bytes say they fit
    # Refusing names the first too long, as row by row did; measured once a process, not again.
    first = fits.index(False)
    with pytest.raises(DataError) as refused:
        read_jsonl(path, QuestionLimit("tiny-math", tokenizer=tokenizer))
    with pytest.raises(DataError) as one_by_one:
        QuestionLimit("tiny-math").admits(questions[first], f"{path}, line {first + 1}")
    assert str(refused.value) == str(one_by_one.value)
    assert len(tokenizer.calls) <= -(-unsure // MEASURED_AT_ONCE)


def test_a_long_check_says_how_far_it_got(gsm8k_file, monkeypatch, caplog):
    path, questions = gsm8k_file
    MEASURED.clear()
    monkeypatch.setenv("GPUSCALE_PROGRESS_AFTER_S", "0")  # a line at once, however fast this machine is
    # The CLI, run in this process by an earlier test, sends the logger to stderr alone (no propagation).
    monkeypatch.setattr(logging.getLogger("gpuscale.progress"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="gpuscale.progress"):
        read_jsonl(path, QuestionLimit("tiny-math", "skip"))
    lines = [record.getMessage() for record in caplog.records]
    unsure = sum(len(question.encode()) > CONTEXT // 2 for question in questions)
    what = f"{path}: question lengths for tiny-math's context of 256 tokens"
    assert lines[0].startswith(f"checking {what}: {MEASURED_AT_ONCE} of {unsure:,} measured, ")
    assert re.fullmatch(rf"checked {re.escape(what)}: {unsure:,} measured in \d+\.\d s", lines[-1])


def test_a_check_done_in_one_go_says_nothing(bigline, monkeypatch, caplog):
    monkeypatch.setenv("GPUSCALE_PROGRESS_AFTER_S", "0")
    monkeypatch.setattr(logging.getLogger("gpuscale.progress"), "propagate", True)  # as above: else it cannot fail
    with caplog.at_level(logging.INFO, logger="gpuscale.progress"):
        read_jsonl(bigline, QuestionLimit("tiny-math", "skip"))
    assert caplog.records == []


def test_a_bad_progress_threshold_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("GPUSCALE_PROGRESS_AFTER_S", "soon")
    with pytest.raises(DataError, match=r"^GPUSCALE_PROGRESS_AFTER_S: 'soon': expected seconds, 0 or more$"):
        progress_after_s()
