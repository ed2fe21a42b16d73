"""The tuning trial of the training recipes, sft and grpo-mtl (`gpuscale tune`): one optimizer step of the
real model on the run's real rows, at a per-device micro-batch, gradient accumulation making up the
rest of the rank's share of the global batch; throughput in tokens per second (every token of the
step's sequences, as the run's tokens_per_s counts them). Every trial takes the same rows, the step's,
and runs the step twice: once untimed, then timed.

A step is what TRL's trainer does for the run: the model as the run trains it (fp32 master weights
under bf16/fp16 autocast for a full fine-tune, peft's LoRA adapters otherwise, activation
checkpointing where asked, liger-kernel's layers where the run has them), `accumulation` micro-batches
each padded to its longest row, or, where the run trains padding-free (sft's default), each one
sequence of its rows padded to a multiple of `pad_to_multiple_of` with attention row by row, a forward,
the loss on the completion tokens, a backward, then AdamW's step (fused on CUDA, TRL's default). The
GRPO loss is a per-token log-probability of the completion like SFT's, so one loss stands for both;
a GRPO reference model (beta > 0) is forwarded too. Where the run takes one gradient per domain
(grpo-mtl's PCGrad), so does the trial: each micro-batch a loss per domain on that domain's rows and
its gradient added into the domain's buffer, the recipe's update written into the gradients before
AdamW's step (`DomainUpdate`): the run's passes, buffers and memory. Not in the trial: GRPO's
generation (its batch is the rollout engine's, not this micro-batch).

AdamW runs at learning rate 0: the update's arithmetic, its state and its memory are all there, and
the model stays as loaded, so every trial measures the same model. Nothing here imports torch at the
top (recipes are listed by front ends that must not load it).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

TIMED_STEPS = 1  # a step is already `rank_batch` rows of forward and backward


@dataclass
class TrainingRows:
    """Token ids of whole training sequences (prompt + completion) and, for each, which tokens the
    loss is on (1: completion)."""

    sequences: list[list[int]]
    loss_masks: list[list[int]]
    domains: list[int] | None = None  # each row's domain (0, 1...) where the run takes a gradient per domain

    @property
    def domain_count(self) -> int:
        return max(self.domains) + 1 if self.domains else 0


class DomainUpdate(Protocol):
    """How a run that takes one gradient per domain makes its update (grpo-mtl's PCGrad): `add` a
    micro-batch's gradient of one domain (one entry per trainable parameter, None where it does not
    reach), then once a step `write` the update into the parameters' .grad."""

    def add(self, domain: int, grads, parameters) -> None: ...

    def write(self, parameters) -> None: ...


@contextmanager
def training_trial_session(settings, ctx, rank_batch: int, rows_for, reference: bool = False,
                           domain_update=None):
    """A trial session for a training recipe: `rows_for(tokenizer) -> TrainingRows` (the run's data,
    tokenized as the run does), `rank_batch` the rows of one optimizer step on this rank; `trial(b)`
    runs `rank_batch // b` micro-batches of b rows and one optimizer step (b divides rank_batch:
    the recipe's tune_batch_sizes says which b may be tried). `domain_update(domains)`, where given,
    makes a step's DomainUpdate: the trial then takes a gradient per domain of the rows' `domains`."""
    import torch

    from gpuscale.engines.batch_search import Trial
    from gpuscale.engines.packed_attention import use_packed_attention
    from gpuscale.recipes.shared.device_trials import timed_steps

    loaded, model = trainable_model(settings, ctx)
    frozen = reference_model(settings, ctx) if reference else None
    # As TRL's collator builds an sft micro-batch: one sequence, padded to a multiple (0: not padded).
    padding_free = getattr(settings, "padding_free", False) or getattr(settings, "packing", False)
    packed_to = (getattr(settings, "pad_to_multiple_of", 0) or 1) if padding_free else None
    data = rows_for(loaded.tokenizer)
    if not data.sequences:
        raise ValueError("no training rows to run a trial on")
    # Every trial trains on the same rows, the step's (repeated if the data has fewer): batch sizes are
    # compared on one piece of work, cut into micro-batches differently.
    step_rows = list(itertools.islice(itertools.cycle(range(len(data.sequences))), rank_batch))
    parameters = [p for p in model.parameters() if p.requires_grad]

    def micro_batch(picked: list[int], scale: float, update: DomainUpdate | None) -> int:
        if update is not None:
            return domain_micro_steps(model, frozen, data, picked, loaded.pad, ctx, scale, update, parameters,
                                      packed_to)
        return micro_step(model, frozen, [data.sequences[i] for i in picked], [data.loss_masks[i] for i in picked],
                          loaded.pad, ctx, scale, packed_to)

    def trial(batch_size: int) -> Trial:
        if rank_batch % batch_size:
            raise ValueError(f"batch_size {batch_size} does not divide the rank's {rank_batch} rows per step")
        accumulation = rank_batch // batch_size
        optimizer = torch.optim.AdamW(parameters, lr=0.0, fused=ctx.device.type == "cuda")

        def step() -> int:
            update = domain_update(data.domain_count) if domain_update else None
            tokens = sum(micro_batch(step_rows[start: start + batch_size], 1 / accumulation, update)
                         for start in range(0, rank_batch, batch_size))
            if update is not None:
                update.write(parameters)
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

    with use_packed_attention(loaded.model, packed_to is not None):
        yield trial


