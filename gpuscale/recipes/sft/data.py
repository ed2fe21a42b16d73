"""The examples an SFT run trains and evaluates on (no torch: the front end's check uses it too)."""

from __future__ import annotations


def training_and_test_examples(settings) -> tuple[list[dict], list[dict]]:
    """(training examples, held-out test examples) of the run's data set.

    Named tasks have disjoint splits. A JSONL file is one split by itself, so its first
    `eval_examples` rows are the test set and are left out of training: a question scored after
    training was never trained on, whatever the data set.
    """
    from gpuscale.data.tasks import load_examples

    test = load_examples(settings.dataset, "test", settings.eval_examples, seed=settings.seed) \
        if settings.eval_examples else []
    held_out = {example["question"] for example in test}
    # Load enough rows that max_examples remain once the held-out questions are dropped.
    limit = None if settings.max_examples is None else settings.max_examples + len(held_out)
    train = load_examples(settings.dataset, "train", limit, seed=settings.seed)
    train = [example for example in train if example["question"] not in held_out]
    return train[: settings.max_examples], test


def sft_rows(examples: list[dict]) -> list[dict]:
    """Examples as the prompt-completion rows `train_sft` takes: the question and the gold answer."""
    return [{"question": example["question"], "completion": example["answer"]} for example in examples]
