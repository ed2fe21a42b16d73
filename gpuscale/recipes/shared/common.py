"""What several recipes do the same way inside a rank: load a model to generate with, cut their share
into batches, keep the batch shape fixed, and keep their per-example results on disk as they go.

Imported inside ranks only (it imports torch through the model loaders).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscale.runs.run_dir import RunDir, write_atomically


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


def summary_opening(ctx, settings=None, *, train: list | None = None, held_out: list | None = None) -> dict:
    """The figures a run's summary opens with, written here once for every recipe: its ranks
    (`world_size`) and `dtype`; with `train`, the `train_examples` it trains on; with `held_out`, the
    `eval_split` (of `settings`) and the `eval_examples` it is scored on. Each is a figure of the
    catalogue, data/figures.py."""
    opening = {"world_size": ctx.world_size, "dtype": str(ctx.dtype).removeprefix("torch.")}
    if train is not None:
        opening["train_examples"] = len(train)
    if held_out is not None:
        opening.update(eval_split=settings.eval_split, eval_examples=len(held_out))
    return opening


def batched(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def padded_to(rows: list, count: int) -> list:
    """A short last batch filled up with copies of its last row (whose outputs the caller drops):
    CUDA graphs and compiled code are made for one batch shape, and a new shape would cost a new
    capture or compilation."""
    return rows + [rows[-1]] * (count - len(rows)) if rows and len(rows) < count else rows


class RankResults:
    """A rank's per-example results, appended to RUN_DIR/results/rank<R>.jsonl as each batch is
    done: a run that is stopped or dies keeps what it finished. Rank 0 merges every rank's rows into
    RUN_DIR/results.jsonl at the end (`merge_results`); where it never gets there, whoever records the
    run's end merges the files (`gpuscale.control.store.merge_rank_results`)."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = RunDir(run_dir).rank_results(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.rows: list[dict] = []

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        with self.path.open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


def merge_results(run_dir: Path, rows: list[dict], key=lambda row: (row["index"], row.get("chain", 0))) -> Path:
    """Every rank's rows, in example order, as RUN_DIR/results.jsonl (written by rank 0, whole or not
    at all: a run stopped meanwhile gets the supervisor's merge of the rank files instead)."""
    path = RunDir(run_dir).results
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in sorted(rows, key=key)))
    return path


def held_out_accuracy(model, tokenizer, examples: list[dict], ctx, *, max_new_tokens: int,
                      temperature: float = 0.0, seed: int = 0, batch_size: int = 64) -> dict[str, float | None]:
    """Accuracy on held-out `examples`, each answered once at `temperature` (0 = greedy), answers
    extracted by the one held-out rule (data/scoring.py's HELD_OUT_ANSWER_MODE, strict): sharded
    over the ranks and gathered on every rank as {"accuracy": ..., "accuracy_<domain>": ...}, with
    "accuracy_new" for examples marked `structurally_new` (data/scoring.py's `held_out_figures`). The
    engine leaves the model's train/eval mode as it was."""
    import torch

    from gpuscale.data.prompts import eos_token_ids, pad_token_id, prompt_ids
    from gpuscale.data.scoring import HELD_OUT_ANSWER_MODE, held_out_figures, score_completion
    from gpuscale.data.seeds import derived_seed
    from gpuscale.engines.generation import GenerationEngine, Sampling

    eos = eos_token_ids(model, tokenizer)
    # No torch.compile: a few hundred answers do not repay tens of seconds of compiling.
    engine = GenerationEngine(model, eos, pad_token_id=pad_token_id(tokenizer, eos), compile=False)
    generator = torch.Generator(device=ctx.device).manual_seed(derived_seed(seed, "evaluation", ctx.rank))
    rows = []
    for batch in batched(ctx.shard(list(enumerate(examples))), batch_size):
        prompts = [prompt_ids(tokenizer, example["question"]) for _, example in batch]
        generation = engine.generate(prompts, max_new_tokens, Sampling(temperature=temperature), generator)
        for (index, example), tokens in zip(batch, generation.sequences()):
            rows.append(score_completion(index, 0, example, tokens, tokenizer, eos, HELD_OUT_ANSWER_MODE))
    return held_out_figures(row for rank_rows in ctx.gather(rows) for row in rank_rows)


def save_model(model, tokenizer, ctx) -> Path:
    """Rank 0 writes the model and its tokenizer to RUN_DIR/model (any recipe loads it with
    `--model` that path); returns the directory on every rank."""
    directory = RunDir(ctx.run_dir).model
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
