"""PCGrad's projection (recipes/grpo_mtl/pcgrad.py) against the paper's formula, on hand-made gradients."""

from __future__ import annotations

import pytest
import torch

from gpuscale.recipes.grpo_mtl.pcgrad import gradient_cosines, pcgrad, projected_gradients


def as_parameters(vector: list[float]) -> list[torch.Tensor]:
    """A flat gradient as two parameter tensors (a 2x2 matrix and the rest), as models hold them."""
    flat = torch.tensor(vector, dtype=torch.float64)
    return [flat[:4].reshape(2, 2).clone(), flat[4:].clone()]


def flat(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in parameters])


def test_three_domains_by_hand():
    # g1 conflicts with g2 only, g3 with nobody; the projection of g1 onto g2's normal plane is
    # orthogonal to g3, so the result does not depend on the order.
    g1 = [1.0, 0, 0, 0, 0, 0]
    g2 = [-1.0, 1, 0, 0, 0, 0]
    g3 = [0, 0, 1.0, 0, 0, 0]
    grads = [as_parameters(g) for g in (g1, g2, g3)]
    projected = projected_gradients(grads, torch.Generator().manual_seed(0))
    # g1 - (g1.g2 / |g2|^2) g2 = (1,0,0) + 1/2 (-1,1,0);  g2 - (g2.g1 / |g1|^2) g1 = (0,1,0)
    expected = [[0.5, 0.5, 0, 0, 0, 0], [0, 1.0, 0, 0, 0, 0], g3]
    for got, want in zip(projected, expected):
        assert torch.allclose(flat(got), torch.tensor(want, dtype=torch.float64))
    total = pcgrad(grads, torch.Generator().manual_seed(0))
    assert torch.allclose(flat(total), torch.tensor([0.5, 1.5, 1.0, 0, 0, 0], dtype=torch.float64))
    # The inputs are left as they were.
    assert torch.equal(flat(grads[0]), torch.tensor(g1, dtype=torch.float64))


def reference_pcgrad(vectors: list[torch.Tensor], orders: list[list[int]]) -> torch.Tensor:
    """The paper's algorithm on flat vectors, with the given order of the others for each task."""
    total = torch.zeros_like(vectors[0])
    for i, g in enumerate(vectors):
        projected = g.clone()
        for j in orders[i]:
            if projected @ vectors[j] < 0:
                projected = projected - (projected @ vectors[j]) / (vectors[j] @ vectors[j]) * vectors[j]
        total += projected
    return total


@pytest.mark.parametrize("seed", range(5))
def test_three_conflicting_domains_follow_the_formula_in_the_drawn_order(seed):
    torch.manual_seed(seed)
    vectors = [torch.randn(6, dtype=torch.float64) for _ in range(3)]
    vectors[1] = -vectors[0] + 0.3 * vectors[1]  # make sure some pairs conflict
    assert any(value < 0 for value in gradient_cosines([as_parameters(v.tolist()) for v in vectors]).values())
    replay = torch.Generator().manual_seed(seed)
    orders = [[j for j in torch.randperm(3, generator=replay).tolist() if j != i] for i in range(3)]
    expected = reference_pcgrad(vectors, orders)
    got = pcgrad([as_parameters(v.tolist()) for v in vectors], torch.Generator().manual_seed(seed))
    assert torch.allclose(flat(got), expected)
    # The order matters here: projecting in the other order gives another update (so the test can
    # tell a wrong order), unless the draw happened to make them equal.
    reversed_orders = [list(reversed(order)) for order in orders]
    if not torch.allclose(reference_pcgrad(vectors, reversed_orders), expected):
        assert not torch.allclose(flat(got), reference_pcgrad(vectors, reversed_orders))


@pytest.mark.parametrize("seed", range(5))
def test_with_two_domains_each_projection_no_longer_conflicts_with_the_other(seed):
    torch.manual_seed(seed)
    a = torch.randn(6, dtype=torch.float64)
    b = -a + 0.5 * torch.randn(6, dtype=torch.float64)
    assert a @ b < 0
    pa, pb = projected_gradients([as_parameters(a.tolist()), as_parameters(b.tolist())])
    assert flat(pa) @ b >= -1e-12 and flat(pb) @ a >= -1e-12
    # Gradients that agree are left alone.
    same = projected_gradients([as_parameters(a.tolist()), as_parameters((a + 0.1).tolist())])
    assert torch.equal(flat(same[0]), a)


def test_the_update_is_the_sum_not_the_mean():
    a = as_parameters([1.0, 2, 0, 0, 0, 0])
    b = as_parameters([0, 0, 3.0, 0, 0, 1])
    assert torch.allclose(flat(pcgrad([a, b])), torch.tensor([1.0, 2, 3, 0, 0, 1], dtype=torch.float64))


def test_cosines_between_domain_gradients():
    cosines = gradient_cosines([as_parameters([1.0, 0, 0, 0, 0, 0]), as_parameters([-1.0, 1, 0, 0, 0, 0]),
                                as_parameters([0.0] * 6)])
    assert cosines[(0, 1)] == pytest.approx(-2 ** -0.5) and cosines[(0, 2)] == 0.0 and cosines[(1, 2)] == 0.0
