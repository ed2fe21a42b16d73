"""tiny-math-conflict (`--dataset tiny-math-conflict`): two domains built to pull GRPO's gradients apart,
for seeing what PCGrad does; every tiny-math counting question twice (data/tiny_math.py makes them)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from gpuscale.data.tiny_math import (
    HELD_OUT_SEED,
    TINY_MATH_SIZES,
    counting_example,
    counting_steps,
    first_of_split,
    pretraining_questions,
    split_of,
    word_list,
    worked_example,
)

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
# Twins share a split (a question's hash bucket fixes it, as tiny-math's do: data/tiny_math.py), so no
# held-out question is trained on under either convention. As tiny-math's, the test and validation
# problems are the same for every seed, and validation leaves out the embedded model's pretraining
# questions. Its problems are not marked `structurally_new`: only tiny-math's are.

CONFLICT_DOMAINS = ("counting", "repeats")


def conflict_examples(split: str, max_examples: int | None, seed: int = 0,
                      domains: tuple[str, ...] | None = None) -> list[dict]:
    """The split's tiny-math-conflict rows (TINY_MATH_SIZES of them: a counting problem, then its
    `repeats` twin, and so on), or only those of `domains`, the first `max_examples` of them."""
    return first_of_split(_conflict_stream(split, seed), TINY_MATH_SIZES[split], max_examples, domains)


def _conflict_stream(split: str, seed: int) -> Iterator[dict]:
    # The seed chooses the training problems only (data/tiny_math.py's docstring).
    rng = random.Random(f"tiny-math-conflict/{split}/{seed if split == 'train' else HELD_OUT_SEED}")
    seen = set()
    while True:
        words, target, hits = word_list(rng)
        counting = counting_example(words, target, hits)
        if counting["question"] not in seen and _in_split(counting["question"], split):
            seen.add(counting["question"])
            yield counting
            steps = counting_steps(target, hits) + [f"Repeats after the first: {hits} - 1 = {hits - 1}."]
            yield worked_example("repeats", counting["question"], steps, hits - 1)


def _in_split(question: str, split: str) -> bool:
    if split_of(question) != split:
        return False
    return split != "validation" or question not in pretraining_questions()
