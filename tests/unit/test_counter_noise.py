"""The engine's sampling noise: uniform numbers computed from (seed words, row key, token id).

Checked against what a good uniform generator gives: flat histograms, no correlation between
neighbouring rows or tokens, a new draw for a new seed, the same draw for the same key, the same
numbers compiled as eager; and, through Gumbel-max, token frequencies that match the distribution.
"""

from __future__ import annotations

import math

import torch

from gpuscale.engines.generation import Sampling, sample_tokens
from gpuscale.engines.generation.sampling import _mix32, counter_uniform


def seed(a: int, b: int) -> torch.Tensor:
    return torch.tensor([a, b], dtype=torch.int32)


def chi_square_of_histogram(values: torch.Tensor, bins: int) -> float:
    counts = torch.histc(values, bins=bins, min=0.0, max=1.0)
    expected = values.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def test_numbers_lie_strictly_between_0_and_1_and_are_flat():
    u = counter_uniform(seed(12345, 678), torch.arange(64), 5000)
    assert u.shape == (64, 5000) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    bins = 100  # chi-square with 99 degrees of freedom: mean 99, sd 14; 99 + 6 sd = 183
    assert chi_square_of_histogram(u.flatten(), bins) < 183
    assert abs(float(u.mean()) - 0.5) < 0.003  # sd of the mean of 320k uniforms: 0.0005


def test_neighbouring_rows_and_tokens_are_uncorrelated():
    u = counter_uniform(seed(1, 2), torch.arange(200), 2000) - 0.5
    rows = float((u[1:] * u[:-1]).mean() / u.var())
    tokens = float((u[:, 1:] * u[:, :-1]).mean() / u.var())
    assert abs(rows) < 0.01 and abs(tokens) < 0.01  # sd of each about 1/sqrt(400k) = 0.0016


def test_a_new_seed_draws_new_numbers_and_the_same_key_the_same():
    keys = torch.tensor([0, 1, 0, 1])
    u = counter_uniform(seed(7, 9), keys, 1000)
    assert torch.equal(u[0], u[2]) and torch.equal(u[1], u[3]) and not torch.equal(u[0], u[1])
    for other in (seed(8, 9), seed(7, 10)):  # either word changes every number (but by chance)
        v = counter_uniform(other, keys, 1000)
        assert float((u == v).float().mean()) < 0.01
        assert abs(float(torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1])) < 0.05


def test_the_hash_is_lowbias32_a_bijection_that_avalanches():
    """Against lowbias32 written with Python's unbounded integers (so int32 wrap-around and the masked
    shifts are checked); distinct inputs never collide; one flipped input bit flips about half of
    the output bits."""
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    x = torch.unique(torch.randint(-(1 << 31), 1 << 31, (100_000,), dtype=torch.int32,
                                   generator=torch.Generator().manual_seed(0)))
    mixed = _mix32(x)
    assert mixed.dtype == torch.int32
    for value, hashed in zip(x[:2000].tolist(), mixed[:2000].tolist()):
        assert hashed & 0xFFFFFFFF == reference(value & 0xFFFFFFFF)
    assert torch.unique(mixed).numel() == x.numel()
    flipped = _mix32(x ^ 1) ^ mixed
    bits = sum(int(((flipped >> b) & 1).sum()) for b in range(32)) / x.numel()
    assert 15.0 < bits < 17.0


def test_compiled_numbers_equal_eager_ones():
    keys = torch.arange(8) % 3
    compiled = torch.compile(counter_uniform, dynamic=False)
    assert torch.equal(compiled(seed(3, 4), keys, 777), counter_uniform(seed(3, 4), keys, 777))


def test_gumbel_max_over_the_numbers_samples_the_distribution():
    """Token frequencies over 20,000 rows (one draw each) against the softmax probabilities."""
    probabilities = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    rows = 20_000
    logits = probabilities.log().expand(rows, -1)
    noise = counter_uniform(seed(2024, 11), torch.arange(rows), probabilities.numel())
    tokens, raw, _ = sample_tokens(logits, Sampling(1.0), noise)
    counts = torch.bincount(tokens, minlength=probabilities.numel()).float()
    expected = probabilities * rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 4 + 6 * math.sqrt(8)  # 4 degrees of freedom: mean 4, sd sqrt(8)
    torch.testing.assert_close(raw, probabilities.log()[tokens])
