"""pass@k from several independent answers per problem: Chen et al. 2021's unbiased estimator.

Drawing k of a problem's n answers (c of them correct) without replacement, the chance that at least
one is correct is 1 - C(n-c, k) / C(n, k); pass@k is its mean over the problems. Unlike "any of the
first k answers is correct", it uses all n answers for every k, so pass@1 is the plain share of
correct answers and the figures rise with k by construction. Pure Python, no torch: the summary is
written on rank 0 from the gathered result rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

# Every k up to this one is reported; beyond it (chains > 16) only the powers of two and the chain count.
EVERY_K_UP_TO = 16


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """One problem's estimate: the chance that k of its `samples` answers, drawn without replacement,
    hold at least one of its `correct` ones (math.comb is exact on integers, so no rounding before
    the one division)."""
    if not 0 <= correct <= samples:
        raise ValueError(f"correct must be in [0, samples={samples}], got {correct}")
    if not 1 <= k <= samples:
        raise ValueError(f"k must be in [1, samples={samples}], got {k}")
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def reported_ks(samples: int) -> list[int]:
    """The k a summary reports for `samples` answers per problem: 1..16, then powers of two, and `samples`."""
    powers = {2**power for power in range(samples.bit_length()) if 2**power <= samples}
    return sorted(set(range(1, min(samples, EVERY_K_UP_TO) + 1)) | powers | {samples})


def pass_at_k_figures(rows: Iterable[Mapping]) -> dict[str, dict[str, float]]:
    """`pass_at_k` ({"1": ..., "2": ..., ...}, keyed by k as text: a JSON object's keys) over all
    problems of the result rows (each with `index`, `correct` and maybe `domain`; one row an answer),
    and `pass_at_k_<domain>` for each domain. k runs up to the fewest answers any problem has."""
    answers: dict[int, list[bool]] = defaultdict(list)
    domains: dict[int, str | None] = {}
    for row in rows:
        answers[row["index"]].append(bool(row["correct"]))
        domains[row["index"]] = row.get("domain")
    if not answers:
        return {}
    ks = reported_ks(min(len(given) for given in answers.values()))

    def mean_over(problems: list[int]) -> dict[str, float]:
        return {str(k): sum(pass_at_k(len(answers[p]), sum(answers[p]), k) for p in problems) / len(problems)
                for k in ks}

    figures = {"pass_at_k": mean_over(list(answers))}
    for domain in sorted({d for d in domains.values() if d}):
        figures[f"pass_at_k_{domain}"] = mean_over([p for p, d in domains.items() if d == domain])
    return figures
