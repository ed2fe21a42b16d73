"""EGGROLL's low-rank perturbations, fitness shaping and update (arXiv 2511.16652), in plain torch.

Member i of the population evaluates the weights W + sigma * E_i on every perturbed matrix, with
E_i = A_i B_i^T / sqrt(r), A_i [out, r] and B_i [in, r] standard normal. With antithetic pairs
(the default, as HyperscaleES) members 2p and 2p+1 share the noise of pair p with signs + and -.

The noise is never stored between steps: every rank regenerates it from (seed, step, layer) with a
generator of its own, drawing every pair's A and B of one layer in one call, so all ranks hold the
same numbers and only scalar fitnesses need to travel.

Update, as HyperscaleES applies it (its gradient estimate handed to SGD):

    W <- W + lr * N^(-1/2) * sum_i s_i * (sigma / sqrt(r)) * sign_i * A_i B_i^T

with s the shaped fitnesses; per pair that is one coefficient c_p = s_{2p} - s_{2p+1}, and the sum is
one (diag(c) A)^T B product per matrix, accumulated in fp32 and written back in the weights' dtype.

Gain vectors (the norms' weights, `perturb_norms`) get full-rank noise, as the paper's non-matrix
parameters: member i sees g + sigma * sign_i * e_i, e_i normal of std norm_sigma / sigma, and the
update is g <- g + lr * N^(-1/2) * sigma * sum_p c_p e_p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpuscale.data.seeds import derived_seed

SHAPINGS = ("zscore", "centered_rank", "antithetic_sign")


@dataclass
class LayerNoise:
    """One matrix's noise for the whole population: A [P, out, r], B [P, in, r] for P noise draws
    (pairs when antithetic, members otherwise)."""

    a: torch.Tensor
    b: torch.Tensor


def noise_seed(seed: int, step: int, layer: int) -> int:
    """A generator seed per (run seed, step, layer); the same on every rank."""
    return derived_seed(seed, "noise", step, layer)


def sampling_seed(seed: int, step: int) -> int:
    """The seed of a step's sampling random numbers when members share them (common random numbers)."""
    return derived_seed(seed, "shared sampling", step)


def draws_for(population: int, antithetic: bool) -> int:
    return population // 2 if antithetic else population


def layer_noise(weight: torch.Tensor, draws: int, rank: int, seed: int, step: int, layer: int) -> LayerNoise:
    """Every draw's A and B for one matrix, in one normal draw of shape [draws, out + in, rank]
    (fp32, on the weight's device)."""
    out_features, in_features = weight.shape
    generator = torch.Generator(device=weight.device).manual_seed(noise_seed(seed, step, layer))
    both = torch.randn(draws, out_features + in_features, rank, generator=generator, device=weight.device)
    return LayerNoise(a=both[:, :out_features], b=both[:, out_features:])


def vector_noise(weight: torch.Tensor, draws: int, seed: int, step: int, layer: int,
                 std: float = 1.0) -> torch.Tensor:
    """Every draw's noise for one gain vector: [draws, size], fp32, on the weight's device, of
    standard deviation `std` (norm_sigma / sigma: the members' gains are then g + norm_sigma * e, and
    the update, with sigma, is the estimator of that perturbation)."""
    generator = torch.Generator(device=weight.device).manual_seed(noise_seed(seed, step, layer))
    return torch.randn(draws, weight.shape[0], generator=generator, device=weight.device) * std


def member_signs(population: int, antithetic: bool, device=None) -> torch.Tensor:
    """+1 for even members and -1 for odd ones with antithetic pairs; all +1 otherwise."""
    signs = torch.ones(population, device=device)
    if antithetic:
        signs[1::2] = -1
    return signs


def member_draw(member: int, antithetic: bool) -> int:
    return member // 2 if antithetic else member


