"""TRL's GRPOTrainer over several task domains, with PCGrad as an option.

`MultiTaskGRPOTrainer` adds to GRPOTrainer:
- each completion carries its domain's index (`domain_ids`), for per-domain losses;
- how far the loss's log-probs of the sampled tokens are from the engine's, every step
  (engines/policy_mismatch.py: `sampling_sampling_logp_difference_mean`/`_max`, `sampling_sampler_kl`);
- `off_policy=True` (rollout=async): the next step's prompts held ahead for the rollout
  (engines/async_rollout.py: `PromptLookahead`) and TRL's importance-sampling correction of the
  sampler's policy turned on (engines/off_policy.py);
- the time spent generating is measured (`time/generation` per step; `generation_seconds` in all);
  `StepClock` times each optimizer step end to end and the generation inside it;
- the step phases (engines/step_phases.py) of the rollout, beside the trainer's own (the TRL bridge's
  data, forward+backward, optimizer, log): `generate`, `logprobs` (log-probs without a graph: the
  reference model's, and the old policy's where TRL takes them, rollout=async with `old_logprobs=forward`;
  by default the importance-sampling ratio takes the loss forward's, engines/off_policy.py), `reward` (the
  rest of the rollout: rewards, advantages, gathers), and the engine's `weight_sync` (engines/rollout.py);
- `mtl="pcgrad"`: `training_step` computes one loss per domain on that domain's rows (`domain_loss`,
  scaled so that the domains' losses, TRL's entropy term included, add up to TRL's loss on the whole
  micro-batch; the rows padded with masked ones to the same count on every rank, since TRL's loss gathers
  per-row metrics), one gradient per domain with `torch.autograd.grad` through the unwrapped model (a
  per-domain gradient bypasses DDP's hooks, which only reduce what a backward accumulates), accumulates them over the
  step's micro-batches, all-reduces them by hand across ranks (the mean, as DDP would), projects them
  (pcgrad.py) and writes their sum into `.grad`; the trainer's own clipping and optimizer step
  follow. Every rank evaluates every domain in the same order, even one it holds no row of: TRL's
  loss runs collectives (for its metrics).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from trl import GRPOTrainer

from gpuscale.data.seeds import derived_seed
from gpuscale.data.step_phases import GENERATE, LOGPROBS, REWARD
from gpuscale.engines.async_rollout import PromptLookahead
from gpuscale.engines.off_policy import ImportanceSamplingCorrection
from gpuscale.engines.policy_mismatch import SamplerMismatchLogging
from gpuscale.engines.step_phases import phase
from gpuscale.recipes.grpo_mtl.pcgrad import DomainGradients, gradient_cosines

# How a domain's loss on its own rows relates to TRL's loss on the whole micro-batch, per loss type:
# "tokens_global": normalised by the step's global token count (the same for any subset of rows);
# "rows": a mean over the rows (scale by the domain's share of rows); "tokens_local": a mean over the
# micro-batch's tokens (scale by the domain's share of tokens).
LOSS_NORMALISATION = {"dapo": "tokens_global", "cispo": "tokens_global", "vespo": "tokens_global",
                      "grpo": "rows", "sapo": "rows", "dr_grpo": "rows", "luspo": "rows", "bnpo": "tokens_local"}


class MultiTaskGRPOTrainer(ImportanceSamplingCorrection, PromptLookahead, SamplerMismatchLogging, GRPOTrainer):
    def __init__(self, *args, domains: list[str], mtl: str = "none", mtl_seed: int = 0, off_policy: bool = False,
                 old_logprobs: str = "loss", **kwargs):
        super().__init__(*args, **kwargs)
        if off_policy:  # rollout=async: the next step's prompts known ahead, and the sampler's policy corrected
            self.lookahead = True
            self.start_correcting(ratio_at_loss=old_logprobs == "loss")
        self.domains = list(domains)
        self.domain_index = {domain: i for i, domain in enumerate(self.domains)}
        self.mtl = mtl
        if mtl == "pcgrad" and self.loss_type not in LOSS_NORMALISATION:
            raise ValueError(f"loss_type: {self.loss_type!r}: PCGrad cannot split this loss by domain")
        # Seeded at every optimizer step from (mtl_seed, step), the same on every rank: the same orders
        # everywhere, and a run resumed from a checkpoint draws the orders the uninterrupted run drew.
        self.mtl_seed = mtl_seed
        self.pcgrad_generator = torch.Generator().manual_seed(mtl_seed)
        self.generation_seconds = 0.0
        self._domain_grads = DomainGradients(len(self.domains))  # the step's, per domain
        self._micro_steps = 0

    # ---- generation: timing and domain ids -----------------------------------------------------

    def _generate(self, prompts: list):
        started = self._now()
        with phase(GENERATE):
            result = super()._generate(prompts)
        seconds = self._now() - started
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["time/generation"].append(seconds)
        if mode == "train":
            self.generation_seconds += seconds
        return result

    def _now(self) -> float:
        if self.accelerator.device.type == "cuda":  # the trainer's stream: not the async rollout's
            torch.cuda.current_stream(self.accelerator.device).synchronize()
        return time.perf_counter()

    def _generate_and_score_completions(self, inputs):
        # The rollout's step phase (engines/step_phases.py) is `reward`: the rewards, the advantages
        # and TRL's gathers; generation and the log-probs without a graph are phases of their own in it.
        with phase(REWARD):
            output = super()._generate_and_score_completions(inputs)
        output["domain_ids"] = torch.tensor([self.domain_index[row["domain"]] for row in inputs],
                                            device=self.accelerator.device)
        return output

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        """TRL's log-probs; those without a graph (the reference model's, the old policy's where TRL
        takes them, in the rollout) timed as a step phase of their own; the loss's are its forward."""
        if torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        with phase(LOGPROBS):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    # ---- PCGrad --------------------------------------------------------------------------------

    def domain_loss(self, model, inputs: dict, domain: int, padded_rows: int | None = None) -> torch.Tensor:
        """TRL's loss on the rows of one domain, scaled so that the domains' losses add up to TRL's
        loss on all the rows. The rows are padded with masked copies to `padded_rows` (every rank
        must pass the same count: TRL's loss gathers per-row metrics, and gloo/NCCL need equal
        sizes); a micro-batch without rows of the domain thus still runs the model (and the
        collectives) and gives a zero loss."""
        rows = (inputs["domain_ids"] == domain).nonzero().squeeze(1)
        padded_rows = max(padded_rows or 0, len(rows), 1)
        padding = padded_rows - len(rows)
        indices = torch.cat([rows, torch.zeros(padding, dtype=torch.long, device=rows.device)])
        subset = select_rows(inputs, indices)
        if padding:
            subset["completion_mask"] = subset["completion_mask"].clone()
            subset["completion_mask"][len(rows):] = 0
        share = self._share(inputs, subset)
        with self._entropy_coef_of_domain(inputs, subset, share):
            loss = self._compute_loss(model, subset)
        return loss * share

    @contextmanager
    def _entropy_coef_of_domain(self, inputs: dict, subset: dict, share: float):
        """TRL's entropy term is `entropy_coef` x the mean entropy of the rows it is handed, whatever the
        loss type; a domain's part of the micro-batch's mean is that times the domain's share of its tokens.
        So, while the domain's loss is computed, the coefficient is scaled by that share (and divided by the
        `share` the loss is then multiplied by): the domains' losses still add up to TRL's whole loss."""
        coefficient = self.entropy_coef
        if not coefficient:
            yield
            return
        total = inputs["completion_mask"].sum().item()
        tokens = subset["completion_mask"].sum().item()
        self.entropy_coef = coefficient * tokens / total / share if total and share else 0.0
        logged = self._metrics["train"].get("entropy_coef", [])
        before = len(logged)
        try:
            yield
        finally:
            self.entropy_coef = coefficient
            logged[before:] = [coefficient] * (len(logged) - before)  # TRL logs the run's coefficient

    def _share(self, inputs: dict, subset: dict) -> float:
        normalisation = LOSS_NORMALISATION[self.loss_type]
        if normalisation == "tokens_global":
            return 1.0
        if normalisation == "rows":
            return subset["completion_mask"].shape[0] / inputs["completion_mask"].shape[0]
        total = inputs["completion_mask"].sum().item()
        return subset["completion_mask"].sum().item() / total if total else 0.0

    def _rows_per_domain_on_any_rank(self, domain_ids: torch.Tensor) -> list[int]:
        """Per domain, the most rows any rank holds in this micro-batch (one all-reduce)."""
        counts = torch.bincount(domain_ids, minlength=len(self.domains))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        return counts.tolist()

    def training_step(self, model, inputs, num_items_in_batch):
        if self.mtl != "pcgrad":
            return super().training_step(model, inputs, num_items_in_batch)
        started = time.perf_counter()
        model.train()
        inputs = self._prepare_inputs(inputs)
        module = self.accelerator.unwrap_model(model)  # not DDP: its hooks expect a backward
        parameters = [p for p in module.parameters() if p.requires_grad]
        total = torch.zeros((), device=self.accelerator.device)
        padded_rows = self._rows_per_domain_on_any_rank(inputs["domain_ids"])
        for domain in range(len(self.domains)):
            with self.compute_loss_context_manager():
                loss = self.domain_loss(module, inputs, domain, padded_rows[domain])
            grads = torch.autograd.grad(loss, parameters, allow_unused=True)
            self._domain_grads.add(domain, grads, parameters)
            total += loss.detach()
        self._micro_steps += 1
        if self._micro_steps % self.current_gradient_accumulation_steps == 0:
            self._write_pcgrad(parameters)
        # GRPOTrainer.training_step's bookkeeping (its generation buffer index and step time).
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return total

    def _write_pcgrad(self, parameters) -> None:
        """All-reduce the step's per-domain gradients, record how they conflict, project, and write
        the sum into each parameter's .grad (the trainer clips and steps next)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            all_reduce_mean(self._domain_grads.flats)
        grads = [[flat] for flat in self._domain_grads.flats]  # pcgrad's functions take a gradient as a list
        cosines = gradient_cosines(grads)
        metrics = self._metrics["train"]
        if cosines:
            metrics["pcgrad/conflict_share"].append(sum(c < 0 for c in cosines.values()) / len(cosines))
        for (i, j), cosine in cosines.items():
            metrics[f"pcgrad/cosine_{self.domains[i]}_{self.domains[j]}"].append(cosine)
        self.pcgrad_generator.manual_seed(derived_seed(self.mtl_seed, "pcgrad", self.state.global_step))
        self._domain_grads.write(parameters, self.pcgrad_generator)


def select_rows(inputs: dict, rows: torch.Tensor) -> dict:
    """The inputs of the given rows: every per-row tensor indexed, everything else as it is."""
    size = inputs["completion_ids"].shape[0]
    return {key: value[rows] if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size
            else value for key, value in inputs.items()}


def all_reduce_mean(tensors: list[torch.Tensor]) -> None:
    """Average tensors over the ranks in place, through one flat buffer (one collective)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


class StepClock(TrainerCallback):
    """Wall time of every optimizer step, from the end of the previous one (or the start of training)
    to the end of this one, the device synchronised, and the trainer's generation seconds within it:
    `step_seconds` and `generation_seconds`, one entry per step."""

    def __init__(self, trainer: MultiTaskGRPOTrainer):
        self.trainer = trainer
        self.step_seconds: list[float] = []
        self.generation_seconds: list[float] = []
        self._last_time = 0.0
        self._last_generation = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_time, self._last_generation = self.trainer._now(), self.trainer.generation_seconds

    def on_step_end(self, args, state, control, **kwargs):
        now, generation = self.trainer._now(), self.trainer.generation_seconds
        self.step_seconds.append(now - self._last_time)
        self.generation_seconds.append(generation - self._last_generation)
        self._last_time, self._last_generation = now, generation
