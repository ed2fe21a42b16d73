"""The tasks gpuscale knows by name, and loading any of them as GSM8K-format examples.

Every example is a dict with `question` and `answer`, the answer written as GSM8K writes it: worked
steps, then a last line `#### N`. Generated tasks also carry their `domain` (multi-task recipes route
rewards and metrics by it).

- `tiny-math`: synthetic word problems in three domains (arithmetic, comparison, counting), generated
  from a seed. Train and test are disjoint by construction: a question belongs to the test split iff a
  hash of its text says so, whatever the seed.
- `gsm8k`: `openai/gsm8k` (config `main`) through `datasets`, an optional dependency imported lazily;
  or any local `.jsonl` file with the same fields, given as the task name.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Callable

from gpuscale.data.answers import extract_strict, to_number

KNOWN_TASKS = ("tiny-math", "gsm8k")
SPLITS = ("train", "test")
GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_CONFIG = "main"


class DataError(ValueError):
    """A data set that cannot be loaded; the message is one line that says why and what to do."""


def gold_answer(example) -> str:
    """The value after `#### ` in an example's answer (or in an answer string), commas removed."""
    text = example["answer"] if isinstance(example, dict) else str(example)
    value = extract_strict(text)
    if value is None:
        raise DataError(f"answer has no '#### N' line: {text[-60:]!r}")
    return value