def trainable_model(settings, ctx):
    """(the loaded model with its tokenizer, the module to train) as the run trains it."""
    import torch

    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.training import apply_liger_kernels, lora_config

    loaded = load_generation_model(settings.model, ctx)
    model = loaded.model
    apply_liger_kernels(model, ctx, getattr(settings, "liger_kernels", False))
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
    from gpuscale.recipes.shared.models import load_generation_model

    frozen = load_generation_model(settings.model, ctx).model
    frozen.requires_grad_(False)
    return frozen.eval()


def micro_step(model, frozen, sequences, loss_masks, pad: int, ctx, scale: float, packed_to: int | None = None) -> int:
    """Forward and backward of one micro-batch; the tokens in it as the run counts them. `packed_to`
    None: the rows right-padded to the longest (the tokens: the rows'); a number: the rows concatenated
    into one sequence padded to a multiple of it (the tokens: the sequence's, padding included, as
    TRL counts a padding-free micro-batch)."""
    loss, tokens = micro_loss(model, frozen, sequences, loss_masks, pad, ctx, packed_to)
    (loss * scale).backward()
    return tokens


def domain_micro_steps(model, frozen, data: TrainingRows, picked: list[int], pad: int, ctx, scale: float,
                       update: DomainUpdate, parameters, packed_to: int | None = None) -> int:
    """One micro-batch as a run with a gradient per domain takes it: for every domain of the data, in
    order, the loss on the micro-batch's rows of that domain (normalised by the whole micro-batch's
    loss tokens, so that the domains' losses add up to its loss; a domain without rows here: one of
    the micro-batch's rows with no loss, as the run pads it) and its gradient, added into the
    domain's buffer; a GRPO reference forwarded once over the micro-batch, not once a domain. The
    tokens: the micro-batch's, as `micro_step` counts them."""
    import torch

    if frozen is not None:  # the reference's forward: once a row, as TRL scores it with the rollouts
        with torch.no_grad():
            micro_loss(frozen, None, [data.sequences[i] for i in picked], [data.loss_masks[i] for i in picked], pad,
                       ctx, packed_to)
    whole = sum(sum(data.loss_masks[i][1:]) for i in picked)  # the tokens a target: every row's first is not
    tokens = 0
    for domain in range(data.domain_count):
        rows = [i for i in picked if data.domains[i] == domain]
        masks = [data.loss_masks[i] for i in rows] or [[0] * len(data.sequences[picked[0]])]
        loss, counted = micro_loss(model, None, [data.sequences[i] for i in rows or picked[:1]], masks, pad, ctx,
                                   packed_to, loss_tokens=whole)
        update.add(domain, torch.autograd.grad(loss * scale, parameters, allow_unused=True), parameters)
        tokens += counted if rows else 0
    return tokens


def micro_loss(model, frozen, sequences, loss_masks, pad: int, ctx, packed_to: int | None = None,
               loss_tokens: int | None = None):
    """(the loss of one micro-batch: the completion tokens' mean negative log-probability, over
    `loss_tokens` where given, else over the micro-batch's; its tokens as `micro_step` counts them)."""
    import torch

    inputs, on_loss = (packed(sequences, loss_masks, pad, packed_to) if packed_to
                       else padded(sequences, loss_masks, pad))
    inputs = {name: value.to(ctx.device) if isinstance(value, torch.Tensor) else value
              for name, value in inputs.items()}
    ids, on_loss = inputs["input_ids"], on_loss.to(ctx.device)
    half = ctx.dtype != torch.float32
    with torch.autocast(device_type=ctx.device.type, dtype=ctx.dtype, enabled=half):
        logits = model(**inputs).logits
        if frozen is not None:
            with torch.no_grad():
                frozen(**inputs)
    # Log-probability of each next token, on the completion's tokens only (a packed row's first token is
    # its prompt's: never a target across a boundary).
    log_probs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    targets = on_loss[:, 1:].float()
    denominator = targets.sum().clamp(min=1) if loss_tokens is None else max(loss_tokens, 1)
    loss = -(log_probs * targets).sum() / denominator
    return loss, int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else ids.shape[1]


def padded(sequences, loss_masks, pad: int):
    """(model inputs, loss mask) of rows right-padded to the longest."""
    import torch

    width = max(len(row) for row in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    on_loss = torch.zeros_like(ids)
    for i, (row, mask) in enumerate(zip(sequences, loss_masks)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        on_loss[i, : len(mask)] = torch.tensor(mask)
    return {"input_ids": ids, "attention_mask": attention}, on_loss


def packed(sequences, loss_masks, pad: int, multiple: int):
    """(model inputs, loss mask) of rows concatenated into one sequence, positions restarting at every
    row, padded to a multiple of `multiple` with positions 0 (one-token rows of no loss), the row
    boundaries given as TRL's padding-free collator gives them."""
    import torch

    from gpuscale.engines.packed_attention import row_boundaries

    length = sum(len(row) for row in sequences)
    padding = -length % multiple
    ids = torch.tensor([token for row in sequences for token in row] + [pad] * padding)[None]
    positions = torch.tensor([i for row in sequences for i in range(len(row))] + [0] * padding)[None]
    on_loss = torch.tensor([bit for mask in loss_masks for bit in mask] + [0] * padding)[None]
    boundaries, longest = row_boundaries(positions)
    return {"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": boundaries, "cu_seq_lens_k": boundaries,
            "max_length_q": longest, "max_length_k": longest}, on_loss
