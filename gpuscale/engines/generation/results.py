"""What the engine returns: a batch of generated rows that also points into the engine's KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import GenerationEngine


class StaleGenerationError(ValueError):
    """The KV cache a Generation points to has since been overwritten by another engine call."""


@dataclass(eq=False)
class Generation:
    """The generated part of B rows, aligned at the end of each prompt (index 0 = first new token).

    tokens [B, T] (pad where mask is False), mask [B, T] (True for real tokens, the EOS included),
    base_logprobs / sampled_logprobs [B, T] fp32 (0 where mask is False), prompt_ids [B, P]
    right-padded with prompt_lengths [B] (one prompt per row: with k samples per prompt, each prompt
    is repeated on its k rows). It also points into the engine's KV cache, which `resample` and
    `accept` use; another engine call may overwrite that cache (then they raise).
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    base_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    ended_with_eos: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    _engine: GenerationEngine = field(repr=False)
    _slot: int = field(repr=False)
    _version: int = field(repr=False)
    _start: torch.Tensor = field(repr=False)  # column of each row's first prompt token in the slot

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def sequences(self) -> list[list[int]]:
        """The generated tokens of each row, without padding. One copy to the host for the whole
        batch: indexing row by row on the GPU would cost a kernel and a synchronisation per row."""
        return rows_of(self.tokens.cpu(), self.mask.cpu())

    def suffix_logprobs(self, cut: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Per row, over generated positions >= cut[i]: (sum of base log-probs, sum of sampled
        log-probs, number of tokens). The terms of a Metropolis-Hastings ratio."""
        cut = torch.as_tensor(cut, device=self.tokens.device).reshape(-1, 1)
        in_suffix = self.mask & (torch.arange(self.tokens.shape[1], device=cut.device)[None] >= cut)
        return (
            (self.base_logprobs * in_suffix).sum(1),
            (self.sampled_logprobs * in_suffix).sum(1),
            in_suffix.sum(1),
        )


def rows_of(tokens: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """Row i's tokens where keep [B, T] is True, in order, as lists: one selection and one `tolist` for
    the batch, the list cut by the rows' counts (indexing each row's tensor, 3,840 rows of an rft call,
    took 3 to 4 times as long: bench/rft_call_host.py)."""
    kept = tokens[keep].tolist()
    rows, begin = [], 0
    for count in keep.sum(dim=1).tolist():
        rows.append(kept[begin : begin + count])
        begin += count
    return rows


def _pad_columns(tensor: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Cut or pad a [B, T] tensor to [B, width]."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    padded = torch.full((tensor.shape[0], width), fill, dtype=tensor.dtype, device=tensor.device)
    padded[:, : tensor.shape[1]] = tensor
    return padded
