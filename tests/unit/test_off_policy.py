"""rollout=async's pieces in-process, one rank, on the embedded model: TRL's importance-sampling correction
turned on for gpuscale's rollout gives the weights an explicit computation gives; the async rollout hands
each step what the synchronous rollout would have sampled from the weights one step older, prefetched from
the prompts the trainer will ask for next; the places TRL reads `use_vllm` are the ones the switch expects;
the ratio taken at the loss (TRL's old-logprobs forward skipped) trains as TRL's way does."""

from __future__ import annotations

import ast
import copy
import inspect
from collections import defaultdict
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from gpuscale.data.models import load_model
from gpuscale.engines.async_rollout import AsyncEngineRollout, LocalSampler, Lookahead
from gpuscale.engines.off_policy import CLIPPED_SHARE, STALENESS, clipped_counts, one_policy_per_generation
from gpuscale.engines.rollout import EngineRollout
from gpuscale.recipes.grpo_mtl import GrpoMtl, Settings
from gpuscale.runs.settings import SettingsError

GENERATIONS = 4


def test_trl_reads_use_vllm_only_where_the_switch_expects():
    """`ImportanceSamplingCorrection` keeps use_vllm false in `__init__` (which would build vLLM) and inside
    `_generate` (the rollout, and the vLLM generation paths it calls), true elsewhere: where TRL corrects. A
    TRL that reads it in another method must be looked at before the switch is trusted."""
    from trl import GRPOTrainer

    tree = ast.parse(inspect.getsource(GRPOTrainer))
    readers = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and node.attr == "use_vllm" and isinstance(node.ctx, ast.Load):
                    readers.add(function.name)
    generation = {"__init__", "_generate", "_generate_single_turn", "_tool_call_loop"}
    correction = {"_generate_and_score_completions", "_compute_loss"}
    assert readers == generation | correction


def test_clipped_counts_count_the_ratios_outside_the_bounds_of_the_counted_tokens():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    sampling = torch.tensor([[0.0, -2.0, 2.0, -0.1], [float("nan"), -2.0, 0.0, 0.0]])  # ratios 1, e^2, e^-2, e^.1
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert clipped_counts(old, sampling, mask, None, 3.0).tolist() == [2.0, 6.0]  # e^2 twice; the NaN not counted
    assert clipped_counts(old, sampling, mask, 0.5, 3.0).tolist() == [3.0, 6.0]  # and e^-2 below 0.5
    assert clipped_counts(old, sampling, mask, None, None).tolist() == [0.0, 6.0]


def test_async_is_refused_before_launch_where_it_cannot_run():
    recipe = GrpoMtl()
    with pytest.raises(SettingsError, match="rollout: async: needs generator=engine, not transformers"):
        recipe.check(Settings(rollout="async", max_examples=64, generator="transformers"))
    recipe.check(Settings(rollout="async", max_examples=64))
    recipe.check(Settings(rollout="async", max_examples=64, lora_rank=8))  # the engine decodes a merged copy


def test_a_lookahead_hands_out_what_it_peeked_in_order():
    ahead = Lookahead(iter([1, 2, 3]))
    assert next(ahead) == 1 and ahead.peek() == 2 and ahead.peek() == 2
    assert list(ahead) == [2, 3] and ahead.peek() is None


# ---- the rollout ---------------------------------------------------------------------------------


