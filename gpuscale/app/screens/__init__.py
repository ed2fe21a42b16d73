"""The TUI's screens: launch, monitor, history, one run, two runs compared, dialogs."""
