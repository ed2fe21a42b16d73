"""GSM8K-shaped JSONL rows for the tests of a large data file: word problems and answers in GSM8K's
format (data/jsonl_files.py reads them: a `question`, an `answer` whose last line is `#### N`), made
from a seed, so that a test needs neither the hub nor a stored copy of GSM8K's 7,473 training rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy", "Mark", "Carla")
THINGS = ("clips", "apples", "books", "pages", "cupcakes", "marbles", "stickers", "eggs", "pencils", "shells")
SENTENCES = (
    "{a} sold {x} {t} to her friends in April, and then she sold half as many {t} in May.",
    "{a} earns ${x} an hour for babysitting; yesterday she did {y} minutes of babysitting.",
    "{a} is saving money for a new wallet which costs ${x}, and she has only half of the money she needs.",
    "Her parents decided to give her ${y} for that purpose, and her grandparents twice as much as her parents.",
    "{a} is reading a {x}-page book; yesterday she was able to read {y} pages and today twice as many.",
    "{a} writes a {x}-page letter to {b} friends twice a week, and the letters go out every Monday.",
    "{a} has {x} {t} and gives {y} of them to {b}, who already had a few of his own.",
    "Each box holds {y} {t}, and there are {x} boxes stacked in the garage next to the old bicycle.",
)
ASKED = ("How many {t} did {a} have altogether?", "How much did {a} earn?", "How many {t} are left?",
         "How much more money does {a} need to buy the wallet?")


def gsm8k_rows(count: int, seed: int = 0, most_sentences: int = 6) -> list[dict]:
    """`count` rows: a question of 1 to `most_sentences` sentences and the asking one (about 100 to
    600 characters at 6, most 150 to 400, as GSM8K's), an answer with a calculation and `#### N`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        fill = {"a": rng.choice(NAMES), "b": rng.choice(NAMES), "t": rng.choice(THINGS),
                "x": rng.randint(2, 500), "y": rng.randint(2, 90)}
        sentences = min(most_sentences, rng.choice((1, 1, 2, 2, 2, 3, 3, 4, 6)))
        body = " ".join(rng.choice(SENTENCES).format(**fill) for _ in range(sentences))
        total = fill["x"] + fill["y"]
        rows.append({"question": f"{body} {rng.choice(ASKED).format(**fill)}",
                     "answer": f"{fill['a']} has {fill['x']} + {fill['y']} = <<{fill['x']}+{fill['y']}={total}>>"
                               f"{total}.\n#### {total}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
