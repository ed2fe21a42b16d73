"""What every process of a run uses (a rank, the tuner's child, the supervisor, the front ends):
the settings, the run folder's layout and file helpers, checkpoint folders, process helpers, the
device plan, the generations a model wrote and a run's statuses. It imports no floor above `data/`,
nor torch, transformers or textual; what only the login node runs is in `gpuscale/control/`."""
