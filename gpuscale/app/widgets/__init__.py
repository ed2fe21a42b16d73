"""The TUI's own widgets: the settings form, the GPU picker, the run monitor and its charts."""
