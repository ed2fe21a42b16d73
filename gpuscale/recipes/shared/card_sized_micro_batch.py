"""A training step's rows on a rank cut into micro-batches in the rank, with batch_size auto: the
largest that fits the rank's share of its card (`card_sized_split`, `fitted_micro_batch`, on
engines/training_memory.py's arithmetic), the same on every rank (`agreed_micro_batch`). Which
micro-batches a step's rows allow, before anything runs, is rank_batches.py's.

No torch at import.
"""

from __future__ import annotations

from gpuscale.recipes.shared.training_settings import AUTO_STEP_ROWS, SupervisedSettings, TrainingSettings


def card_sized_split(settings: SupervisedSettings, ctx, model, lengths: list[int]) -> tuple[SupervisedSettings, str]:
    """The rank's rows of a step (`rank_rows`) in micro-batches: batch_size's if given, else the
    largest that fits its share of the card (on CPU: at most AUTO_STEP_ROWS), the same on every rank
    (`agreed_micro_batch`); gradient accumulation makes up the step. Returns the settings with
    batch_size and gradient_accumulation set (TRL's two counts), and the reason in one line, also
    printed to the rank's log."""
    rows = settings.check_micro_batch(ctx.world_size, settings.batch_size)
    if settings.batch_size is not None:
        return settings.model_copy(update={"gradient_accumulation": rows // settings.batch_size}), "given"
    from gpuscale.engines.training_memory import tokens_per_row

    tokens = tokens_per_row(lengths, padded=not (settings.padding_free or settings.packing),
                            packed_length=settings.max_length if settings.packing else None)
    if ctx.device.type != "cuda":
        micro, reason = AUTO_STEP_ROWS, "the CPU default"
    else:
        micro, reason = fitted_micro_batch(settings, ctx, model, rows, tokens)
    micro = agreed_micro_batch(rows, micro, ctx)
    line = f"batch_size auto: {micro} rows a micro-batch x {rows // micro} accumulated ({reason})"
    print(line, flush=True)
    return settings.model_copy(update={"batch_size": micro, "gradient_accumulation": rows // micro}), line


def fitted_micro_batch(settings: TrainingSettings, ctx, model, rows: int, tokens: int) -> tuple[int, str]:
    """The largest divisor of `rows` whose micro-batch of `tokens`-token rows fits the rank's share of
    its card (engines/training_memory.py's arithmetic, on the memory `memory_for_auto_sizes` gives), and why."""
    import torch

    from gpuscale.engines.distributed import memory_for_auto_sizes
    from gpuscale.engines.training_memory import TrainingShape, split_rows

    memory, source = memory_for_auto_sizes(ctx, settings.gpu_memory_share)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = parameters if settings.lora_rank == 0 else lora_parameters_estimate(model, settings)
    shape = TrainingShape.of(model.config, parameters, trainable, model.dtype != torch.float32,
                             getattr(settings, "activation_checkpointing", False))
    split = split_rows(rows, tokens, shape, memory, settings.gpu_memory_share, source)
    return split.micro_batch, split.reason


def lora_parameters_estimate(model, settings) -> int:
    """LoRA's trainable parameters, about: rank x (in + out) of every linear layer it adapts."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(settings.lora_rank * (m.in_features + m.out_features) for m in linears)


def agreed_micro_batch(rows: int, micro: int, ctx) -> int:
    """The smallest micro-batch any rank found, cut to a divisor of the step's `rows`: DDP and the
    loss's collectives pair the ranks' micro-batches, so every rank must take as many a step."""
    from gpuscale.engines.training_memory import largest_divisor

    if ctx.world_size > 1:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(micro, device=ctx.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        micro = int(tensor)
    return largest_divisor(rows, micro)
