"""sft's tuning trial (`gpuscale tune`): optimizer steps on the run's training rows, tokenized and cut to
max_length as the run's trainer gets them, at a per-device micro-batch (recipes/shared/training_trial.py)."""

from __future__ import annotations

from gpuscale.recipes.sft import Settings
from gpuscale.recipes.shared.training_trial import TrainingRows, training_trial_session


def trial_session(settings: Settings, ctx):
    from gpuscale.recipes.shared.rank_batches import run_ranks

    rank_rows = settings.rank_rows(run_ranks(settings))  # this rank's share of a step

    def rows_for(tokenizer) -> TrainingRows:
        from gpuscale.recipes.shared.training_data import sft_rows, tokenized_dataset, training_and_eval_examples

        wanted = rank_rows  # a step's rows: every trial trains on them
        limited = settings.model_copy(update={"max_examples": min(settings.max_examples or wanted, wanted)})
        train, _held_out = training_and_eval_examples(limited)
        encoded = tokenized_dataset(sft_rows(train), tokenizer)
        return TrainingRows([ids[: settings.max_length] for ids in encoded["input_ids"]],
                            [mask[: settings.max_length] for mask in encoded["completion_mask"]])

    return training_trial_session(settings, ctx, rank_rows, rows_for)
