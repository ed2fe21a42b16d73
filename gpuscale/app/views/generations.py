"""What a run generated (runs/generations.py) as the CLI (`gpuscale generations`) and the TUI's
generations view show them: filtered by step, domain and correct/incorrect, newest first, each with a heading
line (step, domain, correct, rewards, advantage, fitness, length cap) and its prompt and completion
as written. No textual here: the TUI shows these strings through literal widgets."""

from __future__ import annotations

import shutil
import textwrap

from gpuscale.app.views.text import format_number

CORRECT_CHOICES = {"all": None, "correct": True, "incorrect": False}


def newest_first(records: list[dict]) -> list[dict]:
    """The latest step's first, and within a step the last written first."""
    indexed = list(enumerate(records))
    return [record for _, record in sorted(indexed, key=lambda pair: (pair[1]["step"], pair[0]), reverse=True)]


def filtered(records: list[dict], step: int | None = None, domain: str | None = None,
             correct: bool | None = None) -> list[dict]:
    """The records of `step`, `domain` and correctness (None: any), newest first."""
    return [record for record in newest_first(records)
            if (step is None or record["step"] == step) and (domain is None or record.get("domain") == domain)
            and (correct is None or record.get("correct") is correct)]


def steps_of(records: list[dict]) -> list[int]:
    return sorted({record["step"] for record in records})


def domains_of(records: list[dict]) -> list[str]:
    return sorted({record["domain"] for record in records if record.get("domain")})


def steps_text(steps: list[int]) -> str:
    """`1-40` for a run of steps, `3` for one, else the steps listed (`1, 5, 9`)."""
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def heading(record: dict) -> str:
    """`step 2 · arithmetic · correct · correctness 1 · format 0.5 · advantage 0.7071 · hit the length cap`;
    a held-out answer's `step 9 · held-out greedy after · arithmetic · incorrect · gold 12 · answered 9`."""
    parts = [f"step {record['step']}"]
    if record.get("phase"):
        parts.append(str(record["phase"]))
    if record.get("domain"):
        parts.append(str(record["domain"]))
    if record.get("correct") is not None:
        parts.append("correct" if record["correct"] else "incorrect")
    if record.get("gold") is not None:  # held-out answers: what the data's answer parsed to, and the model's
        answered = record.get("extracted")
        parts.append(f"gold {record['gold']} · answered {'nothing' if answered is None else answered}")
    parts += [f"{name} {format_number(value)}" for name, value in (record.get("rewards") or {}).items()]
    for name in ("advantage", "fitness"):
        if record.get(name) is not None:
            parts.append(f"{name} {format_number(record[name])}")
    if record.get("truncated"):
        parts.append("hit the length cap")
    return " · ".join(parts)


def generation_text(record: dict, width: int | None = None) -> str:
    """One generation: its heading, then its prompt and completion, each line wrapped to `width` (the
    terminal's) and indented."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    lines = [heading(record)]
    for name in ("prompt", "completion"):
        lines.append(f"{name}:")
        lines += wrapped(record.get(name) or "", width)
    return "\n".join(lines)


def wrapped(text: str, width: int, indent: str = "  ") -> list[str]:
    """`text` line by line, each wrapped to `width` with `indent`; blank lines kept."""
    out = []
    for line in text.splitlines() or [""]:
        out += textwrap.wrap(line, max(width, 20), initial_indent=indent, subsequent_indent=indent,
                             replace_whitespace=False) or [indent.rstrip()]
    return out
