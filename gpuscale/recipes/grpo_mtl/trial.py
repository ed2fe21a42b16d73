"""grpo-mtl's tuning trial (`gpuscale tune`): optimizer steps of the loss's forward and backward on the run's
training prompts, each followed by a completion of the full max_completion_length (the gold answer's
tokens repeated: the longest a rollout can be, so that the tuned micro-batch fits the longest step),
at a per-device micro-batch (recipes/shared/training_trial.py); with mtl=pcgrad, a loss and a gradient per
domain and PCGrad's update, as the run's trainer takes them (pcgrad.DomainGradients). The rollouts'
generation is not in it."""

from __future__ import annotations

from gpuscale.recipes.grpo_mtl import Settings
from gpuscale.recipes.grpo_mtl.pcgrad import DomainGradients
from gpuscale.recipes.shared.training_trial import TrainingRows, training_trial_session


def trial_session(settings: Settings, ctx):
    from gpuscale.recipes.grpo_mtl import rank_share
    from gpuscale.recipes.shared.rank_batches import run_ranks

    share = rank_share(settings, run_ranks(settings))

    def rows_for(tokenizer) -> TrainingRows:
        from gpuscale.data.prompts import prompt_ids
        from gpuscale.recipes.grpo_mtl.data import training_and_eval_examples

        wanted = share  # a step's rows: every trial trains on them (fewer where prompts are too long: repeated)
        limited = settings.model_copy(update={"max_examples": min(settings.max_examples or wanted, wanted)})
        train, _held_out = training_and_eval_examples(limited)
        sequences, masks, domains = [], [], []
        index = {domain: i for i, domain in enumerate(dict.fromkeys(example["domain"] for example in train))}
        for example in train:
            prompt = prompt_ids(tokenizer, example["question"])
            if len(prompt) > settings.max_prompt_length:
                continue  # the run leaves such prompts out too (grpo_rows)
            completion = full_length(tokenizer(example["answer"], add_special_tokens=False)["input_ids"]
                                     + [tokenizer.eos_token_id], settings.max_completion_length)
            sequences.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
            domains.append(index[example["domain"]])
        return TrainingRows(sequences, masks, domains)

    return training_trial_session(settings, ctx, share, rows_for, reference=settings.beta > 0,
                                  domain_update=DomainGradients if settings.mtl == "pcgrad" else None)


def full_length(tokens: list[int], length: int) -> list[int]:
    """`tokens` repeated to exactly `length` tokens."""
    return (tokens * (length // len(tokens) + 1))[:length]
