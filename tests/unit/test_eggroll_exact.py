"""EGGROLL against explicit computations on a tiny fp32 model.

- The population forward: each member's answers, sampled by the engine with the members' low-rank
  terms (and norm-gain row scales) in one batch, have the log-probs that a copy of the model with
  weights W + sigma * E_i and gains g + sigma * e_i gives them by teacher forcing (prefill and every
  decode step).
- The update: from fitnesses measured on explicit per-member copies, the recipe's step equals the
  closed-form estimator W + lr * N^(-1/2) * sum_i s_i * sigma/sqrt(r) * sign_i * A_i B_i^T (and
  g + lr * N^(-1/2) * sum_i s_i * sigma * sign_i * e_i), summed member by member.
"""

from __future__ import annotations

import copy
import math
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch

from gpuscale.data.models import load_model
from gpuscale.engines.generation import GenerationEngine, Sampling
from gpuscale.recipes.eggroll import Settings, evolution
from gpuscale.recipes.eggroll.trainer import Trainer, perturbed_linears, perturbed_norms
from gpuscale.recipes.shared.models import GenerationModel
from gpuscale.runs.settings import resolve_settings

POPULATION, RANK, SIGMA = 4, 2, 0.05


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-math", dtype=torch.float32)
    return model.eval(), tokenizer


def explicit_member(model, noise: list[evolution.LayerNoise], norm_noise: list[torch.Tensor], member: int,
                    settings: Settings):
    """A copy of the model whose perturbed weights are W + sigma * sign * A B^T / sqrt(r) and whose
    norms' gains are g + sigma * sign * e."""
    twin = copy.deepcopy(model)
    draw, sign = evolution.member_draw(member, settings.antithetic), (-1) ** member if settings.antithetic else 1
    with torch.no_grad():
        for (_, module), layer in zip(perturbed_linears(twin), noise):
            module.weight += sign * settings.sigma / math.sqrt(settings.rank) * layer.a[draw] @ layer.b[draw].T
        for (_, module), gains in zip(perturbed_norms(twin), norm_noise):
            module.weight += sign * settings.sigma * gains[draw]
    return twin


def teacher_forced_logprobs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None]).squeeze(1)


def make_trainer(model, tokenizer, static_shapes: bool, engine_kwargs: dict | None = None, **settings) -> Trainer:
    settings = Settings(**{**dict(population=POPULATION, rank=RANK, sigma=SIGMA, prompts_per_step=2, batch_size=8,
                                  max_new_tokens=6, temperature=1.0), **settings})
    ctx = SimpleNamespace(world_size=1, rank=0, is_main=False, run_dir=None, device=torch.device("cpu"),
                          synchronize=lambda: None)
    loaded = GenerationModel(model, tokenizer, eos=[tokenizer.eos_token_id], pad=tokenizer.pad_token_id or 0)
    engine = GenerationEngine(model, loaded.eos, pad_token_id=loaded.pad, static_shapes=static_shapes,
                              **(engine_kwargs or {}))
    train = [{"question": f"Tom has {n} apples and buys {n + 1} more. How many apples does he have?",
              "answer": f"#### {2 * n + 1}"} for n in range(1, 9)]
    return Trainer(settings, ctx, loaded, engine, train)