def shape_fitness(raw: torch.Tensor, method: str, antithetic: bool) -> torch.Tensor:
    """Shaped fitnesses s [N] from raw fitnesses [N] (float)."""
    raw = raw.float()
    if method == "zscore":
        return (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=False) + 1e-5)
    if method == "centered_rank":
        ranks = torch.empty_like(raw)
        ranks[raw.argsort()] = torch.arange(len(raw), dtype=raw.dtype, device=raw.device)
        return ranks / max(len(raw) - 1, 1) - 0.5
    if method == "antithetic_sign":
        if not antithetic:
            raise ValueError("fitness_shaping antithetic_sign needs antithetic pairs")
        sign = torch.sign(raw[0::2] - raw[1::2]) / 2
        return torch.stack([sign, -sign], dim=1).reshape(-1)
    raise ValueError(f"fitness_shaping {method!r}: expected one of {', '.join(SHAPINGS)}")


def draw_coefficients(shaped: torch.Tensor, antithetic: bool) -> torch.Tensor:
    """c per draw: the shaped fitness times the member's sign, summed over the members sharing it."""
    if antithetic:
        return shaped[0::2] - shaped[1::2]
    return shaped


def weight_step(noise: LayerNoise, coefficients: torch.Tensor, population: int, sigma: float, lr: float,
                rank: int) -> torch.Tensor:
    """lr * N^(-1/2) * (sigma / sqrt(r)) * sum_p c_p A_p B_p^T, fp32 [out, in]."""
    scaled_a = noise.a * coefficients.float()[:, None, None]
    total = torch.einsum("por,pir->oi", scaled_a, noise.b)
    return total * (lr * sigma / (math.sqrt(rank) * math.sqrt(population)))


def parameter_step(noise: LayerNoise | torch.Tensor, coefficients: torch.Tensor, population: int, sigma: float,
                   lr: float, rank: int) -> torch.Tensor:
    """A matrix's step (`weight_step`) or a gain vector's: lr * N^(-1/2) * sigma * sum_p c_p e_p."""
    if isinstance(noise, LayerNoise):
        return weight_step(noise, coefficients, population, sigma, lr, rank)
    return coefficients.float() @ noise * (lr * sigma / math.sqrt(population))


def scheduled_lr(lr: float, schedule: str, step: int, steps: int) -> float:
    """The step size of step `step` (1-based) of `steps`: constant, or a cosine from lr at step 1 down
    to lr / 100 at the last step (an ES estimate's noise keeps moving the weights at a fixed size,
    which undoes what early steps found; the floor keeps the last steps from doing nothing)."""
    if schedule == "constant" or steps <= 1:
        return lr
    progress = (step - 1) / (steps - 1)
    floor = lr / 100
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Updater:
    """Applies each step to the perturbed matrices and gain vectors.

    Steps accumulate in fp32 master copies when the model's weights are bf16 or fp16: an ES step is
    often below half a bf16 ulp of the weight it changes, and would round away if added to the
    weight itself; the weights then take the masters' values, rounded. fp32 weights are their own
    masters. `optimizer="sgd"` adds the step as HyperscaleES does; `"adam"` hands the ES gradient
    estimate (the step at lr 1) to torch.optim.Adam at `lr`, on the masters."""

    def __init__(self, weights: list[torch.Tensor], optimizer: str, lr: float):
        self.weights = weights
        self.masters = [w if w.dtype == torch.float32 else w.detach().float().clone() for w in weights]
        self.adam = torch.optim.Adam(self.masters, lr=lr, maximize=True) if optimizer == "adam" else None

    @torch.no_grad()
    def apply(self, noises: list[LayerNoise | torch.Tensor], coefficients: torch.Tensor, population: int,
              sigma: float, lr: float, rank: int) -> None:
        for master, noise in zip(self.masters, noises):
            if self.adam is None:  # sgd: lr scales the step; adam: lr is Adam's (set below)
                master += parameter_step(noise, coefficients, population, sigma, lr, rank)
            else:
                master.grad = parameter_step(noise, coefficients, population, sigma, 1.0, rank)
        if self.adam is not None:
            for group in self.adam.param_groups:
                group["lr"] = lr
            self.adam.step()
        for weight, master in zip(self.weights, self.masters):
            if master is not weight:
                weight.copy_(master)
