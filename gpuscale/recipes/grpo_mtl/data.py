"""What a grpo-mtl run trains and evaluates on: the prompts TRL gets, and the held-out examples.

`domain_weights` gives a domain more (or less) of the training prompts. GRPO normalises the rewards within
each prompt's group, so a domain's reward weight cannot give it more of a step; more of its prompts can.
TRL's sampler (RepeatSampler) draws the training rows in a seeded permutation, each row once an epoch,
so the weights act on the rows themselves (`weighted_examples`): each domain's count among the rows the
run would train on is scaled by its weight and the total kept, the rows each domain takes being its
first ones in the data's order. TRL's sampler then draws them as it draws today's.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

from gpuscale.data.rewards import weight_entries


def training_and_eval_examples(settings) -> tuple[list[dict], list[dict]]:
    """(training examples, held-out evaluation examples), as every training recipe holds them out
    (recipes/shared/training_data.py's `training_and_eval_examples`: the test split, or with eval_split=validation
    the first eval_examples problems of the training data). Without `max_examples`, only as many training examples
    are loaded as the run can use: max_steps x prompts_per_step (tiny-math generates its problems). With
    `domain_weights`, as many, in the weighted shares (`weighted_examples`), taken from enough of the data that
    a domain given more need not repeat a problem (`pool_factor`); `max_examples` caps the problems taken, so
    within it a domain given more repeats its own."""
    from gpuscale.recipes.shared.training_data import training_and_eval_examples as split_examples

    limit = settings.max_examples or settings.max_steps * settings.prompts_per_step
    weights = parse_domain_weights(settings.domain_weights)
    if not weights:
        return split_examples(settings.model_copy(update={"max_examples": limit}))
    pool_size = limit if settings.max_examples else limit * pool_factor(weights)
    pool, held_out = split_examples(settings.model_copy(update={"max_examples": pool_size}))
    return weighted_examples(pool, limit, weights), held_out


def parse_domain_weights(text: str) -> dict[str, float]:
    """`domain_weights` as {domain: weight}: comma-separated domain=weight ("comparison=2,arithmetic=1"),
    each weight a finite number above 0; "" is {}. ValueError with one line for a bad entry. Whether the
    data set has the domain is `check_domain_weights`'s (it reads the data set)."""
    weights: dict[str, float] = {}
    for entry, domain, weight in weight_entries(text, "domain=weight"):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{entry!r}: the weight must be a finite number above 0")
        if domain in weights:
            raise ValueError(f"{entry!r}: domain {domain!r} is weighted twice")
        weights[domain] = weight
    return weights


def pool_factor(weights: dict[str, float]) -> int:
    """How many times the rows a run trains on to load so that no domain need repeat a problem: a domain's
    weighted count is its count times at most max/min of the weights (a domain not named weighs 1)."""
    every = [*weights.values(), 1.0]
    return math.ceil(max(every) / min(every))


def domain_quotas(counts: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """How many of the sum(counts) rows each domain takes: its count times its weight (1 where not
    named), scaled back to the same total, rounded by the largest remainder (a tie: the order of
    `counts`). Exact arithmetic: equal weights give back `counts`."""
    total = sum(counts.values())
    weighted = {domain: Fraction(weights.get(domain, 1.0)) * count for domain, count in counts.items()}
    exact = {domain: total * value / sum(weighted.values()) for domain, value in weighted.items()}
    quotas = {domain: math.floor(value) for domain, value in exact.items()}
    by_remainder = sorted(exact, key=lambda domain: exact[domain] - quotas[domain], reverse=True)
    for domain in by_remainder[:total - sum(quotas.values())]:
        quotas[domain] += 1
    return quotas


def weighted_examples(pool: list[dict], count: int, weights: dict[str, float]) -> list[dict]:
    """`count` examples (fewer if the pool is smaller) whose domains hold `domain_quotas` of the pool's
    first `count`: each domain's first examples in the pool's order, kept in that order, so that equal
    weights give back the first `count`. A domain whose quota is more than the pool holds of it takes its
    examples again, in order, after the others."""
    quotas = domain_quotas(Counter(example["domain"] for example in pool[:count]), weights)
    taken: Counter[str] = Counter()
    chosen = []
    for example in pool:
        if taken[example["domain"]] < quotas.get(example["domain"], 0):
            chosen.append(example)
            taken[example["domain"]] += 1
    for domain, quota in quotas.items():
        own = [example for example in pool if example["domain"] == domain]
        chosen += [own[i % len(own)] for i in range(taken[domain], quota)]
    return chosen


def domain_shares(rows: list[dict]) -> dict[str, float]:
    """`train_share_<domain>`: each domain's share of the training rows, which TRL's sampler draws each
    once an epoch (a run of max_steps x prompts_per_step rows: exactly the prompts it trains on)."""
    counts = Counter(row["domain"] for row in rows)
    return {f"train_share_{domain}": counts[domain] / len(rows) for domain in domains_of(rows)}


def prompt_for(tokenizer, question: str):
    """The question as TRL's prompt column holds it: a chat (TRL applies the chat template with the
    generation prompt, exactly as `data.prompts.prompt_ids` does) when the tokenizer has a template,
    else the bare question and a newline (TRL then tokenizes it as `prompt_ids` does)."""
    if getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": question}]
    return question + "\n"


def grpo_rows(examples: list[dict], tokenizer, max_prompt_length: int) -> tuple[list[dict], int]:
    """TRL rows {"prompt", "answer", "domain"} of the examples whose prompt fits max_prompt_length
    tokens, and how many were left out (TRL 1.16 no longer truncates prompts; a cut prompt would be
    a different question)."""
    from gpuscale.data.prompts import prompt_ids

    rows, dropped = [], 0
    for example in examples:
        if len(prompt_ids(tokenizer, example["question"])) > max_prompt_length:
            dropped += 1
            continue
        rows.append({"prompt": prompt_for(tokenizer, example["question"]), "answer": example["answer"],
                     "domain": example["domain"]})
    return rows, dropped


def domains_of(rows: list[dict]) -> list[str]:
    """The domains of the rows, in the order they first appear (the same on every rank)."""
    return list(dict.fromkeys(row["domain"] for row in rows))
