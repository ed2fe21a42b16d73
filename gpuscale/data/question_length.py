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

Counting is cheap: a text of B UTF-8 bytes is at most B tokens (every tokenizer splits text into
pieces of at least one byte, byte-level BPE and SentencePiece's byte fallback alike; bytes, not
characters, since one character may be several tokens). So a question of at most half the context in
bytes fits whatever the template adds, and the tokenizer is only loaded for a longer one; then a
prompt whose text (the template rendered) has fewer bytes than the context has tokens fits too, and
only the rest is tokenized, a batch of them in one call of the tokenizer, each on a prefix just long
enough to decide, never whole (a 10 MB line is not tokenized). A check that takes over a second says
how far it got (`CheckProgress`): GSM8K's 7,473 training questions against a small context are
thousands to tokenize.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path
from typing import Literal

TooLong = Literal["refuse", "skip"]
TOO_LONG_ACTIONS: tuple[str, ...] = ("refuse", "skip")
# Questions that may not fit, measured in one call of the tokenizer: big enough that the call's own cost
# vanishes, small enough that a refused file stops soon after its first question too long, and that
# the progress line moves.
MEASURED_AT_ONCE = 256
# Each question measured in this process, by (model, context): the front end reads a file several times
# before launch (the question check, the count of training rows, the held-out split).
MEASURED: dict[tuple[str, int], dict[str, tuple[int, bool] | None]] = {}
# What a long check says while it works: the CLI writes it to stderr (app/cli.py); left unconfigured
# (the TUI, a rank) its INFO lines go nowhere.
PROGRESS = logging.getLogger("gpuscale.progress")
PROGRESS_AFTER_ENV = "GPUSCALE_PROGRESS_AFTER_S"
PROGRESS_AFTER_S = 1.0  # a check that takes longer than this says how far it got ...
PROGRESS_EVERY_S = 2.0  # ... at most this often
# The characters of a question measured first for each token of context: about 4 characters make a
# token in English text, so 8 per token nearly always decides at once; the prefix grows if not.
CHARACTERS_PER_TOKEN_MEASURED = 8


