"""The GPU picker: each GPU of this machine with its name and the memory free now.

NVML is read in a thread worker every few seconds, only while the picker is on screen. On a machine
without NVML it says how many CPU ranks the run will start instead.
"""

from __future__ import annotations

from textual import work
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import SelectionList, Static
from textual.widgets.selection_list import Selection

from gpuscale.app.views.text import format_mib, short_gpu_name

REFRESH_S = 3.0


def gpu_prompt(gpu: dict) -> str:
    """`0 H100 80GB HBM3 · 75.2 GiB free`."""
    return f"{gpu['index']} {short_gpu_name(gpu['name'])} · {format_mib(gpu['mem_free_mb'])} free"


def cpu_text(nproc: int | None) -> str:
    if nproc is None:
        return "no GPU: CPU ranks on gloo"
    return f"no GPU: {nproc} CPU rank{'s' if nproc != 1 else ''}"


class GpuPicker(Vertical):
    """Posts `Picked` when the user ticks GPUs; `gpus` is then the value for the `gpus` setting."""

    class Picked(Message):
        def __init__(self, gpus: str):
            super().__init__()
            self.gpus = gpus

    class Listed(Message):
        """The first (and every) reading of this machine's GPUs."""

        def __init__(self, gpus: list[dict]):
            super().__init__()
            self.gpus = gpus

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gpus: list[dict] | None = None  # None until NVML was read once
        self._selected: set[int] = set()

    def compose(self):
        yield Static("reading GPUs…", id="gpu-none")
        yield SelectionList[int](id="gpu-list", compact=True)

    def on_mount(self) -> None:
        self.border_title = "GPUs"
        self.query_one("#gpu-list").display = False
        # The first reading is the screen's to start (LaunchScreen.after_first_frame): begun here, its
        # worker (NVML, and the import of its helper) would share the interpreter with the app's first
        # frame and put it off by as much.

    @work(thread=True, exclusive=True, group="gpu-picker", exit_on_error=False)
    def read_gpus(self) -> None:
        try:
            gpus = self.app.list_gpus()
        except Exception:  # NVML trouble must not take the launch screen down
            gpus = []
        self.app.from_thread(self._show_gpus, gpus)

    def _show_gpus(self, gpus: list[dict]) -> None:
        first = self.gpus is None
        changed = gpus != self.gpus
        self.gpus = gpus
        if changed:
            self._fill(gpus, select_all=first)
            self.post_message(self.Listed(gpus))
        if gpus:  # a CPU machine gains no GPU while the app runs: read NVML again only where there is one
            self.set_timer(REFRESH_S, self._refresh_if_shown)

    def _refresh_if_shown(self) -> None:
        if self.screen.is_current:
            self.read_gpus()
        else:
            self.set_timer(REFRESH_S, self._refresh_if_shown)

    def _fill(self, gpus: list[dict], select_all: bool) -> None:
        listing = self.query_one("#gpu-list", SelectionList)
        none = self.query_one("#gpu-none", Static)
        listing.display, none.display = bool(gpus), not gpus
        if not gpus:
            none.update(cpu_text(None))
            return
        if select_all:
            self._selected = {g["index"] for g in gpus}
        highlighted = listing.highlighted
        with listing.prevent(SelectionList.SelectedChanged):
            listing.clear_options()
            listing.add_options([Selection(gpu_prompt(g), g["index"], g["index"] in self._selected) for g in gpus])
        if highlighted is not None and highlighted < len(gpus):
            listing.highlighted = highlighted

    def indices(self) -> list[int] | None:
        """The GPU indices this machine offers (None before NVML was read)."""
        return None if self.gpus is None else [g["index"] for g in self.gpus]

    def show_plan(self, gpus_value, nproc: int | None) -> None:
        """Follow the form's `gpus` setting: tick its GPUs, or say how many CPU ranks it means."""
        if not self.gpus:
            if self.gpus is not None:
                self.query_one("#gpu-none", Static).update(cpu_text(nproc))
            return
        indices = self.indices()
        if gpus_value == "all":
            wanted = set(indices)
        elif isinstance(gpus_value, int):
            wanted = set(indices[:gpus_value])
        elif isinstance(gpus_value, list):
            wanted = set(gpus_value)
        else:
            return
        if wanted != self._selected:
            self._selected = wanted
            listing = self.query_one("#gpu-list", SelectionList)
            with listing.prevent(SelectionList.SelectedChanged):
                listing.deselect_all()
                for index in wanted & set(indices):
                    listing.select(index)

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        event.stop()
        self._selected = set(event.selection_list.selected)
        indices = self.indices() or []
        if self._selected == set(indices):
            value = "all"
        else:
            value = ",".join(str(i) for i in sorted(self._selected))
            if len(self._selected) == 1:
                value += ","  # one index, not a count: "3," means GPU 3 (a bare 3 would mean three GPUs)
        self.post_message(self.Picked(value))
