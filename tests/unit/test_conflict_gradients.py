"""tiny-math-conflict's two domains pull GRPO's gradients apart on the embedded model; tiny-math's don't.

For a few steps' worth of prompts, grpo-mtl's trainer generates and scores completions (the engine at
temperature 1, TRL's rewards per domain), and each domain's GRPO loss gives its gradient
(`MultiTaskGRPOTrainer.domain_loss`, as mtl=pcgrad computes them); `gradient_cosines` compares them.
On tiny-math-conflict (every counting question twice, wanting N and N - 1) the cosine is clearly
negative; between tiny-math's domains (different questions) it is about zero.
"""

from __future__ import annotations

import torch

from gpuscale.data.models import load_model
from gpuscale.data.tasks import load_examples
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.recipes.grpo_mtl import Settings
from gpuscale.recipes.grpo_mtl.data import grpo_rows
from gpuscale.recipes.grpo_mtl.pcgrad import gradient_cosines
from gpuscale.recipes.grpo_mtl.trainer import build_trainer

GENERATIONS = 8
PROMPTS = 8  # per step: 4 twin pairs of tiny-math-conflict
STEPS = 8


def step_cosines(dataset: str, run_dir) -> list[float]:
    """The cosines between the domains' GRPO gradients, every pair of domains at each of STEPS steps
    of PROMPTS prompts (the data set's first rows, in its order) with GENERATIONS completions each."""
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny-math")
    rows, _ = grpo_rows(load_examples(dataset, "train", PROMPTS * STEPS), tokenizer, 256)
    settings = Settings(num_generations=GENERATIONS, prompts_per_step=PROMPTS, batch_size=PROMPTS * GENERATIONS,
                        max_steps=1, max_completion_length=40, temperature=1.0, mtl="pcgrad")
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, run_dir)
    reporter = Reporter(run_dir, 0)
    trainer, _callback = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train()
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]
    cosines = []
    for step in range(STEPS):
        batch = [row for row in rows[step * PROMPTS:(step + 1) * PROMPTS] for _ in range(GENERATIONS)]
        inputs = trainer._generate_and_score_completions(batch)
        gradients = []
        for domain in range(len(trainer.domains)):
            loss = trainer.domain_loss(trainer.model, inputs, domain)
            grads = torch.autograd.grad(loss, parameters, allow_unused=True)
            gradients.append([g if g is not None else torch.zeros_like(p) for g, p in zip(grads, parameters)])
        cosines += [c for c in gradient_cosines(gradients).values() if c != 0.0]  # 0: a domain had no signal
    reporter.close()
    return cosines


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_conflict_pair_s_gradients_point_apart_and_tiny_math_s_do_not(tmp_path, one_torch_thread):
    conflict = step_cosines("tiny-math-conflict", tmp_path / "conflict")
    tiny = step_cosines("tiny-math", tmp_path / "tiny")
    # A step where one domain's completions all scored alike gives that domain no gradient (cosine 0,
    # left out); which steps those are depends on the sampled completions. Most steps must count.
    assert len(conflict) >= STEPS // 2 + 1 and len(tiny) >= 2 * STEPS
    print(f"conflict {mean(conflict):.3f} {sorted(round(c, 2) for c in conflict)}; tiny-math {mean(tiny):.3f}")
    assert mean(conflict) < -0.1
    assert abs(mean(tiny)) < 0.05
    share_negative = sum(c < 0 for c in conflict) / len(conflict)
    assert share_negative > sum(c < 0 for c in tiny) / len(tiny)
    assert share_negative >= 0.6
    # The conflict is not a scale effect: the same prompts' gradients are far from orthogonal.
    assert mean([abs(c) for c in conflict]) > 3 * mean([abs(c) for c in tiny])

