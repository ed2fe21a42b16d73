"""The tasks gpuscale knows by name, and loading any of them, or a mixture, as GSM8K-format examples.

Every example is a dict with `question`, `answer` and `domain`, the answer written as GSM8K writes it:
worked steps, then a last line `#### N`. Multi-task recipes route rewards and metrics by `domain`.

This module names the data sets, loads them and holds the rule of what a run holds out; the sources
are apart: data/tiny_math.py and data/tiny_math_conflict.py (the generated tasks), data/gsm8k_hub.py
(the hub), data/jsonl_files.py (local files), data/data_error.py (`DataError`, the one error).

What `--dataset` accepts (`parse_dataset`):

- `tiny-math`: synthetic word problems in three domains (arithmetic, comparison, counting). Train,
  validation and test are disjoint by construction: a hash of a question's text fixes its split. The
  seed chooses the training problems only: test and validation are the same for every seed, and
  validation holds none of the embedded model's pretraining problems (data/tiny_math.py).
- `tiny-math:arithmetic,counting`: the same problems, only those of the named domains.
- `tiny-math-conflict`: two domains built to pull GRPO's gradients apart, for seeing what PCGrad
  does: every tiny-math-style counting question twice, `counting` wanting the number of occurrences
  N and `repeats` the number of repeats N - 1 (see "tiny-math-conflict" below for why they conflict).
  Its subsets work as tiny-math's do (`tiny-math-conflict:repeats`).
- `gsm8k`: `openai/gsm8k` (config `main`) through `datasets`, an optional dependency imported lazily
  (domain "gsm8k").
- `a.jsonl` or `a.jsonl,b.jsonl`: local GSM8K-format files (one split by themselves). A row's domain is
  its `domain` field, else the run's `domain` setting, else its file's stem (`a`). A value holding
  ".jsonl" is always a list of files, so it cannot be mistaken for a task's domain list.

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
  `eval_examples` rows. Training is the training split less any question of those rows. tiny-math's
  test split is TEST_SPLIT_EDITION's of its two (data/splits.py).
- `test-v1` (OLD_TEST_SPLIT): tiny-math's test split before 2026-11-29, which every earlier figure was
  scored on, kept only to compare with them; every other data set's test split, which was never drawn
  again.
- `validation`: problems for choosing settings without ever scoring the test problems. tiny-math
  and tiny-math-conflict have a validation split of their own (the first `eval_examples` of it,
  fixed across seeds, none a pretraining problem of the embedded model); for gsm8k it is the first
  `eval_examples` problems of the training split; for a JSONL file the training data is what is left
  once its test rows (still its first `eval_examples` rows, as with `test`) are held out, so
  validation is the `eval_examples` rows after them. Training is the rest, less any question scored:
  neither the validation nor the test questions are trained on, and the validation questions are
  never test questions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscale.data.answers import extract_strict
from gpuscale.data.data_error import DataError
from gpuscale.data.gsm8k_hub import GSM8K_DOMAIN, GSM8K_TRAIN_SIZE, datasets_module, hub_rows
from gpuscale.data.jsonl_files import read_jsonl, require_file
from gpuscale.data.paths import absolute_path
from gpuscale.data.splits import EVAL_SPLITS, OLD_TEST_SPLIT, SPLITS, TEST_SPLIT_EDITION
from gpuscale.data.tiny_math import TINY_MATH_DOMAINS, TINY_MATH_SIZES, tiny_math_examples
from gpuscale.data.tiny_math_conflict import CONFLICT_DOMAINS, conflict_examples

if TYPE_CHECKING:
    from gpuscale.data.question_length import QuestionLimit

KNOWN_TASKS = ("tiny-math", "tiny-math-conflict", "gsm8k")
# The generated tasks, each with a validation split of its own: (split, max_examples, seed, domains) -> rows.
GENERATED_TASKS = {"tiny-math": tiny_math_examples, "tiny-math-conflict": conflict_examples}
JSONL_SUFFIX = ".jsonl"


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


def dataset_domains(name: str, domain: str | None = None) -> tuple[str, ...]:
    """The domains a data set's rows carry: a named task's (its chosen ones), or the files' rows', read
    whole, in the order they first appear (`domain` as `load_examples`'s)."""
    spec = _parse_named(name)
    if spec.paths:
        return tuple(dict.fromkeys(row["domain"] for path in spec.paths for row in read_jsonl(path, domain=domain)))
    return spec.domains or task_domains(spec.task)


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
        require_file(path)
    return ",".join(str(absolute_path(path)) for path in spec.paths) if spec.paths else name



# ---------------------------------------------------------------------------------------------------
# Loading


def load_examples(
    name_or_path: str, split: str = "test", max_examples: int | None = None, seed: int = 0,
    question_limit: QuestionLimit | None = None, domain: str | None = None,
) -> list[dict]:
    """The examples of a data set named as `--dataset` takes it (see the module's docstring).

    `max_examples` keeps the first N of the data set's order (as lm-eval's --limit does; for a
    mixture of domains that order is interleaved, see above). `seed` chooses the generated training
    problems of `tiny-math` (its test problems are the same for every seed); fixed data sets ignore
    it. JSONL files are one split by themselves, so `split` does not apply to them. `question_limit`:
    the rule for questions longer than the model's context (data/question_length.py), applied to files
    and the hub's rows before the first N are taken. `domain`: the domain of a file's row that names
    none (None: the file's stem), the run's `domain` setting.
    """
    _check_split_and_limit(split, max_examples)
    spec = _parse_named(name_or_path)
    if split == OLD_TEST_SPLIT and spec.task != "tiny-math":
        split = "test"  # only tiny-math's test split was drawn again
    if spec.task in GENERATED_TASKS:
        return GENERATED_TASKS[spec.task](split, max_examples, seed, spec.domains)
    if spec.paths:
        examples = interleave_domains([row for path in spec.paths for row in read_jsonl(path, question_limit, domain)])
    else:
        examples = [e for e in hub_rows(split, question_limit) if spec.domains is None or e["domain"] in spec.domains]
    return examples if max_examples is None else examples[:max_examples]


def test_split_scored(name_or_path: str, split: str) -> dict:
    """{"test_split": tiny-math's test split by name} where `split` is tiny-math's `test`
    (TEST_SPLIT_EDITION's, or test-v1 named), else {}: what a summary adds to its `eval_split` so that
    a `test` figure says which test problems it was scored on."""
    if split not in ("test", OLD_TEST_SPLIT) or JSONL_SUFFIX in str(name_or_path):
        return {}
    task = str(name_or_path).strip().partition(":")[0]
    return {"test_split": TEST_SPLIT_EDITION if split == "test" else split} if task == "tiny-math" else {}


def held_out_split(name_or_path: str, eval_split: str = "test", eval_examples: int = 0,
                   max_examples: int | None = None, seed: int = 0,
                   question_limit: QuestionLimit | None = None,
                   domain: str | None = None) -> tuple[list[dict], list[dict]]:
    """(training examples, evaluation examples) of a run: the rule of the module's docstring.

    eval_split="test" (or test-v1, OLD_TEST_SPLIT): the test split's first `eval_examples` problems (a
    JSONL file: its first rows);
    eval_split="validation": a generated task's validation split's first `eval_examples` problems;
    otherwise the first `eval_examples` problems of the training data (a JSONL file: the rows after
    its test rows). The training examples are the first `max_examples` (None: all) of
    the training data left once every scored question, and a file's test rows, are taken out, so
    `max_examples` counts what is trained on whatever is held out. `question_limit` and `domain`: as
    `load_examples`'s."""
    if eval_split not in EVAL_SPLITS:
        raise DataError(f"unknown eval_split {eval_split!r}; known: {', '.join(EVAL_SPLITS)}")
    spec = _parse_named(name_or_path)
    one_split = bool(spec.paths)
    validation = eval_split == "validation"
    if validation and spec.task in GENERATED_TASKS:  # three splits apart by construction
        scored = GENERATED_TASKS[spec.task]("validation", eval_examples, seed, spec.domains)
        return load_examples(name_or_path, "train", max_examples, seed=seed), scored
    # The test rows: never trained on. A named task's test split is apart from its training split, so
    # a validation run need not load it; a file's test rows are its first rows, held out either way.
    test = load_examples(name_or_path, "test" if validation else eval_split, eval_examples, seed=seed,
                         question_limit=question_limit, domain=domain) \
        if eval_examples and (one_split or not validation) else []
    test_questions = {example["question"] for example in test}
    # Load enough rows that max_examples remain once the held-out ones are dropped; more where a
    # held-out question comes again (a tiny-math-conflict twin, a file's repeated row).
    limit = None if max_examples is None else max_examples + len(test_questions) + (eval_examples if validation else 0)
    while True:
        loaded = load_examples(name_or_path, "train", limit, seed=seed, question_limit=question_limit, domain=domain)
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


def validation_split_size(name: str) -> int | None:
    """How many problems a named task's own validation split holds (tiny-math and tiny-math-conflict:
    TINY_MATH_SIZES), the whole split's count: a domain subset (tiny-math:comparison) asked for it takes
    the problems of its domains among them, fewer. None where validation is carved from the training
    data (gsm8k, files): there a larger validation leaves less to train on."""
    spec = _parse_named(name)
    return TINY_MATH_SIZES["validation"] if not spec.paths and spec.task in GENERATED_TASKS else None


def evaluation_examples(name_or_path: str, split: str, count: int | None, seed: int = 0,
                        question_limit: QuestionLimit | None = None, domain: str | None = None) -> list[dict]:
    """The problems a run that only scores (no training) takes: `load_examples`'s for "train" and
    "test"; for "validation", the `count` problems `held_out_split` would hold out for validation
    with eval_examples=count (a count is needed: validation is a part of the training data, or of a
    generated task's validation split).
    `question_limit` and `domain`: as `load_examples`'s."""
    if split != "validation":
        return load_examples(name_or_path, split, count, seed=seed, question_limit=question_limit, domain=domain)
    if count is None:
        raise DataError("the validation split needs a count (max_examples): it is the first problems of the "
                        "training data")
    return held_out_split(name_or_path, "validation", count, max_examples=0, seed=seed,
                          question_limit=question_limit, domain=domain)[1]


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
            datasets_module()
        if max_examples == 0:
            raise DataError(f"{name}: no examples (max_examples is 0)")
    except DataError as error:
        raise DataError(f"dataset: {error}") from None

