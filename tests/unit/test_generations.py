"""The generations file (runs/generations.py): bounded however long the run, a few of each earlier
step spread over its kinds, all of the latest; its views (app/views/generations.py); `gpuscale
generations` and its older name `gpuscale samples`; and a run made before the rename (samples.jsonl)."""

from __future__ import annotations

import json
from collections import Counter

from gpuscale.app.views import generations as view
from gpuscale.runs import generations
from gpuscale.runs.generations import GenerationLog, generation_record, read_generations
from gpuscale.runs.run_dir import GENERATIONS_BEFORE_RENAME, RunDir


def step_records(step: int, count: int = 10) -> list[dict]:
    return [generation_record(step, f"q{step}-{i}", f"a{step}-{i}", domain=("add", "count")[i % 2],
                              correct=i % 4 < 2, rewards={"correctness": float(i % 4 < 2)}) for i in range(count)]


def test_the_file_stays_bounded_over_a_long_run_and_keeps_all_of_the_latest_step(tmp_path):
    log = GenerationLog(tmp_path)
    for step in range(1, generations.STEPS_KEPT + 51):
        log.add(step, step_records(step))
    records = read_generations(tmp_path)
    per_step = Counter(record["step"] for record in records)
    last = generations.STEPS_KEPT + 50
    assert per_step[last] == 10  # all of the latest step
    assert len(per_step) == generations.STEPS_KEPT + 1
    assert min(per_step) == last - generations.STEPS_KEPT  # the oldest dropped
    assert set(per_step.values()) == {generations.GENERATIONS_PER_STEP, 10}
    assert len(records) == generations.STEPS_KEPT * generations.GENERATIONS_PER_STEP + 10


def test_an_earlier_step_keeps_one_of_each_domain_and_correctness_and_long_text_is_cut(tmp_path):
    log = GenerationLog(tmp_path)
    log.add(1, step_records(1, 40))
    log.add(1, [generation_record(1, "long", "x" * 10_000)])  # a second call of the same step adds to it
    log.add(2, step_records(2, 300))
    records = read_generations(tmp_path)
    first = [record for record in records if record["step"] == 1]
    assert {(record["domain"], record["correct"]) for record in first} == {
        ("add", True), ("count", True), ("add", False), ("count", False)}
    assert sum(record["step"] == 2 for record in records) == generations.LAST_STEP_LIMIT
    log.add(2, [generation_record(2, "p", "y" * 10_000)])
    bound = generations.GENERATIONS_PER_STEP + generations.LAST_STEP_LIMIT
    assert len(read_generations(tmp_path)) == bound  # still bounded
    cut = generation_record(3, "p", "z" * 10_000)["completion"]
    assert len(cut) == generations.TEXT_LIMIT + len(generations.CUT_MARK) and cut.endswith(generations.CUT_MARK)


def test_nan_figures_are_left_out_and_a_damaged_line_is_skipped(tmp_path):
    record = generation_record(1, "p", "c", rewards={"correctness": float("nan"), "format": 0.5},
                               advantage=float("nan"))
    assert record["rewards"] == {"format": 0.5} and record["advantage"] is None
    RunDir(tmp_path).generations.write_text(json.dumps(record) + "\n{torn\n[1]\n")
    assert read_generations(tmp_path) == [json.loads(json.dumps(record))]
    assert read_generations(tmp_path / "missing") == []


def test_the_views_filter_newest_first_and_write_each_generation_wrapped():
    records = step_records(1, 4) + step_records(2, 4)
    shown = view.filtered(records, domain="count", correct=True)
    assert [(r["step"], r["prompt"]) for r in shown] == [(2, "q2-1"), (1, "q1-1")]
    assert [r["prompt"] for r in view.filtered(records, step=2)] == ["q2-3", "q2-2", "q2-1", "q2-0"]
    assert view.steps_text([1, 2, 3]) == "1-3" and view.steps_text([2, 7]) == "2, 7"
    record = generation_record(4, "what is [bold]2+2[/x]?", "word " * 40, domain="add", correct=False,
                               rewards={"correctness": 0.0}, advantage=-0.5, truncated=True)
    text = view.generation_text(record, width=40)
    lines = text.splitlines()
    assert lines[0] == "step 4 · add · incorrect · correctness 0 · advantage -0.5 · hit the length cap"
    assert lines[1:3] == ["prompt:", "  what is [bold]2+2[/x]?"]
    assert lines[3] == "completion:" and len(lines) > 6 and all(len(line) <= 40 for line in lines[4:])


