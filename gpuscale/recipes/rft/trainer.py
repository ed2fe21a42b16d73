"""A rank's whole RFT run: evaluate the base model, generate (or reuse) the kept set, train on it
with recipes/shared/training.py's `train_sft`, save the trained model, evaluate again.

One step count runs through the phases (the front ends show progress from one counter and one
total): `PhasedReporter` shifts each phase's steps past the previous phase's and adds the `phase`
figure to every record. The total is announced once, at the start, and never changes (one that grew
when the trainer announced its steps sent the progress back from 100% to 31%): the training phase
gets as many steps of it as the most optimizer steps the kept set can take, known before it is
generated, and the trainer's own steps are scaled into them.
"""

from __future__ import annotations

import math
import time

from gpuscale.recipes.rft import Settings, training_settings
from gpuscale.recipes.rft.data import (
    GENERATED_FILE,
    generated_set_path,
    read_generated,
    read_generation_figures,
    write_generated,
)
from gpuscale.runs import heartbeat

BASE_EVALUATION, GENERATE, TRAIN, FINAL_EVALUATION = 0, 1, 2, 3


class PhasedReporter:
    """The rank's Reporter as each phase sees it. `spans` are the run's steps of each phase, in order;
    their sum, the run's total, is announced at once. A phase logs its steps from 1; they land after
    the spans of the phases before, scaled into the phase's own span where the phase says it has
    another number of steps (`total(n)`, as the trainer does when it starts)."""

    def __init__(self, reporter, spans: dict[int, int]):
        self.reporter, self.spans = reporter, spans
        self.phase, self.offset, self.scale = BASE_EVALUATION, 0, 1.0
        reporter.total(sum(spans.values()))

    def start(self, phase: int) -> PhasedReporter:
        self.phase, self.scale = phase, 1.0
        self.offset = sum(span for earlier, span in self.spans.items() if earlier < phase)
        self.reporter.log(step=self.offset, phase=phase)
        # Until the phase's first step the rank builds what the phase runs on (the engine and its compiled
        # step, the SFT trainer and its data): minutes at a real size with nothing to log. As loading, the
        # hang watch gives that the phases' allowance, not a step's, which generation's steps had set.
        self.beat(heartbeat.LOADING)
        return self

    def log(self, step: int, **figures) -> None:
        self.reporter.log(step=self.run_step(step), phase=self.phase, **figures)

    def beat(self, phase: str, step: int | None = None) -> None:
        """The rank's heartbeat (engines/reporter.py; the TRL bridge's callbacks call it), a step of the
        phase counted as `log` counts it."""
        self.reporter.beat(phase, None if step is None else self.run_step(step))

    def run_step(self, step: int) -> int:
        """The run's step of the phase's `step`: after the earlier phases' spans, scaled into its own."""
        return self.offset + min(round(int(step) * self.scale), self.spans[self.phase])

    def summary(self, figures: dict, partial: bool = False) -> None:
        """The rank's summary, as the Reporter writes it (the trainer's resume check writes there)."""
        self.reporter.summary(figures, partial=partial)

    def total(self, steps: int) -> None:
        """The phase's own step count: its steps are scaled to its span (the run's total stays)."""
        if steps > 0:
            self.scale = self.spans[self.phase] / steps


