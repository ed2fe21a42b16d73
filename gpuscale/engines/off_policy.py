"""Training on completions another policy sampled: TRL's own importance-sampling correction, turned on
for gpuscale's rollout, and the figures of how far off-policy a step was.

What TRL 1.16's GRPOTrainer does with a `rollout_func`'s `logprobs` (read in trl/trainer/grpo_trainer.py):
- `_generate` returns them; `_generate_and_score_completions` pads them into `sampling_per_token_logps`
  and passes them to the loss, which uses them only for the off-policy sequence mask (OPSM,
  `off_policy_mask_threshold`, off by default). That is all.
- `old_per_token_logps` (the policy the PPO ratio is taken against) is computed, a no-grad forward of
  the trainer's model over the whole generation batch, only when `gradient_accumulation_steps` is not
  a multiple of `steps_per_generation x num_iterations` (grpo-mtl's always is: one generation per
  optimizer step) or when `use_vllm and vllm_importance_sampling_correction`; otherwise the loss takes
  the loss's own log-probs, detached (the ratio is exactly 1).
- The correction itself (the ratio exp(old - sampling) per token or per sequence, truncated at
  `vllm_importance_sampling_clip_max`/`_min` or masked outside them, `vllm_importance_sampling_mode`;
  multiplied into the per-token loss; its min/mean/max logged as `sampling/importance_sampling_ratio/*`)
  runs only under `use_vllm`. With a `rollout_func` and no vLLM, TRL applies no correction at all, and
  its config's correction fields are silently ignored.

So what gpuscale adds is first the switch: `ImportanceSamplingCorrection` makes the trainer read
`use_vllm` as true everywhere but where it would reach for a vLLM engine (its `__init__`, which would
build one, and `_generate`, which would sync weights into one; the rollout runs there). TRL's loss then
weighs each token by `importance_sampling_ratio`. `tests/unit/test_off_policy.py` pins the places TRL
reads `use_vllm`, so a TRL that reads it somewhere new fails there, not in a run.

Where the ratio's trainer log-probs come from (`ratio_at_loss`, grpo-mtl's `old_logprobs`):
- TRL's own way (`old_logprobs=forward`): under `use_vllm` it always runs that no-grad forward over the
  generation batch before the loss, for `old_per_token_logps`, and takes the ratio from it. An extra
  forward a step (11-23% of an async or placed step on a GPU, bench/RESULTS.md).
- At the loss (`old_logprobs=loss`, the default): where every loss on a generation batch runs on the
  weights it was scored under (`one_policy_per_generation`: TRL's own test above; grpo-mtl's one
  generation per optimizer step, num_iterations 1, however many micro-batches accumulate), that forward
  gives exactly the loss forward's log-probs, detached; TRL's `_compute_loss` then takes those itself
  (no `old_per_token_logps`) and the forward is skipped: `use_vllm` also reads false inside
  `_generate_and_score_completions`, and the ratio is computed from the loss forward's log-probs
  (`sampler_ratio`: TRL's token modes, same formula, truncation or mask and clip bounds) and put in the
  loss's inputs as the forward returns, before `_compute_loss` reads it. Nothing else the loss reads
  depends on that forward: the KL term (`beta`; the reference model's forward stays), the entropy mask
  (`top_entropy_quantile`, from the loss's entropies), OPSM (from the sampler's log-probs) and
  sequence-level PPO ratios take the loss's own log-probs either way. The loss and its gradients are
  TRL's way's up to float noise: the two forwards batch the rows differently, so under bf16 TRL's PPO
  ratio starts a step a little off 1 where the loss's is exactly 1 (test_off_policy.py pins one step on
  CPU). Where the weights may move within a generation batch (`one_policy_per_generation` false), TRL's
  way is kept; a model with dropout active would draw different masks in TRL's two forwards, not here.

The figures, beside TRL's `sampling/importance_sampling_ratio/{min,mean,max}` (per rank over its
generation batch's counted tokens, then min, mean and max over the ranks) and gpuscale's
`sampling/sampling_logp_difference/*` (engines/policy_mismatch.py, from the loss forward either way;
TRL's own, from its forward, override them under TRL's way), two of gpuscale's (their TRL-style names;
the ReporterCallback writes `/` as `_`):
- `sampling/staleness`: how many optimizer steps older than the trained policy the sampling weights
  were (the async rollout's, engines/async_rollout.py; 0 when sampled from the current weights);
- `sampling/importance_sampling_clipped_share`: the share of the counted completion tokens whose ratio
  exp(old - sampling) fell outside [clip_min, clip_max] (truncated or masked), all ranks together.
Under TRL's way the ratio figures and the clipped share are computed as the completions are scored;
at the loss, from the step's micro-batches as their losses run, and logged once the generation batch
is done (at the next generation or the next log). Either way they are the figures of the step that
trains on those completions, with the weights it starts from: the same step, the same quantities.
"""

