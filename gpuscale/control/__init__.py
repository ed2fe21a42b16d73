"""The login node's floor: launching, supervising and recording runs (ARCHITECTURE.md, "The floors").

`launch` (argv, starting, stopping and resuming runs), `supervisor` (one process a run), `run_errors`
(what a failed run died of, read from its folder), `store` (the SQLite history: all SQL is in its
`Store`), `telemetry` (NVML), `sample_fields` (what a telemetry sample holds), `metrics_tail` (the
ranks' metric files into the store), `doctor`. Only the front ends
and the supervisor import this floor: a rank runs on nodes without the history, so engines/ and
recipes/ never do. It imports neither torch, transformers nor textual."""