def most_training_steps(settings: Settings, rows: int, world_size: int) -> int:
    """The optimizer steps a fine-tune on `rows` examples takes, as transformers' Trainer counts them
    (each rank's share of the rows in micro-batches, as many of them a step as make up the rank's
    share of rows_per_step, `epochs` passes), or `max_steps`. A `train_batch_size` left auto counts as
    one micro-batch a step here: the card's split is not known yet, and changes the count by at most
    a rounding."""
    if settings.max_steps:
        return settings.max_steps
    step_rows = training_settings(settings).check_micro_batch(world_size, settings.train_batch_size, "train_batch_size")
    micro = settings.train_batch_size or step_rows
    micro_batches = math.ceil(math.ceil(rows / world_size) / micro)
    return max(1, math.ceil(settings.epochs * max(micro_batches // (step_rows // micro), 1)))


def most_kept_rows(settings: Settings, questions: int) -> int:
    """The most examples generation can keep: every question's answers kept up to keep_per_question
    (0: all samples), and its gold answer with include_gold."""
    kept = settings.keep_per_question or settings.samples_per_question
    return questions * (kept + int(settings.include_gold))


def run_rft(settings: Settings, ctx, reporter) -> None:
    from gpuscale.recipes.rft.generate import generation_batches
    from gpuscale.recipes.shared.evaluation import save_then_evaluate
    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.summary import summary_opening
    from gpuscale.recipes.shared.training import train_sft
    from gpuscale.recipes.shared.training_data import training_and_eval_examples

    train, held_out = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    batches = [] if settings.data_from else generation_batches(settings, ctx, train, loaded.model)
    kept = kept_rows_from(settings.data_from, held_out) if settings.data_from else None
    rows_at_most = len(kept[0]) if kept else most_kept_rows(settings, len(train))
    # Every rank announces the same total: its questions' share may take one call more or less.
    phases = PhasedReporter(reporter, {BASE_EVALUATION: 1, GENERATE: max(ctx.gather(len(batches))),
                                       TRAIN: most_training_steps(settings, rows_at_most, ctx.world_size),
                                       FINAL_EVALUATION: 1})

    phases.start(BASE_EVALUATION)
    before = evaluate(loaded.model, loaded.tokenizer, held_out, settings, ctx, "before")
    phases.log(1, **headline(before, "before"))
    # Its train_examples are the kept answers, known once generated (`trained_on`).
    summary = {**summary_opening(ctx, settings, held_out=held_out), "generator": settings.generator,
               **({} if settings.data_from else {"generation_questions": len(train)}), **before}
    if ctx.is_main:
        reporter.summary(summary, partial=True)

    phases.start(GENERATE)
    rows, generation = kept or generate_phase(settings, ctx, loaded, batches, phases)
    summary.update(generation, **trained_on(rows), generated_set=str(ctx.run_dir / GENERATED_FILE)
                   if not settings.data_from else generation["data_from"])
    if ctx.is_main:
        reporter.summary(summary, partial=True)

    phases.start(TRAIN)  # the trainer announces its steps when it starts: scaled into the phase's span
    trained = train_sft(rows, training_settings(settings), ctx, phases, model=loaded.model, tokenizer=loaded.tokenizer)
    trained.figures = rft_training_figures(trained.figures)

    def final_evaluation() -> dict:
        phases.start(FINAL_EVALUATION)
        after = evaluate(trained.model, loaded.tokenizer, held_out, settings, ctx, "after")
        phases.log(1, **headline(after, "after"))
        return {**after, **gains(before, after)}

    save_then_evaluate(trained, loaded.tokenizer, ctx, settings, reporter, summary, final_evaluation)


def kept_rows_from(data_from: str, held_out: list[dict]) -> tuple[list[dict], dict]:
    """An earlier run's kept set (`data_from`) and its generation's figures. The set may hold questions
    this run scores (another eval_split or eval_examples): they are not trained on."""
    path = generated_set_path(data_from)
    scored = {example["question"] for example in held_out}
    every_row = read_generated(path)
    rows = [row for row in every_row if row["question"] not in scored]
    if not rows:
        raise RuntimeError(f"data_from: every row of {path} is a question this run scores: nothing to train on")
    return rows, {"kept_examples": len(rows), **read_generation_figures(path), "data_from": str(path),
                  "held_out_rows_dropped": len(every_row) - len(rows)}


def trained_on(rows: list[dict]) -> dict:
    """What the fine-tune trains on: the kept examples (a data_from set's, those it scores left out)
    and the questions they answer; not the questions generated for, which may be many more."""
    return {"train_examples": len(rows), "train_questions": len({row["question"] for row in rows})}


def generate_phase(settings: Settings, ctx, loaded, batches, phases: PhasedReporter) -> tuple[list[dict], dict]:
    """Every rank generates its share; the kept rows and the per-question records are gathered on
    every rank (each trains on the whole set); rank 0 writes them to the run folder. Returns the
    rows and the generation's figures."""
    from gpuscale.recipes.rft.filtering import yield_by_domain
    from gpuscale.recipes.rft.generate import generate_kept_set

    started = time.perf_counter()
    mine = generate_kept_set(settings, ctx, loaded, batches, phases.log)
    wall = time.perf_counter() - started
    everyone = ctx.gather({"kept": mine.kept, "questions": mine.questions, "samples": mine.samples,
                           "correct": mine.correct, "tokens": mine.tokens, "seconds": mine.seconds,
                           "first": mine.first_call_seconds, "first_samples": mine.first_call_samples,
                           "wall": wall, "call_splits": mine.call_splits})
    rows = sorted((row for rank in everyone for row in rank["kept"]), key=lambda row: row["index"])
    questions = [question for rank in everyone for question in rank["questions"]]
    samples, tokens = sum(r["samples"] for r in everyone), sum(r["tokens"] for r in everyone)
    seconds = max(r["seconds"] for r in everyone)  # the slowest rank sets the phase's time
    steady = max(r["seconds"] - r["first"] for r in everyone)
    steady_samples = samples - sum(r["first_samples"] for r in everyone)
    figures = {
        "generation_questions": len(questions),
        "samples_per_question": settings.samples_per_question, "temperature": settings.temperature,
        "generated_samples": samples, "sample_accuracy": sum(r["correct"] for r in everyone) / max(1, samples),
        **yield_by_domain(questions), "kept_examples": len(rows),
        "kept_samples": sum(row["source"] == "sample" for row in rows),
        "generation_seconds": seconds, "generation_wall_seconds": max(r["wall"] for r in everyone),
        "samples_per_s": samples / seconds if seconds > 0 else None,
        "generated_tokens_per_s": tokens / seconds if seconds > 0 else None,
        # Without each rank's first call (CUDA graph capture, compilation): the rate that scales.
        "samples_per_s_steady": steady_samples / steady if steady > 0 else None,
        **call_split_figures([rank["call_splits"] for rank in everyone]),
    }
    if ctx.is_main:
        write_generated(ctx.run_dir, [{key: row[key] for key in ("question", "completion", "domain", "source")}
                                      for row in rows], figures)
    if not rows:
        raise RuntimeError("no sampled answer was correct: nothing to train on (raise samples_per_question "
                           "or max_new_tokens, or include_gold=true)")
    return rows, figures


def call_split_figures(splits_by_rank: list[list[dict[str, float]]]) -> dict[str, float]:
    """Where a generation call's seconds go (generate.py's `CallLaps.split`: tokenize, prefill, decode,
    results, texts, filter), as `generation_call_<piece>_seconds`: the mean over every rank's calls but its
    first (which captures graphs and compiles), and `generation_first_call_<piece>_seconds` over the first
    calls. Empty where no call was made."""
    figures = {}
    for name, calls in (("generation_first_call", [splits[0] for splits in splits_by_rank if splits]),
                        ("generation_call", [split for splits in splits_by_rank for split in splits[1:]])):
        for piece in calls[0] if calls else ():
            figures[f"{name}_{piece}_seconds"] = sum(call[piece] for call in calls) / len(calls)
    return figures


def evaluate(model, tokenizer, test: list[dict], settings: Settings, ctx, when: str) -> dict:
    """Greedy and temperature-1 accuracy, overall and per domain, strict answers:
    `accuracy_greedy[_<domain>]_<when>` and `accuracy_sampled[_<domain>]_<when>`."""
    from gpuscale.recipes.shared.evaluation import held_out_evaluation

    return held_out_evaluation(model, tokenizer, test, ctx, when, max_new_tokens=settings.max_new_tokens,
                               memory_share=settings.gpu_memory_share, seed=settings.seed,
                               batch_size=settings.eval_batch_size)


def rft_training_figures(figures: dict) -> dict:
    """The training shell's figures, its samples/s renamed: `samples_per_s` is the generation's here."""
    renamed = {"samples_per_s": "train_samples_per_s"}
    return {renamed.get(name, name): value for name, value in figures.items()}


def headline(figures: dict, when: str) -> dict:
    """The two overall accuracies only, for the monitor (the per-domain ones go to the summary)."""
    return {name: figures[name] for name in (f"accuracy_greedy_{when}", f"accuracy_sampled_{when}")}


def gains(before: dict, after: dict) -> dict:
    """after - before for the two headline accuracies, in points."""
    out = {}
    for kind in ("greedy", "sampled"):
        a, b = before.get(f"accuracy_{kind}_before"), after.get(f"accuracy_{kind}_after")
        out[f"accuracy_{kind}_gain_points"] = 100 * (b - a) if a is not None and b is not None else None
    return out
