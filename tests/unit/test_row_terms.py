"""RowTerm's low-rank terms (an outer product added elementwise at rank 1, batched matmuls above)
against the explicit per-group formula."""

import shutil

import pytest
import torch

from gpuscale.engines.generation.row_terms import RowScale, RowTerm, RowTerms


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


# ---- the terms inside the projections (`added`, the engine's fuse_row_terms) -------------------------

needs_cpp_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                        reason="torch.compile on CPU needs a C++ compiler")


def term_and_inputs(groups, per_group, tokens, rank, dtype, seed=3):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    term = RowTerm(randn(groups, 16, rank), randn(groups, 24, rank), 0.7)
    return term, randn(groups * per_group, tokens, 16), randn(groups * per_group, tokens, 24)


def close_in(dtype, actual, expected):
    """fp32 within 1e-5; bf16 within two roundings of the largest value (each side rounds its own way)."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        atol = 2 * torch.finfo(dtype).eps * float(expected.float().abs().max())
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=0)


CASES = [(4, 3, 1, 1), (8, 2, 1, 1), (3, 4, 5, 1), (4, 2, 1, 2), (2, 3, 4, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups, per_group, tokens, rank", CASES)
def test_added_out_of_place_equals_add_into(groups, per_group, tokens, rank, dtype):
    term, x, output = term_and_inputs(groups, per_group, tokens, rank, dtype)
    before = output.clone()
    added = term.added(output, x)
    assert torch.equal(output, before)  # out of place
    term.add_into(output, x)
    close_in(dtype, added, output)


@needs_cpp_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups, per_group, tokens, rank", [(4, 3, 1, 1), (2, 3, 4, 4)])
def test_added_under_torch_compile_equals_add_into(groups, per_group, tokens, rank, dtype):
    """Compiled, `added` is another expression (broadcast products summed in fp32, rounded once):
    the same sums within the dtype's rounding."""
    term, x, output = term_and_inputs(groups, per_group, tokens, rank, dtype)
    compiled = torch.compile(term.added, dynamic=False, fullgraph=True)(output, x)
    term.add_into(output, x)
    close_in(dtype, compiled, output)
    assert compiled.dtype == dtype


def test_added_to_a_slice_of_a_fused_output_leaves_the_fused_output_as_it_was():
    generator = torch.Generator().manual_seed(7)
    down, up = torch.randn(4, 16, 1, generator=generator), torch.randn(4, 8, 1, generator=generator)
    x = torch.randn(8, 1, 16, generator=generator)
    fused = torch.randn(8, 1, 24, generator=generator)
    before = fused.clone()
    added = RowTerm(down, up, 0.5).added(fused[..., 8:16], x)
    assert torch.equal(fused, before)
    torch.testing.assert_close(added, explicit(fused[..., 8:16], x, down, up, 0.5), atol=1e-5, rtol=1e-5)


# ---- mirrored terms: antithetic pairs sharing one group's factors -----------------------------------------

def mirrored_and_paired(groups, per_member, tokens, rank, seed=5):
    """A mirrored term of `groups` groups and the same term written out as 2 x groups groups, each pair's second
    group with the factors of its first and `up` negated; an input and an output of 2 x groups x per_member rows."""
    generator = torch.Generator().manual_seed(seed)
    down, up = torch.randn(groups, 16, rank, generator=generator), torch.randn(groups, 24, rank, generator=generator)
    paired = RowTerm(down.repeat_interleave(2, 0), torch.stack([up, -up], 1).flatten(0, 1), 0.7)
    rows = 2 * groups * per_member
    x, output = torch.randn(rows, tokens, 16, generator=generator), torch.randn(rows, tokens, 24, generator=generator)
    return RowTerm(down, up, 0.7, mirrored=True), paired, x, output


@pytest.mark.parametrize("groups, per_member, tokens, rank", [(4, 1, 1, 1), (2, 3, 1, 1), (3, 2, 4, 1), (2, 2, 3, 2)])
def test_a_mirrored_term_equals_its_pairs_written_out(groups, per_member, tokens, rank):
    """In place (the hooks), out of place (`added`), and its fp32 expressions of the compiled forward: grouped
    (`_fp32_term`) and by each token's row (`_fp32_term_of_rows`, the compiled prefill's)."""
    mirrored, paired, x, output = mirrored_and_paired(groups, per_member, tokens, rank)
    expected = output.clone()
    paired.add_into(expected, x)
    ours = output.clone()
    mirrored.add_into(ours, x)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mirrored.added(output, x), expected, atol=1e-5, rtol=1e-5)
    term = mirrored._fp32_term(x).reshape(output.shape)
    torch.testing.assert_close(output + term, expected, atol=1e-5, rtol=1e-5)
    token_rows = torch.arange(x.shape[0])[:, None].expand(-1, tokens)
    torch.testing.assert_close(output + mirrored._fp32_term_of_rows(x, token_rows), expected, atol=1e-5, rtol=1e-5)
    assert (mirrored.rows_alike(x.shape[0]), paired.rows_alike(x.shape[0])) == (per_member, per_member)


def test_a_mirrored_row_scale_scales_each_pairs_second_half_by_the_mirror_of_its_factors():
    generator = torch.Generator().manual_seed(11)
    factors = 1 + 0.1 * torch.randn(3, 8, generator=generator)
    paired = RowScale(torch.stack([factors, 2 - factors], 1).flatten(0, 1))
    output = torch.randn(12, 2, 8, generator=generator)  # 3 pairs of members, 2 rows a member
    expected, ours = output.clone(), output.clone()
    paired.add_into(expected, None)
    RowScale(factors, mirrored=True).add_into(ours, None)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)
    token_rows = torch.arange(12)[:, None].expand(-1, 2)
    torch.testing.assert_close(RowScale(factors, mirrored=True).scaled_by_row(output, token_rows), expected,
                               atol=1e-6, rtol=1e-6)


def test_a_batch_splits_into_a_mirrored_terms_halves_and_shares_a_prefill_only_within_one():
    registry = RowTerms()
    registry.add([torch.nn.Linear(16, 24)], RowTerm(torch.zeros(2, 16, 1), torch.zeros(2, 24, 1), mirrored=True))
    registry.check_batch(8)
    with pytest.raises(ValueError, match="2 groups, each two halves: the batch \\(6 rows\\) must split into 4 parts"):
        registry.check_batch(6)
    assert registry.share_prefill(16, 4) and not registry.share_prefill(8, 4)  # halves of 4 rows, then of 2


@needs_cpp_compiler
def test_a_mirrored_term_compiled_equals_its_pairs_written_out():
    mirrored, paired, x, output = mirrored_and_paired(2, 2, 3, 1)
    compiled = torch.compile(mirrored.added, dynamic=False, fullgraph=True)(output, x)
    paired.add_into(output, x)
    torch.testing.assert_close(compiled, output, atol=1e-5, rtol=1e-5)
