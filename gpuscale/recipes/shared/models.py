"""A rank's model: loaded to generate from (`load_generation_model`, with a stand-in tokenizer for the
random models), and saved to RUN_DIR/model for any recipe to load (`save_model`).

Imported inside ranks only (it imports torch through the model loaders).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscale.engines.reporter import beat
from gpuscale.runs.heartbeat import SAVE
from gpuscale.runs.run_dir import RunDir


@dataclass
class GenerationModel:
    """A model with what generating from it needs: its tokenizer, the ids that end an answer, the
    padding id."""

    model: Any
    tokenizer: Any
    eos: list[int]
    pad: int


def load_generation_model(model_name: str, ctx) -> GenerationModel:
    from gpuscale.data.models import load_model
    from gpuscale.data.prompts import eos_token_ids, pad_token_id

    model, tokenizer = load_model(model_name, dtype=ctx.dtype, device=ctx.device)
    tokenizer = tokenizer or stand_in_tokenizer(model_name)
    eos = eos_token_ids(model, tokenizer)
    return GenerationModel(model, tokenizer, eos, pad_token_id(tokenizer, eos))


def stand_in_tokenizer(model_name: str):
    """Random models (speed measurements at a real model's shape) have no tokenizer: they are
    prompted with tiny-math's. Their answers are noise, so only their speed means anything."""
    from transformers import AutoTokenizer

    from gpuscale.data.models import RANDOM_CONFIGS, model_path

    if model_name not in RANDOM_CONFIGS:
        raise ValueError(f"model: {model_name!r}: generating needs a model with a tokenizer")
    return AutoTokenizer.from_pretrained(model_path("tiny-math"), local_files_only=True)


def save_model(model, tokenizer, ctx) -> Path:
    """Rank 0 writes the model and its tokenizer to RUN_DIR/model (any recipe loads it with
    `--model` that path); returns the directory on every rank."""
    directory = RunDir(ctx.run_dir).model
    beat(SAVE)
    if ctx.is_main:
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        follow_umask(directory)
    return directory


def follow_umask(directory: Path) -> None:
    """Give each file in `directory` the mode a new file gets under the umask. The safetensors writer
    creates the weights with mode 0600 whatever the umask, so without this `model.safetensors` alone
    could not be read by those who can read the config and tokenizer beside it."""
    mask = os.umask(0o022)  # reading the umask means setting it: set it straight back
    os.umask(mask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)
