"""What the recipes share, kept apart from the recipes (every other package under recipes/, and
probe.py): the typed contract (`contract.py`), the registry (`registry.py`), the rank-side helpers
(`common.py`), the one TRL training shell (`training.py`) and its trial (`training_trial.py`), the
tuner's torch trials (`device_trials.py`), what a tuning is stored by (`tuning_key.py`), a rank's
share of the batch (`rank_batches.py`) and the checks of a run's data before launch
(`data_checks.py`). No module here imports a recipe (tests/unit/test_layering_rules.py)."""
