"""A run's examples: `training_and_eval_examples` (the held-out split, `eval_split` choosing test or
validation problems: data/tasks.py's `held_out_split`, the one rule every recipe goes through), and
`sft_rows` and `tokenized_dataset` (rows as TRL's SFTTrainer takes them)."""

from __future__ import annotations


def training_and_eval_examples(settings) -> tuple[list[dict], list[dict]]:
    """(training examples, held-out evaluation examples) of the run: `dataset`, `eval_split`,
    `eval_examples`, `max_examples` and `seed` of its settings through data/tasks.py's
    `held_out_split`, the rule every recipe holds out by. With eval_split=test the evaluation is the
    test split (a JSONL file, one split by itself: its first `eval_examples` rows); with validation,
    a generated task's validation split, else the first `eval_examples` problems of the training
    data. The seed never changes the problems scored. A question scored is never trained on,
    whatever the data set. A question longer than the model's context is refused or left out before
    any of this (`too_long`, data/question_length.py)."""
    from gpuscale.data.question_length import question_limit
    from gpuscale.data.tasks import held_out_split

    return held_out_split(settings.dataset, getattr(settings, "eval_split", "test"), settings.eval_examples,
                          settings.max_examples, seed=settings.seed, question_limit=question_limit(settings),
                          domain=settings.domain)


def sft_rows(examples: list[dict]) -> list[dict]:
    """Examples as the prompt-completion rows `train_sft` takes: the question and the gold answer."""
    return [{"question": example["question"], "completion": example["answer"]} for example in examples]


def tokenized_dataset(rows: list[dict], tokenizer, max_length: int | None = None):
    """A `datasets.Dataset` of input_ids and completion_mask, tokenized here so that the prompt is
    exactly the generation side's (TRL would re-tokenize text prompts its own way), each row cut to
    `max_length` tokens (TRL's padding-free collator cuts nothing)."""
    import datasets

    from gpuscale.data.prompts import prompt_ids

    datasets.disable_progress_bars()  # TRL's preparation passes would draw bars in the rank's log
    completions = tokenizer([row["completion"] for row in rows], add_special_tokens=False)["input_ids"]
    encoded = []
    for row, completion in zip(rows, completions):
        prompt = prompt_ids(tokenizer, row["question"])
        answer = list(completion) + [tokenizer.eos_token_id]
        ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        encoded.append({"input_ids": ids[:max_length], "completion_mask": mask[:max_length]})
    return datasets.Dataset.from_list(encoded)