def load_examples(
    name_or_path: str, split: str = "test", max_examples: int | None = None, seed: int = 0
) -> list[dict]:
    """The examples of a task: a known name (KNOWN_TASKS) or a local `.jsonl` file.

    `max_examples` keeps the first N (in the data set's own order, as lm-eval's --limit does).
    `seed` chooses the generated problems of `tiny-math`; fixed data sets ignore it. A JSONL file is
    one split by itself, so `split` does not apply to it.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; known splits: {', '.join(SPLITS)}")
    if max_examples is not None and max_examples < 0:
        raise DataError(f"max_examples must be >= 0, got {max_examples}")
    name = str(name_or_path)
    if name.endswith(".jsonl"):
        examples = read_jsonl(Path(name).expanduser())
    elif name == "tiny-math":
        size = TINY_MATH_SIZES[split]
        count = size if max_examples is None else min(max_examples, size)
        return generate_tiny_math(split, count, seed)
    elif name == "gsm8k":
        examples = _load_gsm8k_from_hub(split)
    else:
        raise DataError(
            f"unknown task {name!r}; known tasks: {', '.join(KNOWN_TASKS)} (or a path to a .jsonl file)"
        )
    return examples if max_examples is None else examples[:max_examples]


# ---------------------------------------------------------------------------------------------------
# GSM8K: the hub or a local JSONL file


def read_jsonl(path: Path) -> list[dict]:
    """Examples from a JSONL file of GSM8K rows; a bad line raises DataError naming file and line."""
    if not path.is_file():
        raise DataError(f"no such file: {path}")
    examples = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if line.strip():
                examples.append(_parse_jsonl_line(line, path, line_number))
    return examples


def _parse_jsonl_line(line: str, path: Path, line_number: int) -> dict:
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
    return row


def _as_gsm8k_answer(answer, where: str) -> str:
    """The answer as GSM8K writes it; a bare number ("72" or 72) becomes "#### 72"."""
    text = str(answer)
    if extract_strict(text) is not None:
        return text
    if to_number(text) is not None:
        return f"#### {text.strip()}"
    raise DataError(f"{where}: answer has no '#### N' line and is not a number: {text[-40:]!r}")


def _load_gsm8k_from_hub(split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "gsm8k from the hub needs the 'datasets' package (pip install 'gpuscale[hub]'); "
            "or pass a local .jsonl file with 'question' and 'answer' fields"
        ) from None
    try:
        rows = datasets.load_dataset(GSM8K_HUB_ID, GSM8K_CONFIG, split=split)
    except Exception as error:  # offline, no cache, hub down, auth: all end the same way for the user
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise DataError(
            f"could not load {GSM8K_HUB_ID} ({GSM8K_CONFIG}/{split}) from the Hugging Face hub: {reason}; "
            f"pass a local .jsonl file with 'question' and 'answer' fields instead"
        ) from None
    return [{"question": row["question"], "answer": row["answer"], "domain": "gsm8k"} for row in rows]


# ---------------------------------------------------------------------------------------------------
# tiny-math: synthetic word problems whose answers a program can check

TINY_MATH_DOMAINS = ("arithmetic", "comparison", "counting")
# How often each domain is drawn. Arithmetic is the GSM8K-like one, so it gets the most weight.
TINY_MATH_WEIGHTS = (0.5, 0.25, 0.25)
TINY_MATH_SIZES = {"train": 200_000, "test": 2_000}
# One question in TEST_BUCKETS belongs to the test split (by the hash of its text).
TEST_BUCKETS = 10

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena",
         "Mo", "Nia", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards", "stamps",
          "buttons")
LIST_WORDS = ("apple", "pear", "plum", "fig", "lime", "kiwi", "grape", "lemon")


def is_test_question(question: str) -> bool:
    """Which split a question belongs to, fixed by its text so train and test never share one."""
    digest = hashlib.md5(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % TEST_BUCKETS == 0


def generate_tiny_math(split: str, count: int, seed: int = 0) -> list[dict]:
    """`count` distinct tiny-math problems of `split`, the same ones for the same seed."""
    rng = random.Random(f"tiny-math/{split}/{seed}")
    want_test = split == "test"
    examples, seen = [], set()
    while len(examples) < count:
        domain = rng.choices(TINY_MATH_DOMAINS, weights=TINY_MATH_WEIGHTS)[0]
        example = _DOMAIN_GENERATORS[domain](rng)
        question = example["question"]
        if is_test_question(question) == want_test and question not in seen:
            seen.add(question)
            examples.append(example)
    return examples


def _example(domain: str, question: str, steps: list[str], value: int, **fields) -> dict:
    answer = "\n".join(steps + [f"#### {value}"])
    return {"question": question, "answer": answer, "domain": domain, **fields}


# Arithmetic: one and two steps with + - *. Each example keeps its `expression`, so a test can
# recompute the answer without trusting the generator. The number ranges set the difficulty: a tiny
# model trained for minutes learns the times table and small sums, and gets larger sums half right.


def _arithmetic(rng: random.Random) -> dict:
    kind = rng.choice(_ARITHMETIC_KINDS)
    question, steps, expression, value = kind(rng, rng.choice(NAMES), rng.choice(THINGS))
    return _example("arithmetic", question, steps, value, expression=expression)


def _add(rng, name, things):
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    question = f"{name} has {a} {things}. {name} gets {b} more. How many {things} does {name} have now?"
    return question, [f"{a} + {b} = {a + b}."], f"{a} + {b}", a + b


def _subtract(rng, name, things):
    a = rng.randint(10, 50)
    b = rng.randint(1, a - 1)
    question = f"{name} has {a} {things} and gives away {b}. How many {things} are left?"
    return question, [f"{a} - {b} = {a - b}."], f"{a} - {b}", a - b


def _multiply(rng, name, things):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} buys {a} bags with {b} {things} in each bag. How many {things} is that in all?"
    return question, [f"{a} * {b} = {a * b}."], f"{a} * {b}", a * b


def _add_then_subtract(rng, name, things):
    a, b = rng.randint(2, 25), rng.randint(2, 25)
    c = rng.randint(1, a + b - 1)
    question = (f"{name} has {a} {things}, gets {b} more and then gives away {c}. "
                f"How many {things} does {name} have now?")
    steps = [f"{a} + {b} = {a + b}.", f"{a + b} - {c} = {a + b - c}."]
    return question, steps, f"({a} + {b}) - {c}", a + b - c


def _multiply_then_add(rng, name, things):
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    question = (f"{name} buys {a} bags with {b} {things} in each bag and already has {c}. "
                f"How many {things} does {name} have now?")
    steps = [f"{a} * {b} = {a * b}.", f"{a * b} + {c} = {a * b + c}."]
    return question, steps, f"({a} * {b}) + {c}", a * b + c


def _temperature_drop(rng, name, things):
    # The one kind whose answer may be negative, so recipes see "#### -7" too.
    a, b = rng.randint(0, 15), rng.randint(1, 20)
    question = f"At noon it is {a} degrees. By night it drops {b} degrees. What is the temperature at night?"
    return question, [f"{a} - {b} = {a - b}."], f"{a} - {b}", a - b


_ARITHMETIC_KINDS = (_add, _subtract, _multiply, _add_then_subtract, _multiply_then_add, _temperature_drop)


# Comparison: order three or four amounts, then read off the largest, smallest, middle or range.


def _comparison(rng: random.Random) -> dict:
    size = rng.choice((3, 4))
    names = rng.sample(NAMES, size)
    values = rng.sample(range(1, 51), size)
    things = rng.choice(THINGS)
    holdings = ", ".join(f"{n} has {v} {things}" for n, v in zip(names[:-1], values[:-1]))
    statement = f"{holdings} and {names[-1]} has {values[-1]} {things}."
    ordered = sorted(values)
    steps = ["In order: " + ", ".join(str(v) for v in ordered) + "."]
    asks = ("most", "fewest", "range") + (("middle",) if size == 3 else ())
    ask = rng.choice(asks)
    if ask == "most":
        question, value = f"How many {things} does the one with the most have?", ordered[-1]
        steps.append(f"The most is {value}.")
    elif ask == "fewest":
        question, value = f"How many {things} does the one with the fewest have?", ordered[0]
        steps.append(f"The fewest is {value}.")
    elif ask == "middle":
        question, value = f"How many {things} does the one in the middle have?", ordered[1]
        steps.append(f"The middle is {value}.")
    else:
        question = f"How many more {things} does the one with the most have than the one with the fewest?"
        value = ordered[-1] - ordered[0]
        steps.append(f"{ordered[-1]} - {ordered[0]} = {value}.")
    return _example("comparison", f"{statement} {question}", steps, value)


# Counting: how often a word occurs in a list, counted out loud one occurrence at a time.


def _counting(rng: random.Random) -> dict:
    target = rng.choice(LIST_WORDS)
    others = [w for w in LIST_WORDS if w != target]
    length = rng.randint(4, 10)
    hits = rng.randint(1, min(6, length - 1))
    words = [target] * hits + [rng.choice(others) for _ in range(length - hits)]
    rng.shuffle(words)
    question = f"Here is a list: {', '.join(words)}. How many times does {target} appear in it?"
    steps = [f"Counting {target}: " + ", ".join(str(i) for i in range(1, hits + 1)) + "."]
    return _example("counting", question, steps, hits)


_DOMAIN_GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "arithmetic": _arithmetic,
    "comparison": _comparison,
    "counting": _counting,
}


def check_dataset_name(name: str) -> str:
    """Refuse, before anything starts, a data set that is neither known nor an existing .jsonl file."""
    if name in KNOWN_TASKS:
        return name
    if name.endswith(".jsonl"):
        if Path(name).expanduser().is_file():
            return name
        raise ValueError("no such file")
    raise ValueError(f"unknown data set; known data sets: {', '.join(KNOWN_TASKS)} (or a path to a .jsonl file)")
