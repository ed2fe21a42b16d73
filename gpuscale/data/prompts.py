"""Turning a question into the model's prompt, and knowing where its answer ends.

The prompt format lives with the model (the tokenizer's chat template), as Hugging Face tools expect;
a tokenizer without one gets the bare question and a newline.
"""

from __future__ import annotations


def prompt_ids(tokenizer, question: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding, 4.x a plain list.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return tokenizer(question + "\n", add_special_tokens=True)["input_ids"]


def prompt_texts(tokenizer, questions: list[str]) -> list[str]:
    """The text `prompt_ids` encodes for each question, the chat template rendered for all of them in
    one call; `prompt_lengths` counts their tokens."""
    if not questions:
        return []
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([[{"role": "user", "content": question}] for question in questions],
                                                  tokenize=False, add_generation_prompt=True))
    return [question + "\n" for question in questions]


def prompts_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """`prompt_ids` of each question, the template rendered and the texts encoded in one call each
    (`prompt_lengths`' encoding): one jinja rendering and one Rust batch instead of both per question."""
    if not questions:
        return []
    specials = not getattr(tokenizer, "chat_template", None)
    encoded = tokenizer(prompt_texts(tokenizer, questions), add_special_tokens=specials)
    return [list(ids) for ids in encoded["input_ids"]]


def tokens_added(tokenizer) -> int:
    """The tokens `prompt_ids` adds to its text's own: none with a chat template (the template writes
    them), else the tokenizer's special tokens (a BOS, an EOS)."""
    return 0 if getattr(tokenizer, "chat_template", None) else tokenizer.num_special_tokens_to_add()


def prompt_lengths(tokenizer, texts: list[str]) -> list[int]:
    """len(prompt_ids(...)) of each of `prompt_texts`' texts, the tokenizer called once on the list
    (a fast tokenizer encodes a batch in parallel, in Rust)."""
    if not texts:
        return []
    specials = not getattr(tokenizer, "chat_template", None)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=specials)["input_ids"]]


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends an answer: the generation config's (one or several) and the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def pad_token_id(tokenizer, eos_ids: list[int]) -> int:
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return eos_ids[0] if eos_ids else 0
