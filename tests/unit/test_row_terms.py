"""RowTerm's two ways of the members' down products (one GEMM against every member, or batched
products) against the explicit per-group formula."""

import pytest
import torch

from gpuscale.engines.generation import row_terms
from gpuscale.engines.generation.row_terms import RowTerm


def explicit(output, x, down, up, scale):
    """output[rows of g] + scale * (x[rows of g] @ down[g]) @ up[g]^T, group by group."""
    expected = output.clone()
    per_group = x.shape[0] // down.shape[0]
    for g in range(down.shape[0]):
        rows = slice(g * per_group, (g + 1) * per_group)
        expected[rows] += scale * (x[rows] @ down[g]) @ up[g].transpose(0, 1)
    return expected


@pytest.mark.parametrize("dense_limit", [0, 10_000], ids=["batched", "one-gemm"])
@pytest.mark.parametrize("groups, per_group, tokens, rank", [(4, 3, 1, 1), (8, 2, 1, 1), (3, 4, 5, 1), (4, 2, 1, 2)])
def test_both_ways_of_the_down_products_equal_the_explicit_formula(monkeypatch, dense_limit, groups, per_group,
                                                                   tokens, rank):
    monkeypatch.setattr(row_terms, "DENSE_MAX_ROWS_PER_GROUP", dense_limit)
    monkeypatch.setattr(row_terms, "DENSE_DEVICE_TYPES", ("cpu", "cuda"))
    generator = torch.Generator().manual_seed(groups * 100 + per_group)
    down, up = torch.randn(groups, 16, rank, generator=generator), torch.randn(groups, 8, rank, generator=generator)
    x = torch.randn(groups * per_group, tokens, 16, generator=generator)
    output = torch.randn(groups * per_group, tokens, 8, generator=generator)
    expected = explicit(output, x, down, up, 0.7)
    RowTerm(down, up, 0.7).add_into(output, x)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_the_one_gemm_way_is_taken_where_switched_on_at_rank_1_for_few_rows_a_group_only(monkeypatch):
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *args: calls.append("bmm") or real_bmm(*args))
    down, up = torch.randn(4, 16, 1), torch.randn(4, 8, 1)
    decode_step = torch.zeros(8, 1, 8), torch.randn(8, 1, 16)  # 2 rows a group
    RowTerm(down, up).add_into(*decode_step)
    assert calls == ["bmm"]  # off by default (and never meant for a CPU)
    monkeypatch.setattr(row_terms, "DENSE_DEVICE_TYPES", ("cpu",))  # as a GPU's tensors would take it once on
    RowTerm(down, up).add_into(*decode_step)
    assert calls == ["bmm"]
    many = row_terms.DENSE_MAX_ROWS_PER_GROUP + 1
    RowTerm(down, up).add_into(torch.zeros(4 * many, 1, 8), torch.randn(4 * many, 1, 16))  # a prefill's rows
    assert calls == ["bmm", "bmm"]
