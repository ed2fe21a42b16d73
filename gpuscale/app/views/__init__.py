"""What the CLI and the TUI both show, worked out once, with no UI and no SQL (no textual, no torch).

- `text`: the formatters: numbers, rates, durations, times, memory, GPU names, sparklines.
- `runs`: one run in words: its status and progress line, throughput, figures, a history row,
  two runs compared, a run exported.
- `feed`: one run's telemetry samples and metrics read incrementally from the store, and what each
  device row and chart shows over a window.
- `generations`: what a run generated (its generations file), filtered and written: `gpuscale
  generations` and the TUI's generations view.
- `waste`: the waste rules (idle GPUs, unused memory, GPUs left out, stragglers).
- `collapse`: the collapse rules of RL runs (reward 0 at the length cap, entropy under a floor,
  a figure gone nan).
- `logs`: the ranks' logs, read incrementally.
- `commands`: the launcher command a run will execute, and the same run as a `gpuscale run` line.
- `export`: a run as a JSON or CSV file (`gpuscale export` and the TUI's export dialog).

Everything takes `now` as an argument, so that tests and snapshots can freeze the clock. Reading the
store goes through `gpuscale.control.store.Store`'s methods.
"""
