"""The one rule for a question longer than the model's context, in every recipe that reads questions.

A question is too long when its prompt (the question in the model's chat template, as the recipes
build it: `data.prompts.prompt_ids`) takes the whole context, `model_context` tokens or more, leaving
no room for a single answer token. Nothing good comes of such a row: sft cut it, grpo-mtl dropped it,
and the generating recipes (power-sampling, rft, eggroll) sized their caches for it, one 10 MB line
asking for terabytes, or the kernel's OOM killer taking a rank. The `too_long` setting says what to do:

- `refuse` (the default): the run is refused before launch, naming the file, the line, the question's
  length and the model's context;
- `skip`: those questions are left out (before `max_examples` and the held-out rows are taken), and
  the run records how many (`questions_too_long`).

The front end decides before launch for JSONL files (`launch.start_run`, through the recipe's check);
the ranks apply the same rule where they load the data (`held_out_split`, `evaluation_examples`), so a
skipped question is never loaded and a hub data set (not read before launch) is held to it too.
Generated tasks (tiny-math) are gpuscale's own short problems and are not measured.

Counting is cheap: a question of B UTF-8 bytes is at most B tokens (every tokenizer splits text into
pieces of at least one byte, byte-level BPE and SentencePiece's byte fallback alike), so one of at
most half the context in bytes fits whatever the template adds, and the tokenizer is only loaded for
a longer one; that one is measured on a prefix just long enough to decide, never whole (a 10 MB line
is not tokenized).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Literal

TooLong = Literal["refuse", "skip"]
TOO_LONG_ACTIONS: tuple[str, ...] = ("refuse", "skip")
# The characters of a question measured first for each token of context: about 4 characters make a
# token in English text, so 8 per token nearly always decides at once; the prefix grows if not.
CHARACTERS_PER_TOKEN_MEASURED = 8


class QuestionLimit:
    """The rule for one model: `admits(question, where)` is True for a question that fits, False
    for one to skip, and raises DataError (naming `where`) for one to refuse. `skipped` holds the
    places of those left out, each once."""

    def __init__(self, model: str, action: TooLong = "refuse", context: int | None = None, tokenizer=None):
        if action not in TOO_LONG_ACTIONS:
            raise ValueError(f"too_long: {action!r}: expected one of {', '.join(TOO_LONG_ACTIONS)}")
        from gpuscale.data.models import model_context

        self.model = model
        self.action = action
        self.context = context if context is not None else model_context(model)
        self._tokenizer = tokenizer
        self._tokenizer_loaded = tokenizer is not None
        self.skipped: list[str] = []

    def admits(self, question: str, where: str) -> bool:
        measured = self.prompt_tokens(question)
        if measured is None or measured[0] < self.context:
            return True
        if self.action == "skip":
            if where not in self.skipped:
                self.skipped.append(where)
            return False
        from gpuscale.data.data_error import DataError

        tokens, whole = measured
        raise DataError(f"{where}: the question is too long for the model: {len(question):,} characters, "
                        f"{tokens:,}{'' if whole else ' or more'} tokens as a prompt, and {self.model}'s context "
                        f"is {self.context:,} tokens (the prompt and its answer must fit); remove the line, or "
                        "set too_long=skip to leave such questions out")

    def prompt_tokens(self, question: str) -> tuple[int, bool] | None:
        """(tokens of the question's prompt, whether the whole question was measured) where it may
        not fit: once a prefix's count reaches the context, that count. None where the question
        surely fits, or the model's context is not known."""
        if self.context is None or len(question.encode("utf-8")) <= self.context // 2:
            return None
        tokenizer = self.tokenizer()
        if tokenizer is None:  # a random model has none: bytes are the most tokens it could be
            return len(question.encode("utf-8")), True
        from gpuscale.data.prompts import prompt_ids

        length = self.context * CHARACTERS_PER_TOKEN_MEASURED
        while True:
            with quiet_tokenizer():
                tokens = len(prompt_ids(tokenizer, question[:length]))
            if tokens >= self.context or length >= len(question):
                return tokens, length >= len(question)
            length *= 4

    def tokenizer(self):
        if not self._tokenizer_loaded:
            self._tokenizer, self._tokenizer_loaded = counting_tokenizer(self.model), True
        return self._tokenizer


def counting_tokenizer(model: str):
    """The model's tokenizer for counting prompt tokens. Where its tokenizer.json is on disk (a local
    directory, the embedded model, the hub's cache), PreTrainedTokenizerFast reads it with the chat
    template and special tokens of its tokenizer config: the same ids as the ranks' AutoTokenizer, in
    0.6 s and without torch where AutoTokenizer takes 3 s in the front end. Else that one."""
    from gpuscale.data.models import RANDOM_CONFIGS, TINY_MATH, load_tokenizer, model_path

    if model in RANDOM_CONFIGS:
        return None
    folder = model_path() if model == TINY_MATH else Path(model).expanduser()
    if not (folder / "tokenizer.json").is_file():
        folder = _cached_hub_folder(model)
    if folder is None:
        return load_tokenizer(model)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def _cached_hub_folder(model: str) -> Path | None:
    from gpuscale.data.models import looks_like_hub_id

    if not looks_like_hub_id(model):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = [try_to_load_from_cache(model, name) for name in ("tokenizer.json", "tokenizer_config.json")]
    return Path(found[0]).parent if all(isinstance(path, str) for path in found) else None


@contextlib.contextmanager
def quiet_tokenizer():
    """Measuring a question too long is the point here: no "Token indices sequence length is longer
    than the specified maximum" warning from transformers on the user's terminal."""
    logger = logging.getLogger("transformers.tokenization_utils_base")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def question_limit(settings) -> QuestionLimit:
    """The rule for a run: its model and its `too_long` setting."""
    return QuestionLimit(settings.model, getattr(settings, "too_long", "refuse"))


def questions_too_long(dataset: str, limit: QuestionLimit) -> list[str]:
    """Before launch: every file of a JSONL data set read under the rule. Refusing, the first
    question too long raises DataError ("dataset: FILE, line N: ..."); skipping, the places of
    those left out are returned. Named tasks read nothing here (see the module's docstring)."""
    from gpuscale.data.data_error import DataError
    from gpuscale.data.jsonl_files import read_jsonl
    from gpuscale.data.tasks import parse_dataset

    try:
        for path in parse_dataset(dataset).paths:
            read_jsonl(path, limit)
    except DataError as error:
        raise DataError(f"dataset: {error}") from None
    return list(limit.skipped)
