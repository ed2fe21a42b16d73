"""The tasks gpuscale knows by name, and loading any of them, or a mixture, as GSM8K-format examples.

Every example is a dict with `question`, `answer` and `domain`, the answer written as GSM8K writes it:
worked steps, then a last line `#### N`. Multi-task recipes route rewards and metrics by `domain`.

What `--dataset` accepts (`parse_dataset`):

- `tiny-math`: synthetic word problems in three domains (arithmetic, comparison, counting), generated
  from a seed. Train and test are disjoint by construction: a question belongs to the test split iff a
  hash of its text says so, whatever the seed.
- `tiny-math:arithmetic,counting`: the same problems, only those of the named domains.
- `tiny-math-conflict`: two domains built to pull GRPO's gradients apart, for seeing what PCGrad
  does: every tiny-math-style counting question twice, `counting` wanting the number of occurrences
  N and `repeats` the number of repeats N - 1 (see "tiny-math-conflict" below for why they conflict).
  Its subsets work as tiny-math's do (`tiny-math-conflict:repeats`).
- `gsm8k`: `openai/gsm8k` (config `main`) through `datasets`, an optional dependency imported lazily
  (domain "gsm8k").
- `a.jsonl` or `a.jsonl,b.jsonl`: local GSM8K-format files (one split by themselves). A row's domain is
  its `domain` field, else its file's stem (`a`). A value holding ".jsonl" is always a list of files,
  so it cannot be mistaken for a task's domain list.

Order, and what `max_examples` takes: always the first N of the data set's order. A generated task's
order is its generator's (tiny-math draws its domains 50/25/25 from a seeded stream, so its first N hold
every domain in about those shares; a domain subset keeps the same problems in the same order;
tiny-math-conflict alternates the two domains, each twin right after its counting problem). Files
are read in order; when they hold several domains, the rows are interleaved round-robin across domains
(in the order the domains first appear, each domain's rows in file order), so the first N represent
every domain equally until one runs out.

What a run trains on and what it scores (`held_out_split`, the one rule every recipe holds out by;
`eval_split` chooses the scored set):

- `test` (the default): a named task's test split; a JSONL file (one split by itself) its first
  `eval_examples` rows. Training is the training split less any question of those rows.
- `validation`: the first `eval_examples` problems of the training data, for choosing settings
  without ever scoring the test problems. For a named task that is its training split's first
  problems; for a JSONL file the training data is what is left once its test rows (still its first
  `eval_examples` rows, as with `test`) are held out, so validation is the `eval_examples` rows after
  them. Training is the rest, less any question scored: neither the validation nor the test
  questions are trained on, and the validation questions are never test questions.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscale.data.answers import extract_strict, to_number

if TYPE_CHECKING:
    from gpuscale.data.question_length import QuestionLimit

KNOWN_TASKS = ("tiny-math", "tiny-math-conflict", "gsm8k")
SPLITS = ("train", "test")
EVAL_SPLITS = ("test", "validation")  # what a run's held-out evaluation scores: `held_out_split`
GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_CONFIG = "main"
GSM8K_DOMAIN = "gsm8k"
GSM8K_TRAIN_SIZE = 7473  # rows of openai/gsm8k main/train
JSONL_SUFFIX = ".jsonl"


class DataError(ValueError):
    """A data set that cannot be loaded; the message is one line that says why and what to do."""


def gold_answer(example) -> str:
    """The value after `#### ` in an example's answer (or in an answer string), commas removed."""
    text = example["answer"] if isinstance(example, dict) else str(example)
    value = extract_strict(text)
    if value is None:
        raise DataError(f"answer has no '#### N' line: {text[-60:]!r}")
    return value


# ---------------------------------------------------------------------------------------------------
# What a `--dataset` value names


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed `--dataset` value: a known task (all its domains, or the chosen ones), or JSONL files."""

    task: str | None = None
    domains: tuple[str, ...] | None = None  # the chosen domains of `task`; None: all of them
    paths: tuple[Path, ...] = ()


def task_domains(task: str) -> tuple[str, ...]:
    """The domains a known task's rows carry."""
    return {"tiny-math": TINY_MATH_DOMAINS, "tiny-math-conflict": CONFLICT_DOMAINS}.get(task, (GSM8K_DOMAIN,))


