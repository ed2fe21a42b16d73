"""grpo-mtl's pieces on the embedded model, in-process with one rank: its settings, the engine as
TRL's rollout_func (its log-probs are TRL's own recomputation), per-domain losses and gradients that
add up to TRL's, and a PCGrad step that writes the projected sum of the domains' gradients."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from gpuscale.data.models import load_model
from gpuscale.data.seeds import derived_seed
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.engines.rollout import repeated_runs
from gpuscale.recipes.grpo_mtl import Settings, accumulation_steps
from gpuscale.recipes.grpo_mtl.data import domain_shares, grpo_rows, training_and_eval_examples
from gpuscale.recipes.grpo_mtl.pcgrad import pcgrad
from gpuscale.recipes.grpo_mtl.trainer import build_trainer, with_card_sized_batch
from gpuscale.runs.settings import SettingsError, resolve_settings

GENERATIONS = 4


def test_the_seed_s_verl_knobs_are_settings():
    settings = resolve_settings(Settings, overrides={
        "rollout.n": "4", "data.train_batch_size": "16", "ppo_micro_batch_size_per_gpu": "2",
        "max_prompt_length": "128", "max_response_length": "64", "reward_weights": "correctness=1,counting.format=0.5",
    }, environ={})
    assert (settings.num_generations, settings.prompts_per_step, settings.batch_size) == (4, 16, 2)
    assert (settings.max_prompt_length, settings.max_completion_length) == (128, 64)
    assert accumulation_steps(settings, world_size=2) == 16  # 64 completions / (2 per rank x 2 ranks)
    with pytest.raises(SettingsError, match=r"batch_size: 3: does not divide the 64 completions the one rank takes "
                                            r"a step \(16 prompts x 4 generations = 64 completions\); use 2 or 4$"):
        accumulation_steps(settings.model_copy(update={"batch_size": 3}), world_size=1)
    with pytest.raises(SettingsError, match="reward_weights: .*unknown reward 'speed'"):
        resolve_settings(Settings, overrides={"reward_weights": "speed=1"}, environ={})


def test_an_auto_micro_batch_is_the_largest_divisor_of_the_rank_s_completions_that_fits(monkeypatch, tmp_path):
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    model, _ = load_model("tiny-math")
    auto = resolve_settings(Settings, overrides={"batch_size": "auto", "num_generations": 8, "prompts_per_step": 16},
                            environ={})  # 16 x 8
    assert auto.batch_size is None and accumulation_steps(auto, world_size=8) == 1  # sized on the rank
    assert with_card_sized_batch(auto, ctx, model).batch_size == 8  # a CPU rank: CPU_BATCH_SIZE, divides 128
    asked = []
    monkeypatch.setattr("gpuscale.recipes.shared.card_sized_micro_batch.fitted_micro_batch",
                        lambda settings, ctx, model, rows, tokens: asked.append((rows, tokens)) or (100, "fits 100"))
    on_a_card = RankContext(0, 0, 1, torch.device("cuda"), torch.bfloat16, tmp_path)  # nothing is allocated
    assert with_card_sized_batch(auto, on_a_card, model).batch_size == 64  # 100 fit: 64 divides the 128 completions
    # The memory arithmetic is asked for the rank's completions at a whole prompt and completion each.
    assert asked == [(128, auto.max_prompt_length + auto.max_completion_length)]
    assert with_card_sized_batch(auto.model_copy(update={"batch_size": 4}), ctx, model).batch_size == 4  # given


def test_runs_of_repeated_prompts_are_prefilled_once():
    assert repeated_runs([[1, 2], [1, 2], [3], [3]]) == ([[1, 2], [3]], 2)
    assert repeated_runs([[1, 2], [1, 2], [3]]) == ([[1, 2], [3]], None)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 1-rank MultiTaskGRPOTrainer on tiny-math with the engine generating at temperature 0.7."""
    torch.manual_seed(0)
    run_dir = tmp_path_factory.mktemp("grpo")
    model, tokenizer = load_model("tiny-math")
    from gpuscale.data.tasks import load_examples

    examples = load_examples("tiny-math", "train", 40)
    # Rows of two domains only: the third domain is absent from the batch (its loss must be zero).
    examples = [e for e in examples if e["domain"] in ("arithmetic", "counting")][:4]
    rows, _ = grpo_rows(examples, tokenizer, 256)
    settings = Settings(num_generations=GENERATIONS, prompts_per_step=4, batch_size=16, max_steps=1,
                        max_completion_length=24, temperature=0.7, learning_rate=1e-3, mtl="pcgrad")
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, run_dir)
    reporter = Reporter(run_dir, 0)
    all_rows = rows + [{**rows[0], "domain": "comparison"}]  # the trainer knows three domains
    trainer, _callback = build_trainer(all_rows, settings, ctx, reporter, model, tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()
    batch = [row for row in rows for _ in range(GENERATIONS)]
    yield trainer, batch
    reporter.close()


def test_the_engine_s_log_probs_are_trl_s_recomputation(setup):
    trainer, batch = setup
    inputs = trainer._generate_and_score_completions(batch)
    assert trainer.model.training  # the engine left the mode as it found it
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        recomputed, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, inputs["completion_ids"].shape[1])
    real = inputs["completion_mask"].bool()
    assert real.sum() > 20
    sampled = inputs["sampling_per_token_logps"]
    assert torch.allclose(sampled[real], recomputed[real], atol=1e-4)
    # Each prompt's samples differ (they were drawn, not copied), and the prompts are TRL's own.
    groups = inputs["completion_ids"].view(-1, GENERATIONS, inputs["completion_ids"].shape[1])
    assert any(len({tuple(row.tolist()) for row in group}) > 1 for group in groups)
    assert inputs["domain_ids"].tolist() == [trainer.domain_index[row["domain"]] for row in batch]


