"""What a recipe is: the one contract every recipe implements, and everything else relies on.

A recipe is a subclass of `Recipe` that declares, as class attributes,

- `name`           the name users type (`gpuscale run --recipe NAME`);
- `summary`        one line for the recipe list;
- `settings_cls`   its pydantic settings (a `RunSettings` subclass: the TUI builds its form from it);
- `launcher`       "torchrun" or "accelerate" (TRL-based recipes), how its ranks are started;
- `promised_figures`  the keys its run summary always holds, each a figure of the catalogue
                   (data/figures.py: label, unit, direction; the contract test checks both);
- `smoke_settings` the smallest settings that still exercise the whole recipe on the embedded
                   default on one CPU rank (the contract test runs them);

and implements `run(settings, ctx, reporter)`, the work of one rank, on settings whose device defaults
(recipes/shared/device_defaults.py) are resolved for the rank's device. A recipe that can be tuned
(`gpuscale tune`, `--batch-size auto`) declares `tuning` (its throughput figure and the
settings that change the shape of its work) and implements `trial_session(settings, ctx)`, and where
its batch is bounded or constrained `tune_batch_sizes` / `tune_max_batch`. `check(settings)` runs in the
front end before anything is launched: a recipe refuses there what it can know is bad (a model that
cannot load, data that does not parse, an empty data set) with one line naming the field, the value
and the reason.

A recipe module's top level imports no torch (the TUI lists recipes at start-up and must open fast):
torch and the engines are imported inside `run`. Ranks are started as
`python -m gpuscale.recipes --recipe NAME --settings RUN_DIR/settings.json` (see `__main__.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from gpuscale.recipes.shared.device_defaults import device_defaults_line, left_to_device, resolved_for_device
from gpuscale.recipes.shared.rank_split import FITTED_TO_RANKS, Split, fit_splits
from gpuscale.runs.settings import RunSettings

if TYPE_CHECKING:  # torch is imported only inside a rank
    from gpuscale.engines.batch_search import Trial
    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.reporter import Reporter

Launcher = Literal["torchrun", "accelerate"]


@dataclass(frozen=True)
class Tuning:
    """How a recipe is tuned (`gpuscale tune`, recipes/shared/device_trials.py). `figure`: the throughput its trials
    measure (problems_per_s, tokens_per_s...); `shape_settings`: the settings that change the shape of the work
    (answer length, chains...), part of a stored result's key with recipe, model, GPU and precision; `knob`: what
    the tuned batch is, in words; `start`: the first batch tried on a GPU (small batches of a slow recipe cost
    minutes and are never the best); `cpu_batch_size`: what `--batch-size auto` means on CPU with nothing stored
    (None: the settings' default); `not_shaping`: the other settings its trial reads, which change neither its
    memory nor its work (a learning rate), beside those of every recipe (`RUN_SETTINGS_NOT_SHAPING`). A setting
    the trial reads that is in neither list fails tests/integration/test_tune_recipes.py: left out of the key,
    `--batch-size auto` would reuse a tuning made for other work."""

    figure: str
    shape_settings: tuple[str, ...] = ()
    not_shaping: tuple[str, ...] = ()
    knob: str = "batch_size per rank"
    start: int = 8
    cpu_batch_size: int | None = None


# RunSettings' fields a trial may read that are in no recipe's key: the model and precision are the key's
# own; `batch_size` is what is tuned; `gpus` and `nnodes` count the ranks, whose share of a step is in the
# shape where it matters (sft's `step_asked`); `compile` is added to the key when on (`tuning_key`); the
# seed, the questions drawn (`max_examples`, `too_long`) and the held-out ones change which rows, not
# their size; `domain` only names the rows of a file.
RUN_SETTINGS_NOT_SHAPING = ("model", "precision", "batch_size", "gpus", "nnodes", "compile", "seed", "max_examples",
                            "too_long", "eval_examples", "eval_split", "domain")

TrialFn = Callable[[int], "Trial"]


class Recipe(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    settings_cls: ClassVar[type[RunSettings]]
    launcher: ClassVar[Launcher] = "torchrun"
    promised_figures: ClassVar[tuple[str, ...]] = ()
    smoke_settings: ClassVar[dict[str, Any]] = {}
    tuning: ClassVar[Tuning | None] = None  # None: `gpuscale tune` refuses the recipe
    # Whether its runs read the data set's questions: the rule for one too long for the model's
    # context (`too_long`, data/question_length.py) is checked before launch for those that do.
    reads_questions: ClassVar[bool] = True
    # What a figure of a shared name counts in this recipe's summary, where the recipe counts it its
    # own way (the probe's tokens_per_s: decode steps alone): shown beside its value in `gpuscale show`,
    # the TUI's run page and an export, before the catalogue's own note (data/figures.py).
    figure_notes: ClassVar[dict[str, str]] = {}
    # Whether it trains on what its own policy samples (RL: grpo-mtl): there the trainer's entropy near 0
    # means the policy stopped exploring, and the views warn (app/views/collapse.py). A supervised
    # recipe's entropy (sft's, rft's fine-tune on kept answers) is meant to fall toward 0.
    explores: ClassVar[bool] = False
    # The modules its rank's work imports, by name: made once the rank's world is set up, before the work
    # starts, and frozen with the rest of the rank's imports out of the cyclic collector's sight
    # (engines/distributed.py:freeze_imports). Every built-in recipe's rank loads a transformers model:
    # its model classes, and through them torch._dynamo and torch.distributed.tensor.
    rank_imports: ClassVar[tuple[str, ...]] = ("transformers.modeling_utils",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if getattr(cls, "__abstractmethods__", None):
            return  # an intermediate base class
        missing = [attr for attr in ("name", "summary", "settings_cls") if not hasattr(cls, attr)]
        if missing:
            raise TypeError(f"recipe {cls.__name__} does not declare {', '.join(missing)}")
        if not issubclass(cls.settings_cls, RunSettings):
            raise TypeError(f"recipe {cls.name}: settings_cls must subclass RunSettings")
        if cls.launcher not in ("torchrun", "accelerate"):
            raise TypeError(f"recipe {cls.name}: launcher {cls.launcher!r} is neither torchrun nor accelerate")

    @property
    def rank_entry(self) -> list[str]:
        """The module and arguments that start one rank (settings file excluded)."""
        return ["-m", "gpuscale.recipes", "--recipe", self.name]

    @classmethod
    def uncatalogued_figures(cls) -> list[str]:
        """The promised figures, and the tuning's throughput figure, that the catalogue
        (data/figures.py) does not know: the contract test wants none, so that every view writes what
        a recipe promises with its unit."""
        from gpuscale.data.figures import is_catalogued

        names = (*cls.promised_figures, *([cls.tuning.figure] if cls.tuning else []))
        return [name for name in names if not is_catalogued(name)]

    def check(self, settings: RunSettings) -> None:
        """Refuse, before launch, what can be known to be bad (raise SettingsError, DataError or
        ModelError with one line). The default checks that the counts the ranks share split over them
        (`fit_to_ranks`), that the model can be loaded (config and
        safetensors headers, or the hub id cached or reachable) and, for a recipe that reads
        questions, that none is too long for its context (or that too_long=skip leaves it out); a
        recipe that checks more calls `super().check(settings)` first."""
        from gpuscale.data.models import check_model

        self.fit_to_ranks(settings, adapt=False)  # a count the ranks cannot share: refused, nothing loaded
        check_model(settings.model)
        if self.reads_questions:
            from gpuscale.data.question_length import question_limit, questions_too_long

            questions_too_long(settings.dataset, question_limit(settings))

    def rank_splits(self, settings: RunSettings) -> list[Split]:
        """The counts of a step that the ranks share out equally (recipes/shared/rank_split.py: sft's
        rows_per_step, grpo-mtl's completions, eggroll's population); [] where nothing must split."""
        return []

    def fit_to_ranks(self, settings: RunSettings, adapt: bool = True) -> tuple[RunSettings, list[str]]:
        """The settings with `rank_splits` fitted to the ranks this run starts (`rank_split.fit_splits`): a
        default the user did not give moved to the nearest value that splits, with a line saying so; a
        given value that does not split refused (SettingsError naming it and the values that would), as
        is any value with `adapt=False`. Called by the launch before tuning (app/batch_choice.py) and by
        `check`."""
        from gpuscale.recipes.shared.rank_batches import run_ranks_on

        ranks, on_gpu = run_ranks_on(settings)
        return fit_splits(settings, self.rank_splits(settings), ranks, on_gpu, adapt)

    def for_device(self, settings: RunSettings, on_gpu: bool, ranks: int) -> RunSettings:
        """The settings with those left to the device resolved, for `ranks` ranks; called where the
        device is known: by the rank before its work (`run_on_device`) and by the tuner before its
        trials. The default sets every device default still `auto` (recipes/shared/device_defaults.py:
        sft's epochs, grpo-mtl's steps...) to the device's value, fitted to the ranks where it is one of
        `rank_splits` (`device_values_fitted`); a recipe that sizes more (eggroll's batch) calls it first."""
        return self.device_values_fitted(settings, on_gpu, ranks)[0]

    def device_values_fitted(self, settings: RunSettings, on_gpu: bool, ranks: int) -> tuple[RunSettings, list[str]]:
        """The device defaults resolved (`resolved_for_device`), those the ranks share (eggroll's
        population) moved to the nearest value that splits over `ranks`, and a line for each moved."""
        resolved = resolved_for_device(settings, on_gpu)
        given = resolved.model_fields_set - set(left_to_device(settings))
        return fit_splits(resolved, self.rank_splits(resolved), ranks, on_gpu, given=given)

    def run_on_device(self, settings: RunSettings, ctx: RankContext, reporter: Reporter) -> None:
        """What a rank runs (recipes/__main__.py): `run` on the settings resolved for its device, rank 0's
        log saying first which device defaults it took, and its summary which it fitted to the ranks."""
        on_gpu = ctx.device.type == "cuda"
        line = device_defaults_line(settings, on_gpu)
        _, fitted = self.device_values_fitted(settings, on_gpu, ctx.world_size)
        if ctx.is_main:
            for said in (line, *fitted):
                if said:
                    print(said, flush=True)
            if fitted:
                reporter.summary({FITTED_TO_RANKS: "; ".join(fitted)}, partial=True)
        self.run(self.for_device(settings, on_gpu, ctx.world_size), ctx, reporter)

    def run_side_on_device(self, settings: RunSettings, ctx: RankContext, reporter: Reporter) -> None:
        """What a side rank runs (`RunSettings.side_ranks`: the launch's last ranks, outside the training
        world; engines/distributed.py): `run_side` on the settings resolved as the training ranks' are."""
        self.run_side(self.for_device(settings, ctx.device.type == "cuda", ctx.world_size), ctx, reporter)

    def run_side(self, settings: RunSettings, ctx: RankContext, reporter: Reporter) -> None:
        """The work of a side rank, which serves the `ctx.world_size` training ranks (grpo-mtl's
        generators); only a recipe whose settings declare SIDE_RANKS_FIELD has any."""
        raise NotImplementedError(f"recipe {self.name} has no side ranks")

    def trial_session(self, settings: RunSettings, ctx: RankContext) -> AbstractContextManager[TrialFn]:
        """A context (model and data loaded once) giving `trial(batch_size) -> Trial`: a few steps of
        the real work at that batch on `ctx.device`, warm-up excluded, with `throughput` in
        `tuning.figure` and `step_seconds`; out of memory is raised (torch.cuda.OutOfMemoryError),
        and peak memory is measured around the call by the tuner (recipes/shared/device_trials.py)."""
        raise NotImplementedError(f"recipe {self.name} cannot be tuned")

    def tune_batch_sizes(self, settings: RunSettings, ranks: int = 1) -> list[int] | None:
        """The batch sizes a tuner may try for a run of `ranks` ranks (None: any); a training recipe
        gives the divisors of its per-rank share of the global batch the user asked for, so that
        gradient accumulation can keep it."""
        return None

    def tune_max_batch(self, settings: RunSettings, ranks: int = 1) -> int | None:
        """The most work one of `ranks` ranks can take in one batch (a larger batch would be padding
        only): the default of `gpuscale tune --max-batch`. None where it is not known up front."""
        return None

    def with_batch_size(self, settings: RunSettings, batch_size: int) -> RunSettings:
        """The settings with the tuned batch; a training recipe also rescales gradient accumulation."""
        return settings.model_copy(update={"batch_size": batch_size})

    def resume_overrides(self, run: dict) -> dict[str, Any]:
        """Settings a resume of the ended `run` (the history's row) continues it from besides a
        checkpoint, e.g. rft's kept answers; {} when it has none (a run with neither a checkpoint
        nor these is refused: `control/launch.py:resume_settings`)."""
        return {}

    @abstractmethod
    def run(self, settings: RunSettings, ctx: RankContext, reporter: Reporter) -> None:
        """The work of one rank. Rank 0 ends with `reporter.summary({...})` holding promised_figures."""
