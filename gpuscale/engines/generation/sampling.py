"""How the next token is drawn: the settings, top-k / top-p filtering, and the Gumbel-max draw."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn. temperature 0 = greedy; top_k 0 and top_p 1.0 = no filtering."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def changes_distribution(self) -> bool:
        return self.temperature != 1 or self.top_k > 0 or self.top_p < 1


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature-scaled logits with the tokens top-k / top-p remove set to -inf.

    Same rules, in the same order, as transformers' warpers (temperature, then top-k, then top-p):
    top-k keeps every token scoring at least the k-th best; top-p keeps the smallest set of most
    likely tokens whose mass reaches top_p (always at least one).
    """
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores


def sample_tokens(
    logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (tokens, raw log-prob, sampled-distribution log-prob), fp32.

    `noise` holds uniform [0, 1) numbers of the logits' shape (unused when greedy): Gumbel-max over
    the filtered log-probs samples exactly from the filtered distribution.

    Full-vocabulary work per step, the part that grows with batch x vocab: one log-softmax (a second
    one only when temperature/top-k/top-p change the distribution; the sort only with top_p < 1),
    the Gumbel transform and the argmax. Written as few whole-tensor expressions, so that
    torch.compile can fuse them into a few reductions over the logits and the noise.
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _pick(raw_logprobs, tokens), torch.zeros(tokens.shape, dtype=torch.float32,
                                                                  device=tokens.device)
    if sampling.changes_distribution:
        sampled_logprobs = torch.log_softmax(filter_logits(logits, sampling), dim=-1)
    else:  # plain sampling: the sampled distribution is the model's
        sampled_logprobs = raw_logprobs
    # argmax(log p + g) with Gumbel noise g = -log(-log u); u < 1 keeps g finite, so filtered
    # tokens (-inf) never win, and u = 0 only gives g = -inf.
    tokens = (sampled_logprobs - torch.log(-torch.log(noise))).argmax(dim=-1)
    raw_logprob = _pick(raw_logprobs, tokens)
    sampled_logprob = raw_logprob if sampled_logprobs is raw_logprobs else _pick(sampled_logprobs, tokens)
    return tokens, raw_logprob, sampled_logprob


def _pick(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """values[b, tokens[b]] for every row b."""
    return values.gather(-1, tokens[:, None]).squeeze(-1)
