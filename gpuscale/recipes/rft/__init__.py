"""rft: rejection-sampling fine-tuning (Yuan et al. 2023; as the users' earlier RFT script ran it) in one run.

1. Generate. Each training question is answered `samples_per_question` times at `temperature`,
   `batch_size` questions per engine call, their k samples sharing one prefill (generation engine:
   CUDA graphs on GPU); the questions are sharded over the ranks. The answers the strict checker
   marks correct are kept, duplicates dropped (normalized text, or Yuan et al.'s distinct equation
   lists), at most `keep_per_question` each, the gold answer added with `include_gold`. The kept set
   is gathered and written to RUN_DIR/generated.jsonl (question, completion, domain, source), the
   yield (share of questions with a correct answer, per domain) to RUN_DIR/generation.json.
   `data_from=RUN_ID` (or a path to such a file) skips this and trains on an earlier run's set.
   `generator=transformers` generates with `model.generate` and `num_return_sequences`, as the
   seed did: the baseline the bench compares with.
2. Train. Every rank fine-tunes on the whole kept set with recipes/shared/training.py's `train_sft` (TRL
   SFTTrainer, DDP under `accelerate launch`, full or LoRA, merged after); the trained model goes to
   RUN_DIR/model before the final evaluation.
3. Evaluate. Greedy and temperature-1 accuracy per domain on `eval_examples` held-out problems,
   before generation and after training: the test split's, or with `eval_split=validation` the first
   problems of the training data, taken out of the questions generated for (for choosing settings;
   the summary's `eval_split` says which). A `data_from` set's rows of scored questions are dropped.

The monitor shows the phase as the figure `phase` (0 = base evaluation, 1 = generate, 2 = train,
3 = final evaluation) and one step count over the whole run (generation batches, then optimizer
steps).

Files: this one (settings and the recipe, no torch), filtering.py (what is kept), generate.py (the
generation phase), trainer.py (a rank's whole run), trial.py (its tuning trial: generation calls).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpuscale.data.paths import absolute_path
from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.recipes.shared.device_defaults import device_default
from gpuscale.recipes.shared.training_settings import TRAINING_FIGURE_NOTES, SupervisedSettings
from gpuscale.runs.settings import auto_means_sized_on_card

GPU_SAMPLES, CPU_SAMPLES = 16, 4
GPU_EPOCHS, CPU_EPOCHS = 9.0, 2.0


class Settings(SupervisedSettings):
    # The knob names of the users' earlier RFT script (its homework/datagen.py): `oversample`,
    # `MICRO_BATCH_SIZE` (sequences per generate call).
    KEY_ALIASES = {**SupervisedSettings.KEY_ALIASES, "oversample": "samples_per_question",
                   "k": "samples_per_question", "micro_batch_size": "max_rows_per_call",
                   "per_device_train_batch_size": "train_batch_size"}
    ENV_ALIASES = {"MICRO_BATCH_SIZE": "max_rows_per_call"}

    batch_size: int | None = Field(
        None, ge=1, description="training questions per generation call per rank (each answered "
        "samples_per_question times); empty = auto: 8 on CPU, on a GPU as many as fill half the memory its "
        "model leaves")
    # The defaults are a run that learns on the embedded default in minutes on one GPU; that script's
    # 30 samples over the whole training split are one --set away.
    max_examples: int | None = Field(4000, ge=1, description="training questions to generate answers for "
                                     "(empty = the whole split)")
    # On CPU ranks 16 answers to 4,000 questions and 9 epochs over what is kept take most of an hour on 2
    # cores: the CPU's values keep a run to minutes.
    samples_per_question: Literal["auto"] | Annotated[int, Field(ge=1, le=4096)] = device_default(
        GPU_SAMPLES, CPU_SAMPLES, "answers sampled per training question (the users' earlier RFT script's "
        "oversample)")
    # 32 rows a step at 4e-4: chosen on the validation split on one GPU (bench/results/rft/selection-rows-per-
    # step-2026-11-28-h200.json, as gradient_accumulation=4): of 8 rows at 1e-4 (the default until then) and 32
    # at 2e-4 or 4e-4, the highest temperature-1 accuracy after training, 3 seeds, greedy higher in every
    # domain; and a quarter of the optimizer steps.
    rows_per_step: int = Field(32, ge=1, le=1 << 20, description="training sequences per optimizer step over all "
                               "ranks (the effective batch: a run learns the same on any number of GPUs); each "
                               "rank takes rows_per_step / ranks of them a step, in micro-batches of "
                               "train_batch_size")
    learning_rate: float = Field(4e-4, gt=0.0, le=1.0, description="peak learning rate of the fine-tune "
                                 "(4e-4 at 32 rows a step suits the embedded model; real 0.5B+ models want "
                                 "about 1e-5)")
    temperature: float = Field(0.7, gt=0.0, le=10.0, description="sampling temperature of the generated answers")
    max_rows_per_call: int | None = Field(None, ge=1, description="at most this many sequences per generation "
                                          "call (the users' earlier RFT script's MICRO_BATCH_SIZE); fewer "
                                          "questions per call then")
    keep_per_question: int = Field(4, ge=0, le=4096,
                                   description="distinct correct answers kept per question (0 = all)")
    dedupe: Literal["text", "equations"] = Field("text", description="text = normalized text; equations = Yuan et "
                                          "al.'s distinct equation lists")
    # On: chosen on the validation split (bench/results/rft/selection-samples-keep-gold-2026-11-29-h200.json):
    # of 16 samples keeping 4 (the default before, kept otherwise), 8 samples, keeping 8 and the gold
    # answer added, the highest temperature-1 accuracy after training, 3 seeds, greedy higher in every domain.
    include_gold: bool = Field(True, description="train on each question's gold answer too")
    generator: Literal["gpuscale", "transformers"] = Field(
        "gpuscale", description="gpuscale = the generation engine; transformers = model.generate with "
        "num_return_sequences (the users' earlier RFT script's structure, the bench's baseline)")
    data_from: str | None = Field(None, description="a run id (or path to its generated.jsonl) whose kept set "
                                  "to train on instead of generating")
    train_batch_size: int | None = Field(None, ge=1, description="training sequences per rank per micro-batch, a "
                                         "divisor of the rank's rows_per_step / ranks; auto (empty): on a GPU the "
                                         "largest that fits gpu_memory_share of the card (8 on CPU)")
    # 9: chosen on the validation split (bench/results/rft/selection-epochs-2026-11-27-cpu.json): of 3, 6
    # and 9, the highest temperature-1 accuracy after training, 3 seeds, greedy higher in every domain.
    epochs: Literal["auto"] | Annotated[float, Field(gt=0.0, le=1000.0)] = device_default(
        GPU_EPOCHS, CPU_EPOCHS, "passes over the kept set")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="learning-rate schedule after the warm-up")
    eval_examples: int = Field(500, ge=0, le=100_000, description="held-out problems (of eval_split) scored "
                               "greedily and at temperature 1 before and after (0 = no evaluation)")
    eval_batch_size: int | None = Field(
        None, ge=1, description="held-out problems per evaluation call per rank; unset: on a GPU as many as fill "
                                "gpu_memory_share of the card (at most 512), 64 on CPU")
    max_new_tokens: int = Field(96, ge=1, le=65_536, description="answer length budget (generation and evaluation)")


    RUN_ID_FIELDS = ("data_from",)  # a run id: the front end hands the ranks its folder

    _auto_words = field_validator("batch_size", "train_batch_size", mode="before")(auto_means_sized_on_card)

    @field_validator("data_from")
    @classmethod
    def _path_made_absolute(cls, value: str | None) -> str | None:
        """A path (not a run id) made absolute: the ranks start in the run folder, not in the user's."""
        if value is None or value.strip().isdigit():
            return value
        return str(absolute_path(value))