def test_gpuscale_generations_prints_the_newest_step_literally_and_refuses_what_the_run_lacks(home, capsys):
    from gpuscale.app.cli import main
    from gpuscale.control.store import Store

    store = Store(home)
    run_id = store.create_run("rft", {"model": "tiny-math"}, [], "node")
    bare_id = store.create_run("probe", {"model": "tiny-math"}, [], "node")
    log = GenerationLog(store.get_run(run_id)["run_dir"])
    log.add(1, step_records(1, 4))
    log.add(2, [*step_records(2, 2), generation_record(2, "q [bold]x[/x]", "y " * 80, domain="count", correct=False)])
    assert log.path == RunDir(store.get_run(run_id)["run_dir"]).root / "generations.jsonl"
    assert main(["generations", str(run_id)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {run_id}: 3 generations of step 2 (steps kept: 1-2; --step N for another), "
                          "newest first\n")
    assert "\nstep 2 · count · incorrect\nprompt:\n  q [bold]x[/x]\ncompletion:\n  y y" in out  # newest first
    assert main(["samples", str(run_id)]) == 0  # the command's older name: the same output
    assert capsys.readouterr().out == out
    assert main(["generations", str(run_id), "--step", "1", "--domain", "add", "--json"]) == 0
    picked = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["domain"], r["prompt"]) for r in picked] == [(1, "add", "q1-2"), (1, "add", "q1-0")]
    assert main(["generations", str(run_id), "--domain", "algebra"]) == 2
    assert f"domain: 'algebra': run {run_id}'s generations are of add, count" in capsys.readouterr().err
    assert main(["samples", str(bare_id)]) == 0
    assert "kept no generations" in capsys.readouterr().out


