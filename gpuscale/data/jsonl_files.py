"""Local JSONL files of GSM8K-format rows (`--dataset a.jsonl,b.jsonl`): reading and checking them line
by line, each bad line refused with its file, line number and reason (data/tasks.py loads through here)."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscale.data.answers import extract_strict, to_number
from gpuscale.data.data_error import DataError

if TYPE_CHECKING:
    from gpuscale.data.question_length import QuestionLimit


def read_jsonl(path: Path, question_limit: QuestionLimit | None = None, domain: str | None = None) -> list[dict]:
    """Examples from a JSONL file of GSM8K rows, each with its `domain` (its own field, else `domain`,
    the run's `domain` setting, else the file's stem). A bad line or an empty file raises DataError
    naming the file (and line); `question_limit` refuses or leaves out a question longer than the model's context
    (data/question_length.py)."""
    path = Path(path)
    require_file(path)
    examples, places = [], []
    # Bytes, decoded line by line: a line that is not UTF-8 is refused with its number.
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            line = _decoded(raw, path, line_number)
            if not line.strip():
                continue
            examples.append(_parse_jsonl_line(line, path, line_number, domain))
            places.append(f"{path}, line {line_number}")
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    if question_limit is not None:  # every question at once: measured in batches
        kept = question_limit.admitted([row["question"] for row in examples], places, what=str(path))
        examples = [row for row, keep in zip(examples, kept) if keep]
    return examples



def require_file(path: Path) -> None:
    """DataError saying why `path` is not a file that can be read: missing, a directory, a
    symbolic link loop (all three only a False from `is_file`), or the system's reason."""
    try:
        if path.is_dir():
            raise DataError(f"{path} is a directory, not a .jsonl file (name the files in it, separated by commas)")
        path.stat()
    except OSError as error:
        if error.errno == errno.ENOENT:
            raise DataError(f"no such file: {path}") from None
        if error.errno == errno.ELOOP:
            raise DataError(f"{path} is a symbolic link loop (it leads back to itself), not a file") from None
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None


def _decoded(raw: bytes, path: Path, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}, line {line_number}: not UTF-8 (byte {raw[error.start]:#04x} at byte "
                        f"{error.start + 1} of the line); save the file as UTF-8") from None


def _parse_jsonl_line(line: str, path: Path, line_number: int, domain: str | None = None) -> dict:
    where = f"{path}, line {line_number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with 'question' and 'answer'")
    for field in ("question", "answer"):
        if field not in row:
            raise DataError(f"{where}: missing field {field!r} (each line needs 'question' and 'answer')")
    row["question"], row["answer"] = str(row["question"]), _as_gsm8k_answer(row["answer"], where)
    row["domain"] = _domain_of(row, domain or path.stem, where)
    return row


def _domain_of(row: dict, default: str, where: str) -> str:
    domain = row.get("domain", default)
    if not isinstance(domain, str) or not domain.strip():
        raise DataError(f"{where}: 'domain' must be a non-empty string, got {domain!r}")
    return domain.strip()


def _as_gsm8k_answer(answer, where: str) -> str:
    """The answer as GSM8K writes it; a bare number ("72" or 72) becomes "#### 72"."""
    text = str(answer)
    if extract_strict(text) is not None:
        return text
    if to_number(text) is not None:
        return f"#### {text.strip()}"
    raise DataError(f"{where}: answer has no '#### N' line and is not a number: {text[-40:]!r}")

