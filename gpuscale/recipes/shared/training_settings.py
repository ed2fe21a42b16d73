"""The settings of the TRL training recipes (sft, rft, grpo-mtl): `TrainingSettings` (learning rate and
schedule, clipping, LoRA, the held-out evaluation, saving), and `SupervisedSettings` on it (epochs or
max_steps, rows per step, accumulation, sequence length, speed) for the recipes that fine-tune on
(question, completion) rows; `with_micro_batch` sets a tuned micro-batch. Each recipe keeps its own
defaults by redeclaring a field; `eval_split_field` is the `eval_split` setting of every recipe that
scores held-out problems.

No torch at import: the front ends read the settings classes.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from gpuscale.data.splits import OLD_TEST_SPLIT_HELP, TEST_SPLIT_HELP, EvalSplit
from gpuscale.recipes.shared.rank_split import Split, each_rank, nearest_divisors
from gpuscale.recipes.shared.report_backends import checked_report_to
from gpuscale.runs.settings import RunSettings, SettingsError, words_meaning

# What the training shell's whole-run rate counts (recipes/shared/training.py:training_figures), beside
# the steady one the catalogue notes: sft's, rft's and grpo-mtl's `figure_notes`.
TRAINING_FIGURE_NOTES = {
    "tokens_per_s": "whole run: the trainer's tokens, all ranks, over its whole training time, warm-up included",
}
MOST_ACCUMULATION = 1024  # the largest gradient_accumulation allowed
# batch_size auto with gradient_accumulation given (TRL's count): a unit of accumulation is this many
# rows a rank (as batch_size 8 was), and on CPU a micro-batch takes at most this many rows.
AUTO_STEP_ROWS = 8


def checked_lora_targets(value: str) -> str:
    """`lora_targets` as peft takes it: all-linear, or module names like q_proj,v_proj."""
    value = value.strip()
    if value != "all-linear" and not re.fullmatch(r"\w+(\s*,\s*\w+)*", value):
        raise ValueError("expected all-linear or module names like q_proj,v_proj")
    return value


EVAL_SPLIT_HELP = ("which problems the held-out evaluation scores: test = the data set's test split, the same "
                   f"for every seed ({TEST_SPLIT_HELP}; a JSONL file: its first eval_examples rows); validation = "
                   "problems for choosing settings without scoring the test problems, never trained on: tiny-math's "
                   "own validation split (the same for every seed, none a pretraining problem of the embedded model), "
                   "else the first eval_examples problems of the training data, taken out of training (a JSONL "
                   "file: the eval_examples rows after its test rows, which stay out of training too); "
                   + OLD_TEST_SPLIT_HELP)


def eval_split_field():
    """The `eval_split` setting of every recipe that scores held-out problems (one description)."""
    return Field("test", description=EVAL_SPLIT_HELP)


class TrainingSettings(RunSettings):
    """What every TRL training recipe is set with, besides RunSettings."""

    KEY_ALIASES = {"lr": "learning_rate"}

    learning_rate: float = Field(2e-5, gt=0.0, le=1.0, description="peak learning rate")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="learning-rate schedule after the warm-up")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0,
                                description="share of the steps spent warming up the learning rate")
    max_grad_norm: float = Field(1.0, ge=0.0, le=1e6, description="gradient clipping (0 = none)")
    lora_rank: int = Field(0, ge=0, le=1024, description="0 = full fine-tune; otherwise LoRA adapters of this rank")
    lora_alpha: float = Field(32.0, gt=0.0, le=4096.0,
                              description="LoRA scaling numerator (alpha / rank scales the update)")
    lora_targets: str = Field("all-linear", description="modules LoRA adapts: all-linear, or names like q_proj,v_proj")
    eval_examples: int = Field(100, ge=0, le=100_000, description="held-out problems (of eval_split) scored "
                               "greedily and at temperature 1 before and after training (0 = no evaluation)")
    eval_split: EvalSplit = eval_split_field()
    save_model: bool = Field(True, description="save the trained model (merged if LoRA) to RUN_DIR/model, "
                             "before the final evaluation")
    report_to: str = Field("none", description="where the trainer also sends its logs: none, all (every integration "
                           "installed), or integrations joined by commas: tensorboard (event files in "
                           "RUN_DIR/tensorboard), wandb, trackio, mlflow... (each must be installed)")
    liger_kernels: bool = Field(True, description="liger-kernel's fused RMSNorm, SwiGLU and RoPE on CUDA (pip install "
                                "liger-kernel; without it the run says so and goes on without)")

    @field_validator("lora_targets")
    @classmethod
    def _check_targets(cls, value: str) -> str:
        return checked_lora_targets(value)

    @field_validator("report_to")
    @classmethod
    def _check_report_to(cls, value: str) -> str:
        return checked_report_to(value)


class SupervisedSettings(TrainingSettings):
    """The settings of a fine-tune on (question, completion) rows with TRL's SFTTrainer (sft, rft)."""

    KEY_ALIASES = {**TrainingSettings.KEY_ALIASES, "grad_accum": "gradient_accumulation"}

    epochs: float = Field(1.0, gt=0.0, le=1000.0, description="passes over the training examples")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (overrides epochs)")
    # Over all ranks, as grpo-mtl's prompts_per_step and eggroll's population: the number of GPUs
    # changes how fast a run trains, not what it learns (a per-rank count gave a 4-GPU run 4x the rows
    # a step, a quarter of the steps, and less learned at the same learning rate: bench/RESULTS.md).
    rows_per_step: int = Field(8, ge=1, le=1 << 20, description="training sequences per optimizer step over "
                               "all ranks (the effective batch, a learning setting: a run learns the same on "
                               "any number of GPUs, only faster); each rank takes rows_per_step / ranks of them "
                               "a step, in micro-batches of batch_size")
    gradient_accumulation: int | None = Field(
        None, ge=1, le=MOST_ACCUMULATION, description="TRL's count instead of rows_per_step: micro-batches of "
        "batch_size per optimizer step on each rank, so a step takes batch_size x gradient_accumulation x ranks "
        "rows (batch_size auto counting as 8); empty = it follows from rows_per_step")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    max_length: int = Field(512, ge=8, le=131_072,
                            description="longest prompt + completion, in tokens (longer are cut)")
    activation_checkpointing: bool = Field(False, description="recompute activations in the backward pass "
                                           "(less memory, about a third more compute)")
    max_new_tokens: int = Field(256, ge=1, le=65_536, description="answer length budget in the evaluation")
    # Speed (ARCHITECTURE.md, engines/packed_attention.py): each can be turned off, each gives the same loss
    # (tests/unit/test_training_speed.py).
    padding_free: bool = Field(True, description="a micro-batch's rows concatenated into one sequence, attention "
                               "row by row (flash varlen on CUDA): no compute on padding tokens")
    packing: bool = Field(False, description="pack rows into sequences of max_length tokens (TRL's bfd packing): a "
                          "micro-batch counts packed sequences, so an optimizer step takes more rows")
    pad_to_multiple_of: int = Field(16, ge=0, le=1024, description="a micro-batch's sequence padded to a multiple of "
                                    "this many tokens (0 = not padded): one compiled variant of liger's kernels "
                                    "for every length")

    _no_limit_words = field_validator("max_steps", mode="before")(words_meaning("", "none", "all"))

    def rank_rows(self, ranks: int) -> int:
        """Sequences per optimizer step on each of `ranks` ranks: rows_per_step / ranks, or with
        gradient_accumulation given, batch_size (auto: AUTO_STEP_ROWS) x gradient_accumulation. What
        tuning and the card-sized split keep. SettingsError (naming the field) where the ranks do not
        share the step evenly: DDP pairs every rank's micro-batches."""
        if self.gradient_accumulation is not None:
            return (self.batch_size or AUTO_STEP_ROWS) * self.gradient_accumulation
        if self.rows_per_step % ranks:
            raise SettingsError(f"rows_per_step: {self.rows_per_step}: does not split evenly over the run's {ranks} "
                                f"ranks (each takes an equal share of a step); give a multiple of {ranks}")
        return self.rows_per_step // ranks

    def rows_splits(self) -> list[Split]:
        """rows_per_step, shared out over the ranks (recipes/shared/rank_split.py); nothing where TRL's
        gradient_accumulation counts a rank's rows instead."""
        if self.gradient_accumulation is not None:
            return []
        return [Split("rows_per_step", lambda rows: f"{rows} rows a step")]

    @property
    def step_asked(self) -> dict[str, int]:
        """How the step's rows were asked for, part of a tuning result's key: rows_per_step over all
        ranks, or TRL's per-rank count."""
        if self.gradient_accumulation is not None:
            return {"rows_a_rank": self.rank_rows(1)}
        return {"rows_per_step": self.rows_per_step}

    def check_micro_batch(self, ranks: int, micro_batch: int | None, field: str = "batch_size") -> int:
        """The rank's rows of a step (`rank_rows`), checked to split into micro-batches of
        `micro_batch` rows (None: sized later, any split); SettingsError naming `field` otherwise."""
        rows = self.rank_rows(ranks)
        if micro_batch is not None and rows % micro_batch:
            raise SettingsError(f"{field}: {micro_batch}: does not divide the {rows} rows {each_rank(ranks)} "
                                f"takes a step (rows_per_step {rows * ranks}); use "
                                f"{' or '.join(map(str, nearest_divisors(rows, micro_batch)))}")
        return rows


def with_micro_batch(settings: SupervisedSettings, wanted: int) -> SupervisedSettings:
    """The settings with a tuned micro-batch: the largest allowed up to `wanted` for the rank's rows of
    a step on the ranks this run starts (a batch tuned for another share need not divide this one);
    gradient_accumulation, where given (TRL's count), rescaled so that the step keeps its rows."""
    from gpuscale.recipes.shared.rank_batches import micro_batch_within, run_ranks

    rows = settings.rank_rows(run_ranks(settings))
    micro = micro_batch_within(rows, wanted, MOST_ACCUMULATION)
    accumulation = None if settings.gradient_accumulation is None else rows // micro
    return settings.model_copy(update={"batch_size": micro, "gradient_accumulation": accumulation})
