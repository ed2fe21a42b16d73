"""eggroll with eval_examples=0 reads no test split: a data set that has none (or a hub data set whose
test split is not cached, offline) must not fail a run that evaluates nothing. One in-process rank on
the embedded model, the data loader refusing every test split."""

from __future__ import annotations

import json

import torch

from gpuscale.data import tasks
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.recipes.eggroll import Eggroll, Settings
from gpuscale.recipes.eggroll.trainer import run_eggroll
from gpuscale.runs.run_dir import RunDir


def test_a_run_without_evaluation_never_loads_the_test_split(tmp_path, monkeypatch, one_torch_thread):
    asked = []
    real = tasks.load_examples

    def train_split_only(name, split="test", max_examples=None, seed=0, **options):
        asked.append((split, max_examples))
        if split == "test":
            raise tasks.DataError(f"{name}: no test split here")
        return real(name, split, max_examples, seed, **options)

    monkeypatch.setattr(tasks, "load_examples", train_split_only)
    settings = Settings(eval_examples=0, population=4, prompts_per_step=2, max_new_tokens=4, steps=1, batch_size=8,
                        save_model=False, checkpoint_every=0, max_examples=16)  # not the whole 200,000-problem split
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    try:
        run_eggroll(Eggroll().for_device(settings, on_gpu=False, ranks=1), ctx, reporter)  # as a CPU rank runs it
    finally:
        reporter.close()
    assert [split for split, _ in asked] == ["train"]
    records = [json.loads(line) for line in RunDir(tmp_path).metrics(0).read_text().splitlines()]
    summary = [r["summary"] for r in records if "summary" in r and not r.get("partial")][-1]
    assert summary["steps"] == 1 and summary["accuracy_greedy_after"] is None
