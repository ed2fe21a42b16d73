"""Scoring a recipe's completions against the gold answers, and accuracy overall and per domain.

Shared by every recipe that samples answers (power sampling, evaluation before and after training):
one result row per completion, the same fields everywhere, so results.jsonl files can be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gpuscale.data.answers import extract_answer, is_correct
from gpuscale.data.tasks import gold_answer


def decode_completion(tokens: list[int], tokenizer, eos: list[int]) -> str:
    """The completion's text, without its end-of-sequence tokens. A random model's ids can lie
    beyond its stand-in tokenizer's vocabulary: those are dropped too."""
    known = len(tokenizer)
    return tokenizer.decode([t for t in tokens if t not in eos and t < known], skip_special_tokens=True)


def decode_completions(rows: list[list[int]], tokenizer, eos: list[int]) -> list[str]:
    """`decode_completion` for many rows in one call (a fast tokenizer decodes them in parallel)."""
    known, ends = len(tokenizer), set(eos)
    return texts_of([[t for t in tokens if t not in ends and t < known] for tokens in rows], tokenizer)


def texts_of(rows: list[list[int]], tokenizer) -> list[str]:
    """`tokenizer.batch_decode(rows, skip_special_tokens=True)`, in one call of the Rust tokenizer where
    that gives the same texts: a fast tokenizer that neither overrides the decoding nor cleans up spaces
    after it. transformers 5's batch_decode decodes row by row in Python and first walks every id
    (`to_py_obj`): at 3,840 rows of 128 tokens (rft's generation call) that took 2 to 3 times the
    Rust batch's time (bench/rft_call_host.py)."""
    if _decodes_as_its_backend(tokenizer):
        return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=True)
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def _decodes_as_its_backend(tokenizer) -> bool:
    """Whether the tokenizer's `_decode` is its fast base class's own, with the space clean-up off: then a
    row's text is its backend tokenizer's `decode` of the row, nothing more."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    fast_bases = [cls for cls in type(tokenizer).__mro__ if cls.__name__ in _FAST_BASES]
    return bool(fast_bases) and type(tokenizer)._decode is fast_bases[0]._decode


# transformers' fast tokenizer base class: TokenizersBackend in 5.x, PreTrainedTokenizerFast in 4.x.
_FAST_BASES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def score_completion(index: int, chain: int, example: Mapping, tokens: list[int], tokenizer, eos: list[int],
                     answer_mode: str = "auto") -> dict:
    """One result row: which problem (`index`) and which sample of it (`chain`), its domain, the gold
    answer, the completion (text and token ids), the answer extracted with `answer_mode`, and whether
    it is correct."""
    text = decode_completion(tokens, tokenizer, eos)
    gold = gold_answer(dict(example))
    return {
        "index": index, "chain": chain, "domain": example.get("domain"), "question": example["question"],
        "gold": gold, "completion": text, "token_ids": tokens, "tokens": len(tokens),
        "extracted": extract_answer(text, answer_mode),
        "correct": is_correct(text, gold, mode=answer_mode),
        # tiny-math's mark (data/near_duplicates.py); None for data that has none.
        "structurally_new": example.get("structurally_new"),
    }


# The one answer-extraction rule of every recipe's held-out accuracy (recipes/shared/evaluation.py's
# `held_out_evaluation`): strict, the `#### N` line the training data teaches (lm-eval's strict-match).
# A lenient rule (the last number in the text) also credits an answer the model never stated as its
# answer, a number it rambled past, which would let one recipe's figure gain on another's by its
# extraction alone; the same figure name must mean the same count everywhere.
HELD_OUT_ANSWER_MODE = "strict"

# The held-out rows' subset no training or pretraining problem equals up to names and nouns:
# `accuracy_new` (data/near_duplicates.py), named `accuracy_<greedy|sampled>_new_<when>` in a summary.
NEW_SUBSET = "new"
NO_NEW_SUBSET = ("only tiny-math marks its held-out problems structurally new (no training or pretraining problem "
                 "equal to one up to names and nouns)")


def held_out_figures(rows: Iterable[Mapping]) -> dict[str, float | None]:
    """`accuracy_by_domain`, and `accuracy_new` over the rows marked `structurally_new` where the
    rows carry the mark (None if none of them is new)."""
    rows = list(rows)
    figures = accuracy_by_domain(rows)
    if rows and all(row.get("structurally_new") is not None for row in rows):
        new = [row for row in rows if row["structurally_new"]]
        figures[f"accuracy_{NEW_SUBSET}"] = sum(bool(row["correct"]) for row in new) / len(new) if new else None
    return figures


def new_subset_size(examples: list[Mapping]) -> dict[str, int | str | None]:
    """The summary's `eval_examples_new`, how many held-out problems are structurally new; for data
    without the mark, None and `structurally_new_unavailable` saying why. Nothing without examples."""
    if not examples:
        return {}
    if all(example.get("structurally_new") is not None for example in examples):
        return {"eval_examples_new": sum(bool(example["structurally_new"]) for example in examples)}
    return {"eval_examples_new": None, "structurally_new_unavailable": NO_NEW_SUBSET}


def accuracy_by_domain(rows: Iterable[Mapping]) -> dict[str, float | None]:
    """`accuracy` over all rows (each with `correct`), and `accuracy_<domain>` for every domain the
    rows carry (sorted by name; rows without a domain count only in the overall figure). With no
    rows the accuracy is None: there is nothing to measure, which is not the same as 0."""
    return share_by_domain(rows, "accuracy", lambda row: bool(row["correct"]))


def share_by_domain(items: Iterable[Mapping], name: str, counts: Callable[[Mapping], bool]) -> dict[str, float | None]:
    """`name`: the share of items for which `counts(item)` holds, and `name_<domain>` for every domain
    the items carry (sorted; items without a domain count only overall). None where there are no items."""
    items = list(items)

    def share(chosen: list[Mapping]) -> float | None:
        return sum(bool(counts(item)) for item in chosen) / len(chosen) if chosen else None

    figures = {name: share(items)}
    for domain in sorted({item["domain"] for item in items if item.get("domain")}):
        figures[f"{name}_{domain}"] = share([item for item in items if item.get("domain") == domain])
    return figures