def check_questions_per_rank(settings: Settings) -> None:
    """The training questions are sharded over the ranks for generation: a rank with none of its own
    fails there while the others wait for it in the collectives. The rank count is the one the
    launch will plan (gpus here, times nnodes); the questions are those the trainer loads (the
    held-out ones left out: a JSONL file's first eval_examples rows, and with eval_split=validation
    the validation rows)."""
    from gpuscale.recipes.shared.data_checks import require_training_examples, training_count
    from gpuscale.recipes.shared.rank_batches import run_ranks
    from gpuscale.recipes.shared.training_data import training_and_eval_examples

    ranks = run_ranks(settings)
    count, source = training_count(settings, lambda s: training_and_eval_examples(s)[0])
    if count == 0:
        require_training_examples(count, source, 1, "eval_examples", settings.eval_examples,
                                  "it holds out every example, none is left to generate "
                                  "answers for; lower it")
    require_training_examples(count, source, ranks, "gpus", settings.gpus,
                              f"the {ranks} ranks each generate answers for a share of the training "
                              "questions, and every rank needs one; run on fewer ranks or give more "
                              "questions")


def training_settings(settings: Settings) -> Settings:
    """The settings of the training phase: its micro-batch is train_batch_size (batch_size is the
    generation's questions per call), and the trainer runs uncompiled: `compile` compiles the generation
    engine's decode step only. The trainer's torch_compile meets a new padding-free length most steps and
    compiles again (a 1-step training phase of bench/rft.py at 384 questions sat over 400 s in it on one
    H200: bench/results/rft/generation-speed-3840rows-training-compile-*), and sft compiled was slower than
    sft eager even where it settled (results/sft/train-speed-0.5b-packed-compiled-*)."""
    return settings.model_copy(update={"batch_size": settings.train_batch_size, "compile": False})


