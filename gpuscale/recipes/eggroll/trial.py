"""eggroll's tuning trial (`gpuscale tune`): ES steps of the real trainer (its members answer the run's
prompts through the row terms, fitnesses, the update) at a given batch of rows per engine call;
throughput in members per second. The weights each step updates are put back after every trial, so
that every trial starts from the same model and later trials see the answers earlier ones saw."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

from gpuscale.recipes.eggroll import Settings

TIMED_STEPS = 1  # a step is already every member's answers: population x prompts rows of decoding


@contextmanager
def trial_session(settings: Settings, ctx):
    import torch

    from gpuscale.engines.batch_search import Trial
    from gpuscale.recipes.eggroll.trainer import Trainer, perturbed_linears, perturbed_norms, population_engine
    from gpuscale.recipes.shared.device_trials import timed_steps
    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.training_data import training_and_eval_examples

    train, _held_out = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    loaded.model.requires_grad_(False)
    updated = perturbed_linears(loaded.model) + perturbed_norms(loaded.model)  # all a step may change
    # On the host: a copy on the card would count in every trial's peak memory.
    originals = [module.weight.detach().to("cpu", copy=True) for _, module in updated]
    step_numbers = itertools.count(1)  # each step its own prompts and noise, as in a run

    def trial(batch_size: int) -> Trial:
        sized = settings.model_copy(update={"batch_size": batch_size})
        engine = population_engine(loaded, sized.compile and ctx.device.type == "cuda")
        try:
            trainer = Trainer(sized, ctx, loaded, engine, train)

            def step() -> int:
                trainer.step(next(step_numbers))
                return trainer.local_members

            # The first step captures graphs and sizes the KV cache: untimed, as the run's summary leaves it out.
            rate, seconds = timed_steps(step, TIMED_STEPS, ctx.synchronize, warm_up=1)
        finally:
            engine.remove_row_terms()
            with torch.no_grad():
                for (_, module), original in zip(updated, originals):
                    module.weight.copy_(original)
        return Trial(batch_size, throughput=rate, step_seconds=seconds)

    yield trial
