"""power-sampling's tuning trial: one batch of the real work (the run's method and settings, the data
set's problems) at a given batch size, after the sampler's own short warm-up."""

from __future__ import annotations

from contextlib import contextmanager

from gpuscale.recipes.power_sampling import Settings

TIMED_BATCHES = 1  # one batch is already hundreds of decode steps (every block and MCMC step)


@contextmanager
def trial_session(settings: Settings, ctx):
    from gpuscale.data.question_length import question_limit
    from gpuscale.data.tasks import evaluation_examples
    from gpuscale.recipes.power_sampling.sampler import BatchSampler
    from gpuscale.recipes.shared.device_trials import timed_steps
    from gpuscale.recipes.shared.models import load_generation_model

    count = settings.max_examples if settings.split == "validation" else None  # validation is counted out
    examples = evaluation_examples(settings.dataset, settings.split, count, seed=settings.seed,
                                   question_limit=question_limit(settings), domain=settings.domain)
    loaded = load_generation_model(settings.model, ctx)

    def trial(batch_size: int):
        from gpuscale.engines.batch_search import Trial

        sized = settings.model_copy(update={"batch_size": batch_size})
        sampler = BatchSampler(sized, loaded.model, loaded.tokenizer, loaded.eos, loaded.pad, ctx)
        # The data set's problems in order, repeated where it has fewer than a batch.
        batch = [(i, examples[i % len(examples)]) for i in range(batch_size)]
        sampler.warm_up(batch)
        rate, seconds = timed_steps(lambda: len(sampler.run(batch)) // sized.chains, TIMED_BATCHES,
                                    ctx.synchronize, warm_up=0)
        return Trial(batch_size, throughput=rate, step_seconds=seconds)

    yield trial
