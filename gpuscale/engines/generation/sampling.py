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

    `noise` holds uniform (0, 1) numbers of the logits' shape (unused when greedy): Gumbel-max over
    the filtered scores samples exactly from the filtered distribution. The argmax is taken over the
    scores, not the log-probs (they differ by one constant per row), so that it does not wait for the
    normalizer: the argmax and the log-sum-exp are independent reductions over the same row, which
    torch.compile runs in one pass over the logits (at a large batch the logits are gigabytes). The
    sort happens only with top_p < 1.
    """
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1)
    if sampling.greedy:
        tokens = row_argmax(logits)
        return tokens, _pick(logits, tokens) - normalizer, torch.zeros(tokens.shape, dtype=torch.float32,
                                                                       device=tokens.device)
    if sampling.changes_distribution:
        scores = filter_logits(logits, sampling)
        sampled_normalizer = torch.logsumexp(scores, dim=-1)
    else:  # plain sampling: the sampled distribution is the model's
        scores, sampled_normalizer = logits, normalizer
    # argmax(score + g) with Gumbel noise g = -log(-log u); u strictly inside (0, 1) keeps g finite,
    # so filtered tokens (-inf) never win.
    tokens = row_argmax(scores - torch.log(-torch.log(noise)))
    raw_logprob = _pick(logits, tokens) - normalizer
    sampled_logprob = raw_logprob if scores is logits else _pick(scores, tokens) - sampled_normalizer
    return tokens, raw_logprob, sampled_logprob


# At this many rows or fewer a row's argmax is one plain max reduction of packed keys (`row_argmax`). 1: measured
# at one row on an H200, its kernels shorter and its tokens and log-probs the same (bench/RESULTS.md; the way
# `argmax` of bench/decode_ways.py turns it off); 2 to 32 rows, where the argmax is also few blocks, not measured.
PACKED_ARGMAX_MAX_ROWS = 1


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(dim=-1) of a [rows, n] float tensor: the first index of a row's maximum, as torch's.

    With few rows (PACKED_ARGMAX_MAX_ROWS), as the maximum of int64 keys: each value's float32 bits mapped
    to an int32 in the same order, times 2^32, plus n - 1 - its index (so that of equal values the first
    wins). Why: Inductor gives an argmax reduction one thread block a row, so at batch 1 one of the GPU's
    132 multiprocessors walks a 152k vocabulary alone (the largest kernel of the step's sampling after
    the matmuls: bench/RESULTS.md), where it splits a plain max over many blocks. Blocked argmax forms
    failed to compile on an H200 with the sampling noise's hash fused in (bench/RESULTS.md). Unlike
    torch's argmax, -0.0 ranks below +0.0 here.
    """
    rows, n = values.shape
    if rows > PACKED_ARGMAX_MAX_ROWS:
        return values.argmax(dim=-1)
    bits = values.float().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude, smaller int
    reversed_index = (n - 1) - torch.arange(n, device=values.device, dtype=torch.int64)
    best = (ordered.to(torch.int64) * (1 << 32) + reversed_index).amax(dim=-1)
    return (n - 1) - (best & 0xFFFFFFFF)


# ---- the random numbers of a step, computed where they are used ------------------------------------

# Multipliers of C. Wellons' "lowbias32" integer hash, and the golden ratio's (Weyl sequence), as int32.
_MIX_A, _MIX_B, _WEYL = 0x7FEB352D, 0x846CA68B - (1 << 32), 0x9E3779B9 - (1 << 32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32's xorshift-multiply rounds) on int32 tensors: each input bit
    flips about half the output bits, and distinct inputs never collide. Multiplication wraps around
    (two's complement: Triton's and the CPU's integer multiply); a right shift is masked to be logical."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MIX_A
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MIX_B
    return x ^ ((x >> 16) & 0xFFFF)


def counter_uniform(words: torch.Tensor, row_keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), [rows, vocab] float32: a pure function of the step's two int32 key
    words (drawn from the caller's generator), the row's key and the token id (a counter-based
    generator, as Philox is).

    Why not a buffer filled by torch's RNG: at a large batch a [rows, vocab] fp32 buffer is written,
    then read, at every step (2.3 GB each way at 3,840 rows of a 152k vocabulary). As an expression of
    (seed, row, token id), torch.compile fuses it into the kernel that consumes it, and the numbers
    never reach memory. Rows with one key draw the same numbers (common random numbers); the caller's
    torch.Generator draws the key words, so runs stay reproducible. Per number: the row's hash xor a
    Weyl sequence of the token id, mixed once (two int32 multiplies); 24 random bits, as torch.rand
    gives a float32.
    """
    row_hash = _mix32(_mix32(words[0] ^ row_keys.to(torch.int32)) ^ words[1])  # [rows]
    token_key = torch.arange(vocab, device=row_keys.device, dtype=torch.int32) * _WEYL  # [vocab]
    bits = (_mix32(row_hash[:, None] ^ token_key[None, :]) >> 8) & 0xFFFFFF
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def _pick(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """values[b, tokens[b]] for every row b."""
    return values.gather(-1, tokens[:, None]).squeeze(-1)
