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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


def words_meaning(*words: str, meaning: Any = None) -> Callable[[Any], Any]:
    """A field's before-validator, the one rule for the words a setting takes for "none" (or "auto",
    "off"): a string that is one of `words` (lower case; any case and spaces around it are accepted)
    means `meaning`, None unless given; any other value goes on to the field's own validation as it
    is. In a settings class: `_words = field_validator("field", mode="before")(words_meaning("", "none"))`."""

    def validator(value: Any) -> Any:
        return meaning if isinstance(value, str) and value.strip().lower() in words else value

    return validator


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Knob names users already type, mapped to fields: environment variables and --set keys.
    ENV_ALIASES: ClassVar[dict[str, str]] = {}
    KEY_ALIASES: ClassVar[dict[str, str]] = {}
    # Fields whose value may be a run id of the history (rft's data_from): the front end turns the id
    # into that run's folder before launch (control/launch.py:run_ids_as_folders), so that a rank reads
    # a path only and never opens the history (on a multi-node job the home need not exist there).
    RUN_ID_FIELDS: ClassVar[tuple[str, ...]] = ()

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
    seed: int = Field(0, description="random seed (each rank derives its own)")
    max_examples: int | None = Field(None, ge=1, description="use at most this many examples")
    nnodes: int = Field(1, ge=1, description="number of nodes (hosts) in the job")
    node_rank: int = Field(0, ge=0, description="this node's rank in a multi-node job")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of the rendezvous for a multi-node job")
    rdzv_id: str = Field("gpuscale", description="job id shared by all nodes of one multi-node job")
    telemetry_interval: float = Field(1.0, ge=0.1, le=60, description="seconds between telemetry samples")
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
        return str(Path(value).expanduser().absolute())  # the ranks start in the run folder

    @field_validator("rdzv_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", value):
            raise ValueError("expected HOST:PORT, like node001:29500")
        return value

    @classmethod
    def field_for_key(cls, key: str) -> str:
        """The field a user's key means (its own name, a dashed spelling, or an alias)."""
        name = cls.KEY_ALIASES.get(key, key.replace("-", "_"))
        if name not in cls.model_fields:
            known = ", ".join(sorted(cls.model_fields))
            raise SettingsError(f"{key}: unknown setting; known settings: {known}")
        return name


def read_preset(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"preset: {path}: cannot be read ({exc.strerror})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"preset: {path}: not valid TOML ({exc})") from None


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
    preset: str | Path | None = None,
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
    preset: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The layers merged, by field name, not yet validated (a front end may resolve a word such as
    `batch_size=auto` first)."""
    merged: dict[str, Any] = {}
    layers = [
        ("preset", read_preset(preset) if preset else {}),
        ("environment", environment_layer(settings_cls, os.environ if environ is None else environ)),
        ("command line", dict(overrides or {})),
    ]
    for _origin, layer in layers:
        for key, value in layer.items():
            merged[settings_cls.field_for_key(key)] = value
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
