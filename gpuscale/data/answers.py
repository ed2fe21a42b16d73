"""Answer extraction and checking, shared by every recipe.

Three ways to find the final answer in a model's text, as the GSM8K evaluations do it
(lm-eval-harness `gsm8k` task; `\\boxed{}` prompts of the MATH-style papers):

- strict:   the number on the last `####` line, with nothing after it on that line (GSM8K's own
            format: commas, a sign, a leading `$` and a full stop allowed). `#### 9 - 1 = 15.` and
            `#### 5 apples` are no answer; `#### 12` then `#### 13` is 13;
- boxed:    the content of the last `\\boxed{...}` (or `\\fbox{...}`);
- flexible: the last number-like match of `(-?[$0-9.,]{2,})|(-?[0-9]+)` in the text.

`auto` takes the strict answer where the text has a `####` (the model chose GSM8K's format, so a
malformed final line is no answer, not a cue to look for a number elsewhere), else boxed, else
flexible. Extracted values are cleaned (commas, `$` and a trailing `.` removed)
and compared as numbers with a tolerance, so "1,234.0" equals "1234".
"""

from __future__ import annotations

import math
import re

EXTRACT_MODES = ("auto", "strict", "boxed", "flexible")

# What may follow the last `####` on its line: one number (lm-eval's strict pattern is
# `#### (\-?[0-9\.\,]+)` and it drops a trailing "."; a `$` is allowed as GSM8K answers name dollars).
_STRICT_MARKER = "####"
_STRICT_LINE = re.compile(r"[ \t]*(-?\$?-?[0-9][0-9,]*(?:\.[0-9]+)?)\.?[ \t\r]*")
# lm-eval's flexible pattern, verbatim.
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_FRACTION = re.compile(r"^\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")
_SLASH_FRACTION = re.compile(r"^(-?[0-9.]+)/([0-9.]+)$")


def clean_number_text(s: str) -> str:
    """Drop what decorates a number in prose: thousands commas, dollar signs, spaces, a trailing '.'."""
    s = s.strip().replace(",", "").replace("\\$", "").replace("$", "").replace(" ", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\!", "")
    return s.rstrip(".")


def to_number(s) -> float | None:
    """The value of a number written as text ("1,234.5", "$-3", "\\frac{1}{2}", "3/4"), else None."""
    if isinstance(s, bool) or s is None:
        return None
    if isinstance(s, (int, float)):
        return float(s)
    text = clean_number_text(str(s))
    for pattern in (_FRACTION, _SLASH_FRACTION):
        match = pattern.match(text.lstrip("-"))
        if match:
            sign = -1.0 if text.startswith("-") else 1.0
            numerator, denominator = _plain_float(match.group(1)), _plain_float(match.group(2))
            if numerator is None or not denominator:
                return None
            return sign * numerator / denominator
    return _plain_float(text)


def _plain_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    # float() also accepts "nan" and "inf"; no answer in these data sets is either.
    return value if math.isfinite(value) else None


def extract_strict(text: str) -> str | None:
    marker = text.rfind(_STRICT_MARKER)
    if marker < 0:
        return None
    final_line = text[marker + len(_STRICT_MARKER):].split("\n", 1)[0]
    match = _STRICT_LINE.fullmatch(final_line)
    return clean_number_text(match.group(1)) if match else None


def extract_flexible(text: str) -> str | None:
    # The last match that holds a digit: the pattern also matches "..." or ",," on its own.
    for match in reversed(list(_FLEXIBLE.finditer(text))):
        candidate = clean_number_text(match.group(0))
        if any(ch.isdigit() for ch in candidate):
            return candidate
    return None


def extract_boxed(text: str) -> str | None:
    content = _last_box_content(text)
    if content is None:
        return None
    content = content.strip()
    # "\boxed{x = 5}" -> "5"; "\boxed{\text{42}}" -> "42".
    content = content.rsplit("=", 1)[-1]
    content = re.sub(r"\\text\{([^{}]*)\}", r"\1", content)
    return clean_number_text(content) or None


def _last_box_content(text: str) -> str | None:
    """The content of the last box, with nested braces balanced (`\\boxed{\\frac{1}{2}}`)."""
    start = max(text.rfind(opener) + len(opener) if opener in text else -1 for opener in _BOX_OPENERS)
    if start < 0:
        return None
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
    return None  # the box was never closed: the model was cut off mid-answer


_EXTRACTORS = {"strict": extract_strict, "boxed": extract_boxed, "flexible": extract_flexible}


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The final answer in `text` as a cleaned string, or None if there is none.

    mode: "strict" (the last `#### N` line), "boxed" (last `\\boxed{}`), "flexible" (last number), or
    "auto" (strict where the text has a `####`, else boxed, else flexible).
    """
    if mode == "auto":
        if _STRICT_MARKER in text:
            return extract_strict(text)
        return extract_boxed(text) or extract_flexible(text)
    if mode not in _EXTRACTORS:
        raise ValueError(f"unknown extraction mode {mode!r}; known: {', '.join(EXTRACT_MODES)}")
    return _EXTRACTORS[mode](text)


def answers_match(predicted: str | None, gold: str | None, tol: float = 1e-6) -> bool:
    """Two extracted answers are equal: as numbers within `tol` (absolute or relative), else as text."""
    if predicted is None or gold is None:
        return False
    predicted_value, gold_value = to_number(predicted), to_number(gold)
    if predicted_value is not None and gold_value is not None:
        return math.isclose(predicted_value, gold_value, rel_tol=tol, abs_tol=tol)
    return clean_number_text(predicted) == clean_number_text(gold)


def is_correct(completion: str, gold: str, tol: float = 1e-6, mode: str = "auto") -> bool:
    """Whether the answer in `completion` equals `gold`.

    `gold` is either the bare value ("72") or a whole GSM8K answer ending with `#### 72`.
    """
    gold_value = extract_strict(gold) if "####" in gold else clean_number_text(gold)
    return answers_match(extract_answer(completion, mode), gold_value, tol)
