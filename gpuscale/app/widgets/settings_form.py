"""A recipe's settings as a form, built from its pydantic model: a new setting needs no UI code.

bool -> Switch, Literal -> Select, anything else (numbers, text, the `gpus` union) -> Input. Each
control is checked on every change with the engine's own `check_field`, and its error is shown on
the line under it, before anything is launched. Beside the settings, the run's own fields (its
label: `RUN_FIELDS`), which `gpuscale run` takes as options of their own.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Input, Label, Select, Static, Switch

from gpuscale.app.widgets.plain import PlainStatic
from gpuscale.control.store import label_problem
from gpuscale.runs.settings import RunSettings, check_field

# What every run is about comes first, in every recipe's form and in this order; then the recipe's own
# settings; then the rest of the common ones.
FIRST_FIELDS = ("model", "dataset", "gpus", "batch_size", "label")
LAST_FIELDS = ("precision", "domain", "too_long", "compile", "seed", "max_examples", "gpu_memory_share",
               "checkpoint_every", "keep_checkpoints", "hang_timeout", "private",
               "telemetry_interval", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")
# Set by `gpuscale resume` (and the history's R), never typed in the form.
HIDDEN_FIELDS = ("resume_from",)


@dataclass(frozen=True)
class RunField:
    """A field of the form that is the run's, not a setting of its recipe (`gpuscale run --label`):
    optional text, checked by `problem` (None when fine)."""

    description: str
    problem: Callable[[str], str | None]


RUN_FIELDS = {
    "label": RunField("a name for the run, shown by `gpuscale runs` and usable where its id is (optional)",
                      label_problem),
}


LABEL_WIDTH = 20  # the narrowest names' column (as wide as the CSS's .field-label)


def ordered_fields(settings_cls: type[RunSettings]) -> list[str]:
    """The form's rows: the settings of `settings_cls` (but the hidden ones) and the run's fields."""
    fields = [f for f in settings_cls.model_fields if f not in HIDDEN_FIELDS] + list(RUN_FIELDS)
    own = [f for f in fields if f not in FIRST_FIELDS and f not in LAST_FIELDS]
    return [f for f in FIRST_FIELDS if f in fields] + own + [f for f in LAST_FIELDS if f in fields]


def control_kind(annotation: Any) -> tuple[str, tuple]:
    """('switch', ()), ('select', options) or ('input', ()) for a field's type annotation."""
    if annotation is bool:
        return "switch", ()
    if typing.get_origin(annotation) is Literal:
        return "select", typing.get_args(annotation)
    return "input", ()


def as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def on_off(value: bool) -> str:
    return "on" if value else "off"


