"""sft: supervised fine-tuning with TRL's SFTTrainer on a task's training split.

Each training example becomes a prompt-completion pair: the prompt is the chat-templated question
(exactly as the generation side builds it, `data.prompts.prompt_ids`), the completion the gold answer
and EOS; the loss is on the completion only. Full fine-tune, or LoRA through peft (`lora_rank` > 0).
Every rank trains with DDP under `accelerate launch`; precision, per-device batch, gradient
accumulation, learning rate, epochs or max_steps and scheduler come from the settings through the
TRL bridge (engines/trl_bridge.py), which also sends the trainer's logs to the Reporter live.
Before and after training, greedy and temperature-1 accuracy per domain on `eval_examples` held-out
problems (sharded over ranks): the test split's, or with `eval_split=validation` the first problems of
the training data, taken out of training (for choosing settings; the summary's `eval_split` says
which). The trained model (merged if LoRA) is saved to RUN_DIR/model
before the final evaluation (`save_model`, on by default); any recipe loads it with
`--model RUN_DIR/model`.

Files: this one (settings and the recipe, no torch), trainer.py (a rank's work), trial.py (its tuning
trial, on recipes/shared/training_trial.py). The training itself is recipes/shared/training.py's, shared with rft
and grpo-mtl.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.recipes.shared.device_defaults import device_default
from gpuscale.recipes.shared.training_settings import (
    MOST_ACCUMULATION,
    TRAINING_FIGURE_NOTES,
    SupervisedSettings,
    with_micro_batch,
)
from gpuscale.runs.settings import SettingsError, auto_means_sized_on_card

GPU_EPOCHS, CPU_EPOCHS = 3.0, 1.0


class Settings(SupervisedSettings):
    KEY_ALIASES = {**SupervisedSettings.KEY_ALIASES, "micro_batch_size": "batch_size"}

    batch_size: int | None = Field(None, ge=1, description="training sequences (prompt + completion) per rank per "
                                   "micro-batch (TRL's per_device_train_batch_size), a divisor of the rank's "
                                   "rows_per_step / ranks; gradient accumulation makes up the step. auto (empty): "
                                   "on a GPU the largest that fits gpu_memory_share of the card (8 on CPU)")
    _auto_words = field_validator("batch_size", mode="before")(auto_means_sized_on_card)
    # The defaults are a run that learns on the embedded default in minutes on one GPU; larger data is one
    # --set away. 8,000 examples for 3 epochs: chosen on the validation split
    # (bench/results/sft/selection-max-examples-2026-11-29-h200.json): of 4,000 x 6 (the default before),
    # 8,000 x 3 and 2,000 x 12 (the same rows trained on), the highest temperature-1 accuracy after
    # training, 3 seeds, greedy higher in every domain (6 epochs: selection-epochs-2026-11-27-cpu.json).
    # CPU ranks train 1 epoch of them, the 8,000 rows they trained on before, to keep a run to minutes.
    max_examples: int | None = Field(8000, ge=1, description="training examples (empty = the whole split)")
    epochs: Literal["auto"] | Annotated[float, Field(gt=0.0, le=1000.0)] = device_default(
        GPU_EPOCHS, CPU_EPOCHS, "passes over the training examples")
    # 2e-4: chosen on the validation split at 6 epochs (bench/results/sft/selection-lr-2026-11-27-cpu.json):
    # of 5e-5, 1e-4 and 2e-4, the highest temperature-1 accuracy after training, 3 seeds, greedy higher in
    # every domain; the top of that grid.
    learning_rate: float = Field(2e-4, gt=0.0, le=1.0, description="peak learning rate (2e-4 suits the embedded "
                                 "model; real 0.5B+ models want about 1e-5 full, 1e-4 with LoRA)")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="learning-rate schedule after the warm-up")
    eval_examples: int = Field(500, ge=0, le=100_000, description="held-out problems (of eval_split) scored "
                               "greedily and at temperature 1 before and after training (0 = no evaluation)")


class SFT(Recipe):
    name = "sft"
    summary = ("supervised fine-tuning (TRL SFTTrainer, full or LoRA) on a task's training split, "
               "with accuracy before/after")
    settings_cls = Settings
    launcher = "accelerate"
    figure_notes = TRAINING_FIGURE_NOTES
    rank_imports = (*Recipe.rank_imports, "trl.trainer.sft_trainer")
    promised_figures = ("world_size", "steps", "eval_split", "train_loss", "tokens_per_s", "accuracy_greedy_before",
                        "accuracy_greedy_after", "accuracy_sampled_before", "accuracy_sampled_after", "model_dir")
    smoke_settings = {"max_examples": 8, "batch_size": 2, "max_steps": 2, "max_length": 64, "eval_examples": 2,
                      "max_new_tokens": 8}

    def check(self, settings: Settings) -> None:
        """The data set must load (a bad JSONL line is refused with its file and line) and keep
        training examples once the evaluation's are held out of it (JSONL files are one split;
        validation problems come out of the training data)."""
        super().check(settings)
        from gpuscale.data.tasks import check_dataset
        from gpuscale.recipes.shared.data_checks import training_count
        from gpuscale.recipes.shared.rank_batches import run_ranks
        from gpuscale.recipes.shared.training_data import training_and_eval_examples

        check_dataset(settings.dataset, "train", settings.max_examples)
        settings.check_micro_batch(run_ranks(settings), settings.batch_size)
        count, _source = training_count(settings, lambda s: training_and_eval_examples(s)[0])
        if count == 0:
            raise SettingsError(f"eval_examples: {settings.eval_examples}: holds out every example of "
                                f"{settings.dataset}, none is left to train on; lower it")

    # Tuning (`gpuscale tune`): the per-device micro-batch of the rank's share of a step (rank_rows);
    # gradient accumulation makes up the step, so the rows an optimizer step takes stay as asked.
    tuning = Tuning(figure="tokens_per_s",
                    knob="sequences per device per micro-batch (gradient accumulation keeps the step's batch)",
                    # What the trial's step is made of: its rows and the kernels and layout that train them.
                    shape_settings=("dataset", "max_length", "lora_rank", "lora_targets", "activation_checkpointing",
                                    "step_asked", "padding_free", "pad_to_multiple_of", "liger_kernels"),
                    # How long a run trains (read where the trial's settings are resolved for the device).
                    not_shaping=("epochs",),
                    start=1)  # every trial trains on the same rows per step: a small micro-batch is no slower to try

    def trial_session(self, settings: Settings, ctx):
        from gpuscale.recipes.sft.trial import trial_session

        return trial_session(settings, ctx)

    def rank_splits(self, settings: Settings) -> list:
        return settings.rows_splits()

    def tune_batch_sizes(self, settings: Settings, ranks: int = 1) -> list[int] | None:
        from gpuscale.recipes.shared.rank_batches import micro_batches

        return micro_batches(settings.rank_rows(ranks), MOST_ACCUMULATION)

    def tune_max_batch(self, settings: Settings, ranks: int = 1) -> int | None:
        return settings.rank_rows(ranks)

    def with_batch_size(self, settings: Settings, batch_size: int) -> Settings:
        return with_micro_batch(settings, batch_size)

    def run(self, settings: Settings, ctx, reporter) -> None:
        from gpuscale.recipes.sft.trainer import run_sft

        run_sft(settings, ctx, reporter)