def parse_dataset(name: str) -> DatasetSpec:
    """Read a `--dataset` value (see the module's docstring); DataError with one line if it is neither
    a known task (with known domains) nor a list of .jsonl paths (the caller names the value, as the
    settings' errors do). Files are not opened here."""
    name = str(name).strip()
    if JSONL_SUFFIX in name:
        return DatasetSpec(paths=_parse_paths(name))
    task, colon, chosen = name.partition(":")
    if task not in KNOWN_TASKS and Path(name).expanduser().is_dir():
        raise DataError(f"{name} is a directory, not a .jsonl file (name the files in it, separated by commas)")
    if task not in KNOWN_TASKS:
        raise DataError(f"unknown data set; known data sets: {', '.join(KNOWN_TASKS)} "
                        f"(or TASK:DOMAIN,DOMAIN, or .jsonl files separated by commas)")
    if not colon:
        return DatasetSpec(task=task)
    return DatasetSpec(task=task, domains=_parse_domains(task, chosen))


def _parse_paths(text: str) -> tuple[Path, ...]:
    parts = [part.strip() for part in text.split(",")]
    if "" in parts:
        raise DataError("an empty entry in the list of files (separate .jsonl paths with single commas)")
    for part in parts:
        if not part.endswith(JSONL_SUFFIX):
            raise DataError(f"{part!r} is not a .jsonl file (a list of files is .jsonl paths separated by commas)")
    paths = tuple(Path(part).expanduser() for part in parts)
    if len(set(paths)) != len(paths):
        raise DataError("a file is listed twice")
    return paths


def _parse_domains(task: str, text: str) -> tuple[str, ...]:
    known = task_domains(task)
    chosen = tuple(part.strip() for part in text.split(","))
    if chosen == ("",):
        raise DataError(f"no domain after '{task}:'; known domains of {task}: {', '.join(known)}")
    for domain in chosen:
        if domain not in known:
            raise DataError(f"unknown domain {domain!r} of {task}; known domains: {', '.join(known)}")
    if len(set(chosen)) != len(chosen):
        raise DataError("a domain is listed twice")
    return chosen


def check_dataset_name(name: str) -> str:
    """Refuse, before anything starts, a value that names no data set or a file that cannot be opened
    (the settings' validator: it reads no file; `check_dataset` does). Files come back as absolute
    paths: the ranks start in the run folder, not in the user's."""
    spec = parse_dataset(name)
    for path in spec.paths:
        _require_file(path)
    return ",".join(str(path.absolute()) for path in spec.paths) if spec.paths else name


def _require_file(path: Path) -> None:
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


# ---------------------------------------------------------------------------------------------------
# Loading


def load_examples(
    name_or_path: str, split: str = "test", max_examples: int | None = None, seed: int = 0,
    question_limit: QuestionLimit | None = None,
) -> list[dict]:
    """The examples of a data set named as `--dataset` takes it (see the module's docstring).

    `max_examples` keeps the first N of the data set's order (as lm-eval's --limit does; for a
    mixture of domains that order is interleaved, see above). `seed` chooses the generated problems of
    `tiny-math`; fixed data sets ignore it. JSONL files are one split by themselves, so `split` does
    not apply to them. `question_limit`: the rule for questions longer than the model's context
    (data/question_length.py), applied to files and the hub's rows before the first N are taken.
    """
    _check_split_and_limit(split, max_examples)
    spec = _parse_named(name_or_path)
    if spec.task == "tiny-math":
        return tiny_math_examples(split, max_examples, seed, spec.domains)
    if spec.task == "tiny-math-conflict":
        return conflict_examples(split, max_examples, seed, spec.domains)
    if spec.paths:
        examples = interleave_domains([row for path in spec.paths for row in read_jsonl(path, question_limit)])
    else:
        examples = [e for e in _hub_rows(split, question_limit) if spec.domains is None or e["domain"] in spec.domains]
    return examples if max_examples is None else examples[:max_examples]


