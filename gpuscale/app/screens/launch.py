"""Launch: pick a recipe, tune its settings, see the exact command, start it with one key.

`batch_size` takes `auto` where the recipe can be tuned, as `gpuscale run --batch-size auto`
does and through the same code (app/batch_choice.py): a stored tuning result for this recipe, model,
device, precision and shape, or `gpuscale tune` first on a GPU, or the CPU default. The line under
the form shows the stored result whenever there is one."""

from __future__ import annotations

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, OptionList, Static
from textual.widgets.option_list import Option

from gpuscale.app.widgets.gpu_picker import GpuPicker
from gpuscale.app.widgets.plain import PlainStatic, literal
from gpuscale.app.widgets.settings_form import SettingsForm
from gpuscale.runs.settings import SettingsError, resolve_settings

# This screen is the first frame. What only its form needs, and the form is built after that frame,
# is imported where it is used: app/batch_choice.py, the launcher (control/launch.py) and the command
# views, which bring the store's launcher side, NVML's helper and psutil (some 25 ms on 2 cores).

HELP = "↑↓: recipe · Tab: into its settings · Ctrl+R: launch"


def recipe_option(recipe) -> Option:
    """One line per recipe: its name, then its summary cut to the width there is."""
    prompt = Text.assemble((recipe.name, "bold"), "  ", (recipe.summary, "dim"))
    prompt.no_wrap, prompt.overflow = True, "ellipsis"
    return Option(prompt, id=recipe.name)


def auto_batch(recipe, values: dict) -> bool:
    """The form asks for `batch_size` auto, and the recipe can be tuned (else `auto` is a bad value)."""
    from gpuscale.app.batch_choice import wants_auto

    return recipe.tuning is not None and wants_auto(values.get("batch_size"))


def form_settings(recipe, values: dict):
    """The form's settings validated and fitted to the run's ranks as the launch fits them (a setting
    left at its default may move: recipes/shared/rank_split.py), with the lines saying what moved; with
    `batch_size` auto, all but the batch (the launch finds it)."""
    from gpuscale.app.batch_choice import given_values, validated

    if auto_batch(recipe, values):
        values = {name: value for name, value in values.items() if name != "batch_size"}
    return recipe.fit_to_ranks(validated(recipe, given_values(recipe, values)))


def tuning_line(recipe, settings, device, row: dict | None, auto: bool) -> str:
    """What the form says about tuning: the stored result, or what `auto` will do without one."""
    from gpuscale.app.batch_choice import tuning_summary

    if row:
        return tuning_summary(row) + ("" if auto else " · batch_size auto uses it")
    if not auto:
        return ""
    if device.index is None:
        batch = recipe.tuning.cpu_batch_size or settings.batch_size
        return f"batch_size auto: nothing tuned for this shape on cpu; the CPU default ({batch or 'auto'})"
    return (f"batch_size auto: nothing tuned for this shape on {device.name}; launching tunes first "
            f"(gpuscale tune, minutes)")


def error_field(error: SettingsError, fields: list[str]) -> str | None:
    """The field a SettingsError line ("field: value: reason") is about, if it is one of the form's."""
    name = str(error).split(":", 1)[0].strip()
    return name if name in fields else None


