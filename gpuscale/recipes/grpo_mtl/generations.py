"""grpo-mtl's generations file (runs/generations.py) through TRL's own hooks, the training loop untouched:

- `GenerationNotes` wraps the first reward function and, through the `log_extra` keyword TRL gives every
  reward function, adds two columns to TRL's completion log: each row's domain and whether its
  completion was cut (max_completion_length tokens, the last no EOS: TRL's own `is_truncated` rule);
- `GenerationKeeper`, a TrainerCallback, reads that log (`GRPOTrainer._logs`: prompts, completions, each
  reward function's value and the advantages, TRL gathers them from every rank onto each rank,
  `log_completions` or not) at the end of each optimizer step, and rank 0 hands it to a `GenerationLog`.
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

from gpuscale.data.rewards import completion_text
from gpuscale.runs.generations import GenerationLog, generation_record


class GenerationNotes:
    """A reward function as it was, that also notes each row's domain and truncation for the generations file."""

    def __init__(self, function, max_completion_length: int, eos: list[int]):
        self.function, self.max_completion_length, self.eos = function, max_completion_length, set(eos)
        self.__name__ = function.__name__  # the name TRL logs its reward under

    def __call__(self, *args, log_extra=None, **kwargs):
        if log_extra is not None:
            ids = kwargs.get("completion_ids") or []
            log_extra("domain", list(kwargs.get("domain") or [None] * len(ids)))
            log_extra("truncated", [self.cut(list(row)) for row in ids])
        return self.function(*args, log_extra=log_extra, **kwargs)

    def cut(self, row: list[int]) -> bool:
        return len(row) >= self.max_completion_length and (not row or row[-1] not in self.eos)


class GenerationKeeper(TrainerCallback):
    """At each optimizer step's end, rank 0 writes the step's generations (the whole generation batch,
    every rank's) to the run's generations file."""

    def __init__(self, trainer, run_dir):
        self.trainer = trainer
        self.log = GenerationLog(run_dir)
        self._last_seen = None  # a generation batch that spans several steps is written once

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = self.trainer._logs
        first = (logs["prompt"][0], logs["completion"][0]) if logs["prompt"] else None
        if first is None or first == self._last_seen:
            return
        self._last_seen = first
        self.log.add(state.global_step, step_records(state.global_step, logs))


def step_records(step: int, logs) -> list[dict]:
    """TRL's completion log as generation records: the rewards by name (`correctness_<domain>` shown as
    `correctness`; a function that does not score the row's domain gives NaN and is left out)."""
    rewards, extra = logs["rewards"], logs["extra"]
    records = []
    for i, (prompt, completion) in enumerate(zip(logs["prompt"], logs["completion"])):
        domain = _column(extra, "domain", i)
        values = {_reward_name(name, domain): column[i] for name, column in rewards.items()
                  if i < len(column) and not math.isnan(column[i])}
        correctness = values.get("correctness")
        records.append(generation_record(
            step, completion_text(prompt), completion_text(completion),
            domain=domain, rewards=values, correct=None if correctness is None else correctness >= 1.0,
            advantage=_column(logs, "advantages", i), truncated=_column(extra, "truncated", i)))
    return records


def _column(table: dict, name: str, i: int):
    column = table.get(name)
    return column[i] if column is not None and i < len(column) else None


def _reward_name(name: str, domain: str | None) -> str:
    return name[: -len(domain) - 1] if domain and name.endswith(f"_{domain}") else name
