"""What the recipes share, kept apart from the recipes (every other package under recipes/, and
probe.py): the typed contract (`contract.py`) and the registry (`registry.py`); in a rank, the model
loaded and saved (`models.py`), the summary's opening (`summary.py`), generation batches
(`generation_batches.py`), the per-rank result files (`results.py`) and the held-out evaluation
(`evaluation.py`); the TRL recipes' settings (`training_settings.py`), examples (`training_data.py`),
one training shell (`training.py`), micro-batch sized on the card (`card_sized_micro_batch.py`) and
trial (`training_trial.py`); the tuner's torch trials (`device_trials.py`), what a tuning is stored by
(`tuning_key.py`), a rank's share of the batch (`rank_batches.py`) and the checks of a run's data
before launch (`data_checks.py`). No module here imports a recipe (tests/unit/test_layering_rules.py)."""