@pytest.mark.parametrize("static_shapes, antithetic", [(False, True), (True, True), (True, False)])
def test_every_members_answers_have_the_log_probs_of_its_explicit_weights(tiny, static_shapes, antithetic):
    """With antithetic pairs, each pair's members share one group of the terms (`mirrored`: the second half of
    the group's rows subtracts the term); without, a group a member."""
    model, tokenizer = tiny
    trainer = make_trainer(model, tokenizer, static_shapes, antithetic=antithetic)
    assert trainer.members_per_call == POPULATION  # all four members in one engine call
    assert trainer.mirrored == antithetic
    assert [term.groups for term in trainer.terms + trainer.scales] == [POPULATION // (2 if antithetic else 1)] * (
        len(trainer.terms) + len(trainer.scales))
    prompts = trainer._prompts(step=1)
    trainer.draw_noise(step=1)
    trainer._load_members(list(range(POPULATION)))
    rows = [prompt["ids"] for _ in range(POPULATION) for prompt in prompts]
    generation = trainer.engine.generate(rows, 6, Sampling(temperature=1.0), torch.Generator().manual_seed(3))
    answers = generation.sequences()
    for member in range(POPULATION):
        twin = explicit_member(model, trainer.noise, trainer.norm_noise, member, trainer.settings)
        for index, prompt in enumerate(prompts):
            row = member * len(prompts) + index
            expected = teacher_forced_logprobs(twin, prompt["ids"], answers[row])
            got = generation.base_logprobs[row, : len(answers[row])]
            # fp32: a one-token decode step against a batched teacher-forced forward (matmuls of other
            # shapes sum in other orders) differ by a few 1e-5; a missing term moves them by 1e-3 (below).
            torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)
    # ... and the unperturbed model would have given other log-probs: the terms are really there.
    plain = teacher_forced_logprobs(model, prompts[0]["ids"], answers[0])
    assert (plain - generation.base_logprobs[0, : len(answers[0])]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def unhooked_tiny():
    """tiny-math of its own: `tiny`'s keeps the hooks of the trainers above, and a hook the engine does
    not own on o_proj or down_proj keeps their terms on the module's hooks (the fallback)."""
    model, tokenizer = load_model("tiny-math", dtype=torch.float32)
    return model.eval(), tokenizer


def greedy_population(model, tokenizer, rank: int, static_shapes: bool = True, **engine_kwargs):
    """The population's greedy answers to step 1's prompts (every member's low-rank terms on every
    decoder linear, its row scales on every norm), and the engine's fused decode; the terms are taken off
    after, so that the next engine's fused decode is not refused for this one's hooks."""
    trainer = make_trainer(model, tokenizer, static_shapes, engine_kwargs, rank=rank)
    prompts = trainer._prompts(step=1)
    trainer.draw_noise(step=1)
    trainer._load_members(list(range(POPULATION)))
    rows = [prompt["ids"] for _ in range(POPULATION) for prompt in prompts]
    try:
        return trainer.engine.generate(rows, 8, Sampling(temperature=0.0)), trainer.engine._fused
    finally:
        trainer.engine.remove_row_terms()


def assert_the_same_greedy_population(expected, got, atol):
    assert torch.equal(got.tokens, expected.tokens)
    mask = expected.mask
    torch.testing.assert_close(got.base_logprobs[mask], expected.base_logprobs[mask], rtol=0, atol=atol)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [1, 2])