def test_a_run_made_before_the_rename_shows_its_samples_jsonl_under_both_names(home, capsys):
    """An older run's folder has its generations as samples.jsonl and no generations.jsonl: `gpuscale
    generations ID` and `gpuscale samples ID` show them alike; a folder with both reads generations.jsonl."""
    from gpuscale.app.cli import main
    from gpuscale.control.store import Store

    store = Store(home)
    run_id = store.create_run("grpo-mtl", {"model": "tiny-math"}, [], "node")
    folder = RunDir(store.get_run(run_id)["run_dir"])
    old = [generation_record(3, "old q", "old a", domain="add", correct=True, rewards={"correctness": 1.0})]
    folder.root.mkdir(parents=True, exist_ok=True)
    (folder.root / GENERATIONS_BEFORE_RENAME).write_text("".join(json.dumps(record) + "\n" for record in old))
    assert GENERATIONS_BEFORE_RENAME == "samples.jsonl" and not folder.generations.exists()
    assert folder.generations_to_read == folder.root / "samples.jsonl"
    shown = {}
    for name in ("generations", "samples"):
        assert main([name, str(run_id)]) == 0
        shown[name] = capsys.readouterr().out
    assert shown["generations"] == shown["samples"]
    assert shown["generations"].startswith(f"run {run_id}: 1 generations of step 3 (steps kept: 3;")
    assert "\nstep 3 · add · correct · correctness 1\nprompt:\n  old q\ncompletion:\n  old a" in shown["generations"]
    assert main(["samples", str(run_id), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == old
    GenerationLog(folder.root).add(4, [generation_record(4, "new q", "new a")])  # a file of the new name wins
    assert folder.generations_to_read == folder.generations
    assert [record["prompt"] for record in read_generations(folder.root)] == ["new q"]


def test_help_lists_generations_with_its_older_name():
    from gpuscale.app.cli import build_parser

    listing = build_parser().format_help()
    assert "generations (samples)" in listing and "what a run generated" in listing
    assert build_parser().parse_args(["samples", "7"]).func.__name__ == "cmd_generations"


def held_out_records(step: int, when: str, count: int = 3) -> list[dict]:
    return [generation_record(step, f"q{i}", f"a{i}", domain="add", correct=i == 0, phase=f"held-out {kind} {when}",
                              gold=str(i), extracted=str(i) if i == 0 else None)
            for kind in ("greedy", "sampled") for i in range(count)]


def test_the_held_out_file_keeps_the_first_evaluation_and_the_latest_bounded(tmp_path):
    generations.add_held_out(tmp_path, held_out_records(0, "before"))
    generations.add_held_out(tmp_path, held_out_records(50, "step50", count=generations.LAST_STEP_LIMIT + 9))
    generations.add_held_out(tmp_path, held_out_records(101, "after"))
    kept = generations._read_records(RunDir(tmp_path).held_out_answers)
    assert Counter(record["phase"] for record in kept) == {"held-out greedy before": 3, "held-out sampled before": 3,
                                                           "held-out greedy after": 3, "held-out sampled after": 3}
    generations.add_held_out(tmp_path, held_out_records(150, "step150", count=generations.LAST_STEP_LIMIT + 9))
    kept = generations._read_records(RunDir(tmp_path).held_out_answers)
    # The first evaluation kept, the latest each kind capped.
    assert Counter(record["step"] for record in kept) == {0: 6, 150: 2 * generations.LAST_STEP_LIMIT}


def test_held_out_answers_come_after_the_run_s_generations_and_show_gold_and_extracted(tmp_path):
    assert generations.held_out_step(tmp_path, "before") == 0
    assert generations.held_out_step(tmp_path, "after") == 1  # sft: no generations of its own
    assert generations.held_out_step(tmp_path, "step40") == 40  # eggroll's eval_every
    log = GenerationLog(tmp_path)
    log.add(1, step_records(1, 2))
    log.add(7, step_records(7, 2))
    assert generations.held_out_step(tmp_path, "after") == 8
    generations.add_held_out(tmp_path, held_out_records(0, "before", count=1))
    generations.add_held_out(tmp_path, held_out_records(8, "after", count=2))
    shown = generations.read_run_generations(tmp_path)
    assert [record["step"] for record in shown] == [0, 0, 1, 1, 7, 7, 8, 8, 8, 8]
    assert read_generations(tmp_path) == [record for record in shown if record["phase"] is None]
    wrong, right = view.filtered(shown, step=8)[0], shown[-4]
    assert view.heading(wrong) == "step 8 · held-out sampled after · add · incorrect · gold 1 · answered nothing"
    assert view.heading(right) == "step 8 · held-out greedy after · add · correct · gold 0 · answered 0"


def test_a_held_out_evaluation_writes_every_answer_with_its_gold_and_extracted_answer(tmp_path):
    """The training recipes' held-out evaluation (recipes/shared/evaluation.py), on the embedded model:
    every problem's answer at both temperatures, the gold answer the data gave and the one read from the
    completion by the held-out rule, as `gpuscale generations` shows them."""
    import torch

    from gpuscale.data.answers import extract_strict
    from gpuscale.data.models import load_model
    from gpuscale.data.tasks import gold_answer, load_examples
    from gpuscale.engines.distributed import RankContext
    from gpuscale.recipes.shared.evaluation import held_out_evaluation

    model, tokenizer = load_model("tiny-math", dtype=torch.float32, device=torch.device("cpu"))
    examples = load_examples("tiny-math", "test", 3)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    figures = held_out_evaluation(model, tokenizer, examples, ctx, "before", max_new_tokens=48, memory_share=0.5)
    held_out_evaluation(model, tokenizer, examples, ctx, "after", max_new_tokens=48, memory_share=0.5)
    records = generations.read_run_generations(tmp_path)
    assert [(record["step"], record["phase"]) for record in records] == [
        (step, f"held-out {kind} {when}") for step, when in ((0, "before"), (1, "after"))
        for kind in ("greedy", "sampled") for _ in examples]
    for record, example in zip(records, examples * 4):
        assert (record["prompt"], record["domain"], record["gold"]) == (
            example["question"], example["domain"], gold_answer(example))
        assert record["extracted"] == extract_strict(record["completion"])
        assert record["correct"] is (record["extracted"] == record["gold"])
    greedy_before = [record["correct"] for record in records[:3]]
    assert figures["accuracy_greedy_before"] == sum(greedy_before) / 3
