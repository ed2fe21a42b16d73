"""Rewards for the RL recipes: what a completion earns, per domain, in TRL's reward-function shape.

Two rewards, each in [0, 1]:

- `correctness`: 1.0 if the completion's final answer equals the row's gold answer, else 0.0. The
  answer is extracted strictly (the number after `#### `) unless another mode is chosen: the lenient
  modes reward answers a user would not accept (bench notes: 136 malformed answers passed in one RFT run).
- `format`: 1.0 if the completion ends with a well-formed `#### N` line and holds no other `####`;
  0.5 if it has a `#### N` but something else is wrong (text after it, words on its line, a second
  `####`); 0.0 without one.

`RewardRouter` says which rewards score which domain and with what weight (the same weights for every
domain, or per domain). It gives the rewards in the two forms recipes need:

- `router.reward_funcs(domains)` and `router.reward_weights(domains)`: one TRL reward function per
  (reward, domain), named `<reward>_<domain>` (TRL logs `rewards/correctness_counting/mean`, which is
  that domain's training accuracy), each returning None for rows of other domains, for
  `GRPOTrainer(reward_funcs=...)` and `GRPOConfig(reward_weights=...)`;
- `router(prompts, completions, completion_ids=None, **columns)`: one TRL reward function giving
  every row its domain's weighted total, and `router.score_rows(rows)`, the same in plain Python with
  each reward's value kept.

TRL calls a reward function with `prompts`, `completions` (strings, or chat message lists for
conversational data), `completion_ids`, and every data set column as a keyword list (here `answer`
and `domain`), plus `trainer_state`, `log_extra` and `log_metric`, which these functions ignore.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from gpuscale.data.answers import EXTRACT_MODES, extract_strict, is_correct


def completion_text(completion) -> str:
    """The text of a completion as TRL passes it: a string, or a chat message list whose last
    message's content is a string or a list of parts ({"type": "text", "text": ...})."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"] if completion else ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def correctness(completion: str, answer: str, mode: str = "strict") -> float:
    """1.0 if the final answer in `completion` equals `answer` (a bare value or a GSM8K answer
    ending with `#### N`), else 0.0."""
    return 1.0 if is_correct(completion, answer, mode=mode) else 0.0


# The last line of a well-formed completion: `#### ` and a plain number (GSM8K's gold answers have no
# `$` or units), with nothing else on the line.
_FINAL_LINE = re.compile(r"####\s*-?[0-9][0-9,]*(\.[0-9]+)?")


def format_score(completion: str) -> float:
    """1.0 for a completion ending with a clean `#### N` line and no other `####`; 0.5 for one with a
    `#### N` that is not that; 0.0 for one without."""
    if extract_strict(completion) is None:
        return 0.0
    last_line = completion.rstrip().rsplit("\n", 1)[-1].strip()
    clean = _FINAL_LINE.fullmatch(last_line) is not None and completion.count("####") == 1
    return 1.0 if clean else 0.5


REWARDS = ("correctness", "format")
DEFAULT_WEIGHTS = {"correctness": 1.0, "format": 0.0}


def reward_value(reward: str, completion: str, answer: str, mode: str = "strict") -> float:
    """One named reward of one completion."""
    if reward == "correctness":
        return correctness(completion, answer, mode)
    if reward == "format":
        return format_score(completion)
    raise ValueError(f"unknown reward {reward!r}; known rewards: {', '.join(REWARDS)}")


class DomainReward:
    """One reward for the rows of one domain, as TRL calls a reward function: None for other rows.

    Its `__name__` (`<reward>_<domain>`) is the name TRL logs it under; reward names hold no
    underscore, so the first one splits the name back into reward and domain."""

    def __init__(self, reward: str, domain: str, mode: str = "strict"):
        _check_reward(reward)
        self.reward, self.domain, self.mode = reward, domain, mode
        self.__name__ = f"{reward}_{domain}"

    def __call__(self, prompts, completions, completion_ids=None, *, answer, domain, **columns) -> list[float | None]:
        rows = zip(completions, answer, domain, strict=True)
        return [self._value(completion, gold) if mine == self.domain else None for completion, gold, mine in rows]

    def _value(self, completion, gold: str) -> float:
        return reward_value(self.reward, completion_text(completion), gold, self.mode)

    def __repr__(self) -> str:
        return f"DomainReward({self.reward!r}, {self.domain!r}, mode={self.mode!r})"


