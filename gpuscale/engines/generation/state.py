"""The fixed tensors a decode step reads and updates in place, and the step's second half."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import Sampling, counter_uniform, sample_tokens


@dataclass
class _DecodeState:
    start: torch.Tensor  # [B] column of each row's sequence position 0
    input_ids: torch.Tensor  # [B] token fed at the next step
    positions: torch.Tensor  # [B] its sequence position (write column - start)
    mask: torch.Tensor  # [B, 1, 1, capacity] additive attention mask of the next step's query
    generated: torch.Tensor  # [B] generated tokens per row, kept ones included
    finished: torch.Tensor  # [B] bool
    limit: torch.Tensor  # [1] generated-length budget of every row
    step: torch.Tensor  # [1] index of the next record
    eos_ids: torch.Tensor  # [E]
    noise_words: torch.Tensor  # [2] int32: the next step's two key words (`counter_uniform`)
    noise_rows: torch.Tensor  # [B] each row's key in the noise: rows with one key draw the same numbers
    tokens: torch.Tensor  # [B, capacity] records, one column per decode step
    raw_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, capacity: int, vocab: int, eos_ids: Sequence[int], device: torch.device,
                 dtype: torch.dtype):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            start=zeros(batch), input_ids=zeros(batch), positions=zeros(batch),
            mask=zeros(batch, 1, 1, capacity, dtype=dtype), generated=zeros(batch),
            finished=zeros(batch, dtype=torch.bool), limit=zeros(1), step=zeros(1),
            eos_ids=torch.tensor(list(eos_ids), dtype=torch.long, device=device),
            noise_words=zeros(2, dtype=torch.int32), noise_rows=torch.arange(batch, device=device),
            tokens=zeros(batch, capacity), raw_logprobs=zeros(batch, capacity, dtype=torch.float32),
            sampled_logprobs=zeros(batch, capacity, dtype=torch.float32),
            valid=zeros(batch, capacity, dtype=torch.bool),
        )


def _sample_and_record(s: _DecodeState, logits: torch.Tensor, sampling: Sampling, pad_token_id: int,
                       write_col: torch.Tensor):
    """Sample every row's next token, record it, and advance: in-place updates of `s` only (the second
    half of a decode step; compiled as one graph, its many small kernels become a few)."""
    noise = None if sampling.greedy else counter_uniform(s.noise_words, s.noise_rows, logits.shape[-1])
    tokens, raw_logprob, sampled_logprob = sample_tokens(logits, sampling, noise)
    active = ~s.finished
    tokens = torch.where(active, tokens, pad_token_id)
    for record, value in ((s.tokens, tokens), (s.raw_logprobs, raw_logprob * active),
                          (s.sampled_logprobs, sampled_logprob * active), (s.valid, active)):
        record.index_copy_(1, s.step, value[:, None])
    s.generated.add_(active.long())
    done = s.generated >= s.limit
    if s.eos_ids.numel():
        done |= (tokens[:, None] == s.eos_ids[None, :]).any(dim=-1) & active
    s.finished.logical_or_(done)
    s.input_ids.copy_(tokens)
    s.positions.add_(1)
    s.step.add_(1)
    write_col.add_(1)
