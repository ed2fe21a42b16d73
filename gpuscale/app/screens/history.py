"""History: every run in a table, filtered by recipe and status; open, compare, export, delete.

The table is read in a worker (after `reconcile`) when the screen is shown and every few seconds
while it is, and redrawn only when a row changed, so the cursor stays where the user left it.
It is read a page at a time, newest first: a history of thousands of runs shows its first rows at
once, and the next page is read when the cursor comes near the last row loaded.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label, Select, Static

from gpuscale.app.screens.dialogs import ConfirmDialog
from gpuscale.app.views.runs import RUN_COLUMNS, run_row
from gpuscale.app.views.text import cut_text
from gpuscale.app.widgets.plain import literal
from gpuscale.app.widgets.tables import PlainTable
from gpuscale.control import launch
from gpuscale.runs.statuses import LIVE_STATUSES, STATUSES

REFRESH_S = 3.0
PAGE = 200  # runs read at a time; more fill several screens
MORE_WITHIN = 20  # the next page is read when the cursor is this close to the last row
HINT = "Enter: open · c: compare (pick two) · e: export · d: delete · R: resume"


# The TUI's columns: `gpuscale runs`'s, with a Label column where some run has a label.
LABEL = "Label"
# Below this many columns the table is narrow: Started in short (`01-15 07:55`) and labels cut to
# NARROW_LABEL; and where the figures would still have less than READABLE cells (a power-sampling
# run with a label left them 12 at 80 columns), no Duration (the details and `gpuscale runs` give it).
NARROW_BELOW = 100
NARROW_LABEL, WIDE_LABEL = 10, 24
READABLE = 30


def history_columns(runs: list[dict], without_duration: bool = False) -> tuple[str, ...]:
    """RUN_COLUMNS, with Label after ID when some of the runs has a label (as `gpuscale runs`)."""
    columns = [column for column in RUN_COLUMNS if not (without_duration and column == "Duration")]
    if any(run.get("label") for run in runs):
        columns.insert(1, LABEL)
    return tuple(columns)


def history_row(run: dict, now: float, marked: bool, columns: tuple[str, ...] = RUN_COLUMNS,
                narrow: bool = False) -> tuple[str, ...]:
    """`gpuscale runs`'s row under `columns`; a `*` before the id of the run picked for a comparison;
    narrow: the start time short and the label cut."""
    cells = dict(zip(RUN_COLUMNS, run_row(run, now)))
    cells["ID"] = ("*" if marked else "") + cells["ID"]
    cells[LABEL] = cut_text(run.get("label") or "", NARROW_LABEL if narrow else WIDE_LABEL)
    if narrow and run.get("started_at"):
        cells["Started"] = time.strftime("%m-%d %H:%M", time.localtime(run["started_at"]))
    return tuple(cells[column] for column in columns)


def fit_figures(rows: list[tuple[str, ...]], width: int, columns: tuple[str, ...] = RUN_COLUMNS
                ) -> list[tuple[str, ...]]:
    """The Figures cells cut (with …) to the room the other columns leave in `width` cells: a long
    figure must not push Started, the last column, off a narrow screen. Each column has one cell of
    padding on either side."""
    figures, room = columns.index("Figures"), figures_room(rows, width, columns)
    return [(*row[:figures], cut_figures(row[figures], room), *row[figures + 1:]) for row in rows]


def figures_room(rows: list[tuple[str, ...]], width: int, columns: tuple[str, ...]) -> int:
    """The cells the other columns leave the Figures column in `width` (its header's at least)."""
    figures = columns.index("Figures")
    others = sum(max(len(cell) for cell in [columns[i], *(row[i] for row in rows)])
                 for i in range(len(columns)) if i != figures)
    return max(len(columns[figures]), width - others - 2 * len(columns))


def cut_figures(text: str, room: int) -> str:
    """`accuracy 0.4583…`: as many whole figures as fit in `room` (a number cut in half would read as
    another number); the first one cut short only where even it does not fit."""
    if len(text) <= room:
        return text
    kept = ""
    for figure in text.split(", "):
        longer = f"{kept}, {figure}" if kept else figure
        if len(longer) + 1 > room:
            break
        kept = longer
    return (kept or text[: room - 1]) + "…"


class HistoryScreen(Screen):
    BINDINGS = [
        Binding("enter", "open", "Open", show=False),
        Binding("c", "compare", "Compare"),
        Binding("e", "export", "Export"),
        Binding("d,delete", "delete", "Delete"),
        Binding("r", "refresh", "Refresh", show=False),
        # Shift+R: plain r already refreshes.
        Binding("R", "resume", "Resume", show=False),
    ]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.runs: list[dict] = []
        self.marked: int | None = None  # the first run picked for a comparison
        self._shown_rows: list[tuple] | None = None
        self._shown_keys: list[str] | None = None
        self._reading = False
        self._timer = None
        self.limit = PAGE  # how many of the newest runs are read: a page more each time the cursor nears the end
        self.more = False  # whether the history has runs beyond those read

    def compose(self):
        yield Header(show_clock=False)
        with Horizontal(id="history-filters"):
            yield Label("recipe ")
            yield Select([], prompt="all", id="recipe-filter", compact=True)
            yield Label("  status ")
            yield Select([(s, s) for s in STATUSES], prompt="all", id="status-filter", compact=True)
        yield PlainTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Static(HINT, id="history-hint")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.sub_title = "History"
        table = self.query_one("#runs-table", DataTable)
        self._column_names = RUN_COLUMNS
        self._columns = table.add_columns(*RUN_COLUMNS)
        table.focus()
        self.refresh_runs()

    def on_screen_resume(self) -> None:
        self.refresh_runs()

    # ---- reading -----------------------------------------------------------------------------

    def filters(self) -> tuple[str | None, str | None]:
        recipe = self.query_one("#recipe-filter", Select).value
        status = self.query_one("#status-filter", Select).value
        return (None if recipe == Select.NULL else recipe), (None if status == Select.NULL else status)

    def action_refresh(self) -> None:
        self.refresh_runs()

    def refresh_runs(self) -> None:
        if not self._reading:
            self._reading = True
            self._read_runs(*self.filters(), self.limit)

    @work(thread=True, exclusive=True, group="history", exit_on_error=False)
    def _read_runs(self, recipe: str | None, status: str | None, limit: int) -> None:
        try:
            store = self.app.store()
            launch.reconcile(store)
            runs = store.list_runs(recipe=recipe, status=status, limit=limit + 1)  # one more: is there more?
            recipes = store.recipe_names()
            result = ((recipe, status, limit), runs, recipes, None)
        except Exception as exc:
            result = ((recipe, status, limit), [], [], exc)
        self.app.from_thread(self._show_runs, *result)

    def _show_runs(self, filters: tuple, runs: list[dict], recipes: list[str], error: Exception | None) -> None:
        self._reading = False
        if filters != (*self.filters(), self.limit):  # a filter changed, or a page more was asked for, meanwhile
            self.refresh_runs()
            return
        if error:
            self.notify(f"cannot read the history: {literal(error)}", severity="error")
        self.more = len(runs) > self.limit
        self.runs = runs[: self.limit]
        self._update_recipe_filter(recipes)
        self._fill_table()
        self._schedule_refresh()

    def _schedule_refresh(self) -> None:
        """One timer at a time, armed when the last read was shown."""
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_timer(REFRESH_S, self._refresh_if_shown)

    def _refresh_if_shown(self) -> None:
        self._timer = None
        if self.is_current:
            self.refresh_runs()
        else:
            self._schedule_refresh()

    def _update_recipe_filter(self, recipes: list[str]) -> None:
        select = self.query_one("#recipe-filter", Select)
        known = sorted(set(recipes) | set(self.app.recipes))
        if getattr(self, "_recipe_options", None) != known:
            self._recipe_options = known
            value = select.value
            with select.prevent(Select.Changed):
                select.set_options([(Text(name), name) for name in known])
                if value != Select.NULL and value in known:
                    select.value = value

    def _fill_table(self) -> None:
        table = self.query_one("#runs-table", DataTable)
        now = self.app.clock()
        width = table.scrollable_content_region.width
        narrow = width < NARROW_BELOW
        columns = history_columns(self.runs)
        rows = [history_row(run, now, run["id"] == self.marked, columns, narrow) for run in self.runs]
        if narrow and figures_room(rows, width, columns) < READABLE:
            columns = history_columns(self.runs, without_duration=True)
            rows = [history_row(run, now, run["id"] == self.marked, columns, narrow) for run in self.runs]
        rows = fit_figures(rows, width, columns)
        if rows == self._shown_rows and columns == self._column_names:
            return
        keys = [str(run["id"]) for run in self.runs]
        if self._shown_rows is not None and keys == self._shown_keys and columns == self._column_names:
            self._update_cells(table, keys, rows)  # the same runs: change the cells that changed
            return
        self._shown_rows, self._shown_keys = rows, keys
        current = self.current_run_id()
        table.clear(columns=columns != self._column_names)
        if columns != self._column_names:  # a Label column comes or goes
            self._column_names, self._columns = columns, table.add_columns(*columns)
        for run, row in zip(self.runs, rows):
            table.add_row(*row, key=str(run["id"]))
        if current is not None and str(current) in table.rows:
            table.move_cursor(row=table.get_row_index(str(current)))

    def _update_cells(self, table: DataTable, keys: list[str], rows: list[tuple]) -> None:
        for key, old, new in zip(keys, self._shown_rows, rows):
            for column, before, after in zip(self._columns, old, new):
                if before != after:
                    table.update_cell(key, column, after, update_width=True)
        self._shown_rows = rows

    def on_resize(self) -> None:
        self._fill_table()  # the Figures column's room changed

    @on(DataTable.RowHighlighted, "#runs-table")
    def _near_the_end(self, event: DataTable.RowHighlighted) -> None:
        if self.more and event.cursor_row >= len(self.runs) - MORE_WITHIN and len(self.runs) >= self.limit:
            self.limit += PAGE
            self.refresh_runs()

    @on(Select.Changed)
    def _filter_changed(self, event: Select.Changed) -> None:
        self.limit = PAGE  # a new list: its first page
        self.refresh_runs()  # a read in flight notices the change and reads again

    # ---- the run under the cursor ------------------------------------------------------------

    def current_run_id(self) -> int | None:
        table = self.query_one("#runs-table", DataTable)
        if not table.row_count:
            return None
        row_key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return int(row_key.value)

    def current_run(self) -> dict | None:
        run_id = self.current_run_id()
        return next((r for r in self.runs if r["id"] == run_id), None)

    @on(DataTable.RowSelected, "#runs-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_open(self) -> None:
        if (run_id := self.current_run_id()) is not None:
            self.app.open_details(run_id)

    def action_compare(self) -> None:
        run_id = self.current_run_id()
        if run_id is None:
            return
        if self.marked is None or self.marked == run_id:
            self.marked = None if self.marked == run_id else run_id
            self.query_one("#history-hint", Static).update(
                f"compare: run {run_id} picked; move to another run and press c" if self.marked else HINT)
            self._shown_rows = None
            self._fill_table()
            return
        first, self.marked = self.marked, None
        self._shown_rows = None
        self._fill_table()
        self.query_one("#history-hint", Static).update(HINT)
        self.app.open_compare(first, run_id)

    def action_export(self) -> None:
        if (run_id := self.current_run_id()) is not None:
            self.app.export_run(run_id)

    def action_resume(self) -> None:
        """The run under the cursor continued from its last checkpoint as a new run (the CLI's
        `gpuscale resume`, through the same launch.resume_run); a refusal says why in a toast."""
        run = self.current_run()
        if run is not None:
            self._resume(run)

    @work(thread=True, group="history-resume", exit_on_error=False)
    def _resume(self, run: dict, force: bool = False) -> None:
        from gpuscale.recipes.shared.registry import get_recipe

        try:
            recipe = self.app.recipes.get(run["recipe"]) or get_recipe(run["recipe"])
            run_id = launch.resume_run(self.app.store(), recipe, run, force=force)
        except launch.AlreadyResumed as exc:  # the CLI's --force is a yes here
            self.app.from_thread(self._ask_resume_again, run, exc.children)
            return
        except Exception as exc:  # refused (no checkpoint, still running...), or the history is read-only
            self.app.from_thread(self.notify, f"not resumed: {literal(exc)}", severity="warning")
            return
        self.app.from_thread(self._resumed, run["id"], run_id)

    def _ask_resume_again(self, run: dict, children: list[dict]) -> None:
        names = ", ".join(f"run {child['id']} ({child['status']})" for child in children)
        question = f"Run {run['id']} was already resumed by {names}. Resume run {run['id']} again from the same point?"
        self.app.push_screen(ConfirmDialog(question), lambda yes: self._resume(run, force=True) if yes else None)

    async def _resumed(self, parent_id: int, run_id: int) -> None:
        self.notify(f"run {run_id}: resuming run {parent_id}")
        await self.app.open_monitor(run_id)

    def action_delete(self) -> None:
        run = self.current_run()
        if run is None:
            return
        if run["status"] in LIVE_STATUSES:
            self.notify(f"run {run['id']} is {run['status']}: stop it first (F3, s)", severity="warning")
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._delete(run["id"])

        self.app.push_screen(ConfirmDialog(f"Delete run {run['id']} from the history? Its folder is kept."), confirmed)

    @work(thread=True, group="history-delete", exit_on_error=False)
    def _delete(self, run_id: int) -> None:
        store = self.app.store()
        try:
            store.delete_run(run_id)
            message = f"run {run_id}: deleted (its folder is kept)"
        except Exception as exc:
            message = f"run {run_id}: not deleted: {literal(exc)}"
        self.app.from_thread(self._deleted, message)

    def _deleted(self, message: str) -> None:
        self.notify(message)
        self.refresh_runs()
