"""What the model generated, a bounded selection of it: RUN_DIR/generations.jsonl (`RunDir.generations`;
a run made before the rename has it as samples.jsonl, which `read_generations` still reads).

A recipe that generates (grpo-mtl, rft, eggroll, power-sampling) hands each step's (or phase's)
generations to a `GenerationLog` on rank 0: every one of the latest step (up to `LAST_STEP_LIMIT`),
`GENERATIONS_PER_STEP` of each earlier step (spread over domains and correct/incorrect), the earlier
steps themselves capped at `STEPS_KEPT` (the oldest dropped first), each prompt and completion cut at
`TEXT_LIMIT` characters. So the file never holds more than STEPS_KEPT x GENERATIONS_PER_STEP +
LAST_STEP_LIMIT records of at most 2 x TEXT_LIMIT characters of text each (a few MB), however long the
run. It is rewritten whole at each step (`write_atomically`: a reader never sees half a line).

One record per line (`generation_record`): step, phase (a recipe's phase name, or None), domain, prompt,
completion, correct (True/False, None where nothing scores it), rewards ({reward name: value}),
advantage (grpo-mtl), fitness (eggroll), truncated (the completion hit the length cap), gold and
extracted (the gold answer and the one read from the completion, where they are known), t (time).

The held-out evaluation of every training recipe (recipes/shared/evaluation.py) writes its answers, each
with its gold and extracted answer, to RUN_DIR/held_out.jsonl (`add_held_out`): the first
evaluation's (before training) and the latest one's, at most `LAST_STEP_LIMIT` of each temperature, phase
`held-out <greedy|sampled> <when>`, at the step the model was at (`held_out_step`). The front ends read
both files (`read_run_generations`), so `gpuscale generations ID` shows a training run's final held-out
answers by default, and anyone can check the gold answers the data gave.

Plain Python: the ranks write it and the front ends read it (`read_generations`). Only rank 0 writes,
its own generations, or every rank's where the recipe has them gathered (grpo-mtl: TRL gathers
every rank's completions on each rank).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from gpuscale.runs.run_dir import RunDir, write_atomically

GENERATIONS_PER_STEP = 4  # kept of every step but the latest
LAST_STEP_LIMIT = 256  # the latest step's generations, all of them up to this many
STEPS_KEPT = 250  # earlier steps kept (GENERATIONS_PER_STEP each); the oldest go first
TEXT_LIMIT = 4000  # characters of a prompt or a completion kept
CUT_MARK = " […cut]"


def generation_record(step: int, prompt: str, completion: str, *, domain: str | None = None,
                      correct: bool | None = None, rewards: dict[str, float] | None = None,
                      advantage: float | None = None, fitness: float | None = None,
                      truncated: bool | None = None, phase: str | None = None, gold: str | None = None,
                      extracted: str | None = None) -> dict[str, Any]:
    """One generation, as the file holds it: every field present (None where the recipe has none)."""
    return {"step": int(step), "phase": phase, "domain": domain, "prompt": _cut(prompt),
            "completion": _cut(completion), "correct": correct,
            "rewards": {name: _number(value) for name, value in (rewards or {}).items() if _number(value) is not None},
            "advantage": _number(advantage), "fitness": _number(fitness), "truncated": truncated,
            "gold": gold, "extracted": extracted, "t": time.time()}


class GenerationLog:
    """The writing side, one per run, on the rank that writes (rank 0): `add(step, records)`."""

    def __init__(self, run_dir: str | Path):
        self.path = RunDir(run_dir).generations
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.earlier: dict[int, list[dict]] = {}  # step -> the few kept of it
        self.latest_step: int | None = None
        self.latest: list[dict] = []

    def add(self, step: int, records: list[dict]) -> None:
        """Records of `step` (several calls may add to the same step); the file is rewritten bounded."""
        if not records:
            return
        if self.latest_step is not None and step != self.latest_step:
            self.earlier[self.latest_step] = a_few(self.latest, GENERATIONS_PER_STEP)
            self.latest = []
            while len(self.earlier) > STEPS_KEPT:
                del self.earlier[min(self.earlier)]
        self.latest_step = step
        self.latest = (self.latest + list(records))[:LAST_STEP_LIMIT]
        kept = [record for few in self.earlier.values() for record in few] + self.latest
        write_atomically(self.path, "".join(json.dumps(record) + "\n" for record in kept))


HELD_OUT_PHASE = "held-out"  # a held-out record's phase: `held-out <greedy|sampled> <when>`


def add_held_out(run_dir: str | Path, records: list[dict]) -> None:
    """One held-out evaluation's records (every temperature's, each at most LAST_STEP_LIMIT) into
    RUN_DIR/held_out.jsonl, written whole by rank 0: the file keeps the first evaluation's records (the
    model before training: the file's first step) and the latest one's, those between (eggroll's
    `eval_every`) replaced as they come, so that it stays bounded."""
    path = RunDir(run_dir).held_out_answers
    earlier = _read_records(path)
    first = [record for record in earlier if record["step"] == earlier[0]["step"]] if earlier else []
    phases = dict.fromkeys(record["phase"] for record in records)
    kept = [record for phase in phases for record in [r for r in records if r["phase"] == phase][:LAST_STEP_LIMIT]]
    write_atomically(path, "".join(json.dumps(record) + "\n" for record in first + kept))


def held_out_step(run_dir: str | Path, when: str) -> int:
    """The step a held-out evaluation's records are shown at: 0 before training, K for eggroll's
    `stepK`, and after training one past the last step whose generations the run kept (1 where it kept
    none: sft), so that `gpuscale generations ID` shows the final evaluation first."""
    if when == "before":
        return 0
    if when.startswith("step") and when[4:].isdigit():
        return int(when[4:])
    return 1 + max((record["step"] for record in read_generations(run_dir)), default=0)


def a_few(records: list[dict], count: int) -> list[dict]:
    """`count` of `records`, spread: one of each (domain, correct) kind in turn, in their order."""
    kinds: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        kinds[(record.get("domain"), record.get("correct"))].append(record)
    chosen: list[dict] = []
    queues = list(kinds.values())
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return sorted(chosen, key=records.index)


def read_generations(run_dir: str | Path) -> list[dict]:
    """Every record of the run's generations file (`RunDir.generations_to_read`: an older run's
    samples.jsonl too), in the order written (oldest step first); [] if it has none. A line that is not
    a JSON object is skipped (the file is written whole, so only a damaged file has one)."""
    return _read_records(RunDir(run_dir).generations_to_read)


def _read_records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def read_run_generations(run_dir: str | Path) -> list[dict]:
    """What the front ends show: the generations (`read_generations`) and the held-out answers
    (RUN_DIR/held_out.jsonl), oldest step first, a step's generations before its held-out answers."""
    records = read_generations(run_dir) + _read_records(RunDir(run_dir).held_out_answers)
    return sorted(records, key=lambda record: record["step"])


def _cut(text: Any) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + CUT_MARK


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if value == value else None  # NaN is not JSON
