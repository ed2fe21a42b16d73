"""The tuning trial of the training recipes, sft and grpo-mtl (`gpuscale tune`): one optimizer step of the
real model on the run's real rows, at a per-device micro-batch, gradient accumulation making up the
rest of the rank's share of the global batch; throughput in tokens per second (every token of the
step's sequences, as the run's tokens_per_s counts them). Every trial takes the same rows, the step's,
and runs the step twice: once untimed, then timed.

A step is what TRL's trainer does for the run: the model as the run trains it (fp32 master weights
under bf16/fp16 autocast for a full fine-tune, peft's LoRA adapters otherwise, activation
checkpointing where asked), `accumulation` micro-batches each padded to its longest row, a forward,
the loss on the completion tokens, a backward, then AdamW's step (fused on CUDA, TRL's default). The
GRPO loss is a per-token log-probability of the completion like SFT's, so one loss stands for both;
a GRPO reference model (beta > 0) is forwarded too. Not in the trial: GRPO's generation (its batch is
the rollout engine's, not this micro-batch) and PCGrad's per-domain gradients.

AdamW runs at learning rate 0: the update's arithmetic, its state and its memory are all there, and
the model stays as loaded, so every trial measures the same model. Nothing here imports torch at the
top (recipes are listed by front ends that must not load it).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

TIMED_STEPS = 1  # a step is already `rank_batch` rows of forward and backward


@dataclass
class TrainingRows:
    """Token ids of whole training sequences (prompt + completion) and, for each, which tokens the
    loss is on (1: completion)."""

    sequences: list[list[int]]
    loss_masks: list[list[int]]


@contextmanager
def training_trial_session(settings, ctx, rank_batch: int, rows_for, reference: bool = False):
    """A trial session for a training recipe: `rows_for(tokenizer) -> TrainingRows` (the run's data,
    tokenized as the run does), `rank_batch` the rows of one optimizer step on this rank; `trial(b)`
    runs `rank_batch // b` micro-batches of b rows and one optimizer step (b divides rank_batch:
    the recipe's tune_batch_sizes says which b may be tried)."""
    import torch

    from gpuscale.engines.batch_search import Trial
    from gpuscale.recipes.shared.device_trials import timed_steps

    loaded, model = trainable_model(settings, ctx)
    frozen = reference_model(settings, ctx) if reference else None
    data = rows_for(loaded.tokenizer)
    if not data.sequences:
        raise ValueError("no training rows to run a trial on")
    # Every trial trains on the same rows, the step's (repeated if the data has fewer): batch sizes are
    # compared on one piece of work, cut into micro-batches differently.
    step_rows = list(itertools.islice(itertools.cycle(range(len(data.sequences))), rank_batch))
    parameters = [p for p in model.parameters() if p.requires_grad]

    def micro_batch(picked: list[int], scale: float) -> int:
        return micro_step(model, frozen, [data.sequences[i] for i in picked], [data.loss_masks[i] for i in picked],
                          loaded.pad, ctx, scale)

    def trial(batch_size: int) -> Trial:
        if rank_batch % batch_size:
            raise ValueError(f"batch_size {batch_size} does not divide the rank's {rank_batch} rows per step")
        accumulation = rank_batch // batch_size
        optimizer = torch.optim.AdamW(parameters, lr=0.0, fused=ctx.device.type == "cuda")

        def step() -> int:
            tokens = sum(micro_batch(step_rows[start: start + batch_size], 1 / accumulation)
                         for start in range(0, rank_batch, batch_size))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return tokens

        try:
            # The warm-up step allocates the gradients and AdamW's state, and meets every micro-batch's
            # shape once (a kernel's first call at a shape can cost more than the step: a compile, a plan);
            # the timed step is the same step again.
            rate, seconds = timed_steps(step, TIMED_STEPS, ctx.synchronize, warm_up=1)
        finally:
            optimizer.zero_grad(set_to_none=True)  # the gradients go back now, AdamW's state with the optimizer
        return Trial(batch_size, throughput=rate, step_seconds=seconds)

    yield trial


def trainable_model(settings, ctx):
    """(the loaded model with its tokenizer, the module to train) as the run trains it."""
    import torch

    from gpuscale.recipes.shared.common import load_generation_model
    from gpuscale.recipes.shared.training import lora_config

    loaded = load_generation_model(settings.model, ctx)
    model = loaded.model
    if settings.lora_rank == 0 and ctx.dtype != torch.float32:
        model = model.float()  # fp32 master weights; the forward runs under autocast, as TRL's does
    if getattr(settings, "activation_checkpointing", False):
        model.gradient_checkpointing_enable()
        if settings.lora_rank:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need a grad input
    config = lora_config(settings)
    if config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, config)
    model.train()
    return loaded, model


def reference_model(settings, ctx):
    """GRPO's frozen reference (beta > 0): the initial model in the rank's dtype, forwarded without grad."""
    from gpuscale.recipes.shared.common import load_generation_model

    frozen = load_generation_model(settings.model, ctx).model
    frozen.requires_grad_(False)
    return frozen.eval()


def micro_step(model, frozen, sequences, loss_masks, pad: int, ctx, scale: float) -> int:
    """Forward and backward of one micro-batch (right-padded to its longest row); the tokens in it."""
    import torch

    width = max(len(row) for row in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    on_loss = torch.zeros_like(ids)
    for i, (row, mask) in enumerate(zip(sequences, loss_masks)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        on_loss[i, : len(mask)] = torch.tensor(mask)
    ids, attention, on_loss = ids.to(ctx.device), attention.to(ctx.device), on_loss.to(ctx.device)
    half = ctx.dtype != torch.float32
    with torch.autocast(device_type=ctx.device.type, dtype=ctx.dtype, enabled=half):
        logits = model(input_ids=ids, attention_mask=attention).logits
        if frozen is not None:
            with torch.no_grad():
                frozen(input_ids=ids, attention_mask=attention)
    # Log-probability of each next token, on the completion's tokens only.
    log_probs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    targets = on_loss[:, 1:].float()
    loss = -(log_probs * targets).sum() / targets.sum().clamp(min=1)
    (loss * scale).backward()
    return int(attention.sum())