def test_trl_s_sampler_draws_each_weighted_row_once_over_the_run_s_steps(setup):
    """The summary's train_share_<domain> is each domain's share of the prompts trained on: over a run of
    max_steps x prompts_per_step rows, TRL's own sampler (this trainer's, at its seed) draws every row once a
    run, num_generations times, whatever domain_weights did to the rows."""
    import datasets

    trainer, _ = setup
    settings = Settings(max_steps=25, prompts_per_step=4, eval_examples=0, domain_weights="comparison=3")
    rows, _ = training_and_eval_examples(settings)
    drawn = list(trainer._get_train_sampler(datasets.Dataset.from_list(rows)))
    assert len(drawn) == 25 * 4 * GENERATIONS and Counter(drawn) == {index: GENERATIONS for index in range(100)}
    domains = Counter(rows[index]["domain"] for index in drawn)
    assert {f"train_share_{domain}": count / len(drawn) for domain, count in domains.items()} == domain_shares(rows)


def scored_inputs(trainer, batch):
    """A micro-batch with advantages of both signs (the generated ones may all be zero)."""
    inputs = trainer._generate_and_score_completions(batch)
    inputs["advantages"] = torch.linspace(-1.0, 2.0, inputs["advantages"].shape[0])
    return inputs


@contextmanager
def loss_settings(trainer, loss_type: str = "dapo", entropy_coef: float = 0.0):
    """TRL's loss of this type with its entropy term at this coefficient while inside (the trainer is built
    with dapo and none)."""
    trainer.loss_type, trainer.entropy_coef, trainer._entropy_bonus_enabled = loss_type, entropy_coef, entropy_coef != 0
    try:
        yield
    finally:
        trainer.loss_type, trainer.entropy_coef, trainer._entropy_bonus_enabled = "dapo", 0.0, False


@pytest.mark.parametrize("loss_type,entropy_coef", [("dapo", 0.0), ("grpo", 0.0), ("bnpo", 0.0), ("dr_grpo", 0.0),
                                                    ("dapo", -0.3), ("grpo", 0.3), ("bnpo", -0.3)])
