"""The sft recipe's pieces: what it trains on (prompt-completion tokens, held-out evaluation
questions) and that its training phase, `train_sft`, learns (LoRA on the embedded model, in-process)."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
from transformers import TrainerCallback

from gpuscale.data.models import load_model
from gpuscale.data.prompts import prompt_ids
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.recipes.sft import SFT, Settings
from gpuscale.recipes.shared.training import train_sft, train_sft_dataset
from gpuscale.recipes.shared.training_data import tokenized_dataset, training_and_eval_examples
from gpuscale.runs.settings import SettingsError


def test_rows_become_prompt_then_completion_with_the_loss_on_the_completion():
    _model, tokenizer = load_model("tiny-math")
    rows = [{"question": "Ann has 3 apples. Ann gets 4 more. How many apples does Ann have now?",
             "completion": "3 + 4 = 7.\n#### 7", "domain": "arithmetic"}]
    (encoded,) = tokenized_dataset(rows, tokenizer)
    prompt = prompt_ids(tokenizer, rows[0]["question"])
    answer = tokenizer(rows[0]["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert encoded["input_ids"] == prompt + answer
    assert encoded["completion_mask"] == [0] * len(prompt) + [1] * len(answer)


def write_jsonl(path, count):
    with path.open("w") as handle:
        for n in range(count):
            handle.write(json.dumps({"question": f"What is {n} plus 1?", "answer": f"#### {n + 1}"}) + "\n")
    return str(path)


def test_a_jsonl_file_holds_its_evaluation_questions_out_of_training(tmp_path):
    settings = Settings(dataset=write_jsonl(tmp_path / "plus.jsonl", 10), eval_examples=3, max_examples=5)
    train, test = training_and_eval_examples(settings)
    assert [e["question"] for e in test] == [f"What is {n} plus 1?" for n in range(3)]
    assert [e["question"] for e in train] == [f"What is {n} plus 1?" for n in range(3, 8)]
    SFT().check(settings)
    with pytest.raises(SettingsError, match="eval_examples: 10: holds out every example"):
        SFT().check(settings.model_copy(update={"eval_examples": 10}))


def test_named_tasks_train_and_evaluate_on_their_own_splits():
    train, test = training_and_eval_examples(Settings(max_examples=50, eval_examples=20))
    assert len(train) == 50 and len(test) == 20
    assert not {e["question"] for e in train} & {e["question"] for e in test}


def test_lora_training_lowers_the_loss_and_merges_into_a_plain_model(tmp_path):
    torch.manual_seed(0)
    original, _ = load_model("tiny-math")
    # An answer the embedded model has never seen: its loss starts high and must come down. (On this
    # 128-wide model LoRA levels off near 3.1 nats, in peft's own loop too; a full fine-tune goes lower.)
    rows = [{"question": f"Ann has {n} apples. Ann gets 2 more. How many apples does Ann have now?",
             "completion": "I like to count.\n#### 99"} for n in range(4)]
    settings = SFT().for_device(Settings(batch_size=4, max_steps=20, learning_rate=3e-3, lora_rank=8, lora_alpha=16,
                                         lr_scheduler="constant", max_length=64), on_gpu=False, ranks=1)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    trained = train_sft(rows, settings, ctx, reporter)
    reporter.close()

    figures = trained.figures
    assert figures["steps"] == 20
    assert figures["loss_last"] < 0.75 * figures["loss_first"]  # measured: 5.9 -> 3.3
    assert figures["train_tokens"] > 0 and figures["tokens_per_s"] > 0
    # The adapter is merged: a plain transformers model whose own weights changed.
    assert type(trained.model) is type(original)
    assert not any("lora" in name for name in trained.model.state_dict())
    assert not torch.equal(trained.model.model.layers[0].self_attn.q_proj.weight,
                           original.model.layers[0].self_attn.q_proj.weight)
    logged = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 21))


class SlowFirstStep(TrainerCallback):
    """The first optimizer step made slower by `seconds`, as a warm-up is (the optimizer's state built,
    the allocator's first blocks, kernels compiled on first use)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            time.sleep(self.seconds)


# Long beside a step of the tiny model (well under a second on CPU), so that steps slowed by a loaded
# machine cannot close the gap between the whole run's rate and the steady one.
FIRST_STEP_PAUSE_S = 4.0


def test_the_summary_gives_the_steady_rate_beside_the_whole_runs(tmp_path):
    """A real short fine-tune whose first step is slow: the whole-run tokens/s counts it, the steady
    one (the median step's rate, the first step left out) does not, and is the median of the rates
    of the steps rank 0 logged to its metric file."""
    model, tokenizer = load_model("tiny-math")
    rows = [{"question": f"What is {n} plus 1?", "completion": f"#### {n + 1}"} for n in range(16)]
    settings = SFT().for_device(Settings(batch_size=2, max_steps=6, learning_rate=1e-4, max_length=64),
                                on_gpu=False, ranks=1)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    trained = train_sft_dataset(tokenized_dataset(rows, tokenizer, settings.max_length), settings, ctx, reporter,
                                model, tokenizer, callbacks=(SlowFirstStep(FIRST_STEP_PAUSE_S),))
    reporter.close()

    figures = trained.figures
    assert figures["steps"] == 6
    assert figures["tokens_per_s_steady"] > figures["tokens_per_s"] > 0, figures
    assert figures["mfu"] is None and figures["mfu_steady"] is None  # no card's peak on CPU
    logged = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [row for row in logged if row.get("step_time_ms")]
    assert [row["step"] for row in steps] == list(range(1, 7))
    assert steps[0]["step_time_ms"] > 1000  # the slow first step, left out of the steady rate
    rates = [row["tokens"] / (row["step_time_ms"] / 1000) for row in steps[1:]]
    assert figures["tokens_per_s_steady"] == pytest.approx(statistics.median(rates), rel=1e-6)
