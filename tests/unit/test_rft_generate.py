"""RFT's two samplers on the embedded model: k answers per question in row order i * k + j, each
ending at EOS or at the budget, given back as the row-by-row lists and texts they were before the
call's host work was batched; and the generation phase keeps only strictly correct answers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpuscale.data.prompts import prompt_ids, prompts_ids
from gpuscale.data.rewards import correctness
from gpuscale.data.scoring import texts_of
from gpuscale.data.tasks import load_examples
from gpuscale.engines.generation.results import rows_of
from gpuscale.recipes.rft import Settings
from gpuscale.recipes.rft.generate import SampledCall, generate_kept_set, make_sampler
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
        rows = sample([prompt_ids(loaded.tokenizer, q["question"]) for q in batch]).sequences()
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
    # Each call's seconds, cut into its pieces: the timed ones add up to the call's time.
    assert [list(split) for split in result.call_splits] == [
        ["tokenize", "prefill", "decode", "results", "texts", "filter"]] * 2
    assert all(seconds >= 0 for split in result.call_splits for seconds in split.values())
    timed = sum(seconds for split in result.call_splits for piece, seconds in split.items() if piece != "filter")
    assert timed == pytest.approx(result.seconds)


@pytest.fixture(scope="module")
def random_tiny(one_torch_thread):
    return load_generation_model("random-tiny", CTX)  # its ids run past its stand-in tokenizer's vocabulary


@pytest.mark.parametrize("generator", ["gpuscale", "transformers"])
@pytest.mark.parametrize("model", ["tiny-math", "random-tiny"])
def test_a_calls_rows_texts_and_cuts_are_those_of_the_row_by_row_host_work(loaded, random_tiny, generator, model):
    """The previous host work, row by row, is the reference: each row's tokens by its own mask, its
    text from a list without EOS and unknown ids through `batch_decode`, cut = a full row not ending at
    an EOS; and each prompt encoded alone."""
    model_loaded = loaded if model == "tiny-math" else random_tiny
    tokenizer, eos = model_loaded.tokenizer, model_loaded.eos
    settings = Settings(generator=generator, samples_per_question=4, batch_size=3, max_new_tokens=20)
    questions = [q["question"] for q in load_examples("tiny-math", "train", 3)]
    prompts = prompts_ids(tokenizer, questions)
    assert prompts == [prompt_ids(tokenizer, question) for question in questions]
    sampled = make_sampler(settings, CTX, model_loaded, questions=3)(prompts)
    rows = [row[keep].tolist() for row, keep in zip(sampled.tokens, sampled.mask)]
    assert sampled.sequences() == rows
    known = len(tokenizer)
    assert sampled.texts(tokenizer, eos) == tokenizer.batch_decode(
        [[t for t in row if t not in eos and t < known] for row in rows], skip_special_tokens=True)
    cuts = [len(row) >= 20 and row[-1] not in eos for row in rows]
    assert sampled.truncated(20, eos) == cuts
    if model == "random-tiny":
        assert any(cuts)  # rows that run to the budget, besides those that end


def test_a_calls_texts_drop_eos_and_ids_past_the_vocabulary_as_the_row_by_row_filter_did(loaded):
    """A random model of a real shape samples ids far past its stand-in tokenizer's 512 (the GPU bench's
    case): here such rows are made directly, with EOS inside and ends of every kind."""
    tokenizer, eos = loaded.tokenizer, loaded.eos
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 3 * len(tokenizer), (40, 16), generator=generator)
    tokens[::5, 3] = eos[0]
    lengths = torch.randint(0, 17, (40,), generator=generator)
    sampled = SampledCall(tokens, torch.arange(16)[None] < lengths[:, None])
    rows = [row[:length].tolist() for row, length in zip(tokens, lengths)]
    known = len(tokenizer)
    assert sampled.texts(tokenizer, eos) == tokenizer.batch_decode(
        [[t for t in row if t not in eos and t < known] for row in rows], skip_special_tokens=True)
    assert sampled.truncated(16, eos) == [len(row) >= 16 and row[-1] not in eos for row in rows]


def test_rows_of_keeps_each_rows_masked_tokens_in_order_whatever_the_mask():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (7, 9), generator=generator)
    keep = torch.rand(7, 9, generator=generator) < 0.5  # not a prefix: holes anywhere
    keep[2] = False
    assert rows_of(tokens, keep) == [row[mask].tolist() for row, mask in zip(tokens, keep)]


def test_texts_of_decodes_as_batch_decode_special_tokens_included(loaded):
    tokenizer = loaded.tokenizer
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, len(tokenizer), (50, 30), generator=generator).tolist()
    rows[0] = list(tokenizer.all_special_ids) + rows[0][:5]
    assert texts_of(rows, tokenizer) == tokenizer.batch_decode(rows, skip_special_tokens=True)