def held_out_split(name_or_path: str, eval_split: str = "test", eval_examples: int = 0,
                   max_examples: int | None = None, seed: int = 0,
                   question_limit: QuestionLimit | None = None) -> tuple[list[dict], list[dict]]:
    """(training examples, evaluation examples) of a run: the rule of the module's docstring.

    eval_split="test": the test split's first `eval_examples` problems (a JSONL file: its first rows);
    eval_split="validation": the first `eval_examples` problems of the training data (a JSONL file:
    the rows after its test rows). The training examples are the first `max_examples` (None: all) of
    the training data left once every scored question, and a file's test rows, are taken out, so
    `max_examples` counts what is trained on whatever is held out. `question_limit`: as
    `load_examples`'s."""
    if eval_split not in EVAL_SPLITS:
        raise DataError(f"unknown eval_split {eval_split!r}; known: {', '.join(EVAL_SPLITS)}")
    one_split = bool(_parse_named(name_or_path).paths)
    validation = eval_split == "validation"
    # The test rows: never trained on. A named task's test split is apart from its training split, so
    # a validation run need not load it; a file's test rows are its first rows, held out either way.
    test = load_examples(name_or_path, "test", eval_examples, seed=seed, question_limit=question_limit) \
        if eval_examples and (one_split or not validation) else []
    test_questions = {example["question"] for example in test}
    # Load enough rows that max_examples remain once the held-out ones are dropped; more where a
    # held-out question comes again (a tiny-math-conflict twin, a file's repeated row).
    limit = None if max_examples is None else max_examples + len(test_questions) + (eval_examples if validation else 0)
    while True:
        loaded = load_examples(name_or_path, "train", limit, seed=seed, question_limit=question_limit)
        train = [example for example in loaded if example["question"] not in test_questions]
        scored = test
        if validation:
            scored, train = train[:eval_examples], train[eval_examples:]
            scored_questions = {example["question"] for example in scored}
            train = [example for example in train if example["question"] not in scored_questions]
        if limit is None or len(train) >= max_examples or len(loaded) < limit:
            return train[:max_examples], scored
        limit += max_examples - len(train)


def training_split_size(name: str) -> int | None:
    """How many problems a named task's training split holds, where that is known without loading or
    generating it: tiny-math and tiny-math-conflict whole (TINY_MATH_SIZES), gsm8k's. None for a
    domain subset and for files."""
    spec = _parse_named(name)
    if spec.paths or spec.domains is not None:
        return None
    return GSM8K_TRAIN_SIZE if spec.task == "gsm8k" else TINY_MATH_SIZES["train"]


def evaluation_examples(name_or_path: str, split: str, count: int | None, seed: int = 0,
                        question_limit: QuestionLimit | None = None) -> list[dict]:
    """The problems a run that only scores (no training) takes: `load_examples`'s for "train" and
    "test"; for "validation", the `count` problems `held_out_split` would hold out for validation
    with eval_examples=count (a count is needed: validation is a part of the training data).
    `question_limit`: as `load_examples`'s."""
    if split != "validation":
        return load_examples(name_or_path, split, count, seed=seed, question_limit=question_limit)
    if count is None:
        raise DataError("the validation split needs a count (max_examples): it is the first problems of the "
                        "training data")
    return held_out_split(name_or_path, "validation", count, max_examples=0, seed=seed,
                          question_limit=question_limit)[1]


def _parse_named(name: str) -> DatasetSpec:
    try:
        return parse_dataset(name)
    except DataError as error:
        raise DataError(f"{str(name)!r}: {error}") from None


def _check_split_and_limit(split: str, max_examples: int | None) -> None:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; known splits: {', '.join(SPLITS)}")
    if max_examples is not None and max_examples < 0:
        raise DataError(f"max_examples must be >= 0, got {max_examples}")


def interleave_domains(examples: list[dict]) -> list[dict]:
    """Round-robin across domains (in the order they first appear), each domain's rows in their own
    order: the first N rows of the result hold every domain, as equally as the data allows. Rows of
    a single domain keep their order."""
    by_domain: dict[str, list[dict]] = {}
    for example in examples:
        by_domain.setdefault(example["domain"], []).append(example)
    rounds = itertools.zip_longest(*by_domain.values())
    return [example for round_ in rounds for example in round_ if example is not None]


def check_dataset(name: str, split: str = "test", max_examples: int | None = None) -> None:
    """Refuse, before launch and without the network, a data set a run would fail on or find empty:
    DataError, one line starting with "dataset: " and naming the file, line and reason.

    JSONL files are read whole (every line parsed and checked, as the run will). Generated tasks are
    valid by construction and not generated here. A hub data set is only checked for the `datasets`
    package: whether the hub answers is known only when the run loads it.
    """
    try:
        _check_split_and_limit(split, max_examples)
        spec = _parse_named(name)
        if spec.paths:
            examples = load_examples(name, split, max_examples)
            if not examples:
                raise DataError(f"{name}: no examples")
        elif spec.task == "gsm8k":
            _datasets_module()
        if max_examples == 0:
            raise DataError(f"{name}: no examples (max_examples is 0)")
    except DataError as error:
        raise DataError(f"dataset: {error}") from None


