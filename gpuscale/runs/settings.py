"""Run settings: one pydantic model per recipe, all built on RunSettings.

Layers, later wins: the model's defaults < a preset TOML file < environment variables
(GPUSCALE_<FIELD>, plus the knob names the users already type, e.g. POWERSAMPLE_BATCH_SIZE) < the
command line (`--set key=value`, `--batch-size`, the TUI form). Everything is validated once, before
anything starts; a bad value becomes one SettingsError line naming the field, the value and the reason.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from gpuscale.data.paths import absolute_path

# The one precision rule lives on the lowest floor, where the model loader can call it too; the
# control plane and the front ends take it from here (it imports no torch).
from gpuscale.data.precision import AUTO_RULE, Precision
from gpuscale.data.precision import resolved_precision as resolved_precision


class SettingsError(ValueError):
    """Bad input from the user: one line, field + value + reason. The CLI exits 2 on it."""


# A checkpoint every 50 optimizer steps: a stopped or lost run loses at most that much work, and
# short runs (eggroll's 20 steps, a quick sft) write none and pay nothing for it.
DEFAULT_CHECKPOINT_EVERY = 50


AUTO_MEMORY_SHARE = 0.5  # of the card's memory left once the model is loaded

# The largest seed: the TRL recipes' trainer seeds numpy with it (transformers' set_seed), and numpy's
# legacy seeding takes 0 to 2**32 - 1; a larger one would fail in every rank after launch.
MAX_SEED = 2**32 - 1


def words_meaning(*words: str, meaning: Any = None) -> Callable[[Any], Any]:
    """A field's before-validator, the one rule for the words a setting takes for "none" (or "auto",
    "off"): a string that is one of `words` (lower case; any case and spaces around it are accepted)
    means `meaning`, None unless given; any other value goes on to the field's own validation as it
    is. In a settings class: `_words = field_validator("field", mode="before")(words_meaning("", "none"))`."""

    def validator(value: Any) -> Any:
        return meaning if isinstance(value, str) and value.strip().lower() in words else value

    return validator


class RunSettings(BaseModel):
    # defer_build: a class's validator is built when it first validates, not at import. The TUI lists
    # every recipe (importing every settings class) before its first frame but validates one recipe's
    # settings only after it; the CLI validates one recipe's. Building them all up front cost some
    # 60 ms of the first frame, with pydantic's scan of the installed packages for plugins.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, defer_build=True)

    # Knob names users already type, mapped to fields: environment variables and --set keys.
    ENV_ALIASES: ClassVar[dict[str, str]] = {}
    KEY_ALIASES: ClassVar[dict[str, str]] = {}
    # Fields whose value may be a run id of the history (rft's data_from): the front end turns the id
    # into that run's folder before launch (control/launch.py:run_ids_as_folders), so that a rank reads
    # a path only and never opens the history (on a multi-node job the home need not exist there).
    RUN_ID_FIELDS: ClassVar[tuple[str, ...]] = ()
    # The field that counts the ranks of a launch standing outside the training world (grpo-mtl's
    # generation_gpus: its generators), None where every rank trains: `side_ranks`.
    SIDE_RANKS_FIELD: ClassVar[str | None] = None

    model: str = Field("tiny-math", description="model name, hub id or local path")
    dataset: str = Field("tiny-math", description="data set name or local JSONL path")
    too_long: Literal["refuse", "skip"] = Field(
        "refuse", description="a question longer than the model's context (data/question_length.py): refuse "
                              "the run before launch, naming file and line, or skip such questions and count "
                              "them (questions_too_long in the summary)")
    gpus: Literal["all"] | int | list[int] = Field(
        "all", description="'all', a count, or GPU indices like 0,3 (on a CPU machine: the number of ranks)"
    )
    batch_size: int = Field(8, ge=1, description="sequences per rank per step")
    precision: Precision = Field(
        "auto", description=AUTO_RULE  # what data.precision.resolved_precision does
    )
    gpu_memory_share: float = Field(
        AUTO_MEMORY_SHARE, gt=0, le=0.95,
        description="share of the GPU's memory left after loading the model that a batch sized `auto` may fill "
                    "(the card's memory less this run's, not what other processes leave free, so that a seed "
                    "reproduces); lower it when several runs share one card")
    compile: bool = Field(False, description="torch.compile the model where the recipe supports it")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="random seed, 0 to 4294967295")
    max_examples: int | None = Field(None, ge=1, description="use at most this many examples")
    nnodes: int = Field(1, ge=1, description="number of nodes (hosts) in the job")
    node_rank: int = Field(0, ge=0, description="this node's rank in a multi-node job")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of the rendezvous for a multi-node job")
    rdzv_id: str = Field("gpuscale", description="job id shared by all nodes of one multi-node job")
    telemetry_interval: float = Field(1.0, ge=0.1, le=60, description="seconds between telemetry samples")
    hang_timeout: Literal["auto"] | float = Field(
        "auto",
        description="seconds a step may go without any rank advancing before the run is ended as hung (stacks "
                    "in RUN_DIR/errors/, status failed, `hung:`); auto = the larger of 120 s and 5x the p95 step "
                    "time so far; loading, the first step, evaluation and saving get at least 600 s; 0 or off = never")
    # Checkpoints: only the training recipes (eggroll, sft, rft, grpo-mtl) act on these; the others
    # ignore them, so `gpuscale resume` finds nothing to resume for those.
    checkpoint_every: int = Field(
        DEFAULT_CHECKPOINT_EVERY, ge=0,
        description="training recipes: a checkpoint every this many optimizer steps, in RUN_DIR/checkpoints "
                    "(0 or off = none); `gpuscale resume` continues a stopped run from the last one")
    keep_checkpoints: int = Field(2, ge=1, le=10_000, description="training recipes: keep the newest this many "
                                  "checkpoints (older ones are deleted as new ones are written)")
    resume_from: str | None = Field(None, description="a checkpoint folder to continue from (set by "
                                    "`gpuscale resume`; rarely given by hand)")
    private: bool = Field(False, description="the run folder 0700 and its files 0600 whatever the umask, for a shared "
                          "node (GPUSCALE_PRIVATE=1: every run)")
    domain: str | None = Field(
        None, description="JSONL files: the domain of a row with no 'domain' field of its own (none: its file's "
                          "name, so gsm8k/test.jsonl's rows are domain 'test'); it names the per-domain figures "
                          "(accuracy_greedy_<domain>_after...)")

    # Defined before `_no_bool_for_a_number`: pydantic runs the before-validators defined later first,
    # so true/false is refused as such before this reads it as 1 or 0.
    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _auto_off_or_seconds(cls, value: Any) -> Any:
        value = words_meaning("", "auto", meaning="auto")(words_meaning("off", "none", "no", "false", meaning=0)(value))
        if value == "auto":
            return value
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise ValueError("expected 'auto', 'off' (or 0) or a number of seconds") from None
        if not seconds >= 0:  # not NaN either
            raise ValueError("seconds must be 0 (off) or more")
        return seconds

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """true/false where a number is expected (a preset's `batch_size = true`) is refused: pydantic
        would read it as 1 or 0."""
        annotation = cls.model_fields[info.field_name].annotation
        items = value if isinstance(value, list) else [value]
        if any(isinstance(item, bool) for item in items) and _admits(annotation, (int, float)) \
                and not _admits(annotation, (bool,)):
            raise ValueError("true/false where a number is expected")
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpus(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "all":
            text = value.strip()
            if re.fullmatch(r"\d+", text):
                return int(text)
            if re.fullmatch(r"\d+(\s*,\s*\d+)+|\d+\s*,", text):
                return [int(part) for part in text.split(",") if part.strip()]
            raise ValueError("expected 'all', a count like 2, or GPU indices like 0,3")
        return value

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise ValueError("at least 1 GPU (or CPU rank) is needed; GPU 0 alone is written '0,'")
        if isinstance(value, list):
            if not value:
                raise ValueError("give at least one GPU index")
            if len(set(value)) != len(value):
                raise ValueError("a GPU index is listed twice")
        return value

    @field_validator("model", "dataset", mode="before")
    @classmethod
    def _required(cls, value: Any, info: ValidationInfo) -> Any:
        """An empty model or dataset is named as missing (an empty path read as the current folder
        said "is a directory")."""
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"required: give a {cls.model_fields[info.field_name].description}")
        return value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        from gpuscale.data.models import check_model_name

        return check_model_name(value)

    @field_validator("dataset")
    @classmethod
    def _check_dataset(cls, value: str) -> str:
        from gpuscale.data.tasks import check_dataset_name

        return check_dataset_name(value)

    _no_domain_words = field_validator("domain", mode="before")(words_meaning("", "none"))

    @field_validator("domain")
    @classmethod
    def _check_domain(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not re.fullmatch(r"[\w.\-]+", value.strip()):
            raise ValueError("a domain is one word (letters, digits, _ . -): it is part of figure names")
        from gpuscale.data.tasks import parse_dataset

        dataset = info.data.get("dataset")
        if dataset is not None and not parse_dataset(dataset).paths:
            raise ValueError(f"names the domain of JSONL files' rows; the rows of {dataset} carry their own")
        return value.strip()

    _none_words = field_validator("max_examples", mode="before")(words_meaning("", "none", "all"))
    _off_is_zero = field_validator("checkpoint_every", mode="before")(words_meaning("off", "none", "no", "false",
                                                                                    meaning=0))
    _no_checkpoint_words = field_validator("resume_from", mode="before")(words_meaning("", "none"))


    @field_validator("resume_from")
    @classmethod
    def _check_resume_from(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not Path(value).expanduser().is_dir():
            raise ValueError("no such checkpoint folder (`gpuscale resume ID` finds a run's last checkpoint)")
        return str(absolute_path(value))  # the ranks start in the run folder

    @field_validator("rdzv_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", value):
            raise ValueError("expected HOST:PORT, like node001:29500")
        return value

    @property
    def side_ranks(self) -> int:
        """The launch's last ranks that take no share of the step's work: they serve the others (grpo-mtl's
        generators). The ranks that share it are the launch's less these (recipes/shared/rank_batches.py);
        engines/distributed.py keeps these out of the training world's process group."""
        return int(getattr(self, self.SIDE_RANKS_FIELD) or 0) if self.SIDE_RANKS_FIELD else 0

    @classmethod
    def field_for_key(cls, key: str) -> str:
        """The field a user's key means (its own name, a dashed spelling, or an alias)."""
        name = cls.KEY_ALIASES.get(key, key.replace("-", "_"))
        if name not in cls.model_fields:
            known = ", ".join(sorted(cls.model_fields))
            raise SettingsError(f"{key}: unknown setting; known settings: {known}")
        return name


def _admits(annotation: Any, types: tuple[type, ...]) -> bool:
    """Whether a field's annotation takes a value of one of `types`, anywhere in it (`int | None`,
    `list[int]`, `Literal["all"] | int`); a Literal's values are not types and count for none."""
    return annotation in types or any(_admits(part, types) for part in get_args(annotation))


def read_preset(path: str | Path, recipe: str | None = None, recipes: Collection[str] = ()) -> dict[str, Any]:
    """A preset's settings for `recipe`: its top-level keys, which every recipe reads, with the keys of
    its `[recipe]` table on top (`[grpo-mtl]`), so that one file serves several recipes. Another
    recipe's table (one of `recipes`) is that recipe's and is skipped; a table that names no recipe
    is refused: a typo would otherwise drop its settings without a word."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"preset: {path}: cannot be read ({exc.strerror})") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"preset: {path}: not valid TOML ({exc})") from None
    tables = {key: value for key, value in document.items() if isinstance(value, dict)}
    for name in tables:
        if name != recipe and name not in recipes:
            known = ", ".join(sorted({*recipes, *([recipe] if recipe else [])})) or "none"
            raise SettingsError(f"preset: {path}: [{name}]: a table holds one recipe's settings and no recipe is "
                                f"called {name!r} (recipes: {known}); settings for every recipe go above the tables")
    shared = {key: value for key, value in document.items() if key not in tables}
    return {**shared, **tables.get(recipe, {})}


def environment_layer(settings_cls: type[RunSettings], environ: Mapping[str, str]) -> dict[str, str]:
    layer: dict[str, str] = {}
    for field in settings_cls.model_fields:
        value = environ.get(f"GPUSCALE_{field.upper()}")
        if value is not None:
            layer[field] = value
    for env_name, field in settings_cls.ENV_ALIASES.items():
        if env_name in environ:
            layer[field] = environ[env_name]
    return layer


def parse_assignments(items: list[str]) -> dict[str, str]:
    """`--set key=value` items into a dict (keys checked later, against the recipe's model)."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--set: {item!r}: expected key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def resolve_settings(
    settings_cls: type[RunSettings],
    preset: str | Path | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RunSettings:
    """Merge the layers and validate once. Raises SettingsError naming field, value and reason."""
    merged = merge_layers(settings_cls, preset, overrides, environ)
    try:
        return settings_cls.model_validate(merged)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None


def merge_layers(
    settings_cls: type[RunSettings],
    preset: str | Path | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The layers merged, by field name, not yet validated (a front end may resolve a word such as
    `batch_size=auto` first). `preset`: a TOML file's path, or its settings as `read_preset` gave
    them for the recipe (the front ends, which know the recipes, read its table that way)."""
    merged: dict[str, Any] = {}
    layers = [
        ("preset", read_preset(preset) if isinstance(preset, (str, Path)) else dict(preset or {})),
        ("environment", environment_layer(settings_cls, os.environ if environ is None else environ)),
        ("command line", dict(overrides or {})),
    ]
    for origin, layer in layers:
        for key, value in layer.items():
            try:
                merged[settings_cls.field_for_key(key)] = value
            except SettingsError as error:
                if origin != "preset":
                    raise
                raise SettingsError(f"preset: {error} (a setting of one recipe goes in its [RECIPE] table, "
                                    "e.g. [sft])") from None
    return merged


def describe_validation_error(exc: ValidationError) -> str:
    errors = exc.errors()
    error = errors[0]
    field = ".".join(str(part) for part in error["loc"][:1]) or "settings"
    return f"{field}: {error.get('input')!r}: {field_reason(errors, error['loc'][:1])}"


def field_reason(errors: list[dict], field_loc: tuple) -> str:
    """Why one field's value was refused, in words. A field that takes a word or a number (`auto`
    or a count, `all` or a count) fails on both; the word's "Input should be 'auto'" says nothing
    of what was wrong with the number, so the number's rule is given, the word after it."""
    mine = [error for error in errors if error["loc"][:1] == field_loc]
    reason = mine[0]["msg"].removeprefix("Value error, ")
    if mine[0]["type"] == "literal_error" and len(mine) > 1:
        reason = f"{mine[1]['msg'].removeprefix('Value error, ')} (or {mine[0]['ctx']['expected']})"
    return reason


def check_field(settings_cls: type[RunSettings], field: str, value: Any) -> str | None:
    """Validate one value for one field on its own (the TUI's inline error); None when fine."""
    try:
        settings_cls.model_validate({field: value})
    except ValidationError as exc:
        if any(e["loc"][:1] == (field,) for e in exc.errors()):
            return field_reason(exc.errors(), (field,))
    return None


# A `batch_size` field's before-validator: the words "auto", "none" and "" mean None, the batch the rank
# sizes for its card (card_sized_batch in engines/distributed.py).
auto_means_sized_on_card = words_meaning("", "auto", "none")