class RewardRouter:
    """Which rewards score a row of each domain, and their weights.

    `weights` apply to every domain (missing rewards keep DEFAULT_WEIGHTS: correctness 1, format 0);
    `per_domain` overrides them for the domains it names, e.g. {"counting": {"format": 0.2}}. A reward
    of weight 0 is still computed and reported (TRL logs it), it just adds nothing to the total.
    """

    def __init__(self, weights: Mapping[str, float] | None = None,
                 per_domain: Mapping[str, Mapping[str, float]] | None = None, mode: str = "strict"):
        if mode not in EXTRACT_MODES:
            raise ValueError(f"unknown answer mode {mode!r}; known: {', '.join(EXTRACT_MODES)}")
        self.weights = _checked_weights({**DEFAULT_WEIGHTS, **(weights or {})})
        self.per_domain = {domain: _checked_weights(table) for domain, table in (per_domain or {}).items()}
        self.mode = mode
        self.__name__ = "reward"

    def weights_for(self, domain: str) -> dict[str, float]:
        return {**self.weights, **self.per_domain.get(domain, {})}

    def score(self, completion, answer: str, domain: str) -> dict[str, float]:
        """Each reward of one completion, and `reward`, their weighted total for its domain."""
        text = completion_text(completion)
        weights = self.weights_for(domain)
        values = {reward: reward_value(reward, text, answer, self.mode) for reward in weights}
        return {**values, "reward": sum(weights[reward] * value for reward, value in values.items())}

    def score_rows(self, rows: Iterable[Mapping]) -> list[dict[str, float]]:
        """`score` for rows holding `completion`, `answer` and `domain` (plain Python, for recipes)."""
        return [self.score(row["completion"], row["answer"], row["domain"]) for row in rows]

    def __call__(self, prompts, completions, completion_ids=None, *, answer, domain, **columns) -> list[float]:
        """TRL's shape: every row's weighted total for its own domain."""
        return [self.score(c, a, d)["reward"] for c, a, d in zip(completions, answer, domain, strict=True)]

    def reward_funcs(self, domains: Iterable[str]) -> list[DomainReward]:
        """One TRL reward function per (domain, reward), in a fixed order (domains as given)."""
        return [DomainReward(reward, domain, self.mode) for domain in domains for reward in self.weights_for(domain)]

    def reward_weights(self, domains: Iterable[str]) -> list[float]:
        """The weights of `reward_funcs(domains)`, in the same order."""
        return [weight for domain in domains for weight in self.weights_for(domain).values()]


def _check_reward(reward: str) -> None:
    if reward not in REWARDS:
        raise ValueError(f"unknown reward {reward!r}; known rewards: {', '.join(REWARDS)}")


def _checked_weights(weights: Mapping[str, float]) -> dict[str, float]:
    for reward in weights:
        _check_reward(reward)
    return {reward: float(weight) for reward, weight in weights.items()}


def parse_reward_weights(text: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """A settings string into RewardRouter's (weights, per_domain): comma-separated `reward=weight`
    for every domain, or `domain.reward=weight` for one, e.g. "correctness=1,format=0.1,counting.format=0.5".
    ValueError with one line for a bad entry."""
    weights: dict[str, float] = {}
    per_domain: dict[str, dict[str, float]] = {}
    for entry, key, weight in weight_entries(text, "reward=weight or domain.reward=weight"):
        domain, dot, reward = key.rpartition(".")
        if dot and not domain:
            raise ValueError(f"{entry!r}: expected reward=weight or domain.reward=weight")
        _check_reward(reward)
        (per_domain.setdefault(domain, {}) if dot else weights)[reward] = weight
    return weights, per_domain


def weight_entries(text: str, expected: str) -> list[tuple[str, str, float]]:
    """(entry, name, weight) of each comma-separated `name=weight` of a settings string (reward_weights,
    grpo-mtl's domain_weights); ValueError with one line, saying `expected`, for an entry without a name or
    whose weight is not a number."""
    entries = []
    for entry in (part.strip() for part in text.split(",") if part.strip()):
        name, equals, value = (part.strip() for part in entry.partition("="))
        if not equals or not name:
            raise ValueError(f"{entry!r}: expected {expected}")
        try:
            entries.append((entry, name, float(value)))
        except ValueError:
            raise ValueError(f"{entry!r}: the weight is not a number") from None
    return entries
