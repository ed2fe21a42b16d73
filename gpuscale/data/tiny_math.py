"""tiny-math (`--dataset tiny-math`, `tiny-math:arithmetic,counting`): synthetic word problems in three
domains (arithmetic, comparison, counting) whose answers a program can check. Every example is
GSM8K-format (data/tasks.py's docstring).

Three splits, disjoint by construction: a hash of a question's text puts it in one bucket of ten
(`split_of`), bucket 0 the test split's, bucket 1 the validation split's, the rest the training
split's, whatever the seed.

- test and validation are fixed: the same problems for every seed (a run's seed changes what it
  trains on and how, never what it is scored on).
- Two test splits have been drawn from bucket 0, each named; `test` is data/splits.py's
  TEST_SPLIT_EDITION's (test-v2 since 2026-11-29), the other is reached by its name only.
  - test-v1 (OLD_TEST_SPLIT): the one seed 0 drew (HELD_OUT_SEED), on which every figure before
    2026-11-29 was measured, and selections made: it is kept, as `eval_split=test-v1`, only to
    compare with that history.
  - test-v2 (FRESH_TEST_SPLIT): drawn on 2026-11-29 from its own stream
    ("tiny-math/test-v2/2026-11-29/question", FRESH_TEST_STREAM), of the bucket-0 problems no
    selection can have scored (bucket 0 holds no validation, pretraining or training question to
    begin with): none is a test-v1 problem or shares a structure key (data/near_duplicates.py) with a
    test-v1 or validation problem (`_fresh_test_filter`). The domains are drawn with
    TINY_MATH_WEIGHTS and a refused problem is drawn again within its domain, so they keep their
    shares however unevenly the filter refuses them: 49.7/24.7/25.6% arithmetic/comparison/counting
    (test-v1: 47.6/28.2/24.1%). Like test-v1 it may hold a problem a pretraining problem equals up to
    names and nouns (`accuracy_new` reports the others apart); structurally new: 24.6/99.2/59.6% of
    each domain (test-v1: 18.6/99.6/40.5%). Its arithmetic kinds differ from test-v1's: 250 add, 204
    subtract, 317 add-then-subtract, 222 multiply-then-add, 1 temperature drop and no multiply
    (test-v1: 183, 201, 190, 186, 33, 160), because test-v1 and validation hold every multiply
    structure (its numbers, 2-9 times 2-9, make 64) and 33 of bucket 0's 34 temperature questions
    (they hold no name or noun): a fresh split cannot have them. Its figures do not compare with
    test-v1's.
    The rule considered and not taken: leave out the pretraining problems' near-duplicates too, so
    that every test-v2 problem is structurally new. Pretraining covers most arithmetic structures,
    so its arithmetic came out 902 of 999 add-then-subtract: one kind would have stood for a domain.
- validation also leaves out every pretraining problem of the embedded model (`pretraining_examples`:
  tools/train_tiny.py's first 51,200 training problems of seed 0), so settings chosen on it were never
  chosen on problems the base model was trained on.
- Every held-out problem is marked `structurally_new` (data/near_duplicates.py) or not: whether no
  pretraining problem equals it up to the names and nouns. The training split (drawn from the run's
  seed) leaves out every problem sharing a structurally new held-out problem's structure key, test-v1's
  and test-v2's alike, so no run trains on a near-duplicate of one either (while drawing seed 0's
  200,000 it refuses 706 problems for test-v2 and about 940 for test-v1 and validation).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuscale.data.near_duplicates import structure_key
from gpuscale.data.splits import FRESH_TEST_SPLIT, OLD_TEST_SPLIT, TEST_SPLIT_EDITION, TEST_SPLITS
from gpuscale.data.tiny_math_words import LIST_WORDS, NAMES, THINGS

TINY_MATH_DOMAINS = ("arithmetic", "comparison", "counting")
# How often each domain is drawn. Arithmetic is the GSM8K-like one, so it gets the most weight.
TINY_MATH_WEIGHTS = (0.5, 0.25, 0.25)
TINY_MATH_SIZES = {"train": 200_000, "validation": 2_000, "test": 2_000}
# A question's bucket (one of TEST_BUCKETS, by the hash of its text) fixes its split.
TEST_BUCKETS = 10
TEST_BUCKET, VALIDATION_BUCKET = 0, 1
# The seed test-v1 and validation are drawn with, whatever the run's seed (0: the test problems every
# earlier seed-0 figure was measured on).
HELD_OUT_SEED = 0
# test-v2's stream (the module's docstring). "/question" names its rule: the stream without it drew the
# rule not taken.
FRESH_TEST_STREAM = f"{FRESH_TEST_SPLIT}/2026-11-29/question"
HELD_OUT_SPLITS = (*TEST_SPLITS, "validation")  # the test splits by name (data/splits.py), and validation
# The embedded model's pretraining problems (models/tiny-math/training.json: tools/train_tiny.py's --seed 0,
# --steps 800 of --batch-size 64): the first PRETRAINING_COUNT problems of `_pretraining_stream`.
PRETRAINING_SEED, PRETRAINING_COUNT = 0, 800 * 64
# A training split asked for beyond this many problems is the whole split read from the user's cache
# (`_training_split`); fewer are generated, which takes about 0.1 s for 4,000.
CACHED_TRAINING_FROM = 20_000


def question_bucket(question: str) -> int:
    digest = hashlib.md5(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % TEST_BUCKETS


def split_of(question: str) -> str:
    """Which split a question belongs to, fixed by its text so that no two splits share one."""
    bucket = question_bucket(question)
    return "test" if bucket == TEST_BUCKET else "validation" if bucket == VALIDATION_BUCKET else "train"


def is_test_question(question: str) -> bool:
    return question_bucket(question) == TEST_BUCKET


def tiny_math_examples(split: str, max_examples: int | None, seed: int = 0,
                       domains: tuple[str, ...] | None = None) -> list[dict]:
    """The split's problems (TINY_MATH_SIZES of them), or only those of `domains`, the first
    `max_examples` of them: a domain subset holds the same problems as the whole task, in its order.
    `split`: train, validation, test (TEST_SPLIT_EDITION's) or a test split's name (TEST_SPLITS).
    `seed` chooses the training problems only; test and validation are fixed (the module's docstring)."""
    if split == "train":
        many = max_examples is None or max_examples > CACHED_TRAINING_FROM
        stream = iter(_training_split(seed)) if many else _training_stream(seed)
        return first_of_split(stream, TINY_MATH_SIZES[split], max_examples, domains)
    problems = held_out_problems(split)
    return [dict(example) for example in first_of_split(iter(problems), len(problems), max_examples, domains)]


def held_out_problems(split: str) -> tuple[dict, ...]:
    """The whole validation split, test split (TEST_SPLIT_EDITION's) or named test split (TEST_SPLITS),
    TINY_MATH_SIZES of them, each problem marked `structurally_new` (callers copy before changing one)."""
    return _held_out()[TEST_SPLIT_EDITION if split == "test" else split]


def held_out_new_keys() -> frozenset[str]:
    """The structure keys of the structurally new problems of both test splits and validation: no
    training problem may have one (data/near_duplicates.py)."""
    return _held_out()["new_keys"]


@functools.cache
def _held_out() -> dict:
    """The held-out splits (HELD_OUT_SPLITS, by name) and the new keys, once per process: read from the
    user's cache, else computed (about 2 s, the pretraining problems generated and keyed: every rank
    would pay it) and written there for the next process."""
    found = _cached(held_out_cache_path(), _computed_held_out)
    return {**{split: tuple(found[split]) for split in HELD_OUT_SPLITS}, "new_keys": frozenset(found["new_keys"])}


def _training_split(seed: int) -> list[dict]:
    """The whole training split of `seed`, read from the user's cache, else generated and written there
    (generating its 200,000 problems took 5.6 s on a 2-core machine, in every rank of every run that
    trains on the whole split; reading them 0.2 s). Read afresh at each call: the caller owns the rows."""
    return _cached(_cache_path(f"train-seed{seed}"),
                   lambda: list(itertools.islice(_training_stream(seed), TINY_MATH_SIZES["train"])))


def held_out_cache_path() -> Path:
    """The cache file of `_held_out` (`_cache_path`)."""
    return _cache_path("held-out")


def _cache_path(kind: str) -> Path:
    """A cache file under XDG_CACHE_HOME (else ~/.cache)/gpuscale, named by `kind` and a digest of the
    code that makes its content (this module, its words, the near-duplicate rule and the splits' names,
    TEST_SPLIT_EDITION's included), so that a changed generator, rule or edition never reads an old file."""
    code = b"".join(Path(__file__).with_name(name).read_bytes()
                    for name in ("tiny_math.py", "tiny_math_words.py", "near_duplicates.py", "splits.py"))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuscale"
    return cache / f"tiny-math-{kind}-{hashlib.sha256(code).hexdigest()[:16]}.json"


def _cached(path: Path, compute: Callable[[], object]):
    """The JSON in `path`, else `compute()`'s, written there whole or not at all (ranks may write it at
    the same time); the same kind's files of other code versions are removed then. A cache that
    cannot be read or written is only slower."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    found = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(found))
        os.replace(partial, path)
        kind = path.name.rsplit("-", 1)[0]  # tiny-math-<kind>, less the code's digest
        for older in path.parent.glob(f"{kind}-*.json"):
            if older != path:
                older.unlink(missing_ok=True)
    except OSError:
        pass
    return found


def _computed_held_out() -> dict:
    test, validation = TINY_MATH_SIZES["test"], TINY_MATH_SIZES["validation"]
    found = {OLD_TEST_SPLIT: _drawn(f"test/{HELD_OUT_SEED}", test, is_test_question),
             "validation": _drawn(f"validation/{HELD_OUT_SEED}", validation, _validation_question)}
    scored = found[OLD_TEST_SPLIT] + found["validation"]
    found[FRESH_TEST_SPLIT] = _drawn_fresh_test(scored)
    found["new_keys"] = sorted({structure_key(example["question"]) for split in HELD_OUT_SPLITS
                                for example in found[split] if example["structurally_new"]})
    return found


def _drawn(stream_name: str, size: int, keep: Callable[[str], bool], keep_shares: bool = False) -> list[dict]:
    """A held-out split: the first `size` problems `keep` accepts of the stream seeded
    "tiny-math/<stream_name>" (`_distinct_problems`), each marked `structurally_new`."""
    stream = _distinct_problems(random.Random(f"tiny-math/{stream_name}"), keep, keep_shares)
    return [{**example, "structurally_new": is_structurally_new(example["question"])}
            for example in itertools.islice(stream, size)]


def _drawn_fresh_test(scored: list[dict]) -> list[dict]:
    """test-v2: apart from the `scored` problems (test-v1's and validation's), its domains keeping their
    shares."""
    return _drawn(FRESH_TEST_STREAM, TINY_MATH_SIZES["test"], _fresh_test_filter(scored), keep_shares=True)


def _fresh_test_filter(scored: list[dict]) -> Callable[[str], bool]:
    """Whether a question may be a test-v2 problem: a test-bucket question (so never a validation,
    pretraining or training question: `split_of`) that is no `scored` problem and shares a structure key
    with none of them (selections were made on them)."""
    questions = {example["question"] for example in scored}
    taken = {structure_key(question) for question in questions}
    return lambda question: (is_test_question(question) and question not in questions
                             and structure_key(question) not in taken)


def _validation_question(question: str) -> bool:
    return question_bucket(question) == VALIDATION_BUCKET and question not in pretraining_questions()


@functools.cache
def pretraining_questions() -> frozenset[str]:
    return frozenset(example["question"] for example in pretraining_examples())


def pretraining_examples(count: int = PRETRAINING_COUNT, seed: int = PRETRAINING_SEED) -> list[dict]:
    """The problems tools/train_tiny.py pretrains a model on: the first `count` of the stream it has always
    drawn (every question outside the test bucket, validation's included); with the defaults, the
    embedded model's. Validation leaves these out; the training split may hold them."""
    return list(itertools.islice(_pretraining_stream(seed), count))


@functools.cache
def pretraining_keys() -> frozenset[str]:
    """The structure keys of the embedded model's pretraining problems (`pretraining_examples`),
    computed once per process from `pretraining_questions` (not generated a second time)."""
    return frozenset(structure_key(question) for question in pretraining_questions())


def is_structurally_new(question: str) -> bool:
    """Whether no pretraining problem equals `question` up to names and nouns."""
    return structure_key(question) not in pretraining_keys()


def _pretraining_stream(seed: int) -> Iterator[dict]:
    return _distinct_problems(random.Random(f"tiny-math/train/{seed}"), lambda question: not is_test_question(question))


def _training_stream(seed: int) -> Iterator[dict]:
    """The training split of `seed`: its training-bucket questions less every near-duplicate of a
    structurally new held-out problem."""
    new_keys = held_out_new_keys()
    return _distinct_problems(random.Random(f"tiny-math/train/{seed}"), lambda question: (
        split_of(question) == "train" and structure_key(question) not in new_keys))


def first_of_split(stream: Iterator[dict], size: int, max_examples: int | None,
                   domains: tuple[str, ...] | None) -> list[dict]:
    """The first `max_examples` of the split's `size` examples (of `domains` only, if given)."""
    problems = itertools.islice(stream, size)
    if domains is not None:
        problems = (example for example in problems if example["domain"] in domains)
    return list(itertools.islice(problems, max_examples))


def _distinct_problems(rng: random.Random, keep: Callable[[str], bool], keep_shares: bool = False) -> Iterator[dict]:
    """Distinct problems whose question `keep` accepts, without end, each domain drawn with
    TINY_MATH_WEIGHTS. A refused problem is dropped, or with `keep_shares` drawn again within its
    domain, so that the domains keep their weights however unevenly `keep` refuses them."""
    seen = set()
    while True:
        domain = rng.choices(TINY_MATH_DOMAINS, weights=TINY_MATH_WEIGHTS)[0]
        while True:
            example = _DOMAIN_GENERATORS[domain](rng)
            question = example["question"]
            kept = question not in seen and keep(question)
            if kept or not keep_shares:
                break
        if kept:
            seen.add(question)
            yield example


def worked_example(domain: str, question: str, steps: list[str], value: int, **fields) -> dict:
    answer = "\n".join(steps + [f"#### {value}"])
    return {"question": question, "answer": answer, "domain": domain, **fields}


# Arithmetic: one and two steps with + - *. Each example keeps its `expression`, so a test can
# recompute the answer without trusting the generator. The number ranges set the difficulty: a tiny
# model trained for minutes learns the times table and small sums, and gets larger sums half right.


def _arithmetic(rng: random.Random) -> dict:
    kind = rng.choice(_ARITHMETIC_KINDS)
    question, steps, expression, value = kind(rng, rng.choice(NAMES), rng.choice(THINGS))
    return worked_example("arithmetic", question, steps, value, expression=expression)


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
    return worked_example("comparison", f"{statement} {question}", steps, value)


# Counting: how often a word occurs in a list, counted out loud one occurrence at a time.


def _counting(rng: random.Random) -> dict:
    return counting_example(*word_list(rng))


def word_list(rng: random.Random) -> tuple[list[str], str, int]:
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


def counting_steps(target: str, hits: int) -> list[str]:
    return [f"Counting {target}: " + ", ".join(str(i) for i in range(1, hits + 1)) + "."]


def counting_example(words: list[str], target: str, hits: int) -> dict:
    return worked_example("counting", _counting_question(words, target), counting_steps(target, hits), hits)


_DOMAIN_GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "arithmetic": _arithmetic,
    "comparison": _comparison,
    "counting": _counting,
}

