"""One PCGrad optimizer step of grpo-mtl's MultiTaskGRPOTrainer on a fixed batch, as one rank of
`python -m torch.distributed.run --nproc-per-node N pcgrad_step.py OUT_DIR` (gloo on CPU, fp32).

test_pcgrad_ddp.py runs it with 1 and with 2 ranks and compares the weights they end with. Generation
is bypassed: every rank builds the same 8-row batch (the same questions, completions, advantages and
domains, padded to the same widths, so a row's logits do not depend on which rank holds it) and
trains on its share, rank r on rows [r x 8/N, (r + 1) x 8/N). Rank 0's share holds both domains,
rank 1's only domain 1, so a rank alone sees other gradients than the whole batch: only the
all-reduce of the per-domain gradients makes the ranks agree with one process. The optimizer is
plain SGD without clipping, so the step's change is the learning rate times the PCGrad update.

Writes OUT_DIR/rank<R>.pt: {"before": state_dict, "after": state_dict, "log": the step's log}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from gpuscale.data.models import load_model
from gpuscale.data.prompts import prompt_ids
from gpuscale.data.tasks import load_examples
from gpuscale.engines.distributed import init_rank
from gpuscale.engines.reporter import Reporter
from gpuscale.recipes.grpo_mtl import Settings
from gpuscale.recipes.grpo_mtl.data import grpo_rows
from gpuscale.recipes.grpo_mtl.trainer import build_trainer

DOMAINS = ("first", "second")
# Row i: (question index, domain index, advantage). Domain 1 repeats domain 0's question-answer pairs
# with advantages of the opposite sign, so the two domains' gradients conflict and PCGrad projects.
ROWS = [(0, 0, 1.0), (1, 0, -0.5), (2, 0, 0.8), (3, 1, 0.6),
        (0, 1, -0.9), (1, 1, 0.4), (2, 1, -0.7), (3, 1, 0.3)]
GENERATIONS = 4
LEARNING_RATE = 0.5


def fixed_batch(tokenizer, questions: list[str], answers: list[str]) -> dict:
    """The whole step's batch as TRL's `_generate_and_score_completions` returns it: prompts
    left-padded, completions (the gold answers, then end-of-text) right-padded, advantages, the
    global completion-token count, and each row's domain."""
    prompts = [prompt_ids(tokenizer, questions[q]) for q, _, _ in ROWS]
    completions = [tokenizer(answers[q], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for q, _, _ in ROWS]
    prompt_width, completion_width = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    prompt_ids_ = torch.tensor([[pad] * (prompt_width - len(p)) + p for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (completion_width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (completion_width - len(c)) for c in completions])
    return {
        "prompt_ids": prompt_ids_,
        "prompt_mask": (prompt_ids_ != pad).long(),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([advantage for _, _, advantage in ROWS]),
        "num_items_in_batch": completion_mask.sum(),
        "domain_ids": torch.tensor([domain for _, domain, _ in ROWS]),
    }


def rank_share(batch: dict, rank: int, world_size: int) -> dict:
    share = len(ROWS) // world_size
    rows = slice(rank * share, (rank + 1) * share)
    return {key: value[rows] if value.dim() > 0 else value for key, value in batch.items()}


def main(out_dir: Path) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    settings = Settings(num_generations=GENERATIONS, prompts_per_step=len(ROWS) // GENERATIONS,
                        batch_size=len(ROWS) // world_size, max_steps=1, max_completion_length=64,
                        learning_rate=LEARNING_RATE, max_grad_norm=0.0, mtl="pcgrad", precision="fp32")
    run_dir = out_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = init_rank(settings, run_dir)  # gloo between the ranks, as a real grpo-mtl rank starts
    reporter = Reporter(run_dir, ctx.rank)
    model, tokenizer = load_model("tiny-math")
    examples = load_examples("tiny-math", "train", 4)
    # The trainer's dataset only names the domains (the batch is fixed): "first" and "second".
    rows, _ = grpo_rows([{**e, "domain": DOMAINS[i % 2]} for i, e in enumerate(examples)], tokenizer, 256)
    trainer, _callback = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
    assert trainer.domains == list(DOMAINS)
    from transformers.training_args import OptimizerNames

    trainer.args.optim = OptimizerNames.SGD  # lr x update: no Adam normalisation to hide a difference
    batch = fixed_batch(tokenizer, [e["question"] for e in examples], [e["answer"] for e in examples])
    share = rank_share(batch, ctx.rank, ctx.world_size)
    trainer._generate_and_score_completions = lambda _rows: dict(share)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer.train()
    after = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    torch.save({"before": before, "after": after, "log": log}, out_dir / f"rank{ctx.rank}.pt")
    reporter.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