def fake_trainer(model, upcoming=None):
    """What the rollouts read of a GRPOTrainer."""
    return SimpleNamespace(model=model, state=SimpleNamespace(global_step=0, max_steps=10),
                           args=SimpleNamespace(bf16=False, fp16=False), _metrics={"train": defaultdict(list)},
                           accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0),
                           upcoming_prompts=lambda: upcoming)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_the_async_rollout_hands_each_step_what_the_sync_one_samples_from_the_weights_a_step_older():
    model, tokenizer = load_model("tiny-math")
    first = [chat("What is 2 + 3?")] * 2
    second = [chat("How many letters are in 'apple'?")] * 2
    settings = {"max_new_tokens": 8, "temperature": 1.0, "seed": 3}

    # The synchronous rollout's step 0 and step 1, both from the weights of step 0.
    reference = fake_trainer(copy.deepcopy(model))
    sync = EngineRollout(tokenizer, **settings)
    expected = [sync(first, reference)]
    reference.state.global_step = 1
    expected.append(sync(second, reference))

    trainer = fake_trainer(model, upcoming=second)
    rollout = AsyncEngineRollout(LocalSampler(EngineRollout(tokenizer, own_weights=True, **settings)), max_staleness=1)
    got = rollout(first, trainer)  # generated on call (nothing ahead), step 1's prompts submitted after
    assert got["completion_ids"] == expected[0]["completion_ids"]
    assert (rollout.ahead.step, rollout.ahead.weights_step) == (1, 0)
    with torch.no_grad():  # the optimizer's step, while step 1's completions are being generated
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    trainer.state.global_step = 1
    trainer.upcoming_prompts = lambda: first
    got = rollout(second, trainer)
    assert got["completion_ids"] == expected[1]["completion_ids"]  # the old weights, step 1's seed
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
               for a, b in zip(got["logprobs"], expected[1]["logprobs"], strict=True))
    assert trainer._metrics["train"][STALENESS] == [0.0, 1.0] and rollout.prefetched == 1
    # Between the jobs the engine's copy took the stepped weights, and step 2's job samples from them.
    assert all(torch.equal(copied, master) for copied, master in
               zip(rollout.sampler.rollout.engine.model.parameters(), model.parameters(), strict=True))
    assert (rollout.ahead.step, rollout.ahead.weights_step) == (2, 1)
    trainer.state.global_step = 2
    with pytest.raises(RuntimeError, match="rollout=async: step 2 asked for other prompts than those generated "
                                           "ahead for step 2"):
        rollout(second, trainer)
    rollout.on_train_end(None, None, None)


def test_at_staleness_0_the_async_rollout_samples_what_the_sync_one_does_every_step():
    model, tokenizer = load_model("tiny-math")
    prompts = [chat("What is 7 - 4?")] * 3
    sync, reference = EngineRollout(tokenizer, 6, 1.0, seed=5), fake_trainer(copy.deepcopy(model))
    trainer = fake_trainer(model, upcoming=prompts)
    rollout = AsyncEngineRollout(LocalSampler(EngineRollout(tokenizer, 6, 1.0, seed=5, own_weights=True)),
                                 max_staleness=0)
    for step in range(3):
        reference.state.global_step = trainer.state.global_step = step
        assert rollout(prompts, trainer)["completion_ids"] == sync(prompts, reference)["completion_ids"]
        assert rollout.ahead is None  # nothing generated ahead
    assert trainer._metrics["train"][STALENESS] == [0.0, 0.0, 0.0]
    rollout.on_train_end(None, None, None)


# ---- TRL's correction on the trainer --------------------------------------------------------------


@contextmanager
def built_async_trainer(run_dir, **overrides):
    """A 1-rank MultiTaskGRPOTrainer with rollout=async on tiny-math, temperature 0.7, and the rows of
    one generation batch (each prompt `GENERATIONS` times); the same weights and rollout seeds each time."""
    from gpuscale.data.tasks import load_examples
    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.reporter import Reporter
    from gpuscale.recipes.grpo_mtl.data import grpo_rows
    from gpuscale.recipes.grpo_mtl.trainer import build_trainer

    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-math")
    rows, _ = grpo_rows(load_examples("tiny-math", "train", 4), tokenizer, 256)
    settings = Settings(**{"num_generations": GENERATIONS, "prompts_per_step": 4, "batch_size": 16, "max_steps": 1,
                           "max_completion_length": 16, "temperature": 0.7, "rollout": "async", **overrides})
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, run_dir)
    reporter = Reporter(run_dir, 0)
    trainer, _ = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    try:
        yield trainer, [row for row in rows for _ in range(GENERATIONS)]
    finally:
        trainer.rollout_func.on_train_end(None, None, None)
        reporter.close()