def test_per_domain_losses_and_gradients_add_up_to_trl_s(setup, loss_type, entropy_coef):
    """TRL's entropy term (a mean over all the micro-batch's tokens) included."""
    trainer, batch = setup
    with loss_settings(trainer, loss_type, entropy_coef):
        inputs = scored_inputs(trainer, batch)
        parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        full = trainer._compute_loss(trainer.model, inputs)
        full_grads = torch.autograd.grad(full, parameters)
        parts = [trainer.domain_loss(trainer.model, inputs, d) for d in range(len(trainer.domains))]
        absent = trainer.domain_index["comparison"]
        assert parts[absent].item() == 0.0
        assert full.abs() > 1e-3
        assert torch.allclose(sum(parts), full, atol=1e-6)
        summed = [torch.zeros_like(p) for p in parameters]
        for part in parts:
            for total, grad in zip(summed, torch.autograd.grad(part, parameters, allow_unused=True)):
                if grad is not None:
                    total += grad
        for total, grad in zip(summed, full_grads):
            assert torch.allclose(total, grad, atol=1e-6)


def test_the_entropy_term_is_the_coefficient_times_the_completions_mean_token_entropy(setup):
    """TRL's loss with entropy_coef c is its loss without, less c x the mean over the completions' tokens
    of the entropy of the policy at the rollouts' temperature, computed here from the model's logits."""
    trainer, batch = setup
    inputs = scored_inputs(trainer, batch)
    without = trainer._compute_loss(trainer.model, inputs)
    with loss_settings(trainer, entropy_coef=-0.3):
        penalised = trainer._compute_loss(trainer.model, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1] / trainer.temperature
    log_p = logits.log_softmax(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    tokens = inputs["completion_mask"].float()
    mean_entropy = (entropy * tokens).sum() / tokens.sum()
    assert mean_entropy > 0.01  # the embedded model is sharp at T=0.7: 0.047 nats a token
    # TRL scales each micro-batch's loss for gradient accumulation, the entropy term too.
    expected = 0.3 * mean_entropy / trainer.current_gradient_accumulation_steps
    assert torch.allclose(penalised - without, expected, atol=1e-5)


def conflicting_inputs(trainer, batch) -> dict:
    """A micro-batch whose domains 0 and 1 pull against each other: domain 1's rows are copies of
    half of domain 0's rows with the opposite advantages."""
    from gpuscale.recipes.grpo_mtl.multitask import select_rows

    inputs = scored_inputs(trainer, batch)
    rows = inputs["completion_ids"].shape[0]
    copies = select_rows(inputs, torch.arange(rows // 2))
    merged = {key: torch.cat([value, copies[key]]) if isinstance(value, torch.Tensor) and value.dim() > 0
              else value for key, value in inputs.items()}
    merged["advantages"][rows:] *= -1
    merged["domain_ids"] = torch.tensor([0] * rows + [1] * (rows // 2))
    return merged


def test_a_pcgrad_step_writes_the_projected_sum_of_the_domains_gradients(setup, monkeypatch):
    trainer, batch = setup
    prepared = conflicting_inputs(trainer, batch)
    monkeypatch.setattr(trainer, "_generate_and_score_completions", lambda rows: prepared)
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in parameters:
        p.grad = None
    trainer.training_step(trainer.model, batch, None)
    written = [p.grad.clone() for p in parameters]
    assert trainer._metrics["train"]["pcgrad/conflict_share"][-1] > 0
    # The same step by hand, on the micro-batch the trainer trained on.
    inputs = trainer._buffered_inputs[0]
    per_domain = []
    for d in range(len(trainer.domains)):
        grads = torch.autograd.grad(trainer.domain_loss(trainer.model, inputs, d), parameters, allow_unused=True)
        per_domain.append([g if g is not None else torch.zeros_like(p) for g, p in zip(grads, parameters)])
    # PCGrad's order: drawn from (mtl_seed, step), so that a resumed run draws the same (data/seeds.py).
    order = torch.Generator().manual_seed(derived_seed(trainer.mtl_seed, "pcgrad", trainer.state.global_step))
    expected = pcgrad(per_domain, order)
    # The trainer sums PCGrad's dot products over one flat buffer, this reference tensor by tensor: the
    # fp32 rounding differs (measured: 2.5e-6 at most, on entries up to 0.11).
    for got, want in zip(written, expected):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    # ... which is not the plain sum: the projection changed it.
    plain = [sum(parts) for parts in zip(*per_domain)]
    assert not all(torch.allclose(got, raw, atol=1e-6) for got, raw in zip(written, plain))


def test_the_policy_mismatch_is_the_loss_s_log_probs_against_the_engine_s_and_is_logged(setup):
    """Same weights, fp32, CPU: the loss's own log-probs are the engine's (within float tolerance); a
    sampler off by 0.3 nats on every token gives exactly that; each log carries the figures since the
    last one, through the ReporterCallback into the rank's metric file."""
    import json
    import math
    from pathlib import Path

    from gpuscale.engines.policy_mismatch import KL, MAX, MEAN
    from gpuscale.engines.trl_bridge import ReporterCallback

    trainer, batch = setup
    trainer._mismatch_sums = None  # what the other tests' losses left
    inputs = scored_inputs(trainer, batch)
    trainer._compute_loss(trainer.model, inputs)
    same = trainer._mismatch_sums.tolist()
    assert same[2] == inputs["completion_mask"].sum().item() > 20  # every completion token, counted once
    assert same[0] / same[2] < 1e-5 and same[3] < 1e-4

    trainer._mismatch_sums = None
    off = {**inputs, "sampling_per_token_logps": inputs["sampling_per_token_logps"] + 0.3}
    for domain in range(len(trainer.domains)):  # PCGrad's per-domain losses: padding rows are masked out
        trainer.domain_loss(trainer.model, off, domain, padded_rows=len(batch))
    trainer.log({"loss": 0.5})
    assert trainer._mismatch_sums is None  # reset by the log
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, ReporterCallback)]
    line = json.loads(Path(callback.reporter._file.name).read_text().splitlines()[-1])
    assert line["sampling_sampling_logp_difference_mean"] == pytest.approx(0.3, abs=1e-4)
    assert line["sampling_sampling_logp_difference_max"] == pytest.approx(0.3, abs=1e-4)
    assert line["sampling_sampler_kl"] == pytest.approx(math.expm1(-0.3) + 0.3, abs=1e-4)  # k3 at r = -0.3
    assert {MEAN, MAX, KL} <= set(trainer.state.log_history[-1])


def test_under_half_precision_autocast_the_engine_decodes_a_copy_refreshed_after_each_optimizer_step():
    """TRL's bf16 trainer keeps fp32 masters; the rollout decodes a bf16 copy of them (as TRL's own
    generation does under autocast), copied again once the optimizer has stepped, never in between."""
    from types import SimpleNamespace

    from gpuscale.engines.rollout import EngineRollout

    model, tokenizer = load_model("tiny-math")
    state = SimpleNamespace(global_step=0)
    trainer = SimpleNamespace(model=model, state=state, args=SimpleNamespace(bf16=True, fp16=False),
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0))
    rollout = EngineRollout(tokenizer, max_new_tokens=4, temperature=1.0)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    out = rollout([prompt, prompt], trainer)
    assert len(out["completion_ids"]) == 2 and all(len(row) > 0 for row in out["logprobs"])
    decoded = rollout.engine.model
    assert decoded is not model and {p.dtype for p in decoded.parameters()} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())  # the masters as they were
    first = next(model.parameters())
    with torch.no_grad():
        first.add_(0.5)  # what an optimizer step does
    rollout([prompt], trainer)  # the same optimizer step: nothing copied
    assert not torch.equal(next(decoded.parameters()), first.to(torch.bfloat16))
    state.global_step = 1
    rollout([prompt], trainer)
    assert all(torch.equal(copied, master.to(torch.bfloat16))
               for copied, master in zip(decoded.parameters(), model.parameters(), strict=True))


def test_continuous_batching_on_cpu_caches_the_step_s_sequences_not_half_the_machine_s_memory(tmp_path):
    """transformers sizes its paged cache by the device's free memory: on CPU, half of the RAM, allocated
    at every generation call. A CPU rank's trainer asks for the pages a step's sequences can fill."""
    from gpuscale.data.tasks import load_examples

    model, tokenizer = load_model("tiny-math")
    rows, _ = grpo_rows(load_examples("tiny-math", "train", 8), tokenizer, 256)
    settings = Settings(generator="continuous", num_generations=2, prompts_per_step=4, batch_size=8, max_steps=1,
                        max_completion_length=8)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    try:
        trainer, _callback = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
    finally:
        reporter.close()
    pages_per_sequence = -(-(settings.max_prompt_length + 8) // 256)
    assert trainer.use_transformers_continuous_batching
    assert trainer.continuous_batching_config.num_blocks == 4 * 2 * pages_per_sequence
