"""The `report_to` setting of the TRL training recipes: the tools (TensorBoard, W&B, Trackio, MLflow...)
that the trainer also sends its logs to, through transformers' own integrations
(`engines/trl_bridge.py:trainer_args` passes it to the config's `report_to`).

Checked before launch, in the front end, without importing transformers (which takes seconds, and
torch with it): the names are transformers' integrations (INTEGRATION_TO_CALLBACK;
tests/unit/test_report_backends.py holds the two equal), and each must be importable here, found the
way transformers looks for it (find_spec, which imports nothing), or its callback would fail at the
trainer's start, after the launch.
"""

from __future__ import annotations

import importlib.util

# An integration -> the modules it needs, each a tuple of alternatives (any one will do), and what
# `pip install` takes to bring them. kubeflow is left out: transformers turns it on by itself inside
# a Kubeflow TrainJob.
REPORT_BACKENDS: dict[str, tuple[tuple[tuple[str, ...], ...], str]] = {
    "tensorboard": ((("tensorboard", "tensorboardX"),), "tensorboard"),
    "wandb": ((("wandb",),), "wandb"),
    "trackio": ((("trackio",),), "trackio"),
    "mlflow": ((("mlflow",),), "mlflow"),
    "comet_ml": ((("comet_ml",),), "comet-ml"),
    "clearml": ((("clearml",),), "clearml"),
    "neptune": ((("neptune",),), "neptune"),
    "dvclive": ((("dvclive",),), "dvclive"),
    "swanlab": ((("swanlab",),), "swanlab"),
    "codecarbon": ((("codecarbon",),), "codecarbon"),
    "azure_ml": ((("azureml.core",),), "azureml-core"),
    "dagshub": ((("dagshub",), ("mlflow",)), "dagshub mlflow"),
    "flyte": ((("flytekit",), ("flytekitplugins.deck",)), "flytekit flytekitplugins-deck"),
}
NONE, ALL = "none", "all"  # transformers' words: no integration; every one installed


def installed(backend: str) -> bool:
    needs, _package = REPORT_BACKENDS[backend]
    return all(any(module_found(name) for name in alternatives) for alternatives in needs)


def module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing (azureml), or a broken install
        return False


def checked_report_to(value: str) -> str:
    """`report_to` as the settings keep it: none, all, or installed integrations joined by commas,
    lower case, each once. ValueError saying what is wrong: an unknown name (with the known ones), one
    that is not installed (with what to install), or none/all beside other names."""
    names = list(dict.fromkeys(name.strip().lower() for name in value.split(",") if name.strip())) or [NONE]
    if len(names) > 1 and {NONE, ALL} & set(names):
        raise ValueError(f"{NONE} and {ALL} stand alone; otherwise list integrations joined by commas")
    if names[0] in (NONE, ALL):
        return names[0]
    for name in names:
        if name not in REPORT_BACKENDS:
            raise ValueError(f"unknown integration {name!r}; known: {NONE}, {ALL}, {', '.join(REPORT_BACKENDS)}")
        if not installed(name):
            raise ValueError(f"{name} is not installed here (pip install {REPORT_BACKENDS[name][1]}): the trainer "
                             "would fail when it starts")
    return ",".join(names)

