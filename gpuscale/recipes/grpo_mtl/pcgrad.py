"""PCGrad (Yu et al. 2020, "Gradient Surgery for Multi-Task Learning"), as pure functions on gradients,
and `DomainGradients`, the buffers a step sums each domain's gradient into before the update.

For each task i: g_i' = g_i; for every other task j, in a random order drawn from the caller's
generator, if g_i' . g_j < 0 then g_i' -= (g_i' . g_j / |g_j|^2) g_j, always against the ORIGINAL g_j.
The update is the SUM of the projected gradients (the paper's reduction; a popular PyTorch port
averages instead, which also divides the learning rate by the number of tasks).

A task's gradient is a list of tensors (one per parameter), so that nothing is flattened into one
more copy of the model. Dot products accumulate in fp32 (fp64 for fp64 gradients).
"""

from __future__ import annotations

import torch


def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """The dot product of two gradients given as lists of tensors (in fp32 at least)."""
    dtype = torch.promote_types(a[0].dtype, torch.float32)
    total = torch.zeros((), dtype=dtype, device=a[0].device)
    for x, y in zip(a, b, strict=True):
        total += torch.dot(x.reshape(-1).to(dtype), y.reshape(-1).to(dtype))
    return total


def projected_gradients(grads_by_domain: list[list[torch.Tensor]],
                        generator: torch.Generator | None = None) -> list[list[torch.Tensor]]:
    """Each task's gradient projected off the normal plane of every other task's original gradient
    it conflicts with, the others taken in a random order per task drawn from `generator` (a CPU
    generator: with the same seed and the same calls, every rank draws the same orders). The
    inputs are not modified."""
    count = len(grads_by_domain)
    squared_norms = [dot(g, g) for g in grads_by_domain]
    result = []
    for i, own in enumerate(grads_by_domain):
        projected = [t.clone() for t in own]
        for j in (j for j in torch.randperm(count, generator=generator).tolist() if j != i):
            along = dot(projected, grads_by_domain[j])
            if along < 0 and squared_norms[j] > 0:
                scale = (along / squared_norms[j]).item()
                for p, g in zip(projected, grads_by_domain[j]):
                    p.add_(g, alpha=-scale)
        result.append(projected)
    return result


def pcgrad(grads_by_domain: list[list[torch.Tensor]], generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The PCGrad update: the sum of `projected_gradients` (one tensor per parameter)."""
    projected = projected_gradients(grads_by_domain, generator)
    return [torch.stack(parts).sum(0) for parts in zip(*projected)]


def gradient_cosines(grads_by_domain: list[list[torch.Tensor]]) -> dict[tuple[int, int], float]:
    """The cosine between every pair (i < j) of the tasks' original gradients (0 where one is zero)."""
    norms = [dot(g, g).sqrt() for g in grads_by_domain]
    cosines = {}
    for i in range(len(grads_by_domain)):
        for j in range(i + 1, len(grads_by_domain)):
            denominator = norms[i] * norms[j]
            value = dot(grads_by_domain[i], grads_by_domain[j]) / denominator if denominator > 0 else 0.0
            cosines[(i, j)] = float(value)
    return cosines


class DomainGradients:
    """A step's gradient of each domain, summed over its micro-batches into one flat buffer per
    domain (the parameters' gradients laid end to end: the dot products, projections and an
    all-reduce are then one kernel each rather than one per parameter), and the PCGrad update made
    from them. The trainer's (multitask.py) and the tuning trial's (recipes/shared/training_trial.py)."""

    def __init__(self, domains: int):
        self.domains = domains
        self.flats: list[torch.Tensor] | None = None  # allocated at the step's first gradient

    def add(self, domain: int, grads, parameters) -> None:
        """Add one gradient of `domain`, given per parameter (None where it does not reach)."""
        if self.flats is None:
            size = sum(p.numel() for p in parameters)
            self.flats = [torch.zeros(size, dtype=parameters[0].dtype, device=parameters[0].device)
                          for _ in range(self.domains)]
        offset = 0
        for parameter, grad in zip(parameters, grads, strict=True):
            if grad is not None:
                self.flats[domain][offset: offset + parameter.numel()].add_(grad.reshape(-1))
            offset += parameter.numel()

    def write(self, parameters, generator: torch.Generator | None = None) -> None:
        """The PCGrad update of the step's gradients into each parameter's .grad (in its dtype); the
        buffers go back."""
        (update,) = pcgrad([[flat] for flat in self.flats], generator)
        self.flats = None
        offset = 0
        for parameter in parameters:
            parameter.grad = update[offset: offset + parameter.numel()].view_as(parameter).to(parameter.dtype)
            offset += parameter.numel()
