"""The engine's rollout, one step ahead: step k+1's completions are generated while step k trains.

TRL's GRPOTrainer asks its `rollout_func` for a step's completions at that step's first micro-batch,
and trains on them at once. `AsyncEngineRollout` answers the call for step k with completions it
started generating during step k-1, then starts step k+1's before handing them over:

    call k:   wait for job k  ->  weights -> the sampler's copy (it is idle)  ->  submit job k+1  ->  return job k
    sampler:  ... job k (weights of step k-1) ...                               job k+1 (weights of step k) ...

- Which prompts step k+1 takes: `PromptLookahead`, mixed into the trainer, holds the first batch of
  the next optimizer step as transformers' loop fetches a step's batches (`get_batch_samples`): the
  rows TRL will hand to `_generate_and_score_completions` at step k+1, whatever its sampler and
  accelerate's sharding made of the data, with one batch kept in memory and no pass of its own. None
  at an epoch's end (the next epoch's order is drawn when it starts): that step generates on call.
  A call whose prompts are not the prefetched ones is a bug, and fails the run.
- Who decodes: a sampler. `LocalSampler`: the rank's own engine, in a thread (below);
  engines/placement.py's `RemoteSampler`: generator ranks of their own (grpo-mtl's `generation_gpus`).
  A sampler's `start(prompts, step, trainer)` brings its weights to the trainer's where the trainer
  has stepped (the `weight_sync` phase), starts the job and gives the step of the weights it samples
  from and the pending completions (`.result()`); `taken()` follows each job's result, `close()` the
  training.
- The weights: a job samples from weights one step older than the step that trains on it
  (`max_staleness >= 1`), or from the current ones (`max_staleness=0`: each call waits for its own job,
  the synchronous rollout through the same code). One job ahead keeps the lag at 1 whatever
  `max_staleness` allows: deeper queues need a snapshot of the weights per job.
- The local sampler: the engine decodes its own copy (`EngineRollout(own_weights=True)`; a LoRA model's is a
  plain model with the adapter merged, engines/merged_lora.py), refreshed by
  `_engine_for` only between jobs, on the trainer's thread, after the optimizer step; one worker thread,
  and on a GPU its own CUDA stream, which waits for the weight copy before a job and which the trainer's
  stream waits for before the next copy; on CPU the same code without a stream. Each job is seeded as
  the synchronous rollout seeds that step's call, so at staleness 0 the two sample the same completions.
- The gap: the trainer applies TRL's importance-sampling correction (engines/off_policy.py); this
  module logs each step's staleness beside it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from transformers import TrainerCallback

from gpuscale.engines.off_policy import log_staleness
from gpuscale.engines.rollout import EngineRollout


@dataclass
class Job:
    prompts: list
    step: int  # the optimizer step that trains on it
    weights_step: int  # the optimizer step of the weights it samples from
    result: Future  # or anything whose `result()` waits for the completions


class AsyncEngineRollout(TrainerCallback):
    """Callable for `GRPOTrainer(rollout_func=...)` on a trainer with `PromptLookahead`, and one of its
    callbacks (its sampler is closed with the training). `sampler`: `LocalSampler` or placement's
    `RemoteSampler`."""

    def __init__(self, sampler, max_staleness: int = 1):
        self.sampler = sampler
        self.max_staleness = max_staleness
        self.prefetched = 0  # steps whose completions were generated ahead
        self.ahead: Job | None = None  # the job generated ahead, for the next step

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        step = int(trainer.state.global_step)
        job, self.ahead = self.ahead, None
        if job is not None and (job.step, job.prompts) != (step, prompts):
            job.result.result()  # the sampler idle before anything else touches it
            raise RuntimeError(f"rollout=async: step {step} asked for other prompts than those generated ahead "
                               f"for step {job.step}")
        if job is None:
            job = self._submit(prompts, step, trainer)
        else:
            self.prefetched += 1
        completions = job.result.result()
        self.sampler.taken()
        log_staleness(trainer, step - job.weights_step)
        upcoming = trainer.upcoming_prompts()
        if self.max_staleness > 0 and upcoming is not None and step + 1 < trainer.state.max_steps:
            self.ahead = self._submit(upcoming, step + 1, trainer)
        return completions

    def _submit(self, prompts: list, step: int, trainer) -> Job:
        """Start generating `prompts` for `step` (no job is running: the caller waited for the last)."""
        weights_step, result = self.sampler.start(prompts, step, trainer)
        return Job(prompts, step, weights_step, result)

    def on_train_end(self, args, state, control, **kwargs):
        """Wait for a job still running (none after the last step) and close the sampler."""
        if self.ahead is not None:
            self.ahead.result.result()
            self.ahead = None
        self.sampler.close()


class LocalSampler:
    """The rank's own engine as AsyncEngineRollout's sampler: a worker thread (on a GPU with its own CUDA
    stream) decodes the engine's own copy of the weights (`rollout`: an EngineRollout with own_weights)."""

    def __init__(self, rollout: EngineRollout):
        if not rollout.own_weights:
            raise ValueError("LocalSampler: the engine must decode weights of its own (own_weights=True)")
        self.rollout = rollout
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuscale-rollout")
        self._stream = None  # the worker's CUDA stream

    def start(self, prompts: list, step: int, trainer) -> tuple[int, Future]:
        """The engine's weights refreshed where the trainer has stepped since (no job is running), then
        `prompts` generated in the worker, seeded as the synchronous rollout seeds `step`."""
        engine = self.rollout._engine_for(trainer)
        seed = self.rollout.step_seed(trainer, step)
        self._stream_after_trainer(engine.device)
        return self.rollout._copied_at_step, self._worker.submit(self._generate, prompts, seed)

    def _generate(self, prompts: list, seed: int) -> dict[str, list]:
        if self._stream is None:
            return self.rollout.generate(prompts, seed)
        import torch

        with torch.cuda.stream(self._stream):
            return self.rollout.generate(prompts, seed)

    def _stream_after_trainer(self, device) -> None:
        """On a GPU: the worker's stream starts after what the trainer's stream has queued (the copy)."""
        if device.type != "cuda":
            return
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))

    def taken(self) -> None:
        """The trainer's stream waits for the worker's before it touches the engine's weights again."""
        if self._stream is not None:
            import torch

            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class Lookahead:
    """An iterator that can hold its next item before it is asked for it (`peek`)."""

    def __init__(self, source):
        self.source = source
        self.held = None
        self._holding = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._holding:
            self._holding = False
            item, self.held = self.held, None
            return item
        return next(self.source)

    def peek(self):
        """The next item, kept for the next `next`; None at the end."""
        if not self._holding:
            try:
                self.held, self._holding = next(self.source), True
            except StopIteration:
                return None
        return self.held


class PromptLookahead:
    """Mixed into a GRPOTrainer subclass (before it): once transformers' loop has fetched an optimizer
    step's batches, the first batch of the next step is fetched too and held, and `upcoming_prompts`
    says its prompts. Off unless `lookahead` is set (the fetch order then is transformers' own)."""

    lookahead = False
    _ahead: Lookahead | None = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if not self.lookahead:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._ahead is None or self._ahead.source is not epoch_iterator:  # a new epoch
            self._ahead = Lookahead(epoch_iterator)
        batches = super().get_batch_samples(self._ahead, num_batches, device)
        self._ahead.peek()
        return batches

    def upcoming_prompts(self) -> list | None:
        batch = None if self._ahead is None else self._ahead.held
        return None if batch is None else [row["prompt"] for row in batch]
