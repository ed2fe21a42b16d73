"""grpo-mtl: GRPO over a mixture of task domains with TRL's GRPOTrainer, optionally with PCGrad.

The users' earlier GURU scripts (six domains on verl/Ray, a mixed-domain baseline against multi-task
learning with PCGrad) on TRL. Every training row carries its `domain`; each domain has its own reward
functions (correct final answer, plus an optional format reward, `reward_weights`), so TRL logs each
domain's training reward. Completions come from gpuscale's generation engine through TRL's
`rollout_func` hook (`generator=engine`), or from TRL's own paths (`transformers`: `model.generate`;
`continuous`: transformers' continuous batching), so the three can be compared on the same run.
`mtl=pcgrad` replaces the plain backward by per-domain gradients, projected against each other
(Yu et al. 2020) and summed into `.grad` before clipping and the optimizer step.

Before and after training: held-out accuracy per domain, greedy and sampled at temperature 1, on the
test split's problems, or with `eval_split=validation` on the first problems of the training data,
taken out of training (for choosing settings; the summary's `eval_split` says which). The
trained model (merged if LoRA) is saved with its tokenizer to RUN_DIR/model before the final
evaluation (`save_model`, on by default). The training shell (fp32 master weights, the NaN guard,
merging, casting) is recipes/shared/training.py's, shared with sft and rft.

Files: this one (settings and the recipe, no torch), data.py (training rows, their domains weighted by
`domain_weights`, and held-out examples), trainer.py (a rank's work; the engine behind `rollout_func` is
engines/rollout.py), multitask.py (the GRPOTrainer subclass: per-domain losses and gradients), pcgrad.py (the
projection, and a step's per-domain gradient buffers), generations.py (the generations a run keeps), trial.py
(its tuning trial, on recipes/shared/training_trial.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.recipes.shared.device_defaults import device_default, resolved_for_device
from gpuscale.recipes.shared.rank_split import Split, each_rank, nearest_divisors
from gpuscale.recipes.shared.training_settings import TRAINING_FIGURE_NOTES, TrainingSettings
from gpuscale.runs.settings import SettingsError, auto_means_sized_on_card

GPU_STEPS, CPU_STEPS = 500, 50


class Settings(TrainingSettings):
    SIDE_RANKS_FIELD = "generation_gpus"  # its generators stand outside the training world (engines/placement.py)
    # verl's names for the same knobs keep working, short and long spellings: configs written for verl
    # carry over as they are.
    KEY_ALIASES = {
        "rollout.n": "num_generations",
        "actor_rollout_ref.rollout.n": "num_generations",
        "data.train_batch_size": "prompts_per_step",
        "train_batch_size": "prompts_per_step",
        "ppo_micro_batch_size_per_gpu": "batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "batch_size",
        "data.max_prompt_length": "max_prompt_length",
        "max_response_length": "max_completion_length",
        "data.max_response_length": "max_completion_length",
        "trainer.total_training_steps": "max_steps",
        "steps": "max_steps",
        "actor_rollout_ref.actor.optim.lr": "learning_rate",
        "lr": "learning_rate",
        "kl_coef": "beta",
    }

    batch_size: int | None = Field(
        None, ge=1, le=65_536, description="completions per rank per micro-batch (verl's "
        "ppo_micro_batch_size_per_gpu), accumulated up to the step's prompts_per_step x num_generations; "
        "empty = auto: 8 on CPU, on a GPU the most of the rank's completions per step (a divisor of them) "
        "that fill gpu_memory_share of the memory its model leaves: each micro-batch costs a fixed overhead, three "
        "with mtl=pcgrad, so few large ones are fastest")
    # 64 prompts x 4 completions: chosen on today's validation split (bench/results/grpo_mtl/selection-prompts-
    # generations-lr-2026-11-29-h200.json): of 32 x 8, 64 x 4 and 32 x 8 at lr 5e-5 (the same 256 completions a
    # step), the highest temperature-1 accuracy after training, 3 seeds, greedy higher in every domain; in the call
    # before it (selection-prompts-generations-2026-11-29-h200.json) 32 x 8 had beaten 16 x 16, the default until
    # then (chosen on 11-28's validation split, which lay inside pretraining). More prompts a step, fewer
    # completions each: more of tiny-math's problems teach something each step.
    num_generations: int = Field(4, ge=2, le=1024, description="completions per prompt, one GRPO group "
                                 "(verl's rollout.n)")
    prompts_per_step: int = Field(64, ge=1, le=65_536, description="prompts per optimizer step over all ranks "
                                  "(verl's data.train_batch_size; 8 left tiny-math short of its gains: "
                                  "too many all-right or all-wrong groups per step)")
    max_prompt_length: int = Field(256, ge=8, le=131_072,
                                   description="longer training prompts (in tokens) are left out")
    max_completion_length: int = Field(64, ge=1, le=131_072, description="answer length budget, in tokens "
                                       "(verl's max_response_length), in training and evaluation (64 "
                                       "holds tiny-math's longest answer, 36 tokens; GSM8K with a real model "
                                       "wants 256 or more)")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="sampling temperature of the rollouts")
    beta: float = Field(0.0, ge=0.0, le=10.0, description="KL coefficient against the initial model "
                        "(0 = no reference model, TRL's default)")
    # 0 by default: the validation selection's pick (bench/RESULTS.md, grpo-mtl: "TRL's entropy term") won by less
    # than the seeds' spread, and a changed default makes every grpo-mtl README figure stale; it moves with an
    # acceptance that measures it beside 0 in one call (bench/acceptance.py --variant).
    entropy_coef: float = Field(0.0, ge=-1.0, le=1.0, description="TRL's entropy term: the loss less this times "
                                "the mean entropy of the completions' tokens (positive: a bonus that keeps "
                                "sampling diverse; negative: a penalty that sharpens it toward the greedy answer)")
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = Field(
        "dapo", description="TRL's loss normalisation (dapo: over all tokens of the step)")
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="peak learning rate (1e-4 suits the "
                                 "embedded tiny-math model: 2e-4 lowered its greedy accuracy on the validation "
                                 "split; 0.5B+ models want about 1e-6)")
    # On CPU ranks a step of 256 completions takes 2 s or more on 2 cores: CPU_STEPS keeps a run to minutes.
    max_steps: Literal["auto"] | Annotated[int, Field(ge=1, le=10_000_000)] = device_default(
        GPU_STEPS, CPU_STEPS, "optimizer steps")
    lr_scheduler: Literal["constant", "linear", "cosine", "constant_with_warmup"] = Field(
        "cosine", description="learning-rate schedule after the warm-up (constant kept the last steps as large "
                              "as the first and undid gains on tiny-math)")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="share of the steps spent warming up")
    reward_weights: str = Field("correctness=1,format=0", description="reward=weight for every domain, "
                                "domain.reward=weight for one (rewards: correctness, format)")
    domain_weights: str = Field(
        "", description="domain=weight, comma-separated (e.g. comparison=2): each domain's count among the training "
        "prompts times its weight (1 where not named, each above 0), scaled back to the same total (reward_weights "
        "cannot do this: GRPO normalises rewards within each prompt's group); the summary's train_share_<domain> "
        "says what each domain got. Empty: the data's own mixture")
    generator: Literal["engine", "transformers", "continuous"] = Field(
        "engine", description="engine = gpuscale's generation engine; transformers = TRL's model.generate; "
                              "continuous = TRL's transformers continuous batching")
    mtl: Literal["none", "pcgrad"] = Field("none", description="none = one loss over the mixed domains; "
                                           "pcgrad = per-domain gradients projected (gradient surgery)")
    rollout: Literal["sync", "async"] = Field(
        "sync", description="sync = each step generates, then trains; async = step k+1's completions are generated "
                            "(by the engine, in a thread of its own) while step k trains, from weights at most "
                            "max_staleness steps old, the gap corrected by TRL's truncated importance sampling")
    max_staleness: int = Field(1, ge=0, le=64, description="rollout=async: how many optimizer steps older than the "
                               "trained policy the sampling weights may be (0: each step samples from its own "
                               "weights, no overlap; one engine a rank lags 1 step at most)")
    old_logprobs: Literal["loss", "forward"] = Field(
        "loss", description="rollout=async: where the trainer's log-probs of the importance-sampling ratio come "
        "from: loss = the loss's own forward, detached (the same weights: one optimizer step a generation; no "
        "extra forward); forward = TRL's no-grad forward over the step's completions before the loss (an extra "
        "forward a step, kept to compare the two)")
    generation_gpus: int = Field(0, ge=0, le=4096, description="rollout=async: how many of the run's devices (GPUs, "
                                 "or CPU ranks) only generate, from the weights the others train and send them "
                                 "each step (0: every training rank generates its own, in a thread)")
    eval_examples: int = Field(500, ge=0, le=100_000, description="held-out problems (of eval_split) scored "
                               "before and after training, greedy and sampled (0 = no evaluation)")

    _auto_words = field_validator("batch_size", mode="before")(auto_means_sized_on_card)

    @field_validator("reward_weights")
    @classmethod
    def _check_reward_weights(cls, value: str) -> str:
        from gpuscale.data.rewards import parse_reward_weights

        parse_reward_weights(value)  # ValueError with one line
        return value.strip()

    @field_validator("domain_weights")
    @classmethod
    def _check_domain_weights(cls, value: str) -> str:
        from gpuscale.recipes.grpo_mtl.data import parse_domain_weights

        parse_domain_weights(value)  # ValueError with one line; the domains are check_domain_weights'
        return value.strip()

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations


def completions_split(settings: Settings) -> Split:
    """The step's completions, prompts_per_step x num_generations, shared out over the ranks: each rank
    trains on its share (recipes/shared/rank_split.py)."""
    generations = settings.num_generations
    return Split("prompts_per_step", lambda prompts: f"{prompts} prompts x {generations} generations = "
                 f"{prompts * generations} completions", per_value=generations)


def accumulation_steps(settings: Settings, world_size: int) -> int:
    """Micro-batches per optimizer step so that one step trains on the whole generation batch
    (prompts_per_step x num_generations completions) once; SettingsError, naming batch_size and the
    divisors nearest to it, if it does not divide a rank's share (the share splitting is `check`'s).
    A batch_size left to the rank (None) is sized there as a divisor: one micro-batch here."""
    if settings.batch_size is None:
        return 1
    share = rank_share(settings, world_size)
    if share % settings.batch_size:
        raise SettingsError(
            f"batch_size: {settings.batch_size}: does not divide the {share} completions {each_rank(world_size)} "
            f"takes a step ({completions_split(settings).items(settings.prompts_per_step)}); use "
            f"{' or '.join(map(str, nearest_divisors(share, settings.batch_size)))}")
    return share // settings.batch_size


def rank_share(settings: Settings, ranks: int) -> int:
    """A rank's completions per optimizer step (all of them where the ranks do not divide them: the
    launch then refuses or fits prompts_per_step, `completions_split`)."""
    if settings.completions_per_step % ranks:
        return settings.completions_per_step
    return settings.completions_per_step // ranks


def check_training_examples(settings: Settings) -> None:
    """Every optimizer step takes prompts_per_step distinct training prompts; with fewer, TRL's data
    loader yields no whole step and the run ends at once with 0 steps as if it had succeeded. The
    count is of the rows the run loads (the held-out ones left out: JSONL: its first eval_examples
    rows; validation problems too with eval_split=validation)."""
    from gpuscale.recipes.grpo_mtl.data import training_and_eval_examples
    from gpuscale.recipes.shared.data_checks import require_training_examples, training_count

    count, source = training_count(settings, lambda s: training_and_eval_examples(s)[0])
    require_training_examples(count, source, settings.prompts_per_step, "prompts_per_step",
                              settings.prompts_per_step,
                              "every step trains on that many distinct prompts; lower prompts_per_step "
                              "or give more training examples")


def check_domain_weights(settings: Settings) -> None:
    """Every domain `domain_weights` names is one of the data set's (a file's domains are read from its rows)."""
    from gpuscale.data.tasks import dataset_domains
    from gpuscale.recipes.grpo_mtl.data import parse_domain_weights

    named = parse_domain_weights(settings.domain_weights)
    if not named:
        return
    known = dataset_domains(settings.dataset, settings.domain)
    for domain in named:
        if domain not in known:
            raise SettingsError(f"domain_weights: {settings.domain_weights!r}: unknown domain {domain!r} of "
                                f"{settings.dataset}; known domains: {', '.join(known)}")


def check_rollout(settings: Settings) -> None:
    """rollout=async where it can run: on gpuscale's engine (TRL's own generation runs inside its
    training step). The engine decodes a copy of its own while the trainer steps (a LoRA model's with its
    adapter merged: engines/merged_lora.py)."""
    if settings.rollout != "async":
        return
    if settings.generator != "engine":
        raise SettingsError(f"rollout: async: needs generator=engine, not {settings.generator}: TRL's own "
                            "generation runs inside its training step and cannot overlap it")


def check_placement(settings: Settings) -> None:
    """generation_gpus where it can run: generators serve the async rollout with gpuscale's engine (a LoRA
    run sends them its adapters only: engines/placement.py), are ranks of one node's launch, leave a device
    to train (rank_batches.run_ranks_on's refusal) and each serves a training rank at least (a training
    rank's prompts go to one generator)."""
    from gpuscale.recipes.shared.rank_batches import run_ranks

    generators = settings.generation_gpus
    if not generators:
        return
    if settings.rollout != "async":
        raise SettingsError(f"generation_gpus: {generators}: needs rollout=async: with rollout=sync each training "
                            "rank generates its own step's completions")
    if settings.generator != "engine":
        raise SettingsError(f"generation_gpus: {generators}: needs generator=engine, not {settings.generator}: the "
                            "generating devices decode with gpuscale's engine")
    if settings.nnodes > 1:
        raise SettingsError(f"generation_gpus: {generators}: on one node only for now (nnodes={settings.nnodes})")
    trainers = run_ranks(settings)
    if generators > trainers:
        raise SettingsError(f"generation_gpus: {generators}: more than the {trainers} training rank(s) left: each "
                            f"training rank's prompts go to one generator, and {generators - trainers} would idle")


class GrpoMtl(Recipe):
    name = "grpo-mtl"
    summary = ("GRPO over a mixture of task domains (TRL GRPOTrainer, gpuscale's generation engine), "
               "optionally with PCGrad; held-out accuracy per domain before/after")
    settings_cls = Settings
    launcher = "accelerate"
    figure_notes = TRAINING_FIGURE_NOTES
    explores = True  # GRPO learns from its own samples: an entropy near 0 is a collapse
    rank_imports = (*Recipe.rank_imports, "trl.trainer.grpo_trainer")
    promised_figures = ("world_size", "steps", "generator", "rollout", "eval_split", "mtl", "tokens_per_s",
                        "generation_seconds", "training_seconds", "step_seconds_median", "generation_seconds_per_step",
                        "accuracy_greedy_before", "accuracy_greedy_after",
                        "accuracy_sampled_before", "accuracy_sampled_after", "model_dir")
    smoke_settings = {"max_examples": 8, "batch_size": 4, "num_generations": 2, "prompts_per_step": 2,
                      "max_steps": 1, "max_completion_length": 8, "eval_examples": 2}

    def check(self, settings: Settings) -> None:
        """The data set must load and keep training examples once the evaluation's are held out;
        the step's completions must split over the ranks (`super().check`) into equal micro-batches."""
        check_placement(settings)  # before super(): its reasons say more than the count of devices left
        super().check(settings)
        from gpuscale.data.tasks import check_dataset
        from gpuscale.recipes.shared.rank_batches import run_ranks

        check_dataset(settings.dataset, "train", settings.max_examples)
        check_domain_weights(settings)
        check_rollout(settings)
        accumulation_steps(settings, run_ranks(settings))  # after super(): the share splits
        # The ranks' device is not known here: the rows are counted at a GPU's steps, the most a run loads
        # (data.py), which hold a step's prompts exactly when the CPU's fewer do.
        check_training_examples(resolved_for_device(settings, on_gpu=True))

    # Tuning (`gpuscale tune`): the per-device micro-batch of the loss's forward and backward; the
    # accumulation follows from it (accumulation_steps), so the step's completions stay as asked. mtl is
    # in the key: PCGrad's trial takes a pass and a gradient buffer per domain, as its run does.
    tuning = Tuning(figure="tokens_per_s",
                    knob="completions per device per micro-batch (accumulation keeps the step's completions)",
                    shape_settings=("dataset", "max_prompt_length", "max_completion_length", "lora_rank",
                                    "lora_targets", "beta", "completions_per_step", "liger_kernels", "mtl"),
                    # How long a run trains (read where the trial's settings are resolved for the device);
                    # the generators, which count the ranks that share a step as `gpus` does; which prompts the
                    # trial's rows are, as `seed` and `max_examples` choose them (completions at full length).
                    not_shaping=("max_steps", "generation_gpus", "domain_weights"),
                    start=1)  # every trial trains on the same rows per step: a small micro-batch is no slower to try

    def rank_splits(self, settings: Settings) -> list[Split]:
        return [completions_split(settings)]

    def trial_session(self, settings: Settings, ctx):
        from gpuscale.recipes.grpo_mtl.trial import trial_session

        return trial_session(settings, ctx)

    def tune_batch_sizes(self, settings: Settings, ranks: int = 1) -> list[int] | None:
        from gpuscale.recipes.shared.rank_batches import micro_batches

        return micro_batches(rank_share(settings, ranks))

    def tune_max_batch(self, settings: Settings, ranks: int = 1) -> int | None:
        return rank_share(settings, ranks)

    def with_batch_size(self, settings: Settings, batch_size: int) -> Settings:
        from gpuscale.recipes.shared.rank_batches import micro_batch_within, run_ranks

        micro = micro_batch_within(rank_share(settings, run_ranks(settings)), batch_size)
        return settings.model_copy(update={"batch_size": micro})

    def run(self, settings: Settings, ctx, reporter) -> None:
        from gpuscale.recipes.grpo_mtl.trainer import run_grpo_mtl

        run_grpo_mtl(settings, ctx, reporter)

    def run_side(self, settings: Settings, ctx, reporter) -> None:
        from gpuscale.recipes.grpo_mtl.trainer import generate_for_trainers

        generate_for_trainers(settings, ctx, reporter)
