"""RFT's two samplers on the embedded model: k answers per question in row order i * k + j, each
ending at EOS or at the budget; and the generation phase keeps only strictly correct answers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpuscale.data.prompts import prompt_ids
from gpuscale.data.rewards import correctness
from gpuscale.data.tasks import load_examples
from gpuscale.recipes.rft import Settings
from gpuscale.recipes.rft.generate import generate_kept_set, make_sampler
from gpuscale.recipes.shared.models import load_generation_model

CTX = SimpleNamespace(rank=0, is_main=False, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                      run_dir=None)


@pytest.fixture(scope="module")
def loaded(one_torch_thread):
    return load_generation_model("tiny-math", CTX)


@pytest.mark.parametrize("generator", ["gpuscale", "transformers"])
def test_each_sampler_gives_k_answers_per_question_that_end_at_eos_or_the_budget(loaded, generator):
    settings = Settings(generator=generator, samples_per_question=3, batch_size=2, max_new_tokens=40)
    questions = load_examples("tiny-math", "train", 3)
    sample = make_sampler(settings, CTX, loaded, questions=2)
    for batch in (questions[:2], questions[2:]):  # a full call and a short last one
        rows = sample([prompt_ids(loaded.tokenizer, q["question"]) for q in batch])
        assert len(rows) == len(batch) * 3
        for row in rows:
            assert 1 <= len(row) <= 40
            assert row[-1] in loaded.eos or len(row) == 40
            assert not any(token in loaded.eos for token in row[:-1])


def test_the_generation_phase_keeps_only_strictly_correct_distinct_answers(loaded, tmp_path):
    ctx = SimpleNamespace(**{**vars(CTX), "run_dir": tmp_path})  # its rank results file goes there, not the checkout
    # The sampled answers alone (the gold answers the default adds: tests/unit/test_rft_filter.py).
    settings = Settings(samples_per_question=6, batch_size=4, max_new_tokens=48, keep_per_question=3,
                        include_gold=False)
    train = load_examples("tiny-math", "train", 8)
    batches = [list(enumerate(train))[:4], list(enumerate(train))[4:]]
    logged = []
    result = generate_kept_set(settings, ctx, loaded, batches, lambda number, **figures: logged.append(number))
    assert logged == [1, 2] and result.samples == 8 * 6
    assert (tmp_path / "results" / "rank0.jsonl").read_text().count("\n") == len(result.kept)
    assert len(result.questions) == 8 and result.correct == sum(q["correct_samples"] for q in result.questions)
    assert result.kept, "the embedded model answers some of these correctly"
    for row in result.kept:
        gold = train[row["index"]]["answer"]
        assert row["question"] == train[row["index"]]["question"] and row["source"] == "sample"
        assert correctness(row["completion"], gold, mode="strict")
    per_question = [[r["completion"] for r in result.kept if r["index"] == i] for i in range(8)]
    assert all(len(answers) <= 3 and len(set(answers)) == len(answers) for answers in per_question)