@pytest.fixture(scope="module")
def async_trainer(tmp_path_factory):
    """TRL's way: its no-grad forward gives the old log-probs (old_logprobs=forward)."""
    with built_async_trainer(tmp_path_factory.mktemp("async"), old_logprobs="forward") as built:
        yield built


def step_behind(trainer, batch, noise_seed: int = 1) -> None:
    """Scores `batch` once (which builds the engine's copy of the weights of step 0), then moves the
    trainer's weights as an optimizer step would, the copy left as it was: the next completions come from
    a policy other than the trained one."""
    trainer._generate_and_score_completions(batch)
    noise = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=noise))
    trainer._metrics["train"].clear()


def completion_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log p(completion token | what precedes it) under `model` at `temperature`, one row, no padding."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_the_importance_weights_are_the_trainer_s_probabilities_over_the_sampler_s_truncated(async_trainer):
    """TRL's way (its old-logprobs forward, old_logprobs=forward). The engine samples from its copy of the
    weights of the step before; the trainer has stepped since (noise added to its masters, the copy left as
    it was). Every completion token's weight is min(p_trainer / p_sampler, cap), each probability from a
    plain forward of its own weights; the clipped share is the share of tokens over the cap. The test below
    shows the default way (the ratio at the loss) trains as this one does."""
    trainer, batch = async_trainer
    assert not trainer.ratio_at_loss
    step_behind(trainer, batch)
    sampler = copy.deepcopy(trainer.rollout_func.sampler.rollout.engine.model)  # the weights of step 0
    trainer.vllm_importance_sampling_clip_max = cap = 1.1  # TRL's 3.0 would clip nothing here
    output = trainer._generate_and_score_completions(batch)

    explicit, weights, clipped = [], [], 0
    for row in range(len(batch)):
        prompt = output["prompt_ids"][row][output["prompt_mask"][row].bool()].tolist()
        completion = output["completion_ids"][row][output["completion_mask"][row].bool()].tolist()
        ratio = torch.exp(completion_logps(trainer.model, prompt, completion, 0.7)
                          - completion_logps(sampler, prompt, completion, 0.7))
        clipped += int((ratio > cap).sum())
        explicit.append(ratio.clamp(max=cap))
        weights.append(output["importance_sampling_ratio"][row][: len(completion)])
    explicit, weights = torch.cat(explicit), torch.cat(weights)
    assert len(explicit) > 20 and 0 < clipped < len(explicit)
    assert torch.allclose(weights, explicit, atol=1e-4)
    assert trainer._metrics["train"][CLIPPED_SHARE] == [pytest.approx(clipped / len(explicit))]
    assert trainer._metrics["train"][STALENESS] == [0.0]  # the same optimizer step: nothing stale by the count


# ---- the ratio at the loss: TRL's old-logprobs forward skipped ----------------------------------------


RATIO_FIGURES = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max", CLIPPED_SHARE, "sampling/sampling_logp_difference/mean",
                 "sampling/sampling_logp_difference/max")


def one_step(trainer, batch, mode: str, clip_min: float | None, clip_max: float) -> dict:
    """One optimizer step's micro-batches (2: batch_size 8 of a rank's 16 completions) through the trainer's
    own training_step, from completions sampled a step behind: their losses, the gradients they accumulated,
    the rows scored, and the figures the step logs."""
    step_behind(trainer, batch)
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = clip_min, clip_max
    scored = []
    score = trainer._generate_and_score_completions

    def kept(inputs):  # the batch TRL scores, kept to compare
        scored.append(score(inputs))
        return scored[-1]

    trainer._generate_and_score_completions = kept
    trainer.model.zero_grad()
    torch.manual_seed(5)  # TRL shuffles the scored rows before it splits them into micro-batches
    losses = [trainer.training_step(trainer.model, batch, None).item()
              for _ in range(trainer.args.gradient_accumulation_steps)]
    trainer.log({})
    figures = trainer.state.log_history[-1]
    return {"losses": losses, "scored": scored, "figures": {name: figures.get(name) for name in RATIO_FIGURES},
            "grads": [p.grad.clone() for p in trainer.model.parameters()]}