# ---------------------------------------------------------------------------------------------------
# GSM8K: the hub or local JSONL files


def read_jsonl(path: Path, question_limit: QuestionLimit | None = None) -> list[dict]:
    """Examples from a JSONL file of GSM8K rows, each with its `domain` (its own field, else the
    file's stem). A bad line or an empty file raises DataError naming the file (and line);
    `question_limit` refuses or leaves out a question longer than the model's context
    (data/question_length.py)."""
    path = Path(path)
    _require_file(path)
    examples = []
    # Bytes, decoded line by line: a line that is not UTF-8 is refused with its number.
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            line = _decoded(raw, path, line_number)
            if not line.strip():
                continue
            row = _parse_jsonl_line(line, path, line_number)
            if question_limit is None or question_limit.admits(row["question"], f"{path}, line {line_number}"):
                examples.append(row)
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    return examples


def _decoded(raw: bytes, path: Path, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}, line {line_number}: not UTF-8 (byte {raw[error.start]:#04x} at byte "
                        f"{error.start + 1} of the line); save the file as UTF-8") from None


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
    row["domain"] = _domain_of(row, path, where)
    return row


def _domain_of(row: dict, path: Path, where: str) -> str:
    domain = row.get("domain", path.stem)
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


def _datasets_module():
    if importlib.util.find_spec("datasets") is None:
        raise DataError(
            "gsm8k from the hub needs the 'datasets' package (pip install 'gpuscale[hub]'); "
            "or pass a local .jsonl file with 'question' and 'answer' fields"
        )
    import datasets

    return datasets


def _hub_rows(split: str, question_limit: QuestionLimit | None) -> list[dict]:
    rows = _load_gsm8k_from_hub(split)
    if question_limit is None:
        return rows
    return [row for number, row in enumerate(rows, start=1)
            if question_limit.admits(row["question"], f"{GSM8K_HUB_ID} {split}, row {number}")]


def _load_gsm8k_from_hub(split: str) -> list[dict]:
    datasets = _datasets_module()
    try:
        rows = datasets.load_dataset(GSM8K_HUB_ID, GSM8K_CONFIG, split=split)
    except Exception as error:  # offline, no cache, hub down, auth: all end the same way for the user
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise DataError(
            f"could not load {GSM8K_HUB_ID} ({GSM8K_CONFIG}/{split}) from the Hugging Face hub: {reason}; "
            f"pass a local .jsonl file with 'question' and 'answer' fields instead"
        ) from None
    return [{"question": row["question"], "answer": row["answer"], "domain": GSM8K_DOMAIN} for row in rows]


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


def tiny_math_examples(split: str, max_examples: int | None, seed: int = 0,
                       domains: tuple[str, ...] | None = None) -> list[dict]:
    """The split's problems (TINY_MATH_SIZES of them), or only those of `domains`, the first
    `max_examples` of them: a domain subset holds the same problems as the whole task, in its order."""
    return _first_of_split(_tiny_math_stream(split, seed), split, max_examples, domains)


def _first_of_split(stream: Iterator[dict], split: str, max_examples: int | None,
                    domains: tuple[str, ...] | None) -> list[dict]:
    """The first `max_examples` of the split's TINY_MATH_SIZES examples (of `domains` only, if given)."""
    problems = itertools.islice(stream, TINY_MATH_SIZES[split])
    if domains is not None:
        problems = (example for example in problems if example["domain"] in domains)
    return list(itertools.islice(problems, max_examples))


def generate_tiny_math(split: str, count: int, seed: int = 0) -> list[dict]:
    """`count` distinct tiny-math problems of `split`, the same ones for the same seed."""
    return list(itertools.islice(_tiny_math_stream(split, seed), count))


def _tiny_math_stream(split: str, seed: int) -> Iterator[dict]:
    """Distinct problems of `split`, without end, each domain drawn with TINY_MATH_WEIGHTS."""
    rng = random.Random(f"tiny-math/{split}/{seed}")
    want_test = split == "test"
    seen = set()
    while True:
        domain = rng.choices(TINY_MATH_DOMAINS, weights=TINY_MATH_WEIGHTS)[0]
        example = _DOMAIN_GENERATORS[domain](rng)
        question = example["question"]
        if is_test_question(question) == want_test and question not in seen:
            seen.add(question)
            yield example


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
    return _counting_example(*_word_list(rng))


def _word_list(rng: random.Random) -> tuple[list[str], str, int]:
    """(a shuffled list of 4 to 10 words, the target word, how often it occurs in the list)."""
    target = rng.choice(LIST_WORDS)
    others = [w for w in LIST_WORDS if w != target]
    length = rng.randint(4, 10)
    hits = rng.randint(1, min(6, length - 1))
    words = [target] * hits + [rng.choice(others) for _ in range(length - hits)]
    rng.shuffle(words)
    return words, target, hits


def _counting_question(words: list[str], target: str) -> str:
    return f"Here is a list: {', '.join(words)}. How many times does {target} appear in it?"


def _counting_steps(target: str, hits: int) -> list[str]:
    return [f"Counting {target}: " + ", ".join(str(i) for i in range(1, hits + 1)) + "."]


def _counting_example(words: list[str], target: str, hits: int) -> dict:
    return _example("counting", _counting_question(words, target), _counting_steps(target, hits), hits)


_DOMAIN_GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "arithmetic": _arithmetic,
    "comparison": _comparison,
    "counting": _counting,
}


