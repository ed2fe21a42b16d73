"""eggroll: evolution strategies with low-rank perturbations (EGGROLL, arXiv 2511.16652) to fine-tune an
LM on a task's reward, the whole population in one batched forward.

Each step, every member i of the population answers the same prompts with its own weights
W + sigma * A_i B_i^T / sqrt(r) on every perturbed matrix. Members are contiguous blocks of rows in
one engine batch: the shared matmul x W^T runs once for all of them, and each member adds its thin
(x B_i) A_i^T through the engine's per-row term, so no weight is ever cloned. Members are sharded
over ranks; the scalar fitnesses (mean reward of a member's answers) are all-gathered and every rank
applies the same update from noise it regenerates itself (evolution.py).

`method=naive` is the structure its users had (seed 002): per member, perturb the weights in place,
generate every prompt, restore; same engine, same noise, same update, so only the structure differs.

Held-out accuracy (greedy and temperature 1) before, every `eval_every` steps and after, on
`eval_examples` problems: the test split's, or with `eval_split=validation` the first problems of the
training data, taken out of training (recipes/shared/training_data.py's split, as every training recipe's; for
choosing settings; the summary's `eval_split` says which).

Files: this one (settings and the recipe, no torch), evolution.py (perturbations, shaping, update),
trainer.py (a rank's work), trial.py (its tuning trial: ES steps at a batch, weights restored).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from gpuscale.data.splits import EvalSplit
from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.recipes.shared.device_defaults import device_default
from gpuscale.recipes.shared.rank_split import Split
from gpuscale.recipes.shared.training_settings import eval_split_field
from gpuscale.runs.settings import RunSettings

# The population and steps a run gets unless told: chosen on the validation split, 3 seeds (bench/RESULTS.md,
# "Settings chosen on the validation split"): 512 members beat 64, then 2,048 members for 200 steps had a
# higher T=1 accuracy than 2,048 for 150 and 512 for 300, greedy higher in every domain and seed (2,048
# for 300 steps took too long for a default; what 200 cost is in bench/RESULTS.md). On CPU a step's time
# grows with the members (at 512 a 300-step run takes hours), so CPU runs keep 64 members; a step of 64
# takes about 2 s on 2 cores, so 60 steps and no evaluation between them keep a run to minutes.
GPU_POPULATION, GPU_STEPS, GPU_EVAL_EVERY = 2048, 200, 50
CPU_POPULATION, CPU_STEPS, CPU_EVAL_EVERY = 64, 60, 0
MAX_ROWS_PER_CALL = 8192  # the unset batch at most: the selection's (2,048 members x 16 prompts in four calls)


class Settings(RunSettings):
    KEY_ALIASES = {"population_size": "population", "noise_rank": "rank", "learning_rate": "lr",
                   "epochs": "steps", "num_epochs": "steps",
                   "lr_schedule": "lr_scheduler"}  # the name it had at first (bench/RESULTS.md's commands)

    batch_size: int | None = Field(
        None, ge=1, description="rows (member x prompt x generation) per engine call per rank; unset: a step's "
                                f"rows in one call, at most {MAX_ROWS_PER_CALL}")
    method: Literal["eggroll", "naive"] = Field(
        "eggroll",
        description="eggroll = all members in one batched forward; naive = perturb, generate, restore per member")
    antithetic: bool = Field(True, description="members in pairs with noise +E and -E")
    population: Literal["auto"] | Annotated[int, Field(ge=2, le=1 << 20)] = device_default(
        GPU_POPULATION, CPU_POPULATION, "members per step, over all ranks")
    rank: int = Field(1, ge=1, le=64, description="rank r of each perturbation A B^T")
    perturb_norms: bool = Field(
        True, description="also perturb the norms' gain vectors (full-rank noise, as the paper's non-matrix "
                          "parameters); the final norm sets how sharp the answers are, which the decoder's "
                          "matrices cannot (their outputs are normalised before the head)")
    norm_sigma: float = Field(0.03, gt=0, le=1.0, description="perturbation scale of the norms' gains: they "
                              "sit near 1 where the matrices' entries sit near 0.03, so sigma would move them "
                              "relatively 30 times less")
    sigma: float = Field(0.003, gt=0, le=1.0, description="perturbation scale of the matrices")
    lr: float = Field(0.3, gt=0, le=100.0, description="step size of the ES update")
    lr_scheduler: Literal["constant", "cosine"] = Field(
        "cosine", description="constant = lr at every step; cosine = from lr down to lr / 100 at the last step")
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="sgd = the step as HyperscaleES applies it; adam = torch Adam on the ES gradient at lr")
    fitness_shaping: Literal["zscore", "centered_rank", "antithetic_sign"] = Field(
        "zscore", description="how raw fitnesses become update weights")
    prompts_per_step: int = Field(16, ge=1, le=4096, description="training prompts every member answers each step")
    generations_per_prompt: int = Field(1, ge=1, le=256, description="answers per prompt and member")
    fitness: Literal["correctness", "gold_logprob"] = Field(
        "gold_logprob", description="correctness = mean reward of the members' sampled answers; gold_logprob = mean "
                                   "per-token log-prob of the training answers given the questions (teacher "
                                   "forcing: nothing sampled, a smooth signal)")
    max_new_tokens: int = Field(48, ge=1, le=8192, description="answer length budget")
    temperature: float = Field(0.0, ge=0.0, le=10.0,
                               description="sampling temperature of the members' answers (0 = greedy)")
    common_random_numbers: bool = Field(
        True, description="with temperature > 0, every member samples its answers with the same random numbers "
                          "in a step, so members' fitnesses differ by their noise, not by their luck")
    steps: Literal["auto"] | Annotated[int, Field(ge=1, le=1_000_000)] = device_default(
        GPU_STEPS, CPU_STEPS, "ES steps")
    eval_every: Literal["auto"] | Annotated[int, Field(ge=0)] = device_default(
        GPU_EVAL_EVERY, CPU_EVAL_EVERY, "held-out accuracy every this many steps (0 = only before and after)")
    eval_examples: int = Field(500, ge=0, le=100_000, description="held-out problems (of eval_split) for the "
                               "accuracy figures (0 = no evaluation)")
    eval_split: EvalSplit = eval_split_field()
    save_model: bool = Field(True, description="save the final model in RUN_DIR/model, before the final evaluation")
    answer_mode: Literal["strict", "auto", "boxed", "flexible"] = Field(
        "strict", description="answer extraction of the reward")

    @field_validator("population")
    @classmethod
    def _pairs_are_whole(cls, value: int | str, info: ValidationInfo) -> int | str:
        if value != "auto" and info.data.get("antithetic", True) and value % 2:
            raise ValueError("must be even with antithetic pairs")
        return value

    @field_validator("fitness")
    @classmethod
    def _gold_samples_nothing(cls, value: str, info: ValidationInfo) -> str:
        if value == "gold_logprob" and info.data.get("generations_per_prompt", 1) != 1:
            raise ValueError("gold_logprob samples no answers: generations_per_prompt must be 1")
        return value

    @field_validator("fitness_shaping")
    @classmethod
    def _sign_needs_pairs(cls, value: str, info: ValidationInfo) -> str:
        if value == "antithetic_sign" and not info.data.get("antithetic", True):
            raise ValueError("antithetic_sign needs antithetic=true")
        return value


def population_split(settings: Settings) -> Split:
    """The members, shared out over the ranks: an equal share each (a member's pair may sit on the next
    rank: noise is drawn by member, evolution.py), and with antithetic pairs an even population."""
    pairs = settings.antithetic
    return Split("population", lambda members: f"{members:,} members{' in antithetic pairs' if pairs else ''}",
                 multiple=lambda ranks: math.lcm(2, ranks) if pairs else ranks)


def check_training_examples(settings: Settings) -> None:
    """Each step samples prompts_per_step distinct prompts from the training examples (without
    replacement); with fewer the first step raises, after the model is loaded. The trainer loads
    them as every training recipe does (recipes/shared/training_data.py's `training_and_eval_examples`: the
    held-out problems left out)."""
    from gpuscale.recipes.shared.data_checks import require_training_examples, training_count
    from gpuscale.recipes.shared.training_data import training_and_eval_examples

    count, source = training_count(settings, lambda s: training_and_eval_examples(s)[0])
    require_training_examples(count, source, settings.prompts_per_step, "prompts_per_step",
                              settings.prompts_per_step,
                              "every step samples that many distinct prompts; lower prompts_per_step "
                              "or give more training examples")


class Eggroll(Recipe):
    name = "eggroll"
    summary = "evolution strategies with low-rank perturbations: the whole population in one batched forward"
    settings_cls = Settings
    promised_figures = ("members_per_s", "eval_split", "tokens_per_s", "fitness_mean_first", "fitness_mean_last",
                        "accuracy_greedy_before", "accuracy_greedy_after", "accuracy_sampled_before",
                        "accuracy_sampled_after", "weights_identical_across_ranks", "model_dir",
                        # a step's scoring and its fitness all-gather timed apart, whatever the fitness
                        # (bench/scaling.py's communication share)
                        "score_seconds_median", "gather_seconds_median")
    smoke_settings = {"population": 4, "prompts_per_step": 2, "max_new_tokens": 8, "steps": 2,
                      "eval_examples": 4, "eval_every": 0, "batch_size": 8,
                      "max_examples": 16}  # the whole training split: ~6 s a rank on CPU, cache cold

    def check(self, settings: Settings) -> None:
        super().check(settings)
        from gpuscale.data.tasks import check_dataset

        check_dataset(settings.dataset, "train", settings.max_examples)
        if settings.eval_examples:
            check_dataset(settings.dataset, "test", settings.eval_examples)
        check_training_examples(settings)

    # Tuning (`gpuscale tune`): the batch is rows per engine call, a whole number of members' rows
    # (prompts_per_step x generations_per_prompt each); a call holds at most the rank's members.
    tuning = Tuning(figure="members_per_s", knob="rows (member x prompt x generation) per engine call per rank",
                    shape_settings=("dataset", "method", "population", "prompts_per_step", "generations_per_prompt",
                                    "max_new_tokens", "temperature", "rank", "fitness"),
                    # Learning settings, and terms a member adds in place (antithetic pairs, norms): the
                    # same rows and decoding. `fitness` is in the key: correctness decodes, gold_logprob not.
                    not_shaping=("sigma", "norm_sigma", "lr", "lr_scheduler", "optimizer", "fitness_shaping",
                                 "antithetic", "perturb_norms", "steps", "eval_every"),
                    start=256)  # the default: smaller calls mean many calls per step, trials of minutes

    def rank_splits(self, settings: Settings) -> list[Split]:
        return [population_split(settings)]

    def for_device(self, settings: Settings, on_gpu: bool, ranks: int) -> Settings:
        settings = super().for_device(settings, on_gpu, ranks)  # population (fitted to the ranks) and steps
        if settings.batch_size is not None:
            return settings
        # A step's rows on one rank.
        rows = settings.prompts_per_step * settings.generations_per_prompt * max(1, settings.population // ranks)
        return settings.model_copy(update={"batch_size": min(rows, MAX_ROWS_PER_CALL)})

    def trial_session(self, settings: Settings, ctx):
        from gpuscale.recipes.eggroll.trial import trial_session

        return trial_session(settings, ctx)  # the tuner resolved what was left to the device (for_device)

    def tune_batch_sizes(self, settings: Settings, ranks: int = 1) -> list[int] | None:
        rows = settings.prompts_per_step * settings.generations_per_prompt
        if settings.method == "naive":
            return [rows]  # one member per call whatever batch_size says
        return [rows * members for members in range(1, max(1, settings.population // ranks) + 1)]

    def tune_max_batch(self, settings: Settings, ranks: int = 1) -> int | None:
        return settings.prompts_per_step * settings.generations_per_prompt * max(1, settings.population // ranks)

    def run(self, settings: Settings, ctx, reporter) -> None:
        from gpuscale.recipes.eggroll.trainer import run_eggroll

        run_eggroll(settings, ctx, reporter)  # sized for the rank's device (run_on_device)
