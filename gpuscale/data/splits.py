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
# Which of tiny-math's test splits `test` means, the one line to change to score on test-v2: every `test`
# figure from then on is test-v2's (a run's summary still says eval_split `test`: earlier runs' `test` is
# test-v1). The held-out cache holds both test splits by name and `test` is looked up here, never in the
# file; the file is named by a digest of this module too (data/tiny_math.py's `_cache_path`), so a flip
# also makes the held-out and training caches once more. Both splits are always drawn and training always
# leaves out the near-duplicates of test-v2's structurally new problems, so the flip changes no training
# problem. Which problems test-v2 leaves out is data/tiny_math.py's FRESH_TEST_RULE, to choose before it.
TEST_SPLIT_EDITION = OLD_TEST_SPLIT

SPLITS = ("train", "test", OLD_TEST_SPLIT)  # what data/tasks.py's `load_examples` loads
EVAL_SPLITS = ("test", "validation", OLD_TEST_SPLIT)  # what a run's held-out evaluation scores: `held_out_split`
EvalSplit = Literal[*EVAL_SPLITS]  # the type of the recipes' `eval_split` setting
# What the settings' descriptions say of the test splits.
TEST_SPLIT_HELP = f"tiny-math's is {TEST_SPLIT_EDITION}, {TEST_SPLITS[TEST_SPLIT_EDITION]}"
OLD_TEST_SPLIT_HELP = (f"{OLD_TEST_SPLIT} = tiny-math's test split before 2026-11-29, which every earlier figure "
                       "was scored on, kept only to compare with them (another data set: its test split, never "
                       "drawn again)")
