"""A rank's share cut into generation batches (`batched`), a short last batch kept at the full batch
shape (`padded_to`), and the prompt's cache columns a card-sized batch budgets (`PROMPT_COLUMNS`)."""

from __future__ import annotations

# Cache columns a problem's prompt is budgeted in a card-sized generation batch (tiny-math's prompts take
# about 60 tokens, GSM8K's under 300).
PROMPT_COLUMNS = 512


def batched(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def padded_to(rows: list, count: int) -> list:
    """A short last batch filled up with copies of its last row (whose outputs the caller drops):
    CUDA graphs and compiled code are made for one batch shape, and a new shape would cost a new
    capture or compilation."""
    return rows + [rows[-1]] * (count - len(rows)) if rows and len(rows) < count else rows
