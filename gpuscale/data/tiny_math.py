"""tiny-math (`--dataset tiny-math`, `tiny-math:arithmetic,counting`): synthetic word problems in three
domains (arithmetic, comparison, counting) whose answers a program can check, generated from a seed.
Train and test are disjoint by construction: a question belongs to the test split iff a hash of its
text says so, whatever the seed. Every example is GSM8K-format (data/tasks.py's docstring)."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterator

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
    return first_of_split(_tiny_math_stream(split, seed), split, max_examples, domains)


def first_of_split(stream: Iterator[dict], split: str, max_examples: int | None,
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

