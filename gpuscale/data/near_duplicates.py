"""The near-duplicate rule of tiny-math: two questions are near-duplicates when they are the same up to
the people's names and the nouns, the numbers kept.

A question's structure key (`structure_key`) writes each name of tiny-math's NAMES as `<name1>`,
`<name2>`, ... in the order they first appear, each noun of THINGS as `<thing1>`, ..., and each word of
a counting list (LIST_WORDS) as `<word1>`, ... (the words are data/tiny_math_words.py's): "Ann has 3
apples. Ann gets 4 more." and "Raj has 3 coins. Raj gets 4 more." share a key; "Ann has 5 apples. Ann
gets 4 more." does not. Numbering the placeholders by first appearance keeps who is who (the
comparison's order of people, the counting list's pattern of target and other words), so only a
renaming makes a near-duplicate.

A held-out problem is `structurally_new` when its key is no key of the embedded model's pretraining
problems (data/tiny_math.py's `pretraining_keys` and `is_structurally_new`). data/tiny_math.py marks its
test and validation problems once and keeps the marks and the new keys in the user's cache, so the next
process reads them instead of generating and keying the pretraining problems again. It also keeps every
problem sharing a new problem's key out of its training split, so no run trains on a near-duplicate of
one either, whatever its seed. This module imports only the words, so that tiny_math.py imports it and
not the other way round.
"""

from __future__ import annotations

import re

from gpuscale.data.tiny_math_words import LIST_WORDS, NAMES, THINGS

_CATEGORY_OF = {**{word: "word" for word in LIST_WORDS}, **{word: "thing" for word in THINGS},
                **{word: "name" for word in NAMES}}
# Whole words only: the counting list's "apple" is not the noun "apples".
_REPLACED = re.compile(r"\b(" + "|".join(sorted(_CATEGORY_OF, key=len, reverse=True)) + r")\b")


def structure_key(question: str) -> str:
    """The question with its names and nouns replaced by placeholders numbered by first appearance
    (see the module's docstring); the numbers and every other word kept."""
    placeholders: dict[str, str] = {}
    counts = dict.fromkeys(("name", "thing", "word"), 0)

    def placeholder(match: re.Match) -> str:
        word = match.group(0)
        if word not in placeholders:
            category = _CATEGORY_OF[word]
            counts[category] += 1
            placeholders[word] = f"<{category}{counts[category]}>"
        return placeholders[word]

    return _REPLACED.sub(placeholder, question)
