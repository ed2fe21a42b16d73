"""RowTerm's low-rank terms (an outer product added elementwise at rank 1, batched matmuls above)
against the explicit per-group formula."""

import pytest
import torch

from gpuscale.engines.generation.row_terms import RowTerm


def explicit(output, x, down, up, scale):
    """output[rows of g] + scale * (x[rows of g] @ down[g]) @ up[g]^T, group by group."""
    expected = output.clone()
    per_group = x.shape[0] // down.shape[0]
    for g in range(down.shape[0]):
        rows = slice(g * per_group, (g + 1) * per_group)
        expected[rows] += scale * (x[rows] @ down[g]) @ up[g].transpose(0, 1)
    return expected


@pytest.mark.parametrize("groups, per_group, tokens, rank",
                         [(4, 3, 1, 1), (8, 2, 1, 1), (3, 4, 5, 1), (4, 2, 1, 2), (2, 3, 4, 4)])
def test_the_terms_equal_the_explicit_formula(groups, per_group, tokens, rank):
    generator = torch.Generator().manual_seed(groups * 100 + per_group)
    down, up = torch.randn(groups, 16, rank, generator=generator), torch.randn(groups, 8, rank, generator=generator)
    x = torch.randn(groups * per_group, tokens, 16, generator=generator)
    output = torch.randn(groups * per_group, tokens, 8, generator=generator)
    expected = explicit(output, x, down, up, 0.7)
    RowTerm(down, up, 0.7).add_into(output, x)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_the_terms_add_into_a_slice_of_a_fused_output():
    """A fused projection's output is [rows, tokens, q | k | v]: each term adds into its own columns."""
    generator = torch.Generator().manual_seed(7)
    down, up = torch.randn(4, 16, 1, generator=generator), torch.randn(4, 8, 1, generator=generator)
    x = torch.randn(8, 1, 16, generator=generator)
    fused = torch.randn(8, 1, 24, generator=generator)
    expected = fused.clone()
    expected[..., 8:16] = explicit(fused[..., 8:16], x, down, up, 0.5)
    RowTerm(down, up, 0.5).add_into(fused[..., 8:16], x)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)
