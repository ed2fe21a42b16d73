"""How many training rows fit a card at once: the micro-batch of a training step, from arithmetic.

A training rank holds, besides the weights already loaded: the gradients and AdamW's two moments of
every trainable parameter (fp32: 4 + 8 bytes each), for a full fine-tune of a model loaded in half
precision the fp32 master copy's extra 2 bytes a parameter, and the activations the backward needs,
which grow with the tokens of the micro-batch. `split_rows` takes the rows of an optimizer step and
splits them into the largest micro-batch that fits a share of the memory left after loading, and the
gradient accumulation that keeps the step's rows as they were: the effective batch is a learning
setting and stays the user's; memory decides only how it is cut.

Activations (bytes a token a layer), bf16 autocast over fp32 weights as the training recipes run:
the fp32 residual stream, the RMSNorms' inputs and outputs, and the bf16 copies of every projection's
input and output, q, k, v and attention's output (ACTIVATION_HIDDEN x hidden), and the MLP's gate
and up in bf16 (ACTIVATION_INTERMEDIATE x intermediate). The output head's logits are not counted:
TRL computes the loss in tiles without materialising them. The two figures are fitted to the peaks
bench/train_speed.py measured at Qwen2.5-0.5B's shape on an H200 (bench/RESULTS.md: about 1.05 MiB a
token, padding-free, with and without liger-kernel alike); MARGIN keeps headroom for the
allocator's fragmentation.

Pure arithmetic, no torch: tested on a table of cases without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATION_HIDDEN = 30  # bytes a token a layer, per unit of hidden size
ACTIVATION_INTERMEDIATE = 4  # bytes a token a layer, per unit of MLP width
MARGIN = 0.85  # of the share: the allocator's fragmentation and the kernels' workspaces


@dataclass(frozen=True)
class TrainingShape:
    """What the memory of a training step depends on, read off a model config."""

    parameters: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    half_precision_master: bool  # a full fine-tune of a model loaded in bf16/fp16, cast to fp32 to train
    activation_checkpointing: bool = False

    @classmethod
    def of(cls, config, parameters: int, trainable: int, loaded_in_half: bool,
           activation_checkpointing: bool = False) -> TrainingShape:
        hidden = config.hidden_size
        return cls(parameters=parameters, trainable=trainable, layers=config.num_hidden_layers, hidden=hidden,
                   intermediate=getattr(config, "intermediate_size", None) or 4 * hidden,
                   half_precision_master=loaded_in_half and trainable == parameters,
                   activation_checkpointing=activation_checkpointing)


def activation_bytes_per_token(shape: TrainingShape) -> int:
    """Activations kept for the backward, a token: every layer's, or with activation checkpointing
    every layer's fp32 input and one layer's whole set (recomputed one layer at a time)."""
    per_layer = ACTIVATION_HIDDEN * shape.hidden + ACTIVATION_INTERMEDIATE * shape.intermediate
    if shape.activation_checkpointing:
        return shape.layers * 4 * shape.hidden + per_layer
    return shape.layers * per_layer


def fixed_training_bytes(shape: TrainingShape) -> int:
    """Memory a step holds whatever its batch: gradients and AdamW's moments of the trainable
    parameters, and the fp32 master weights' extra half where the model was loaded in half precision."""
    extra_master = 2 * shape.parameters if shape.half_precision_master else 0
    return 12 * shape.trainable + extra_master


@dataclass(frozen=True)
class RowSplit:
    micro_batch: int
    accumulation: int
    reason: str


def tokens_per_row(lengths: list[int], padded: bool, packed_length: int | None = None) -> int:
    """The tokens a row is budgeted at: a packed sequence's length; in padded batches the longest row
    (each batch pads to its longest); padding-free, the mean with a quarter on top (a micro-batch of
    many rows sums close to its mean), never above the longest."""
    if packed_length:
        return packed_length
    if not lengths:
        return 1
    if padded:
        return max(lengths)
    return min(max(lengths), int(1.25 * sum(lengths) / len(lengths)) + 1)


def largest_divisor(rows: int, at_most: int) -> int:
    """The largest divisor of `rows` not above `at_most`, at least 1: a micro-batch that a step's rows
    split into whole (every micro-batch of a step the same size, as DDP pairs them across ranks)."""
    return max((d for d in range(1, min(rows, at_most) + 1) if rows % d == 0), default=1)


def split_rows(rows_per_step: int, tokens_per_row: int, shape: TrainingShape, memory_bytes: int,
               share: float, source: str | None = None) -> RowSplit:
    """The largest divisor of `rows_per_step` whose micro-batch of `tokens_per_row`-token rows fits
    `share` x MARGIN of `memory_bytes` (the card's memory left once the model is loaded:
    engines/distributed.py's memory_for_auto_sizes; `source` says so in the reason) after the fixed
    training state; at least 1 (the step may then not fit, and the run's out-of-memory error says so)."""
    budget = memory_bytes * share * MARGIN - fixed_training_bytes(shape)
    per_row = max(1, tokens_per_row) * activation_bytes_per_token(shape)
    fits = int(budget // per_row) if budget > 0 else 0
    micro = largest_divisor(rows_per_step, fits)
    gib = 2**30
    reason = (f"{rows_per_step} rows a step at {tokens_per_row} tokens a row; {share:.0%} of "
              f"{source or f'{memory_bytes / gib:.1f} GiB'} less {fixed_training_bytes(shape) / gib:.1f} GiB of "
              f"gradients and optimizer state leaves room for {fits} rows at {per_row / 2**20:.0f} MiB each")
    if fits < 1:
        reason += "; not even one row fits: lower max_length, use LoRA or activation_checkpointing"
    return RowSplit(micro, rows_per_step // micro, reason)


# ---- a batch left `auto`, sized for the card (a fixed default of 8 used 1% of an H200's memory) ------

CPU_BATCH_SIZE = 8  # the default on CPU ranks, where memory is not what limits a batch
AUTO_BATCH_CAP = 512  # more rows per batch bring little on one GPU (bench/RESULTS.md) and coarser progress


def memory_to_size_from(free_bytes: int, total_bytes: int, own_bytes: int, share: float) -> tuple[int, bool]:
    """The memory a batch sized `auto` is sized from, and whether other processes set it: the card's
    memory less what this process holds (its model: the memory free after loading had the card been
    its own), so that a seed gives the same batch on an idle card and on one other runs share, as long
    as `share` of it is free now; else, where others leave less free, the memory free now (the run
    then depends on what they hold, and its log says so)."""
    alone = max(0, total_bytes - own_bytes)
    if share * alone <= free_bytes:
        return alone, False
    return free_bytes, True


def auto_batch_size(free_bytes: int, bytes_per_item: int, share: float, items: int | None = None,
                    cap: int = AUTO_BATCH_CAP) -> int:
    """Items per batch on a GPU when the user gave no batch_size: as many as fill `share` (the run's
    `gpu_memory_share`) of the memory free after loading the model (the rest is headroom for the
    allocator, activations and CUDA graphs), at most `cap`, at most the `items` this rank has (a
    larger batch would be padding), at least 1. A pure function of the numbers, so that the rule is
    tested without a GPU."""
    fits = int(free_bytes * share // max(1, bytes_per_item))
    size = min(fits, cap, items) if items else min(fits, cap)
    return max(1, size)