def is_optional(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


class SettingsForm(VerticalScroll, can_focus=False):
    """One row per setting (label, control) and an error line under each.

    The form itself takes no focus: Tab goes from the recipe list straight to the first setting,
    and the form scrolls to whichever control has the focus."""

    class Changed(Message):
        """A control changed; `error` is its inline error, or None."""

        def __init__(self, form: SettingsForm, field: str, error: str | None):
            super().__init__()
            self.form, self.field, self.error = form, field, error

    class Ready(Message):
        """Every control is mounted: the form can be read."""

        def __init__(self, form: SettingsForm):
            super().__init__()
            self.form = form

    class Focused(Message):
        def __init__(self, field: str, description: str):
            super().__init__()
            self.field, self.description = field, description

    def __init__(self, settings_cls: type[RunSettings], initial: RunSettings, cursor_blink: bool = True,
                 auto_fields: tuple[str, ...] = (), **kwargs):
        """`auto_fields`: the settings where the word `auto` is also accepted (the front end resolves
        it before validating: `batch_size` of a recipe that can be tuned)."""
        super().__init__(**kwargs)
        self.settings_cls = settings_cls
        self.auto_fields = auto_fields
        self.initial = initial
        self.cursor_blink = cursor_blink
        self.fields = ordered_fields(settings_cls)  # every row: the settings and the run's fields
        self.settings_fields = [name for name in self.fields if name not in RUN_FIELDS]
        self.ready = False  # True once every control is mounted (a recipe switch rebuilds the form)
        self._errors: dict[str, str] = {}
        # Kept by name rather than queried: a query walks the whole form, and reading the form for
        # each change read every control (a few hundred widgets deep on the larger recipes).
        self._controls: dict[str, Any] = {}
        self._error_lines: dict[str, Static] = {}
        self._checked: dict[str, Any] = {}  # each control's value when last checked

    def compose(self):
        for name in self.fields:
            with Horizontal(classes="field-row"):
                label = Label(name, classes="field-label")
                label.styles.width = self.label_width()
                yield label
                control = self._control(name, self.annotation(name), getattr(self.initial, name, None))
                self._controls[name] = control
                yield control
                if isinstance(control, Switch):  # the slider alone is colour only: say it in a word
                    yield Label(on_off(control.value), id=f"state-{name}", classes="field-switch-state")
        # No description or error line per field up front: a dozen widgets fewer per recipe to build
        # before the form shows. The focused field's description has its own line on the screen; an
        # error line is mounted under its field the first time that field is wrong.

    def label_width(self) -> int:
        """The names' column: the CSS width, or wider where a name is longer (`activation_checkpointing`),
        so that every name shows whole with a space before its control."""
        return max(LABEL_WIDTH, *(len(name) + 1 for name in self.fields))

    def annotation(self, name: str) -> Any:
        """A setting's type; a run's field is optional text."""
        return str | None if name in RUN_FIELDS else self.settings_cls.model_fields[name].annotation

    def description(self, name: str) -> str:
        field = RUN_FIELDS.get(name) or self.settings_cls.model_fields[name]
        return field.description or ""

    def _control(self, name: str, annotation: Any, value: Any):
        kind, options = control_kind(annotation)
        control_id = f"field-{name}"
        if kind == "switch":
            return Switch(value=bool(value), id=control_id, classes="field-control")
        if kind == "select":
            return Select([(str(o), o) for o in options], value=value, allow_blank=False, compact=True,
                          id=control_id, classes="field-control")
        control = Input(as_text(value), id=control_id, compact=True, classes="field-control",
                        placeholder="none" if is_optional(annotation) else "")
        control.cursor_blink = self.cursor_blink
        return control

    def on_mount(self) -> None:
        self.ready = True  # Mount comes after the children of compose() were mounted
        # The initial values are the recipe's settings, valid already: the Changed message each
        # control sends once mounted is no change (checking each and redrawing the command for
        # each held the keys up for seconds on a loaded machine).
        self._checked = {name: self.value(name) for name in self.fields}
        self.post_message(self.Ready(self))

    # ---- values ------------------------------------------------------------------------------

    def control(self, name: str):
        return self._controls[name]

    def value(self, name: str) -> Any:
        control = self.control(name)
        if isinstance(control, Input):
            text = control.value.strip()
            return None if text == "" and is_optional(self.annotation(name)) else text
        return control.value

    def values(self) -> dict[str, Any]:
        """Every setting as the form holds it: the top layer given to resolve_settings."""
        return {name: self.value(name) for name in self.settings_fields}

    def run_values(self) -> dict[str, Any]:
        """The run's fields (`label`), None where left empty: what `gpuscale run` takes beside --set."""
        return {name: self.value(name) for name in RUN_FIELDS}

    def set_value(self, name: str, value: Any) -> None:
        control = self.control(name)
        if isinstance(control, Input):
            control.value = as_text(value)
        else:
            control.value = value

    # ---- errors ------------------------------------------------------------------------------

    def check(self, name: str) -> str | None:
        value = self.value(name)
        auto = name in self.auto_fields and isinstance(value, str) and value.lower() == "auto"
        if name in RUN_FIELDS:
            error = None if value is None else RUN_FIELDS[name].problem(value)
        else:
            error = None if auto else check_field(self.settings_cls, name, value)
        self.show_error(name, error)
        return error

    def check_all(self) -> dict[str, str]:
        for name in self.fields:
            self.check(name)
        return dict(self._errors)

    def show_error(self, name: str, error: str | None) -> None:
        line = self._error_lines.get(name)
        if line is None and not error:
            return
        if line is None:
            line = self._error_lines[name] = PlainStatic("", id=f"error-{name}", classes="field-error")
            self.mount(line, after=self.control(name).parent)
        if error:
            self._errors[name] = error
            line.update(f"✗ {name}: {error}")
        else:
            self._errors.pop(name, None)
            line.update("")
        line.set_class(bool(error), "-shown")

    def errors(self) -> dict[str, str]:
        return dict(self._errors)

    def focus_field(self, name: str) -> None:
        control = self.control(name)
        control.focus()
        self.scroll_to_widget(control)

    # ---- events ------------------------------------------------------------------------------

    def _changed(self, control) -> None:
        if self.ready and control.id and control.id.startswith("field-"):
            name = control.id.removeprefix("field-")
            value = self.value(name)
            if name in self._checked and self._checked[name] == value:
                return  # a control's own message at mount, or the same value set again
            self._checked[name] = value
            self.post_message(self.Changed(self, name, self.check(name)))

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._changed(event.input)

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._changed(event.select)

    def on_switch_changed(self, event: Switch.Changed) -> None:
        event.stop()
        name = (event.switch.id or "").removeprefix("field-")
        self.query_one(f"#state-{name}", Label).update(on_off(event.value))
        self._changed(event.switch)

    def on_descendant_focus(self, event) -> None:
        control = event.widget
        if control.id and control.id.startswith("field-"):
            name = control.id.removeprefix("field-")
            self.post_message(self.Focused(name, self.description(name)))
