"""What a grpo-mtl run trains and evaluates on: the prompts TRL gets, and the held-out examples."""

from __future__ import annotations


def training_and_eval_examples(settings) -> tuple[list[dict], list[dict]]:
    """(training examples, held-out evaluation examples), as every training recipe holds them out
    (recipes/shared/training_data.py's `training_and_eval_examples`: the test split, or with eval_split=validation
    the first eval_examples problems of the training data). Without `max_examples`, only as many training examples
    are loaded as the run can use: max_steps x prompts_per_step (tiny-math generates its problems)."""
    from gpuscale.recipes.shared.training_data import training_and_eval_examples as split_examples

    limit = settings.max_examples or settings.max_steps * settings.prompts_per_step
    return split_examples(settings.model_copy(update={"max_examples": limit}))


def prompt_for(tokenizer, question: str):
    """The question as TRL's prompt column holds it: a chat (TRL applies the chat template with the
    generation prompt, exactly as `data.prompts.prompt_ids` does) when the tokenizer has a template,
    else the bare question and a newline (TRL then tokenizes it as `prompt_ids` does)."""
    if getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": question}]
    return question + "\n"


def grpo_rows(examples: list[dict], tokenizer, max_prompt_length: int) -> tuple[list[dict], int]:
    """TRL rows {"prompt", "answer", "domain"} of the examples whose prompt fits max_prompt_length
    tokens, and how many were left out (TRL 1.16 no longer truncates prompts; a cut prompt would be
    a different question)."""
    from gpuscale.data.prompts import prompt_ids

    rows, dropped = [], 0
    for example in examples:
        if len(prompt_ids(tokenizer, example["question"])) > max_prompt_length:
            dropped += 1
            continue
        rows.append({"prompt": prompt_for(tokenizer, example["question"]), "answer": example["answer"],
                     "domain": example["domain"]})
    return rows, dropped


def domains_of(rows: list[dict]) -> list[str]:
    """The domains of the rows, in the order they first appear (the same on every rank)."""
    return list(dict.fromkeys(row["domain"] for row in rows))
