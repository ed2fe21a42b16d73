"""Which sampled answers RFT keeps: correct under the strict checker, distinct, at most k per question.

Pure Python (no torch): the rank's generation loop and the tests call the same functions.

Distinct means, by default, a different text once normalized (case, spacing). With
`dedupe="equations"`, as Yuan et al. 2023 ("Scaling Relationship on Learning Mathematical Reasoning
with LLMs") do, two answers are the same if they use the same list of equations: GSM8K's calculator
annotations `<<48/2=24>>` where the answer has them, else every `expression = value` it writes, with
spaces removed. Answers that differ only in their wording then count once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from gpuscale.data.rewards import correctness

DEDUPE_MODES = ("text", "equations")
# GSM8K's calculator annotations, `<<48/2=24>>`.
_ANNOTATION = re.compile(r"<<([^<>]*)>>")
# `18 + 20 = 38`, `(3*4)-2=10`, `12 / 4 = 3.5`: numbers joined by operators, `=`, a number, on one line.
_NUMBER = r"\$?\d+(?:[.,]\d+)*"
_TERM = rf"\(*-?{_NUMBER}\)*"
_EQUATION = re.compile(rf"{_TERM}(?:[ \t]*[-+*/×÷x][ \t]*{_TERM})+[ \t]*=[ \t]*-?{_NUMBER}")


def normalized_text(completion: str) -> str:
    """The completion as compared for duplicates: lower case, runs of white space as one space."""
    return " ".join(completion.lower().split())


def equation_list(completion: str) -> tuple[str, ...]:
    """The equations an answer uses, in order, without spaces (Yuan et al.'s key for "distinct")."""
    found = _ANNOTATION.findall(completion) or _EQUATION.findall(completion)
    return tuple(re.sub(r"\s+", "", equation).strip(".,") for equation in found)


def duplicate_key(completion: str, dedupe: str = "text"):
    if dedupe == "text":
        return normalized_text(completion)
    if dedupe == "equations":
        # An answer with no equation at all (counting, comparisons) falls back to its text.
        return equation_list(completion) or normalized_text(completion)
    raise ValueError(f"unknown dedupe mode {dedupe!r}; known: {', '.join(DEDUPE_MODES)}")


def kept_answers(completions: Iterable[str], gold: str, *, dedupe: str = "text", keep: int = 0,
                 include_gold: bool = False) -> list[tuple[str, str]]:
    """The answers to train on for one question, as (completion, source) pairs, source "sample" or
    "gold": the samples the strict checker marks correct against `gold` (a GSM8K answer ending with
    `#### N`), first of each duplicate kept, at most `keep` of them (0 = all); with `include_gold`,
    the gold answer first (samples that duplicate it are dropped, and it does not count in `keep`)."""
    seen = set()
    kept: list[tuple[str, str]] = []
    if include_gold:
        seen.add(duplicate_key(gold, dedupe))
        kept.append((gold, "gold"))
    samples = 0
    for completion in completions:
        if keep and samples >= keep:
            break
        if not correctness(completion, gold, mode="strict"):
            continue
        key = duplicate_key(completion, dedupe)
        if key in seen:
            continue
        seen.add(key)
        kept.append((completion, "sample"))
        samples += 1
    return kept


def yield_by_domain(questions: Iterable[Mapping]) -> dict[str, float | None]:
    """The yield: the share of questions with at least one correct sample (`yield`), and per domain
    (`yield_<domain>`). Each item holds `domain` and `correct_samples`."""
    from gpuscale.data.scoring import share_by_domain

    return share_by_domain(questions, "yield", lambda question: question["correct_samples"] > 0)
