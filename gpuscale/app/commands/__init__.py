"""The `gpuscale` commands, a module per group (app/cli.py builds the parser from them, in the order
`gpuscale --help` lists them): `launching` (run, resume, sbatch), `tuning` (tune), `history` (runs,
show, stop, delete, logs, compare, export, doctor), `listings` (recipes, gpus, models, data export),
`demo`; `common` holds what they share (the one-line errors, the settings' options, the history).
Each module's `PARSERS` maps a command to the function that adds its parser."""
