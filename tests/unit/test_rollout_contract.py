"""The contract between TRL's GRPOTrainer and gpuscale's `rollout_func` (engines/rollout.py), driven the
way TRL drives it: one real optimizer step of `trainer.train()` on the embedded model, on CPU, with the
trainer grpo-mtl builds (its dataloader, its sampler that repeats each prompt, its generation buffer).

`rollout_func` is experimental upstream (pyproject.toml pins trl below the next minor for it). What
gpuscale relies on, each asserted here so that a TRL that changes it fails this test:
- TRL calls `rollout_func(prompts, trainer)`, positionally, with the trainer itself;
- the prompts are this rank's rows with each prompt already repeated num_generations times in a row
  (EngineRollout prefills each run once and samples all its rows), one-message chats as data.py writes;
- TRL reads "prompt_ids", "completion_ids" and "logprobs", one list per prompt row, and trains on them:
  the scored micro-batch holds the rollout's ids, and its "sampling_per_token_logps" are the rollout's
  log-probs (the policy-mismatch figures read them, and are logged);
- any other key is an extra field handed to the reward functions by name, beside the completion ids,
  the dataset's columns (`domain`) and the `log_extra` hook that grpo-mtl's samples use.
"""

from __future__ import annotations

import torch

from gpuscale.data.models import load_model
from gpuscale.data.tasks import load_examples
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.engines.rollout import EngineRollout, repeated_runs
from gpuscale.recipes.grpo_mtl import Settings
from gpuscale.recipes.grpo_mtl.data import grpo_rows
from gpuscale.recipes.grpo_mtl.trainer import build_trainer

GENERATIONS = 4
PROMPTS = 2
EXTRA = "rollout_call"  # an extra field the spy adds to gpuscale's output


class RolloutSpy:
    """gpuscale's EngineRollout, recording how TRL calls it and what it returned."""

    def __init__(self, rollout: EngineRollout):
        self.rollout = rollout
        self.calls: list[tuple[tuple, dict, dict]] = []

    def __call__(self, *args, **kwargs):
        output = self.rollout(*args, **kwargs)
        self.calls.append((args, kwargs, output))
        return {**output, EXTRA: [len(self.calls)] * len(output["completion_ids"])}


class RewardSpy:
    """A reward function of the trainer as it was, recording the keywords TRL passes it."""

    def __init__(self, function):
        self.function, self.__name__ = function, function.__name__
        self.kwargs: list[dict] = []

    def __call__(self, *args, **kwargs):
        self.kwargs.append(kwargs)
        return self.function(*args, **kwargs)


def unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def test_grpo_trainer_calls_gpuscale_s_rollout_and_trains_on_what_it_returns(tmp_path):
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-math")
    examples = load_examples("tiny-math", "train", 40)
    examples = [next(e for e in examples if e["domain"] == d) for d in ("arithmetic", "counting")]
    rows, _ = grpo_rows(examples, tokenizer, 256)
    settings = Settings(num_generations=GENERATIONS, prompts_per_step=PROMPTS, batch_size=PROMPTS * GENERATIONS,
                        max_steps=1, max_completion_length=12, temperature=0.7, learning_rate=1e-3)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    trainer, _callback = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
    assert isinstance(trainer.rollout_func, EngineRollout)  # generator=engine, the default
    spy = trainer.rollout_func = RolloutSpy(trainer.rollout_func)
    rewards = trainer.reward_funcs[0] = RewardSpy(trainer.reward_funcs[0])
    scored = []
    score = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: scored.append(score(inputs)) or scored[-1]
    try:
        trainer.train()
    finally:
        reporter.close()

    # Called once for the step's generation batch, as rollout_func(prompts, trainer).
    assert len(spy.calls) == 1
    (args, kwargs, output), = spy.calls
    assert kwargs == {} and len(args) == 2 and args[1] is trainer
    prompts = args[0]
    # Each prompt repeated num_generations times in a row; one-message chats.
    assert len(prompts) == PROMPTS * GENERATIONS
    assert all(isinstance(p, list) and len(p) == 1 and p[0]["role"] == "user" for p in prompts)
    distinct, per_prompt = repeated_runs([[p[0]["content"]] for p in prompts])
    assert per_prompt == GENERATIONS and len(distinct) == PROMPTS
    # What gpuscale returned: one row per prompt row, a log-prob per completion token.
    assert set(output) == {"prompt_ids", "completion_ids", "logprobs"}
    assert len(output["prompt_ids"]) == len(output["completion_ids"]) == len(output["logprobs"]) == len(prompts)
    assert all(len(lp) == len(ids) > 0 for lp, ids in zip(output["logprobs"], output["completion_ids"]))

    # The scored micro-batch is made of the rollout's rows, its sampler log-probs the rollout's.
    assert len(scored) == 1
    batch = scored[0]
    assert unpadded(batch["prompt_ids"], batch["prompt_mask"]) == output["prompt_ids"]
    assert unpadded(batch["completion_ids"], batch["completion_mask"]) == output["completion_ids"]
    sampled = batch["sampling_per_token_logps"]
    real = batch["completion_mask"].bool()
    assert torch.allclose(sampled[real], torch.tensor([x for row in output["logprobs"] for x in row]))
    assert batch["domain_ids"].tolist() == [trainer.domain_index[r] for r in ("arithmetic", "counting")
                                           for _ in range(GENERATIONS)]

    # The reward functions got the rollout's completions, the dataset's columns, the extra field, log_extra.
    (given,) = rewards.kwargs
    assert [list(ids) for ids in given["completion_ids"]] == output["completion_ids"]
    assert given["domain"] == [r for r in ("arithmetic", "counting") for _ in range(GENERATIONS)]
    assert given[EXTRA] == [1] * len(prompts)
    assert callable(given["log_extra"])

    # The loss trained on them: one optimizer step, the engine's generation timed, the mismatch between
    # the loss's log-probs and the rollout's logged (same weights, fp32: near zero).
    assert trainer.state.global_step == 1
    assert spy.rollout.seconds > 0 and trainer.generation_seconds > 0
    logged = next(log for log in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in log)
    assert 0 <= logged["sampling/sampling_logp_difference/mean"] < 1e-3