def test_terms_in_the_projections_decode_the_hooks_greedy_tokens(unhooked_tiny, dtype, rank):
    """The engine's fuse_row_terms on the embedded model with the recipe's population (4 members, their
    norms' scales too), prefill and decode: the same greedy tokens as the terms by hooks, log-probs
    within 1e-5 (fp32) or bf16's rounding (the hooks' prefill, through the model's modules, attends
    over the whole static KV buffer, the fused prefill over the columns it writes: sums of other
    lengths, rounded otherwise; 0.026 seen, 0 with dynamic shapes, where both attend over the same);
    and the terms change the answers' log-probs (against the unperturbed model)."""
    model, tokenizer = unhooked_tiny
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    hooks, _ = greedy_population(model, tokenizer, rank)
    fused, fused_decode = greedy_population(model, tokenizer, rank, fuse_row_terms=True)
    assert fused_decode.terms_in_projections and all(o and d for o, d in fused_decode.output_terms)
    assert_the_same_greedy_population(hooks, fused, atol=1e-5 if dtype == torch.float32 else 4e-2)
    engine = GenerationEngine(model, [tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id or 0)
    plain = engine.generate(fused.prompt_ids.tolist(), 8, Sampling(temperature=0.0))
    assert (plain.base_logprobs - fused.base_logprobs)[fused.mask & plain.mask].abs().max() > 1e-3


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.usefixtures("one_torch_thread")
def test_terms_in_the_projections_compiled_decode_the_hooks_greedy_tokens(unhooked_tiny):
    """The same compiled (the form Inductor fuses), against the hooks run eagerly: fp32, rank 1. On the
    model's first decoder layer alone: it has every kind of perturbed linear and norm, and Inductor's
    time grows with the layers it compiles (4 layers took about 70 s of a CI machine, cold)."""
    model, tokenizer = unhooked_tiny
    model = copy.deepcopy(model)
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    hooks, _ = greedy_population(model, tokenizer, rank=1)
    with warnings.catch_warnings():
        # The engine falls back to the uncompiled step with a RuntimeWarning if compiling fails: that
        # would compare eager with eager.
        warnings.simplefilter("error", RuntimeWarning)
        compiled, _ = greedy_population(model, tokenizer, rank=1, fuse_row_terms=True, compile=True)
    assert_the_same_greedy_population(hooks, compiled, atol=1e-5)


@pytest.mark.parametrize("shaping", ["zscore", "centered_rank", "antithetic_sign"])
def test_one_update_equals_the_closed_form_estimator(tiny, shaping):
    model, tokenizer = tiny
    settings = Settings(population=POPULATION, rank=RANK, sigma=SIGMA, lr=0.5, fitness_shaping=shaping)
    linears, norms = perturbed_linears(model), perturbed_norms(model)
    draws = evolution.draws_for(POPULATION, True)
    noise = [evolution.layer_noise(m.weight, draws, RANK, 7, 1, i) for i, (_, m) in enumerate(linears)]
    norm_noise = [evolution.vector_noise(m.weight, draws, 7, 1, len(linears) + i) for i, (_, m) in enumerate(norms)]
    # Fitness of each member, measured on its explicit copy: mean log-prob of a fixed answer.
    prompt = tokenizer("What is 2 plus 3?\n")["input_ids"]
    answer = tokenizer("2 + 3 = 5\n#### 5")["input_ids"]
    twins = [explicit_member(model, noise, norm_noise, m, settings) for m in range(POPULATION)]
    raw = torch.tensor([float(teacher_forced_logprobs(twin, prompt, answer).mean()) for twin in twins])
    shaped = evolution.shape_fitness(raw, shaping, antithetic=True)
    # The recipe's update, on a copy.
    updated = copy.deepcopy(model)
    coefficients = evolution.draw_coefficients(shaped, antithetic=True)
    updated_modules = perturbed_linears(updated) + perturbed_norms(updated)
    updater = evolution.Updater([module.weight for _, module in updated_modules], "sgd", 0.5)
    updater.apply(noise + norm_noise, coefficients, POPULATION, SIGMA, 0.5, RANK)
    # The closed form, member by member.
    for (name, module), (_, new), layer in zip(linears, perturbed_linears(updated), noise):
        expected = module.weight.detach().clone()
        for m in range(POPULATION):
            sign, draw = (-1) ** m, m // 2
            expected += (0.5 / math.sqrt(POPULATION) * float(shaped[m]) * SIGMA / math.sqrt(RANK) * sign
                         * layer.a[draw] @ layer.b[draw].T)
        torch.testing.assert_close(new.weight.detach(), expected, rtol=0, atol=1e-6, msg=name)
    for (name, module), (_, new), gains in zip(norms, perturbed_norms(updated), norm_noise):
        expected = module.weight.detach().clone()
        for m in range(POPULATION):
            expected += 0.5 / math.sqrt(POPULATION) * float(shaped[m]) * SIGMA * (-1) ** m * gains[m // 2]
        torch.testing.assert_close(new.weight.detach(), expected, rtol=0, atol=1e-6, msg=name)
    assert len(norms) == 2 * len(model.model.layers) + 1  # two per block and the final one
    assert all((new.weight - old.weight).abs().max() > 1e-6
               for (_, old), (_, new) in zip(linears + norms, updated_modules))


def test_shaping_by_hand():
    raw = torch.tensor([0.0, 1.0, 0.5, 0.5])
    z = evolution.shape_fitness(raw, "zscore", antithetic=True)
    torch.testing.assert_close(z, (raw - 0.5) / torch.sqrt(torch.tensor(0.125) + 1e-5))
    torch.testing.assert_close(evolution.shape_fitness(torch.tensor([3.0, 1.0, 2.0]), "centered_rank", False),
                               torch.tensor([0.5, -0.5, 0.0]))
    torch.testing.assert_close(evolution.shape_fitness(raw, "antithetic_sign", True),
                               torch.tensor([-0.5, 0.5, 0.0, -0.0]))


def test_bf16_weights_keep_steps_too_small_for_bf16_in_fp32_masters():
    weight = torch.full((4, 3), 1.0, dtype=torch.bfloat16)
    noise = [evolution.LayerNoise(a=torch.ones(1, 4, 1), b=torch.ones(1, 3, 1))]
    updater = evolution.Updater([weight], "sgd", lr=1.0)
    tiny = 1e-3  # bf16 holds 1.0 and 1.0078: a step of 1e-3 added to the weight would vanish
    for _ in range(10):
        updater.apply(noise, torch.tensor([tiny]), population=1, sigma=1.0, lr=1.0, rank=1)
    torch.testing.assert_close(updater.masters[0], torch.full((4, 3), 1.01))
    assert float(weight[0, 0]) == float(torch.tensor(1.01).to(torch.bfloat16))  # the master, rounded


def test_adam_moves_every_weight_by_lr_along_the_estimates_sign_at_its_first_step():
    weight = torch.zeros(2, 2)
    a, b = torch.tensor([[[1.0], [-2.0]]]), torch.tensor([[[3.0], [0.5]]])
    updater = evolution.Updater([weight], "adam", lr=0.01)
    updater.apply([evolution.LayerNoise(a=a, b=b)], torch.tensor([1.0]), population=1, sigma=1.0, lr=0.01, rank=1)
    # Adam's first step is lr * m / sqrt(v) = lr * sign(gradient), upward (maximize).
    torch.testing.assert_close(weight, 0.01 * torch.sign(a[0] @ b[0].T), rtol=0, atol=1e-6)


def test_cosine_schedule_runs_from_lr_to_a_hundredth_and_adam_takes_each_steps_lr():
    lrs = [evolution.scheduled_lr(0.3, "cosine", step, 5) for step in range(1, 6)]
    assert lrs[0] == 0.3 and lrs[-1] == pytest.approx(0.003)
    assert lrs[2] == pytest.approx((0.3 + 0.003) / 2)  # the cosine's midpoint
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert evolution.scheduled_lr(0.3, "constant", 4, 5) == 0.3
    # The setting is named as sft's and grpo-mtl's; its first name (RESULTS' commands) still works.
    assert resolve_settings(Settings, overrides={"lr_schedule": "cosine"}).lr_scheduler == "cosine"
    weight = torch.zeros(1, 1)
    updater = evolution.Updater([weight], "adam", lr=0.01)
    noise = [evolution.LayerNoise(a=torch.ones(1, 1, 1), b=torch.ones(1, 1, 1))]
    updater.apply(noise, torch.tensor([1.0]), population=1, sigma=1.0, lr=0.002, rank=1)
    torch.testing.assert_close(weight, torch.full((1, 1), 0.002))  # Adam's first step: lr x sign


@pytest.mark.parametrize("method", ["eggroll", "naive"])
def test_gold_logprob_fitness_is_each_members_teacher_forced_score(tiny, method):
    """fitness=gold_logprob: each member's score of each prompt is the mean log-prob that the
    member's explicit copy gives the training answer (and EOS) by teacher forcing; the batched
    population (row terms in the model's own forward) and the naive structure both."""
    model, tokenizer = tiny
    trainer = make_trainer(model, tokenizer, static_shapes=False, fitness="gold_logprob", method=method)
    prompts = trainer._prompts(step=1)
    trainer.draw_noise(step=1)
    trainer.clock.start()  # as a step does: the scoring laps its phases
    scores = []
    for start in range(0, POPULATION, trainer.members_per_call):
        scores += trainer._evaluate(list(range(start, start + trainer.members_per_call)), prompts)[0]
    for member in range(POPULATION):
        twin = explicit_member(model, trainer.noise, trainer.norm_noise, member, trainer.settings)
        for index, prompt in enumerate(prompts):
            expected = teacher_forced_logprobs(twin, prompt["ids"], prompt["gold_ids"]).mean()
            assert scores[member * len(prompts) + index] == pytest.approx(float(expected), abs=1e-5)
    # The members differ: the terms (or the perturbed weights) acted.
    assert len({round(score, 4) for score in scores[:: len(prompts)]}) == POPULATION
    # Outside its calls the model is the unperturbed one.
    plain = teacher_forced_logprobs(model, prompts[0]["ids"], prompts[0]["gold_ids"]).mean()
    assert float(plain) != pytest.approx(scores[0], abs=1e-4)