class LaunchScreen(Screen):
    BINDINGS = [
        # ctrl+r and F5 reach the screen even while an input has the focus (typed letters would not).
        Binding("ctrl+r", "launch", "Launch run", priority=True),
        Binding("f5", "launch", "Launch run", show=False, priority=True),
        # `gpuscale run --queue`: the run waits, queued, until its devices are free (README, "Many runs").
        Binding("f6", "launch(True)", "Launch queued", show=False, priority=True),
    ]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.recipe = None
        self.settings = None  # the form's settings while they are valid
        self.plan = None
        self.not_ready = ""
        self.launching = False
        self._form: SettingsForm | None = None

    def compose(self):
        yield Header(show_clock=False)
        with Horizontal(id="launch-body"):
            with Vertical(id="launch-side"):
                yield OptionList(*[recipe_option(r) for r in self.app.recipes.values()], id="recipes")
                yield GpuPicker(id="gpu-picker")
            with Vertical(id="launch-main"):
                yield Static("", id="recipe-summary")
                yield Vertical(id="form-box")
                yield PlainStatic("", id="tuning-line")  # tuning output: model names, paths
                yield Static(HELP, id="field-help")  # then the focused setting's description
        yield Static("", id="preview")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.sub_title = "Launch"
        self.query_one("#recipes").border_title = "Recipes"
        self.query_one("#preview").border_title = "Command"
        self.query_one("#recipes", OptionList).focus()
        if self.app.first_frame_shown:  # else the app calls this once its first frame is drawn
            self.after_first_frame()

    def after_first_frame(self) -> None:
        """What the first frame does without: this machine's GPUs, and the recipe's form."""
        self.query_one(GpuPicker).read_gpus()
        self.pick_first_recipe()

    def pick_first_recipe(self) -> None:
        """Build the highlighted recipe's form (some dozens of widgets), the first one's if none is."""
        recipes = self.query_one("#recipes", OptionList)
        if not self.app.recipes:
            return
        if recipes.highlighted is None:
            recipes.highlighted = 0  # its OptionHighlighted builds the form
        else:  # highlighted before the first frame (the list highlights on focus)
            # After the next refresh, as a highlight's message would: the form's box may be mounting still.
            self.call_after_refresh(self._pick_highlighted)

    def _pick_highlighted(self) -> None:
        """The highlighted recipe's form, unless a key already picked one."""
        recipes = self.query_one("#recipes", OptionList)
        if self.recipe is None and recipes.highlighted is not None:
            self.pick_recipe(recipes.get_option_at_index(recipes.highlighted).id)

    # ---- recipe and form ---------------------------------------------------------------------

    @on(OptionList.OptionHighlighted, "#recipes")
    def _recipe_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        if not self.app.first_frame_shown:  # the list highlights its first recipe on focus: form after the frame
            return
        if event.option.id != (self.recipe and self.recipe.name):
            self.pick_recipe(event.option.id)

    @on(OptionList.OptionSelected, "#recipes")
    def _recipe_selected(self, event: OptionList.OptionSelected) -> None:
        """Enter on a recipe: on to its first setting."""
        if form := self.form():
            form.focus_field(form.fields[0])

    def pick_recipe(self, name: str) -> None:
        self.recipe = self.app.recipes[name]
        self.query_one("#recipe-summary", Static).update(Text.assemble((name, "bold"), f": {self.recipe.summary}"))
        box = self.query_one("#form-box", Vertical)
        box.remove_children()
        self._form = SettingsForm(self.recipe.settings_cls, self._initial_settings(),
                                  cursor_blink=self.app.cursor_blink,
                                  auto_fields=("batch_size",) if self.recipe.tuning else ())
        box.mount(self._form)  # its Ready message brings the preview up to date

    def _initial_settings(self):
        """Defaults with the environment's layer (GPUSCALE_BATCH_SIZE=...) applied, as a launch would."""
        try:
            return resolve_settings(self.recipe.settings_cls)
        except SettingsError as exc:
            self.notify(f"environment ignored: {literal(exc)}", severity="warning")
            return self.recipe.settings_cls()

    def form(self) -> SettingsForm | None:
        """The current recipe's form, once all of it is mounted."""
        return self._form if self._form is not None and self._form.ready else None

    @on(SettingsForm.Ready)
    @on(SettingsForm.Changed)
    def _setting_changed(self, event: SettingsForm.Changed | SettingsForm.Ready) -> None:
        if event.form is self._form:  # not a late message from the previous recipe's form
            self.update_preview()

    @on(SettingsForm.Focused)
    def _setting_focused(self, event: SettingsForm.Focused) -> None:
        self.query_one("#field-help", Static).update(Text.assemble((event.field, "bold"), f": {event.description}"))

    # ---- GPUs --------------------------------------------------------------------------------

    @on(GpuPicker.Picked)
    def _gpus_picked(self, event: GpuPicker.Picked) -> None:
        form = self.form()
        if form is not None:
            form.set_value("gpus", event.gpus)

    @on(GpuPicker.Listed)
    def _gpus_listed(self, event: GpuPicker.Listed) -> None:
        self.update_preview()

    # ---- preview and launch ------------------------------------------------------------------

    def update_preview(self) -> None:
        """Validate the whole form and show the command it means, or why there is none yet."""
        from gpuscale.app.batch_choice import pick_device
        from gpuscale.app.views.commands import launch_preview, shell_equivalent
        from gpuscale.control import launch

        form, preview = self.form(), self.query_one("#preview", Static)
        self.settings = self.plan = None
        self.not_ready = "the form is not ready"
        if form is None:
            return
        available = self.query_one(GpuPicker).indices()
        if available is None:
            preview.update("reading this machine's GPUs…")
            return
        values = form.values()
        try:
            settings, fitted = form_settings(self.recipe, values)
            plan = launch.plan_devices(settings.gpus, available)
        except SettingsError as exc:
            field = error_field(exc, form.fields)
            if field and field not in form.errors():  # e.g. more GPUs than this machine has
                form.show_error(field, str(exc).split(": ", 2)[-1])
            self.not_ready = str(exc)
            preview.update(Text(f"not ready to launch: {exc}", style="bold"))
            self.query_one(GpuPicker).show_plan(None, None)
            self.show_tuning_line("")
            return
        form.show_error("gpus", None)  # valid now, whatever plan_devices said before
        self.settings, self.plan = settings, plan
        self.query_one(GpuPicker).show_plan(settings.gpus, plan.nproc)
        command = launch_preview(self.recipe, settings, plan, self.app.home)
        label = None if "label" in form.errors() else form.run_values()["label"]
        shell = shell_equivalent(self.recipe.name, settings, label)
        if auto_batch(self.recipe, values):
            shell += " --batch-size auto"
        if self.recipe.tuning is not None:
            device = pick_device(plan.gpu_indices, self.query_one(GpuPicker).gpus or [])
            self.look_up_tuning(self.recipe, settings, device, auto_batch(self.recipe, values))
        else:
            self.show_tuning_line("")
        moved = [("\n" + line, "italic") for line in fitted]  # defaults fitted to the ranks
        preview.update(Text.assemble(("$ ", "bold"), command, "\n", ("same from a shell: ", "dim"), (shell, "dim"),
                                     *moved))

    @work(thread=True, exclusive=True, group="tuning-line", exit_on_error=False)
    def look_up_tuning(self, recipe, settings, device, auto: bool) -> None:
        """The stored tuning result for the form's settings (SQLite: in a thread, like every read)."""
        from gpuscale.app.batch_choice import stored_tuning

        try:
            row = stored_tuning(self.app.store(), recipe, settings, device)
        except Exception:  # an unreadable store must not take the form down; the history says why
            row = None
        line = tuning_line(recipe, settings, device, row, auto)
        self.app.from_thread(self._tuning_found, recipe, settings, line)

    def _tuning_found(self, recipe, settings, line: str) -> None:
        if recipe is self.recipe and settings == self.settings:  # not a look-up for an older form
            self.show_tuning_line(line)

    def show_tuning_line(self, text: str) -> None:
        line = self.query_one("#tuning-line", Static)
        line.update(text)
        line.display = bool(text)  # no empty row where there is nothing to say

    def action_launch(self, queue: bool = False) -> None:
        form = self.form()
        if form is None or self.launching:
            return
        errors = form.check_all()
        self.update_preview()
        errors = errors or form.errors()
        if errors or self.settings is None:
            first = next(iter(errors), None)
            if first:
                form.focus_field(first)
                self.notify(f"not launched: {first}: {literal(errors[first])}", severity="error")
            else:
                self.notify(f"not launched: {literal(self.not_ready)}", severity="error")
            return
        self.launching = True
        queued = ", queued until its devices are free" if queue else ""
        self.notify(f"launching {literal(self.recipe.name)} on {literal(self.plan.describe())}{queued}…")
        self._start(self.recipe, form.values(), self.plan, form.run_values(), queue)

    @work(thread=True, exclusive=True, group="launch", exit_on_error=False)
    def _start(self, recipe, values: dict, plan, run_values: dict, queue: bool = False) -> None:
        """The batch resolved as the CLI resolves it (`auto`: stored, tuned first, or the CPU default),
        then the run started with the form's label, with where its batch came from in its notes;
        `queue`: as `--queue`."""
        from gpuscale.app.batch_choice import given_values, settings_with_batch
        from gpuscale.control import launch

        try:
            store = self.app.store()
            settings, notes = settings_with_batch(recipe, given_values(recipe, values), store,
                                                  on_tune_line=self._tuning_output)
            run_id = launch.start_run(store, recipe, settings, plan, notes=notes, label=run_values["label"],
                                      queue=queue)
        except Exception as exc:  # e.g. tuning failed, or the run folder cannot be written
            self.app.from_thread(self._failed, exc)
            return
        self.app.from_thread(self._started, run_id)

    def _tuning_output(self, line: str) -> None:
        """A line of `gpuscale tune` run by `auto` before the launch: shown where the tuning line is."""
        if line.strip():
            self.app.from_thread(self.show_tuning_line, line.strip())

    def _failed(self, exc: Exception) -> None:
        self.launching = False
        self.notify(f"not launched: {literal(exc)}", severity="error")

    async def _started(self, run_id: int) -> None:
        self.launching = False
        await self.app.open_monitor(run_id)
