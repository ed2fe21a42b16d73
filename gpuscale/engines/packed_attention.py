"""Attention over padding-free batches: each row of a flattened micro-batch attends only to itself.

TRL's padding-free collator (SFTConfig(padding_free=True)) concatenates a micro-batch's rows into one
sequence, restarts `position_ids` at every row and hands the rows' boundaries to the model
(`cu_seq_lens_q`, `max_length_q`). Flash attention's variable-length kernel is what that layout is
made for; transformers reaches it through the flash-attn package, which has no wheel on the package
index. torch ships the same kernel (`torch.nn.attention.varlen.varlen_attn`), so this module
registers it with transformers as the attention implementation `PACKED_ATTENTION`. Without it, sdpa
would be handed one dense causal mask over the whole flattened micro-batch: every row attending to
every other row's positions before being masked, quadratic in the micro-batch's tokens.

Off CUDA (or where torch lacks the kernel) the same contract is kept by sdpa row by row, so that CPU
runs and tests take the same path. Only a training forward uses it: `use_packed_attention` restores
the model's own implementation on exit, since generation with a KV cache needs it.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager

import torch

PACKED_ATTENTION = "gpuscale_packed"
_registered = False


def register() -> None:
    """Make PACKED_ATTENTION known to transformers (attention function and mask rule), once."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    # Like flash attention, the kernel takes row boundaries, not a mask: transformers builds none.
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, flash_attention_mask)
    _registered = True


@contextmanager
def use_packed_attention(model, enabled: bool = True):
    """Within the block, `model` attends row by row over padding-free batches; its own attention
    implementation is back on exit."""
    if not enabled:
        yield model
        return
    register()
    config = model.config
    before = config._attn_implementation
    model.set_attn_implementation(PACKED_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def row_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cumulative row starts as int32 with the total at the end, the longest row) of one flattened
    sequence whose positions restart at 0 at every row."""
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().flatten()
    total = torch.tensor([positions.numel()], device=positions.device)
    cumulative = torch.cat([starts, total]).to(torch.int32)
    return cumulative, int(cumulative.diff().max())


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: query [1, heads, tokens, head_dim], key and value
    [1, kv_heads, tokens, head_dim]; returns ([1, tokens, heads, head_dim], None). Causal within each
    row given by `cu_seq_lens_q`/`max_length_q` (the collator's) or by where `position_ids` restart."""
    if query.shape[0] != 1:
        raise ValueError(f"{PACKED_ATTENTION} takes one flattened sequence (padding_free), got a batch of "
                         f"{query.shape[0]}")
    cumulative, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cumulative is None:
        cumulative, longest = row_boundaries(kwargs["position_ids"])
    cumulative = cumulative.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    kernel_dtype = _varlen_dtype(q, k, v)
    if query.is_cuda and _varlen_kernel() is not None and kernel_dtype is not None:
        out = _varlen(*(t.to(kernel_dtype) for t in (q, k, v)), cumulative, int(longest), scaling)
    else:
        out = _rows_by_sdpa(q, k, v, cumulative, scaling)
    return out.unsqueeze(0), None


def _varlen_dtype(q, k, v) -> torch.dtype | None:
    """The dtype the varlen kernel (fp16 and bf16 only) runs in, or None where it cannot. Under autocast
    it is autocast's, as sdpa would be cast: with fp32 master weights the rotary embedding hands over
    fp32 queries and keys (its cos and sin follow the fp32 embeddings) beside bf16 values."""
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    dtypes = {q.dtype, k.dtype, v.dtype}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16} else None


def _rows_by_sdpa(q, k, v, cumulative, scaling):
    """The same attention row by row with sdpa (CPU, and CUDA builds without the varlen kernel)."""
    groups = q.shape[1] // k.shape[1]
    outputs = []
    bounds = cumulative.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [heads, length, head_dim]
        if groups > 1:
            rows[1], rows[2] = (t.repeat_interleave(groups, dim=0) for t in rows[1:])
        out = torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=True, scale=scaling)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _varlen(q, k, v, cumulative, longest, scaling):
    kernel = _varlen_kernel()
    causal, takes_gqa = _varlen_options()
    options = {"scale": scaling, **causal}
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if takes_gqa:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return kernel(q, k, v, cumulative, cumulative, longest, longest, **options)


@functools.cache
def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_options() -> tuple[dict, bool]:
    """How this torch's kernel is told "causal" (torch 2.11: is_causal; later: window_size) and whether
    it takes grouped key/value heads; read once, not at every layer of every forward."""
    parameters = inspect.signature(_varlen_kernel()).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    return causal, "enable_gqa" in parameters
