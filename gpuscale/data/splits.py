"""The names of the splits a run loads or scores, and which of tiny-math's test splits `test` is: one
place for the loaders (data/tasks.py, data/tiny_math.py), the settings' types and their descriptions.
It imports nothing of the data sets, so that the recipes' settings, which the front ends read at start-up,
name the splits without loading a data set's code (tests/tui/test_startup.py).

tiny-math has two test splits (data/tiny_math.py's docstring says how each was drawn): test-v1, which
every figure before 2026-11-29 was scored on, kept under that name only to compare with them, and
test-v2, drawn that day apart from every problem scored before. Any other data set has one test split,
which `test-v1` names too.
"""

from __future__ import annotations

from typing import Literal

OLD_TEST_SPLIT, FRESH_TEST_SPLIT = "test-v1", "test-v2"
TEST_SPLITS = {OLD_TEST_SPLIT: "the one every figure before 2026-11-29 was scored on",
               FRESH_TEST_SPLIT: "drawn on 2026-11-29 apart from every problem scored before"}
# Which of tiny-math's test splits `test` means: test-v2 since 2026-11-29. A run's summary names it
# (`test_split`, beside eval_split `test`), and so does every bench result (bench/record.py): a `test`
# figure with none is test-v1's. The held-out cache holds both test splits by name and `test` is looked up
# here, never in the file. Training leaves out the near-duplicates of both splits' structurally new
# problems, so which one `test` means changes no training problem.
TEST_SPLIT_EDITION = FRESH_TEST_SPLIT

SPLITS = ("train", "test", OLD_TEST_SPLIT)  # what data/tasks.py's `load_examples` loads
EVAL_SPLITS = ("test", "validation", OLD_TEST_SPLIT)  # what a run's held-out evaluation scores: `held_out_split`
EvalSplit = Literal[*EVAL_SPLITS]  # the type of the recipes' `eval_split` setting
# What the settings' descriptions say of the test splits.
TEST_SPLIT_HELP = f"tiny-math's is {TEST_SPLIT_EDITION}, {TEST_SPLITS[TEST_SPLIT_EDITION]}"
OLD_TEST_SPLIT_HELP = (f"{OLD_TEST_SPLIT} = tiny-math's test split before 2026-11-29, which every earlier figure "
                       "was scored on, kept only to compare with them (another data set: its test split, never "
                       "drawn again)")
