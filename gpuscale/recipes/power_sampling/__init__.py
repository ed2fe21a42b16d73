"""power-sampling: MCMC sampling from p^alpha for math reasoning (Karan & Du 2025), batched, multi-GPU.

Each rank takes every world_size-th problem, and works through its share in batches of `batch_size`
problems x `chains` chains, all advanced together by the batched engine (mcmc.py). `method` also
offers the baselines to compare with: plain sampling at `temperature`, greedy decoding, and
`reference`, the public code's structure (one problem at a time, one generate() call per MCMC step).
At the end rank 0 merges every rank's results into RUN_DIR/results.jsonl. The chains of a problem are
independent draws (every row its own noise), so with chains > 1 the summary's `accuracy` is the share
of all problems x chains answered correctly (pass@1) and `pass_at_k` adds Chen et al.'s unbiased pass@k.

`split` (also set as `eval_split`) chooses the problems: the data set's test or training split, or
`validation`, the first `max_examples` problems of the training data as a training recipe's
`eval_split=validation` holds them out (data/tasks.py's `evaluation_examples`), for choosing
settings without scoring the test problems. The summary's `eval_split` names it.

Files: this one (settings and the recipe, no torch), sampler.py (a rank's work), mcmc.py (the
Metropolis-Hastings sampler on the generation engine, and the reference structure), pass_at_k.py (the
estimator, pure).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpuscale.data.splits import EVAL_SPLITS, OLD_TEST_SPLIT_HELP, TEST_SPLIT_HELP
from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.recipes.shared.device_defaults import AUTO, device_default
from gpuscale.runs.settings import RunSettings, SettingsError, auto_means_sized_on_card

# The problems scored unless told: the whole split on a GPU; on CPU ranks tiny-math's 2,000 test problems
# take several minutes on 2 cores, 500 (about +-2.2 points of accuracy) about a minute.
GPU_PROBLEMS, CPU_PROBLEMS = None, 500


class Settings(RunSettings):
    # The knobs of the users' own scripts (shared/seeds) keep working.
    ENV_ALIASES = {
        "POWERSAMPLE_STEPS": "mcmc_steps",
        "POWERSAMPLE_MAX_NEW": "max_new_tokens",
        "POWERSAMPLE_MAX_EXAMPLES": "max_examples",
        "POWERSAMPLE_NUM_GPUS": "gpus",
        "POWERSAMPLE_BATCH_SIZE": "batch_size",
    }
    KEY_ALIASES = {"steps": "mcmc_steps", "max_new": "max_new_tokens", "temp": "temperature",
                   "eval_split": "split"}  # the training recipes' name for the problems scored

    batch_size: int | None = Field(
        None, ge=1,
        description="problems per rank per batch; empty = auto: 8 on CPU, on a GPU as many as fill half the "
                    "memory its model leaves (at most 512)",
    )
    compile: bool = Field(False, description="torch.compile the decode step (CUDA only): faster steps, but each "
                          "process compiles for tens of seconds first; worth it for long runs")
    method: Literal["power", "sample", "greedy", "reference"] = Field(
        "power",
        description="power = batched MCMC; sample / greedy = baselines; "
                    "reference = one problem at a time with generate()",
    )
    max_examples: Literal["auto"] | Annotated[int, Field(ge=1)] | None = device_default(
        GPU_PROBLEMS, CPU_PROBLEMS, "problems scored (empty = the whole split)")
    # 16, not 4 (until 2026-11-30): on 500 validation problems, 3 seeds, power minus greedy was -0.2 ± 0.2
    # points at 16 and -0.8 ± 0.7 at 4 on an H200 in bf16, and +0.6 against +0.2 on CPU ranks in fp32
    # (bench/results/power_sampling/power-vs-greedy-alpha-3seeds-2026-11-30-h200x2.json, ...-29-cpu.json).
    alpha: float = Field(16.0, ge=1.0, le=64.0, description="target p^alpha; proposal at temperature 1/alpha")
    max_new_tokens: int = Field(3072, ge=1, le=65536, description="answer length budget")
    blocks: int = Field(16, ge=1, le=1024, description="the answer grows in this many blocks")
    mcmc_steps: int = Field(10, ge=0, le=10000, description="Metropolis-Hastings steps after each block")
    chains: int = Field(1, ge=1, le=1024, description="independent chains (samples) per problem")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="temperature of method=sample")
    split: Literal[*EVAL_SPLITS, "train"] = Field(
        "test", description="the problems scored (also set as eval_split): test or train = the data set's split "
        f"({TEST_SPLIT_HELP}; a JSONL file: its first max_examples rows either way); validation = the first "
        "max_examples problems of the training data, as a training recipe's eval_split=validation holds them out (a "
        "JSONL file: the max_examples rows after its first max_examples); needs max_examples; " + OLD_TEST_SPLIT_HELP)
    answer_mode: Literal["auto", "strict", "boxed", "flexible"] = Field("auto", description="answer extraction")

    _auto_words = field_validator("batch_size", mode="before")(auto_means_sized_on_card)


class PowerSampling(Recipe):
    name = "power-sampling"
    summary = "MCMC sampling from p^alpha for math reasoning (GSM8K), batched over problems, chains and GPUs"
    settings_cls = Settings
    promised_figures = ("world_size", "method", "problems", "eval_split", "accuracy", "problems_per_s", "tokens_per_s",
                        "warm_up_seconds")
    smoke_settings = {"max_examples": 2, "max_new_tokens": 8, "blocks": 2, "mcmc_steps": 1, "batch_size": 2}
    tuning = Tuning(figure="problems_per_s", knob="problems per rank per batch", cpu_batch_size=8,
                    shape_settings=("dataset", "split", "method", "max_new_tokens", "blocks", "mcmc_steps", "chains"),
                    # The target's exponent and the answer rule: the same proposals and forwards.
                    not_shaping=("alpha", "answer_mode"))

    def trial_session(self, settings: Settings, ctx):
        from gpuscale.recipes.power_sampling.trial import trial_session

        return trial_session(settings, ctx)

    def tune_max_batch(self, settings: Settings, ranks: int = 1) -> int | None:
        """A rank's share of max_examples (each rank takes every ranks-th problem)."""
        return -(-settings.max_examples // ranks) if settings.max_examples else None

    def check(self, settings: Settings) -> None:
        """The data set's problems parse (all of the split where max_examples is left to the device:
        a GPU scores them all); validation problems need their number given."""
        super().check(settings)
        from gpuscale.data.tasks import check_dataset

        if settings.split == "validation":
            if settings.max_examples in (None, AUTO):
                raise SettingsError(f"split: validation: needs max_examples as a number, not "
                                    f"{settings.max_examples or 'empty'} (the validation problems are the first "
                                    "max_examples of the training data)")
            check_dataset(settings.dataset, "train", None)
        else:
            check_dataset(settings.dataset, settings.split, None if settings.max_examples == AUTO
                          else settings.max_examples)

    def run(self, settings: Settings, ctx, reporter) -> None:
        from gpuscale.recipes.power_sampling.sampler import run_power_sampling

        run_power_sampling(settings, ctx, reporter)