class QuestionLimit:
    """The rule for one model: `admits(question, where)` is True for a question that fits, False
    for one to skip, and raises DataError (naming `where`) for one to refuse; `admitted` decides a
    list at once. `skipped` holds the places of those left out, each once."""

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
        return self.admitted([question], [where])[0]

    def admitted(self, questions: list[str], wheres: list[str], what: str = "") -> list[bool]:
        """`admits` for each question in order, the ones that may not fit measured in batches
        (`MEASURED_AT_ONCE`); refusing, the first too long (in order) raises. A check that takes over
        `progress_after_s()` says how far it got on the `PROGRESS` logger (the CLI writes it to
        stderr), `what` naming what is read."""
        kept = [True] * len(questions)
        unsure = [index for index, question in enumerate(questions) if self.may_not_fit(question)]
        progress = CheckProgress(f"{what + ': ' if what else ''}question lengths for {self.model}'s context of "
                                 f"{self.context:,} tokens", len(unsure))
        for start in range(0, len(unsure), MEASURED_AT_ONCE):
            batch = unsure[start:start + MEASURED_AT_ONCE]
            for index, measured in zip(batch, self.measure([questions[index] for index in batch])):
                if measured is not None and measured[0] >= self.context:
                    kept[index] = self.too_long(questions[index], wheres[index], measured)
            progress.done(start + len(batch))
        progress.finish()
        return kept

    def may_not_fit(self, question: str) -> bool:
        """Whether a question may be too long: not where the context is unknown, nor for one of at most
        half the context in bytes (see the module's docstring), decided without a tokenizer."""
        return self.context is not None and len(question.encode("utf-8")) > self.context // 2

    def too_long(self, question: str, where: str, measured: tuple[int, bool]) -> bool:
        """False (left out) with too_long=skip; else DataError naming the place, the length and the context."""
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
        """`measure` of one question, where it may not fit (`may_not_fit`); None where it surely fits."""
        return self.measure([question])[0] if self.may_not_fit(question) else None

    def measure(self, questions: list[str]) -> list[tuple[int, bool] | None]:
        """For each question: (tokens of its prompt, whether the whole question was measured), or None
        where its prompt surely fits. A prompt is measured on a prefix of the question just long enough
        to decide (`CHARACTERS_PER_TOKEN_MEASURED` a token of context, four times longer until it
        decides): once a prefix's count reaches the context, that count. Each question is measured once
        a process for a model (`MEASURED`): the checks before launch read a file several times."""
        known = MEASURED.setdefault((self.model, self.context), {})
        pending = list(dict.fromkeys(question for question in questions if question not in known))
        tokenizer = self.tokenizer() if pending else None
        if pending and tokenizer is None:  # a random model has none: bytes are the most tokens it could be
            return [(len(question.encode("utf-8")), True) for question in questions]
        length = self.context * CHARACTERS_PER_TOKEN_MEASURED
        while pending:
            prefixes = [question[:length] for question in pending]
            for question, measured in zip(pending, self.measure_prefixes(tokenizer, prefixes)):
                whole = length >= len(question)
                if measured is None and whole:
                    known[question] = None
                elif measured is not None and (measured[0] >= self.context or whole):
                    known[question] = (measured[0], whole)
            pending = [question for question in pending if question not in known]
            length *= 4
        return [known[question] for question in questions]

    def measure_prefixes(self, tokenizer, prefixes: list[str]) -> list[tuple[int, bool] | None]:
        """The prompt tokens of each prefix (its whole flag left to `measure`), or None where its prompt
        text has fewer bytes than the context has tokens: every token is at least one byte of the text
        (byte-level BPE and SentencePiece's byte fallback alike; a character may be several), so that
        prompt fits uncounted. The others are counted in one call of the tokenizer on the list."""
        from gpuscale.data.prompts import prompt_lengths, prompt_texts, tokens_added

        with quiet_tokenizer():
            texts = prompt_texts(tokenizer, prefixes)
            room = self.context - tokens_added(tokenizer)
            counted = [index for index, text in enumerate(texts) if len(text.encode("utf-8")) >= room]
            lengths = dict(zip(counted, prompt_lengths(tokenizer, [texts[index] for index in counted])))
        return [(lengths[index], False) if index in lengths else None for index in range(len(prefixes))]

    def tokenizer(self):
        if not self._tokenizer_loaded:
            self._tokenizer, self._tokenizer_loaded = counting_tokenizer(self.model), True
        return self._tokenizer


class CheckProgress:
    """Progress lines of a check of `total` items on the `PROGRESS` logger, once it has taken over
    `progress_after_s()` with items left: then at most every PROGRESS_EVERY_S, and a last line when
    it is done (none for a check done in one go: a small file's says nothing)."""

    def __init__(self, what: str, total: int):
        self.what, self.total = what, total
        self.started = time.monotonic()
        self.after = progress_after_s()
        self.said_at: float | None = None

    def done(self, count: int) -> None:
        now = time.monotonic()
        if count >= self.total:  # nothing left: `finish` says so where a line was written
            return
        if now - self.started < self.after or (self.said_at is not None and now - self.said_at < PROGRESS_EVERY_S):
            return
        self.said_at = now
        PROGRESS.info(f"checking {self.what}: {count:,} of {self.total:,} measured, {now - self.started:.1f} s")

    def finish(self) -> None:
        if self.said_at is not None:
            PROGRESS.info(f"checked {self.what}: {self.total:,} measured in {time.monotonic() - self.started:.1f} s")


def progress_after_s(environ=os.environ) -> float:
    """PROGRESS_AFTER_S, or GPUSCALE_PROGRESS_AFTER_S's seconds (0: a line for every check)."""
    text = environ.get(PROGRESS_AFTER_ENV, "").strip()
    if not text:
        return PROGRESS_AFTER_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # NaN too
        from gpuscale.data.data_error import DataError

        raise DataError(f"{PROGRESS_AFTER_ENV}: {text!r}: expected seconds, 0 or more")
    return seconds


@functools.lru_cache(maxsize=4)  # loaded once a process for each of the last models checked
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
