"""Training on completions another policy sampled: TRL's own importance-sampling correction, turned on
for gpuscale's rollout, and the figures of how far off-policy a step was.

What TRL 1.16's GRPOTrainer does with a `rollout_func`'s `logprobs` (read in trl/trainer/grpo_trainer.py):
- `_generate` returns them; `_generate_and_score_completions` pads them into `sampling_per_token_logps`
  and passes them to the loss, which uses them only for the off-policy sequence mask (OPSM,
  `off_policy_mask_threshold`, off by default). That is all.
- `old_per_token_logps` (the policy the PPO ratio is taken against) is computed, a no-grad forward of
  the trainer's model over the whole generation batch, only when `gradient_accumulation_steps` is not
  a multiple of `steps_per_generation x num_iterations` (grpo-mtl's never is: one generation per
  optimizer step) or when `use_vllm and vllm_importance_sampling_correction`; otherwise the loss takes
  the loss's own log-probs, detached (the ratio is exactly 1).
- The correction itself (the ratio exp(old - sampling) per token or per sequence, truncated at
  `vllm_importance_sampling_clip_max`/`_min` or masked outside them, `vllm_importance_sampling_mode`;
  multiplied into the per-token loss; its min/mean/max logged as `sampling/importance_sampling_ratio/*`)
  runs only under `use_vllm`. With a `rollout_func` and no vLLM, TRL applies no correction at all, and
  its config's correction fields are silently ignored.

So what gpuscale adds is only the switch: `ImportanceSamplingCorrection` makes the trainer read
`use_vllm` as true everywhere but where it would reach for a vLLM engine (its `__init__`, which would
build one, and `_generate`, which would sync weights into one; the rollout runs there). TRL's own code
then computes `old_per_token_logps`, the ratio, its truncation and its figures, and weighs the loss.
`tests/unit/test_off_policy.py` pins the places TRL reads `use_vllm`, so a TRL that reads it somewhere
new fails there, not in a run. Beside TRL's figures, two of gpuscale's (their TRL-style names; the
ReporterCallback writes `/` as `_`):
- `sampling/staleness`: how many optimizer steps older than the trained policy the sampling weights
  were (the async rollout's, engines/async_rollout.py; 0 when sampled from the current weights);
- `sampling/importance_sampling_clipped_share`: the share of the counted completion tokens whose ratio
  exp(old - sampling) fell outside [clip_min, clip_max] (truncated or masked), all ranks together.
"""

from __future__ import annotations

import math

import torch

STALENESS = "sampling/staleness"
CLIPPED_SHARE = "sampling/importance_sampling_clipped_share"
# TRL's modes that weigh each token by its own ratio: the clipped share counts tokens, as they do.
TOKEN_MODES = ("token_truncate", "token_mask")


def clipped_counts(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                   clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """[tokens whose ratio exp(old - sampling) is outside [clip_min, clip_max], tokens counted] over
    `mask`'s tokens ((rows, tokens) each); a token without a sampling log-prob (NaN) is not counted,
    as TRL gives it the ratio 1."""
    log_ratio = old_logps.float() - sampling_logps.float()
    counted = mask.bool() & ~torch.isnan(log_ratio)
    ratio = torch.exp(torch.where(counted, log_ratio, torch.zeros_like(log_ratio)))
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    clipped = counted & ((ratio < low) | (ratio > high))
    return torch.stack([clipped.sum(), counted.sum()]).float()


class ImportanceSamplingCorrection:
    """Mixed into a GRPOTrainer subclass (before it): with `correct_sampler` set once the trainer is
    built, TRL corrects the rollout's completions by its own `vllm_importance_sampling_*` settings (see
    the module docstring), and logs the clipped share. Only token-level modes (`TOKEN_MODES`)."""

    correct_sampler = False
    _generating = False  # inside `_generate`, where TRL's use_vllm would mean a vLLM engine

    @property
    def use_vllm(self) -> bool:
        return self.correct_sampler and not self._generating

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:  # TRL's __init__ sets it from its config
        if value:
            raise ValueError("use_vllm: true: gpuscale's engine is this trainer's rollout, not vLLM")

    def start_correcting(self) -> None:
        mode = self.vllm_importance_sampling_mode
        if mode not in TOKEN_MODES:
            raise ValueError(f"vllm_importance_sampling_mode: {mode!r}: gpuscale corrects token by token "
                             f"({' or '.join(TOKEN_MODES)})")
        self.correct_sampler = True

    def _generate(self, prompts: list):
        self._generating = True
        try:
            return super()._generate(prompts)
        finally:
            self._generating = False

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.correct_sampler and self.model.training:
            counts = clipped_counts(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                    output["completion_mask"], self.vllm_importance_sampling_clip_min,
                                    self.vllm_importance_sampling_clip_max)
            clipped, counted = self.accelerator.gather(counts).view(-1, 2).sum(dim=0).tolist()
            if counted:
                self._metrics["train"][CLIPPED_SHARE].append(clipped / counted)
        return output


def log_staleness(trainer, steps: int) -> None:
    """The staleness of the completions handed to `trainer` now (the same on every rank)."""
    trainer._metrics["train"][STALENESS].append(float(steps))
