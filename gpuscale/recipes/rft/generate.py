"""RFT's generation phase on one rank: its share of the training questions answered k times each,
the answers filtered (filtering.py), the kept rows and the figures given back.

Two samplers behind one call, `sample(prompts) -> SampledCall`, the k answers per prompt on the host
(row i * k + j is answer j of prompt i):
- `EngineSampler`: gpuscale's generation engine; a call's k samples per question share one prefill,
  and the batch shape stays fixed (a short last batch is padded) so CUDA graphs are captured once;
- `TransformersSampler`: `model.generate(..., num_return_sequences=k)` on left-padded prompts, the
  users' earlier RFT script's structure (its homework/datagen.py, 8 questions at a time): the bench's baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gpuscale.data.seeds import derived_seed
from gpuscale.data.step_phases import FILTER, GENERATE
from gpuscale.engines.step_phases import phase
from gpuscale.recipes.rft.filtering import kept_answers, yield_by_domain
from gpuscale.recipes.shared.device_trials import release_memory
from gpuscale.runs.generations import GenerationLog, generation_record


@dataclass
class GenerationResult:
    """What a rank's generation produced: the kept rows (question, completion, domain, source, and
    `index`, the question's place in the training set), one record per question (domain, samples
    that were correct), and the counts behind the rates."""

    kept: list[dict] = field(default_factory=list)
    questions: list[dict] = field(default_factory=list)
    samples: int = 0
    correct: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_call_seconds: float = 0.0  # includes CUDA graph capture / compilation on a GPU
    first_call_samples: int = 0
    call_splits: list[dict[str, float]] = field(default_factory=list)  # `CallLaps.split` of each call


@dataclass
class SampledCall:
    """A call's answers on the host: `tokens` [rows, T] and `mask` [rows, T], True on an answer's tokens
    (its EOS included, nothing after it). Kept as tensors: a call's filtering works on the whole batch
    before any id becomes a Python int (a random model's ids are mostly beyond its stand-in tokenizer's
    vocabulary, and every id of a row was a Python int before: bench/rft_call_host.py)."""

    tokens: torch.Tensor
    mask: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    def sequences(self) -> list[list[int]]:
        from gpuscale.engines.generation.results import rows_of

        return rows_of(self.tokens, self.mask)

    def texts(self, tokenizer, eos: list[int]) -> list[str]:
        """data/scoring.py's `decode_completions` of the rows: their EOS and the ids beyond the tokenizer's
        vocabulary dropped (a random model's), here on the whole batch at once."""
        from gpuscale.data.scoring import texts_of
        from gpuscale.engines.generation.results import rows_of

        text_tokens = self.mask & ~_is_eos(self.tokens, eos) & (self.tokens < len(tokenizer))
        return texts_of(rows_of(self.tokens, text_tokens), tokenizer)

    def truncated(self, max_new_tokens: int, eos: list[int]) -> list[bool]:
        """Whether each row ran to max_new_tokens without ending at an EOS."""
        lengths = self.lengths()
        last = self.tokens.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
        return ((lengths >= max_new_tokens) & ~_is_eos(last, eos)).tolist()


def _is_eos(tokens: torch.Tensor, eos: list[int]) -> torch.Tensor:
    return torch.isin(tokens, torch.tensor(list(eos), dtype=tokens.dtype))


class CallLaps:
    """Host seconds of a generation call's pieces, each lap from the end of the one before."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, piece: str) -> None:
        now = time.perf_counter()
        self.seconds[piece] = now - self._last
        self._last = now

    def split(self, device_seconds: dict[str, float]) -> dict[str, float]:
        """The laps with the sampler's lap cut into the device's prefill and decode seconds (where the
        sampler measured them) and `results`, the rest of it: the engine's preparation on the host, the
        prefill's KV copied to each prompt's rows, the rows assembled and copied to the host."""
        split = dict(self.seconds)
        if device_seconds:
            sample = split.pop("sample")
            split = {"tokenize": split.pop("tokenize"), **device_seconds,
                     "results": sample - sum(device_seconds.values()), **split}
        return split


def questions_per_call(settings) -> int:
    """`batch_size` questions per call, fewer where max_rows_per_call (the users' earlier RFT
    script's MICRO_BATCH_SIZE) caps the sequences of one call."""
    if settings.max_rows_per_call is None:
        return settings.batch_size
    return max(1, min(settings.batch_size, settings.max_rows_per_call // settings.samples_per_question))


def generation_batches(settings, ctx, train: list[dict], model) -> list[list[tuple[int, dict]]]:
    """This rank's questions (with their index in the training set), cut into calls of
    `batch_size` questions (`auto`: sized for the card, `with_batch_size`)."""
    from gpuscale.recipes.shared.generation_batches import batched

    mine = ctx.shard(list(enumerate(train)))
    return batched(mine, questions_per_call(with_batch_size(settings, model, len(mine), ctx)))


def with_batch_size(settings, model, questions: int, ctx):
    """The settings with batch_size resolved where the user gave none: 8 questions on CPU ranks; on a
    GPU as many as fill gpu_memory_share (half by default) of the card's memory left once the model is
    loaded, each question's samples_per_question rows counted (at most 512 questions, at most this
    rank's). The rank's log says what was chosen and why."""
    if settings.batch_size is not None:
        return settings
    from gpuscale.engines.distributed import card_sized_batch
    from gpuscale.engines.generation import bytes_per_row
    from gpuscale.recipes.shared.generation_batches import PROMPT_COLUMNS

    columns = PROMPT_COLUMNS + settings.max_new_tokens
    per_question = settings.samples_per_question * bytes_per_row(model.config, model.dtype.itemsize, columns)
    size = card_sized_batch(ctx, per_question, questions, "question", settings.gpu_memory_share)
    return settings.model_copy(update={"batch_size": size})


def generate_kept_set(settings, ctx, loaded, batches, log) -> GenerationResult:
    """Answer every question of `batches` `samples_per_question` times and keep the filtered answers.
    `log(batch_number, **figures)` is called after each call (counts of that call, running figures)."""
    from gpuscale.data.prompts import prompts_ids
    from gpuscale.recipes.shared.results import RankResults

    sampler = make_sampler(settings, ctx, loaded, max((len(batch) for batch in batches), default=1))
    k = settings.samples_per_question
    result = GenerationResult()
    # Each call's kept rows go to the rank's results file at once: a run stopped (or lost) while
    # generating keeps its partial kept set in RUN_DIR/results.jsonl, which `data_from` can train on.
    saved = RankResults(ctx.run_dir, ctx.rank)
    generation_log = GenerationLog(ctx.run_dir) if ctx.is_main else None  # rank 0's own generations
    for number, batch in enumerate(batches, start=1):
        laps = CallLaps()
        with phase(GENERATE):  # the step phases of each call (engines/step_phases.py)
            prompts = prompts_ids(loaded.tokenizer, [example["question"] for _, example in batch])
            laps.lap("tokenize")
            sampled = sampler(prompts)
            laps.lap("sample")
            texts = sampled.texts(loaded.tokenizer, loaded.eos)
            laps.lap("texts")
        seconds = sum(laps.seconds.values())
        result.seconds += seconds
        if number == 1:
            result.first_call_seconds, result.first_call_samples = seconds, len(sampled)
        call_tokens = int(sampled.lengths().sum())
        result.tokens += call_tokens
        result.samples += len(sampled)
        with phase(FILTER):  # the answers scored and filtered, the kept ones and the generations written
            kept_before = len(result.kept)
            for position, (index, example) in enumerate(batch):
                _keep(result, index, example, texts[position * k : (position + 1) * k], settings)
            saved.add(result.kept[kept_before:])
            if generation_log is not None:
                truncated = sampled.truncated(settings.max_new_tokens, loaded.eos)
                generation_log.add(number, call_generations(number, batch, texts, truncated, settings))
        laps.lap("filter")
        result.call_splits.append(laps.split(sampler.device_seconds()))
        log(number, tokens=call_tokens, samples=len(sampled), sample_accuracy=result.correct / result.samples,
            **yield_by_domain(result.questions))
    del sampler
    release_memory(ctx.device)  # the KV cache and graphs go back before training allocates
    return result


def _keep(result: GenerationResult, index: int, example: dict, answers: list[str], settings) -> None:
    from gpuscale.data.rewards import correctness

    correct = sum(correctness(answer, example["answer"], mode="strict") for answer in answers)
    result.correct += int(correct)
    domain = example.get("domain") or "all"
    result.questions.append({"index": index, "domain": domain, "correct_samples": int(correct)})
    kept = kept_answers(answers, example["answer"], dedupe=settings.dedupe, keep=settings.keep_per_question,
                        include_gold=settings.include_gold)
    result.kept += [{"index": index, "question": example["question"], "completion": completion,
                     "domain": domain, "source": source} for completion, source in kept]


def call_generations(number: int, batch, texts: list[str], truncated: list[bool], settings) -> list[dict]:
    """A generation call's answers as generation records (runs/generations.py), step = the call's number: each
    question's k answers, their correctness, and whether one ran to max_new_tokens without ending."""
    from gpuscale.data.rewards import correctness

    k, records = settings.samples_per_question, []
    for position, (_, example) in enumerate(batch):
        for row in range(position * k, (position + 1) * k):
            score = correctness(texts[row], example["answer"], mode="strict")
            records.append(generation_record(number, example["question"], texts[row], phase="generate",
                                             domain=example.get("domain") or "all", correct=score == 1.0,
                                             rewards={"correctness": score}, truncated=truncated[row]))
    return records


# ---- samplers ------------------------------------------------------------------------------------


def make_sampler(settings, ctx, loaded, questions: int):
    if settings.generator == "transformers":
        return TransformersSampler(settings, ctx, loaded)
    return EngineSampler(settings, ctx, loaded, questions)


class EngineSampler:
    def __init__(self, settings, ctx, loaded, questions: int):
        from gpuscale.engines.generation import GenerationEngine, Sampling
        from gpuscale.engines.generation.call_marks import CallMarks

        self.engine = GenerationEngine(loaded.model, loaded.eos, pad_token_id=loaded.pad,
                                       compile=settings.compile and ctx.device.type == "cuda")
        self.engine.call_marks = CallMarks(ctx.device)  # each call's prefill and decode seconds
        self.sampling = Sampling(temperature=settings.temperature)
        sampling_seed = derived_seed(settings.seed, "sampling", ctx.rank)
        self.generator = torch.Generator(device=ctx.device).manual_seed(sampling_seed)
        self.questions, self.k, self.max_new_tokens = questions, settings.samples_per_question, settings.max_new_tokens

    def __call__(self, prompts: list[list[int]]) -> SampledCall:
        from gpuscale.recipes.shared.generation_batches import padded_to

        generation = self.engine.generate(padded_to(prompts, self.questions), self.max_new_tokens, self.sampling,
                                          self.generator, samples_per_prompt=self.k)
        rows = len(prompts) * self.k  # the padding's answers dropped
        return SampledCall(generation.tokens[:rows].cpu(), generation.mask[:rows].cpu())

    def device_seconds(self) -> dict[str, float]:
        """The last call's prefill and decode on the device (read after its answers reached the host)."""
        return self.engine.call_marks.seconds()


class TransformersSampler:
    """The users' earlier RFT script's structure: left-padded prompts, `model.generate` with sampling and
    `num_return_sequences`, plain multinomial sampling at the temperature (no top-k/top-p, as the
    engine samples)."""

    def __init__(self, settings, ctx, loaded):
        self.model, self.eos, self.pad = loaded.model, loaded.eos, loaded.pad
        self.settings, self.device = settings, ctx.device
        torch.manual_seed(derived_seed(settings.seed, "sampling", ctx.rank))

    def __call__(self, prompts: list[list[int]]) -> SampledCall:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        s = self.settings
        with torch.no_grad():
            output = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=s.temperature,
                top_k=0, top_p=1.0, num_return_sequences=s.samples_per_question, max_new_tokens=s.max_new_tokens,
                eos_token_id=self.eos, pad_token_id=self.pad)
        tokens = output[:, width:].cpu()
        # A row ends at its first EOS: generate() pads the rows that ended before the others.
        ends = _is_eos(tokens, self.eos).long()
        return SampledCall(tokens, ends.cumsum(dim=1) - ends == 0)

    def device_seconds(self) -> dict[str, float]:
        return {}  # generate() is one piece here: its prefill is not told apart
