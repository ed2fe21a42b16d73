"""rft's tuning trial (`gpuscale tune`): the generation phase's calls at a given number of questions per call,
each question answered samples_per_question times, on the run's training questions; throughput in
samples (answers) per second. Filtering and training are left out: their cost does not depend on
the generation batch."""

from __future__ import annotations

from contextlib import contextmanager

from gpuscale.recipes.rft import Settings

TIMED_CALLS = 2


@contextmanager
def trial_session(settings: Settings, ctx):
    from gpuscale.data.prompts import prompt_ids
    from gpuscale.engines.batch_search import Trial
    from gpuscale.recipes.rft.generate import make_sampler, questions_per_call
    from gpuscale.recipes.shared.device_trials import timed_steps
    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.training_data import training_and_eval_examples

    train, _held_out = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    prompts = [prompt_ids(loaded.tokenizer, example["question"]) for example in train]

    def trial(batch_size: int) -> Trial:
        sized = settings.model_copy(update={"batch_size": batch_size})
        questions = questions_per_call(sized)
        sampler = make_sampler(sized, ctx, loaded, questions)
        # The training questions in order, repeated where there are fewer than a call holds.
        call = [prompts[i % len(prompts)] for i in range(questions)]
        # The first call captures graphs and sizes the KV cache: untimed.
        rate, seconds = timed_steps(lambda: len(sampler(call)), TIMED_CALLS, ctx.synchronize, warm_up=1)
        return Trial(batch_size, throughput=rate, step_seconds=seconds)

    yield trial
