"""The control plane: launching, supervising and recording runs. Never imports torch, transformers,
textual, nor gpuscale.engines/recipes/app.

Two kinds of module (ARCHITECTURE.md, "The floors"; tests/unit/test_layering_rules.py checks them):
the plain ones in EVERY_PROCESS, which a rank, the tuner's child, the supervisor and the front ends
all use (settings, the run folder's layout and file helpers, checkpoint folders, process helpers,
the device plan, the generations' samples); every other module is the login node's only (launch,
supervisor, store, telemetry, doctor, metrics_tail): engines/ and recipes/ import none of them, and a
new module here is the login node's until it is named below."""

EVERY_PROCESS = ("checkpoints", "devices", "process", "run_dir", "samples", "settings")