@pytest.mark.parametrize(("mode", "clip_min", "clip_max"), [("token_truncate", None, 1.02),
                                                           ("token_mask", 0.98, 1.02)])
@pytest.mark.parametrize("mtl", ["none", "pcgrad"])
def test_the_ratio_at_the_loss_trains_as_trl_s_old_logprobs_forward_does(tmp_path, mode, clip_min, clip_max, mtl):
    """Two trainers alike but for where the ratio's trainer log-probs come from (old_logprobs): TRL's no-grad
    forward while scoring, or the loss's own forward. One optimizer step of two accumulated micro-batches on
    the same completions, sampled a step behind (ratios clipped, not all): the same losses, gradients and
    logged ratio figures up to float noise; and the default way runs no old-logprobs forward at all."""
    steps = {}
    for way in ("forward", "loss"):
        with built_async_trainer(tmp_path / way, old_logprobs=way, batch_size=8, mtl=mtl) as (trainer, batch):
            assert trainer.args.gradient_accumulation_steps == 2 and trainer.ratio_at_loss == (way == "loss")
            steps[way] = one_step(trainer, batch, mode, clip_min, clip_max)
    trl, ours = steps["forward"], steps["loss"]
    [trl_scored], [our_scored] = trl["scored"], ours["scored"]
    assert torch.equal(trl_scored["completion_ids"], our_scored["completion_ids"])  # the same completions
    assert "old_per_token_logps" in trl_scored and "importance_sampling_ratio" in trl_scored
    assert "old_per_token_logps" not in our_scored and "importance_sampling_ratio" not in our_scored
    assert ours["losses"] == pytest.approx(trl["losses"], rel=1e-5, abs=1e-7)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(ours["grads"], trl["grads"], strict=True))
    assert any(grad.abs().sum() > 0 for grad in ours["grads"])
    assert all(value is not None for value in trl["figures"].values()), trl["figures"]
    assert ours["figures"] == pytest.approx(trl["figures"], rel=1e-5, abs=1e-7)
    assert 0 < trl["figures"][CLIPPED_SHARE] < 1  # the clip bounds in play


def test_one_policy_per_generation_where_no_optimizer_step_falls_inside_a_generation_batch():
    assert one_policy_per_generation(accumulation_steps=4, steps_per_generation=4, num_iterations=1)  # grpo-mtl
    assert one_policy_per_generation(4, 2, 1) and one_policy_per_generation(4, 2, 2)
    assert not one_policy_per_generation(2, 4, 1)  # an optimizer step between a batch's micro-batches
    assert not one_policy_per_generation(1, 1, 2)  # the second pass on stepped weights
    assert not one_policy_per_generation(4, 3, 1)


def test_trl_s_loss_reads_the_ratio_and_the_old_logprobs_only_after_its_one_forward():
    """The ratio at the loss is put in the loss's inputs as its forward returns, and the loss takes its own
    log-probs, detached, where `old_per_token_logps` is absent; TRL generates every steps_per_generation x
    num_iterations micro-batches, as `one_policy_per_generation` counts. A TRL that reads either before its
    forward, forwards twice, or counts otherwise must be looked at again."""
    from trl import GRPOTrainer

    def function(name: str) -> ast.FunctionDef:
        return ast.parse(inspect.getsource(getattr(GRPOTrainer, name)).strip().replace("\n    ", "\n")).body[0]

    loss = function("_compute_loss")
    forwards = [node.lineno for node in ast.walk(loss) if isinstance(node, ast.Attribute)
                and node.attr == "_get_per_token_logps_and_entropies"]
    reads = [node.lineno for node in ast.walk(loss) if isinstance(node, ast.Constant)
             and node.value in ("importance_sampling_ratio", "old_per_token_logps")]
    assert len(forwards) == 1 and reads and min(reads) > forwards[0]
    for name in ("_prepare_inputs", "_generate_and_score_completions"):
        assert "generate_every = self.args.steps_per_generation * self.num_iterations" in ast.unparse(function(name))
