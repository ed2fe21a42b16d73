"""How far the trainer's log-probabilities of the sampled tokens are from the sampler's, every step.

GRPO's loss takes the completions as drawn from the policy being trained. When another engine samples
them (gpuscale's generation engine as TRL's `rollout_func`), the two may disagree: another precision
(the engine decoding the fp32 master weights, the loss's forward under bf16 autocast), other kernels,
a KV cache. The loss then trains on completions from a slightly different policy, silently. TRL
measures this only where vLLM samples (`sampling/sampling_logp_difference/*`, with
`vllm_importance_sampling_correction`); `SamplerMismatchLogging` measures the same figures for any
rollout that returns its log-probs, under the same names, plus a KL estimate:

- `sampling/sampling_logp_difference/mean`, `.../max`: |log p_trainer - log p_sampler| over the
  completion tokens the loss counts (TRL's definition; its mean is over tokens, all ranks together);
- `sampling/sampler_kl`: the k3 estimate of KL(sampler || trainer), mean over those tokens of
  exp(r) - 1 - r with r = log p_trainer - log p_sampler (non-negative, unbiased for tokens drawn
  from the sampler; Schulman's "Approximating KL divergence").

The trainer's log-probs are the loss's own (TRL's `_compute_loss` forward, with its autocast and its
temperature), taken as they are computed: nothing is recomputed. The sums stay on the device (no sync
per micro-batch) and are gathered over the ranks once per log, so each logged value covers every
micro-batch and every rank since the last log. The ReporterCallback (trl_bridge.py) then writes them
like every other figure of the log: `sampling_sampling_logp_difference_mean`, `..._max`,
`sampling_sampler_kl`.
"""

from __future__ import annotations

import torch

MEAN, MAX, KL = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/sampler_kl")
MISMATCH_FIGURES = (MEAN, MAX, KL)
# |r| is clamped here before exp(r): a token the trainer finds e^20 times likelier than the sampler
# did is a mismatch beyond any bound already (TRL clamps its log importance ratios to 20 as well).
LOG_RATIO_CLAMP = 20.0


def mismatch_sums(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum |r|, sum k3, tokens, max |r|] over the tokens of `mask`, r = trainer - sampler log-probs
    ((rows, tokens) each). A token the sampler gave no log-prob for (NaN) is left out."""
    log_ratio = trainer_logps.detach().float() - sampler_logps.float()
    counted = mask.bool() & ~torch.isnan(log_ratio)
    log_ratio = torch.where(counted, log_ratio, torch.zeros_like(log_ratio)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    distance = log_ratio.abs()
    k3 = torch.expm1(log_ratio) - log_ratio  # 0 where not counted (r = 0 there)
    largest = distance.max() if distance.numel() else distance.new_zeros(())
    return torch.stack([distance.sum(), k3.sum(), counted.sum().float(), largest])


def combined_sums(earlier: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """Two `mismatch_sums` as one: the sums and counts added, the larger max."""
    return torch.cat([earlier[:3] + later[:3], torch.maximum(earlier[3:], later[3:])])


def mismatch_figures(sums: torch.Tensor) -> dict[str, float]:
    """The figures of per-rank sums gathered side by side ([sum |r|, sum k3, tokens, max |r|] per rank);
    {} where no token was counted."""
    per_rank = sums.reshape(-1, 4)
    tokens = per_rank[:, 2].sum().item()
    if tokens == 0:
        return {}
    return {MEAN: per_rank[:, 0].sum().item() / tokens, MAX: per_rank[:, 3].max().item(),
            KL: per_rank[:, 1].sum().item() / tokens}


def loss_mask(inputs: dict) -> torch.Tensor:
    """The completion tokens TRL's loss counts: the completion mask, the tools' tokens left out."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


class LossForwardTap:
    """Mixed into a GRPOTrainer subclass: each loss's own forward (the first one inside TRL's
    `_compute_loss`) is handed, with the loss's inputs, to `_loss_forward`, which mixins extend (each
    calling super()). The inputs are the loss's own copy of its micro-batch, so a mixin may add to them
    what TRL's loss reads after that forward; the buffered micro-batch stays as it was scored."""

    _tapped_inputs: dict | None = None  # the inputs of the loss being computed, until its forward is seen

    def _compute_loss(self, model, inputs):
        self._tapped_inputs = inputs = dict(inputs)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._tapped_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs, self._tapped_inputs = self._tapped_inputs, None
        if inputs is not None:
            self._loss_forward(result[0], inputs)
        return result

    def _loss_forward(self, per_token_logps: torch.Tensor, inputs: dict) -> None:
        """The loss's forward has given `per_token_logps` (with grad) for `inputs`."""


class SamplerMismatchLogging(LossForwardTap):
    """Mixed into a GRPOTrainer subclass (before it: `class T(SamplerMismatchLogging, GRPOTrainer)`):
    adds the module's figures to every training log. Needs the rollout's log-probs in the loss's
    inputs (`sampling_per_token_logps`, TRL's name for them); without them, and on TRL's Liger loss
    (which does not go through `_compute_loss`), the figures are simply absent."""

    _mismatch_sums: torch.Tensor | None = None  # summed since the last log, on the rank's device

    def _loss_forward(self, per_token_logps: torch.Tensor, inputs: dict) -> None:
        super()._loss_forward(per_token_logps, inputs)
        sampled = inputs.get("sampling_per_token_logps")
        if sampled is not None and self.model.training:  # the log-probs it trains on
            sums = mismatch_sums(per_token_logps, sampled, loss_mask(inputs))
            self._mismatch_sums = sums if self._mismatch_sums is None else combined_sums(self._mismatch_sums, sums)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every rank computes the same losses, so every rank holds sums here or none does: the gather
        # (a collective) runs on all of them or on none.
        if self._mismatch_sums is not None:
            sums, self._mismatch_sums = self._mismatch_sums, None
            logs = {**logs, **mismatch_figures(self.accelerator.gather(sums).cpu())}
        super().log(logs, start_time)