from __future__ import annotations

import math

import torch

from gpuscale.engines.policy_mismatch import LossForwardTap, loss_mask

STALENESS = "sampling/staleness"
CLIPPED_SHARE = "sampling/importance_sampling_clipped_share"
RATIO_MIN, RATIO_MEAN, RATIO_MAX = (f"sampling/importance_sampling_ratio/{figure}" for figure in ("min", "mean", "max"))
# TRL's modes that weigh each token by its own ratio: the clipped share counts tokens, as they do.
TOKEN_MODES = ("token_truncate", "token_mask")


def one_policy_per_generation(accumulation_steps: int, steps_per_generation: int, num_iterations: int) -> bool:
    """Whether every loss on a generation batch runs on the weights the batch was scored under: TRL
    generates every `steps_per_generation x num_iterations` micro-batches, the optimizer steps every
    `accumulation_steps`; when the one divides the other, no optimizer step falls inside a batch's
    passes (TRL's own test for leaving out `old_per_token_logps`)."""
    return accumulation_steps % (steps_per_generation * num_iterations) == 0


def sampler_ratio(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                  clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's importance weight of each token, exp(trainer - sampling) ((rows, tokens) each), 1 outside
    `mask` and where the sampler gave no log-prob (NaN); `token_truncate` clamps it to [clip_min,
    clip_max] (None: no bound), `token_mask` zeroes it outside them."""
    ratio = torch.exp(torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0))
    if mode == "token_truncate":
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode == "token_mask":
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode: {mode!r}: not one of {', '.join(TOKEN_MODES)}")


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


def ratio_sums(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, tokens, min, max] of `ratio` over `mask`'s tokens (TRL's figures count every masked token,
    NaN-scored ones at their ratio 1), kept on the device."""
    counted = mask.bool()
    ratio = ratio.float()
    return torch.stack([torch.where(counted, ratio, 0.0).sum(), counted.sum().float(),
                        torch.where(counted, ratio, math.inf).min(), torch.where(counted, ratio, -math.inf).max()])


def added_sums(earlier: torch.Tensor | None, later: torch.Tensor) -> torch.Tensor:
    """Two micro-batches' [ratio sum, tokens, min, max, clipped, counted] as one."""
    if earlier is None:
        return later
    return torch.stack([earlier[0] + later[0], earlier[1] + later[1], torch.minimum(earlier[2], later[2]),
                        torch.maximum(earlier[3], later[3]), earlier[4] + later[4], earlier[5] + later[5]])


def ratio_figures(per_rank: torch.Tensor) -> dict[str, float]:
    """TRL's ratio figures and the clipped share from each rank's sums ([ratio sum, tokens, min, max,
    clipped, counted] a row): each rank's min, mean and max (0 for a rank without tokens, as TRL), then
    the least, the mean and the largest over the ranks."""
    total, tokens, low, high, clipped, counted = per_rank.T
    some = tokens > 0
    mean = torch.where(some, total / tokens.clamp(min=1.0), 0.0)
    figures = {RATIO_MIN: torch.where(some, low, 0.0).min().item(), RATIO_MEAN: mean.mean().item(),
               RATIO_MAX: torch.where(some, high, 0.0).max().item()}
    if counted.sum() > 0:
        figures[CLIPPED_SHARE] = (clipped.sum() / counted.sum()).item()
    return figures


class ImportanceSamplingCorrection(LossForwardTap):
    """Mixed into a GRPOTrainer subclass (before it): with `start_correcting` called once the trainer is
    built, TRL corrects the rollout's completions by its own `vllm_importance_sampling_*` settings (see
    the module docstring), and logs the clipped share. Only token-level modes (`TOKEN_MODES`)."""

    correct_sampler = False
    ratio_at_loss = False  # the trainer's log-probs of the ratio: the loss forward's, not TRL's extra forward
    _generating = False  # inside `_generate`, where TRL's use_vllm would mean a vLLM engine
    _scoring = False  # inside `_generate_and_score_completions`
    _ratio_sums: dict | None = None  # mode -> the generation batch's sums so far, on the rank's device

    @property
    def use_vllm(self) -> bool:
        return self.correct_sampler and not self._generating and not (self._scoring and self.ratio_at_loss)

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:  # TRL's __init__ sets it from its config
        if value:
            raise ValueError("use_vllm: true: gpuscale's engine is this trainer's rollout, not vLLM")

    def start_correcting(self, ratio_at_loss: bool = True) -> None:
        """Turn the correction on; with `ratio_at_loss`, take the ratio at the loss where that is exact
        (`one_policy_per_generation`), TRL's extra forward elsewhere."""
        mode = self.vllm_importance_sampling_mode
        if mode not in TOKEN_MODES:
            raise ValueError(f"vllm_importance_sampling_mode: {mode!r}: gpuscale corrects token by token "
                             f"({' or '.join(TOKEN_MODES)})")
        self.correct_sampler = True
        self.ratio_at_loss = ratio_at_loss and one_policy_per_generation(
            self.args.gradient_accumulation_steps, self.args.steps_per_generation, self.num_iterations)
        self._ratio_sums = {}

    def _generate(self, prompts: list):
        self._generating = True
        try:
            return super()._generate(prompts)
        finally:
            self._generating = False

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._log_ratio_figures(mode)  # the batch before is done with
        self._scoring = True
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._scoring = False
        if self.correct_sampler and not self.ratio_at_loss and mode == "train":
            counts = clipped_counts(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                    output["completion_mask"], self.vllm_importance_sampling_clip_min,
                                    self.vllm_importance_sampling_clip_max)
            clipped, counted = self.accelerator.gather(counts).view(-1, 2).sum(dim=0).tolist()
            if counted:
                self._metrics["train"][CLIPPED_SHARE].append(clipped / counted)
        return output

    def _loss_forward(self, per_token_logps: torch.Tensor, inputs: dict) -> None:
        super()._loss_forward(per_token_logps, inputs)
        if self.correct_sampler and self.ratio_at_loss:  # TRL's loss reads the ratio after this forward
            inputs["importance_sampling_ratio"] = self._ratio_at_loss(per_token_logps.detach(), inputs)

    def _ratio_at_loss(self, trainer_logps: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The ratio of the loss's tokens from its own log-probs (what TRL's forward would have given),
        its figures' sums added to the generation batch's."""
        if "old_per_token_logps" in inputs:
            raise RuntimeError("old_per_token_logps computed although the ratio is taken at the loss: "
                               "TRL computes it under other conditions than off_policy.py expects")
        sampling, mask = inputs["sampling_per_token_logps"], loss_mask(inputs)
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        ratio = sampler_ratio(trainer_logps, sampling, mask, self.vllm_importance_sampling_mode, clip_min, clip_max)
        sums = torch.cat([ratio_sums(ratio, mask), clipped_counts(trainer_logps, sampling, mask, clip_min, clip_max)])
        mode = "train" if self.model.training else "eval"
        self._ratio_sums[mode] = added_sums(self._ratio_sums.get(mode), sums)
        return ratio

    def _log_ratio_figures(self, mode: str) -> None:
        """The figures of the generation batch whose losses ran since the last call, into TRL's metrics.
        A collective: every rank runs the same losses, so every rank holds sums here or none does."""
        sums = (self._ratio_sums or {}).pop(mode, None)
        if sums is not None:
            for name, value in ratio_figures(self.accelerator.gather(sums[None])).items():
                self._metrics[mode][name].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._log_ratio_figures("train" if self.model.training else "eval")
        super().log(logs, start_time)


def log_staleness(trainer, steps: int) -> None:
    """The staleness of the completions handed to `trainer` now (the same on every rank)."""
    trainer._metrics["train"][STALENESS].append(float(steps))