class RFT(Recipe):
    name = "rft"
    summary = ("rejection-sampling fine-tuning: sample answers, keep the correct distinct ones, "
               "SFT on them, accuracy before/after")
    settings_cls = Settings
    launcher = "accelerate"
    figure_notes = TRAINING_FIGURE_NOTES
    rank_imports = (*Recipe.rank_imports, "trl.trainer.sft_trainer")  # its fine-tune on the kept answers
    promised_figures = ("world_size", "kept_examples", "eval_split", "yield", "samples_per_s", "steps", "train_loss",
                        "tokens_per_s", "accuracy_greedy_before", "accuracy_greedy_after", "accuracy_sampled_before",
                        "accuracy_sampled_after", "model_dir")
    smoke_settings = {"max_examples": 4, "samples_per_question": 4, "batch_size": 2, "max_new_tokens": 24,
                      "max_steps": 2, "train_batch_size": 2, "max_length": 96, "eval_examples": 4,
                      "save_model": False}

    def check(self, settings: Settings) -> None:
        """The model loads, the training split (unless the set comes from data_from) and the test
        split parse, data_from names a run or file that holds a generated set, and the ranks share a
        training step evenly."""
        super().check(settings)
        from gpuscale.data.tasks import check_dataset
        from gpuscale.recipes.shared.rank_batches import run_ranks

        if settings.data_from:
            from gpuscale.recipes.rft.data import generated_set_path

            generated_set_path(settings.data_from)
        else:
            check_dataset(settings.dataset, "train", settings.max_examples)
            check_questions_per_rank(settings)
        training_settings(settings).check_micro_batch(run_ranks(settings), settings.train_batch_size,
                                                      "train_batch_size")
        if settings.eval_examples:
            check_dataset(settings.dataset, "test", settings.eval_examples)

    # Tuning (`gpuscale tune`): the generation phase's questions per call (the phase where a batch is
    # chosen; training's micro-batch is train_batch_size).
    tuning = Tuning(figure="samples_per_s", knob="training questions per generation call per rank",
                    shape_settings=("dataset", "samples_per_question", "max_new_tokens", "temperature", "generator",
                                    "max_rows_per_call"),
                    # How long the training phase lasts, and its step's rows (read where the trial's settings are
                    # resolved for the device and fitted to the ranks); the trial times generation.
                    not_shaping=("epochs", "rows_per_step", "gradient_accumulation"))

    def rank_splits(self, settings: Settings) -> list:
        return settings.rows_splits()  # the fine-tune's step; generation shards its questions, any count

    def trial_session(self, settings: Settings, ctx):
        from gpuscale.recipes.rft.trial import trial_session

        return trial_session(settings, ctx)

    def tune_max_batch(self, settings: Settings, ranks: int = 1) -> int | None:
        """A rank's share of max_examples questions; with max_rows_per_call, the questions it lets
        into one call (a larger batch_size changes nothing)."""
        limits = []
        if settings.max_examples:
            limits.append(-(-settings.max_examples // ranks))
        if settings.max_rows_per_call:
            limits.append(max(1, settings.max_rows_per_call // settings.samples_per_question))
        return min(limits) if limits else None

    def resume_overrides(self, run: dict) -> dict:
        """A run that generated its own set resumes on the answers it kept (`data_from` its folder:
        the whole set, or the part its ranks finished before a stop in generation), from its training
        checkpoint where it has one; the rest of its questions are not generated again."""
        from gpuscale.recipes.rft.data import kept_set_in

        if (run.get("settings") or {}).get("data_from") or not run.get("run_dir"):
            return {}
        return {"data_from": run["run_dir"]} if kept_set_in(Path(run["run_dir"])).is_file() else {}

    def run(self, settings: Settings, ctx, reporter) -> None:
        from gpuscale.recipes.rft.trainer import run_rft

        run_rft(settings, ctx, reporter)
