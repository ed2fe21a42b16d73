"""The held-out evaluation of every recipe, and the end of a training run.

- `held_out_rows`: held-out problems answered at one temperature, sharded over the ranks and gathered,
  answers extracted by the one strict rule (data/scoring.py's HELD_OUT_ANSWER_MODE).
- `evaluation_batch_size`: held-out problems per generation call, card-sized on a GPU.
- `held_out_evaluation`: greedy and temperature 1, per domain and on tiny-math's structurally new
  subset, figures named `accuracy_<greedy|sampled>[_<domain>|_new]_<before|after>` by data/figures.py's
  `accuracy_name`; every answer, with its gold and extracted answer, in RUN_DIR/held_out.jsonl.
- `save_then_evaluate`: the trained model is saved before the final evaluation, so that a failure
  there never loses it.

No torch at import: eggroll, not a TRL recipe, uses the evaluation too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuscale.data.figures import accuracy_name
from gpuscale.recipes.shared.generation_batches import batched
from gpuscale.runs.generations import HELD_OUT_PHASE, add_held_out, generation_record, held_out_step

if TYPE_CHECKING:
    from gpuscale.recipes.shared.training import TrainedModel


# Held-out problems per generation call on a CPU rank, as before the GPU's batch was sized from the card.
CPU_EVALUATION_BATCH = 64


def evaluation_batch_size(model, ctx, problems: int, max_new_tokens: int, memory_share: float) -> int:
    """Held-out problems per generation call on this rank: CPU_EVALUATION_BATCH on a CPU rank; on a GPU as
    many as fill `memory_share` (the run's gpu_memory_share) of the memory its model leaves, at most 512
    and at most the rank's share of the `problems` (engines/distributed.py's card_sized_batch). A call's
    decode steps cost about the same whatever its rows on a GPU, so fewer, fuller calls end sooner
    (`python bench/evaluation_batch.py`; bench/RESULTS.md)."""
    if ctx.device.type != "cuda":
        return CPU_EVALUATION_BATCH
    from gpuscale.engines.distributed import card_sized_batch
    from gpuscale.engines.generation.kv import bytes_per_row
    from gpuscale.recipes.shared.generation_batches import PROMPT_COLUMNS

    per_problem = bytes_per_row(model.config, model.dtype.itemsize, PROMPT_COLUMNS + max_new_tokens)
    rank_problems = -(-problems // ctx.world_size)
    return card_sized_batch(ctx, per_problem, rank_problems, "held-out problem", memory_share,
                            name="held-out evaluation", how_to_set="")


def held_out_rows(model, tokenizer, examples: list[dict], ctx, *, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0, batch_size: int = CPU_EVALUATION_BATCH) -> list[dict]:
    """`examples` sharded over the ranks, each answered once at `temperature` (0 = greedy), `batch_size`
    a call, and scored (data/scoring.py's `score_completion`: the gold answer, the completion, the answer
    extracted by the strict held-out rule, correct), every rank's rows gathered on every rank, each with
    `truncated` (it ran to max_new_tokens without ending). The engine leaves the model's train/eval mode
    as it was."""
    import torch

    from gpuscale.data.prompts import eos_token_ids, pad_token_id, prompt_ids
    from gpuscale.data.scoring import HELD_OUT_ANSWER_MODE, score_completion
    from gpuscale.data.seeds import derived_seed
    from gpuscale.engines.generation import GenerationEngine, Sampling
    from gpuscale.engines.reporter import beat
    from gpuscale.recipes.shared.device_trials import release_memory
    from gpuscale.runs.heartbeat import EVALUATE

    eos = eos_token_ids(model, tokenizer)
    # No torch.compile: a few hundred answers do not repay tens of seconds of compiling.
    engine = GenerationEngine(model, eos, pad_token_id=pad_token_id(tokenizer, eos), compile=False)
    generator = torch.Generator(device=ctx.device).manual_seed(derived_seed(seed, "evaluation", ctx.rank))
    rows = []
    for batch in batched(ctx.shard(list(enumerate(examples))), batch_size):
        beat(EVALUATE)  # a batch at a time: a long evaluation is not a silent rank
        prompts = [prompt_ids(tokenizer, example["question"]) for _, example in batch]
        generation = engine.generate(prompts, max_new_tokens, Sampling(temperature=temperature), generator)
        for (index, example), tokens in zip(batch, generation.sequences()):
            row = score_completion(index, 0, example, tokens, tokenizer, eos, HELD_OUT_ANSWER_MODE)
            rows.append({**row, "truncated": len(tokens) >= max_new_tokens and (not tokens or tokens[-1] not in eos)})
    # The KV cache of a card-sized batch: back to the card, not kept in torch's cache, where training would size
    # its micro-batch around it (card_sized_split). The engine sits in reference cycles: the collector frees it.
    engine = generation = None
    release_memory(ctx.device)
    return [row for rank_rows in ctx.gather(rows) for row in rank_rows]


def held_out_evaluation(model, tokenizer, examples: list[dict], ctx, when: str, *, max_new_tokens: int,
                        memory_share: float, seed: int = 0, batch_size: int | None = None) -> dict[str, float | None]:
    """Held-out accuracy, greedy and at temperature 1, overall and per domain, every recipe's answers
    extracted by one strict `#### N` rule (data/scoring.py's HELD_OUT_ANSWER_MODE says why):
    {"accuracy_greedy_<when>": ..., "accuracy_greedy_<domain>_<when>": ..., "accuracy_sampled_<when>": ...};
    the overall ones are None without examples. On tiny-math also the structurally new subset
    (data/near_duplicates.py): `accuracy_<greedy|sampled>_new_<when>` and its size `eval_examples_new`;
    other data has `eval_examples_new` None and `structurally_new_unavailable` saying why. `when` is
    "before" or "after" (training); the final evaluation is where GPUSCALE_INJECT_FAULT's `final_eval` fires.
    `batch_size` None: `evaluation_batch_size` sizes it, from `memory_share` on a GPU. Rank 0 writes every
    answer with its gold and extracted answer to RUN_DIR/held_out.jsonl (runs/generations.py's
    `add_held_out`), which `gpuscale generations ID` shows."""
    from gpuscale.data.scoring import held_out_figures, new_subset_size
    from gpuscale.engines.reporter import fail_if_injected

    if when == "after":
        fail_if_injected("final_eval", ctx.rank)
    figures: dict[str, float | None] = dict(new_subset_size(examples))
    if batch_size is None and examples:
        batch_size = evaluation_batch_size(model, ctx, len(examples), max_new_tokens, memory_share)
    answers = []
    for label, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        if not examples:
            figures[accuracy_name(label, "", when)] = None
            continue
        rows = held_out_rows(model, tokenizer, examples, ctx, max_new_tokens=max_new_tokens,
                             temperature=temperature, seed=seed, batch_size=batch_size)
        figures.update({accuracy_name(label, name.removeprefix("accuracy").lstrip("_"), when): value
                        for name, value in held_out_figures(rows).items()})
        answers += [(f"{HELD_OUT_PHASE} {label} {when}", row) for row in sorted(rows, key=lambda row: row["index"])]
    if ctx.is_main and answers:
        step = held_out_step(ctx.run_dir, when)
        add_held_out(ctx.run_dir, [held_out_record(step, phase, row) for phase, row in answers])
    return figures


def held_out_record(step: int, phase: str, row: dict) -> dict:
    """A scored held-out row as the generations files hold it (runs/generations.py)."""
    return generation_record(step, row["question"], row["completion"], domain=row["domain"],
                             correct=bool(row["correct"]), truncated=row["truncated"], phase=phase,
                             gold=row["gold"], extracted=row["extracted"])


def save_then_evaluate(trained: TrainedModel, tokenizer, ctx, settings, reporter, summary: dict,
                       evaluate: Callable[[], dict]) -> dict:
    """The end of a training run: save the trained model to RUN_DIR/model (where `save_model`), report
    the summary so far as a partial one, then run the final evaluation `evaluate()` and report the
    whole summary. A failure in the evaluation leaves the saved model and the figures measured
    before it. Returns the whole summary (rank 0's matters)."""
    from gpuscale.recipes.shared.models import save_model

    model_dir = save_model(trained.model, tokenizer, ctx) if settings.save_model else None
    summary = {**summary, **trained.figures, "model_dir": str(model_dir) if model_dir else None}
    if ctx.is_main:
        reporter.summary(summary, partial=True)
    summary.update(evaluate())
    if ctx.is_main:
        reporter.summary(summary)
    return summary