# ---------------------------------------------------------------------------------------------------
# tiny-math-conflict: two domains whose GRPO gradients pull against each other
#
# Every problem comes twice, with the same question: a tiny-math counting question ("Here is a list:
# ... How many times does plum appear in it?"). Domain `counting` wants the number of occurrences, N;
# domain `repeats` wants the number of repeats after the first occurrence, N - 1. The prompt does not
# say which convention is asked: that is what makes the gradients conflict. On a counting question the
# embedded model answers N about two times in three and N - 1 (stopping its count one short) most of
# the other times, so both domains' groups of samples hold right and wrong answers, and GRPO raises
# the probability of N on `counting` rows while lowering it in favour of N - 1 on their `repeats`
# twins: the same prompts, opposite directions. (The two gradients' cosine was -0.3 on average over
# 8 steps of 4 twin pairs x 8 samples, tests/unit/test_conflict_gradients.py; tiny-math's domains'
# about 0.) No model can satisfy both domains, so what shows is how each method trades them off:
# plain GRPO follows the sum of the two gradients, PCGrad removes from each the part that undoes the
# other (and on tiny-math, whose domains barely conflict, hardly changes anything).
#
# Other constructions were tried on the embedded model and conflicted far less (a mean cosine about
# 0): a prompt marking the convention ("One more plum is added to it.", "..., less one?") is text the
# model never saw, which scatters its answers, so the two domains' samples no longer overlap; and a
# negated answer (`#### -N`) is never sampled, so that domain's groups all score 0, leaving its GRPO
# advantages and gradient at zero.
#
# Twins share a split (the test split holds the problems whose question hashes to it, as tiny-math's
# do), so no test question is trained on under either convention.

CONFLICT_DOMAINS = ("counting", "repeats")


def conflict_examples(split: str, max_examples: int | None, seed: int = 0,
                      domains: tuple[str, ...] | None = None) -> list[dict]:
    """The split's tiny-math-conflict rows (TINY_MATH_SIZES of them: a counting problem, then its
    `repeats` twin, and so on), or only those of `domains`, the first `max_examples` of them."""
    return _first_of_split(_conflict_stream(split, seed), split, max_examples, domains)


def _conflict_stream(split: str, seed: int) -> Iterator[dict]:
    rng = random.Random(f"tiny-math-conflict/{split}/{seed}")
    want_test = split == "test"
    seen = set()
    while True:
        words, target, hits = _word_list(rng)
        counting = _counting_example(words, target, hits)
        if is_test_question(counting["question"]) == want_test and counting["question"] not in seen:
            seen.add(counting["question"])
            yield counting
            steps = _counting_steps(target, hits) + [f"Repeats after the first: {hits} - 1 = {hits - 1}."]
            yield _example("repeats", counting["question"], steps, hits - 1)
