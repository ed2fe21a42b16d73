"""GSM8K from the Hugging Face hub (`--dataset gsm8k`): `openai/gsm8k` (config `main`) through
`datasets`, an optional dependency imported only when a run loads it; every failure is one DataError
line that says to pass a local JSONL file instead."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from gpuscale.data.data_error import DataError

if TYPE_CHECKING:
    from gpuscale.data.question_length import QuestionLimit

GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_CONFIG = "main"
GSM8K_DOMAIN = "gsm8k"
GSM8K_TRAIN_SIZE = 7473  # rows of openai/gsm8k main/train


def datasets_module():
    if importlib.util.find_spec("datasets") is None:
        raise DataError(
            "gsm8k from the hub needs the 'datasets' package (pip install 'gpuscale[hub]'); "
            "or pass a local .jsonl file with 'question' and 'answer' fields"
        )
    import datasets

    return datasets


def hub_rows(split: str, question_limit: QuestionLimit | None) -> list[dict]:
    rows = _load_gsm8k_from_hub(split)
    if question_limit is None:
        return rows
    places = [f"{GSM8K_HUB_ID} {split}, row {number}" for number in range(1, len(rows) + 1)]
    kept = question_limit.admitted([row["question"] for row in rows], places, what=f"{GSM8K_HUB_ID} {split}")
    return [row for row, keep in zip(rows, kept) if keep]


def _load_gsm8k_from_hub(split: str) -> list[dict]:
    datasets = datasets_module()
    try:
        rows = datasets.load_dataset(GSM8K_HUB_ID, GSM8K_CONFIG, split=split)
    except Exception as error:  # offline, no cache, hub down, auth: all end the same way for the user
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise DataError(
            f"could not load {GSM8K_HUB_ID} ({GSM8K_CONFIG}/{split}) from the Hugging Face hub: {reason}; "
            f"pass a local .jsonl file with 'question' and 'answer' fields instead"
        ) from None
    return [{"question": row["question"], "answer": row["answer"], "domain": GSM8K_DOMAIN} for row in rows]

