"""What a recipe is: the one contract every recipe implements, and everything else relies on.

A recipe is a subclass of `Recipe` that declares, as class attributes,

- `name`           the name users type (`gpuscale run --recipe NAME`);
- `summary`        one line for the recipe list;
- `settings_cls`   its pydantic settings (a `RunSettings` subclass: the TUI builds its form from it);
- `launcher`       "torchrun" or "accelerate" (TRL-based recipes), how its ranks are started;
- `promised_figures`  the keys its run summary always holds (the contract test checks them);
- `smoke_settings` the smallest settings that still exercise the whole recipe on the embedded
                   default on one CPU rank (the contract test runs them);

and implements `run(settings, ctx, reporter)`, the work of one rank. `check(settings)` runs in the
front end before anything is launched: a recipe refuses there what it can know is bad (a model that
cannot load, data that does not parse, an empty data set) with one line naming the field, the value
and the reason.

A recipe module's top level imports no torch (the TUI lists recipes at start-up and must open fast):
torch and the engines are imported inside `run`. Ranks are started as
`python -m gpuscale.recipes --recipe NAME --settings RUN_DIR/settings.json` (see `__main__.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from gpuscale.engines.settings import RunSettings

if TYPE_CHECKING:  # torch is imported only inside a rank
    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.metrics import Reporter

Launcher = Literal["torchrun", "accelerate"]


class Recipe(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    settings_cls: ClassVar[type[RunSettings]]
    launcher: ClassVar[Launcher] = "torchrun"
    promised_figures: ClassVar[tuple[str, ...]] = ()
    smoke_settings: ClassVar[dict[str, Any]] = {}

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

    def check(self, settings: RunSettings) -> None:
        """Refuse, before launch, what can be known to be bad (raise SettingsError, DataError or
        ModelError with one line). The default checks that the model can be loaded (config and
        safetensors headers, or the hub id cached or reachable); a recipe that checks more calls
        `super().check(settings)` first."""
        from gpuscale.data.models import check_model

        check_model(settings.model)

    @abstractmethod
    def run(self, settings: RunSettings, ctx: RankContext, reporter: Reporter) -> None:
        """The work of one rank. Rank 0 ends with `reporter.summary({...})` holding promised_figures."""
