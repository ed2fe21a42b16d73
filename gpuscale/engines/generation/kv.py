"""KV storage: a transformers Cache whose layers all write at one shared column, and the 4D mask.

Row i's token at sequence position k lives in column start[i] + k of its slot (see the package
docstring); `_Cursor` says which column the next forward writes.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Cursor:
    """Where the next forward writes (a device tensor, so CUDA graphs can advance it) and how many
    columns attention sees (all of them with static shapes, else only those written so far).

    row_stride: the forward's batch row r writes buffer row r * row_stride. A prefill shared by k
    samples per prompt writes prompt i into row i * k (the first of its k rows) with stride k.
    """

    def __init__(self, device: torch.device):
        self.write_col = torch.zeros(1, dtype=torch.long, device=device)
        self.host_write_col = 0  # the same number, kept on the host to size eager forwards
        self.visible = 0
        self.row_stride = 1

    def move_to(self, column: int):
        self.write_col.fill_(column)
        self.host_write_col = column


class _ColumnLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, cursor: _Cursor, batch: int, capacity: int):
        super().__init__()
        self.cursor, self.batch, self.capacity = cursor, batch, capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv_heads = key_states.shape[1]
        self.keys = key_states.new_zeros(self.batch, kv_heads, self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(self.batch, kv_heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        columns = self.cursor.write_col + torch.arange(key_states.shape[-2], device=key_states.device)
        keys, values = self.keys, self.values
        if self.cursor.row_stride != 1:
            keys, values = keys[:: self.cursor.row_stride], values[:: self.cursor.row_stride]
        keys.index_copy_(2, columns, key_states)
        values.index_copy_(2, columns, value_states)
        visible = self.cursor.visible
        return keys[:, :, :visible], values[:, :, :visible]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cursor.visible, 0

    def get_seq_length(self) -> int:
        return self.cursor.host_write_col

    def get_max_length(self) -> int:
        return self.capacity


class _SlotCache(Cache):
    """One KV slot: per layer [batch, kv_heads, capacity, head_dim], allocated on first write."""

    def __init__(self, cursor: _Cursor, num_layers: int, batch: int, capacity: int):
        super().__init__(layers=[_ColumnLayer(cursor, batch, capacity) for _ in range(num_layers)])

    @property
    def allocated(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        """Every layer's buffers now, rather than at the first write: a compiled forward then only
        writes into them (an allocation inside it would be another compiled graph's output)."""
        template = torch.empty(0, kv_heads, 0, head_dim, dtype=dtype, device=device)
        for layer in self.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(template, template)

    def _buffers(self):
        for layer in self.layers:
            if layer.is_initialized:
                yield layer, "keys", layer.keys
                yield layer, "values", layer.values

    def grow(self, capacity: int):
        """More columns, keeping what the slot holds (generations that point into it stay valid)."""
        for layer, name, old in list(self._buffers()):
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, : old.shape[2]] = old
            setattr(layer, name, new)
        for layer in self.layers:
            layer.capacity = capacity

    def gather_columns(self, source: _SlotCache, source_columns: torch.Tensor):
        """self[b, :, j] = source[b, :, source_columns[b, j]] for j < source_columns.shape[1]."""
        width = source_columns.shape[1]
        for layer, src in zip(self.layers, source.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(src.keys, src.values)
            for dst_buf, src_buf in ((layer.keys, src.keys), (layer.values, src.values)):
                index = source_columns[:, None, :, None].expand(-1, src_buf.shape[1], -1, src_buf.shape[-1])
                dst_buf[:, :, :width] = src_buf.gather(2, index)

    def copy_rows(self, source: _SlotCache, rows: torch.Tensor):
        for layer, src in zip(self.layers, source.layers):
            layer.keys.index_copy_(0, rows, src.keys.index_select(0, rows))
            layer.values.index_copy_(0, rows, src.values.index_select(0, rows))

    def share_first_row_of_groups(self, group_size: int, columns: int):
        """Rows g*k+1 .. g*k+k-1 get row g*k's first `columns` columns (k = group_size): the KV of a
        prompt prefilled once, handed to each of its samples. One copy per buffer, in place."""
        for _, _, buf in self._buffers():
            grouped = buf.view(-1, group_size, *buf.shape[1:])[:, :, :, :columns]  # [prompts, k, H, C, D]
            grouped[:, 1:] = grouped[:, :1]


def attention_mask_4d(
    start: torch.Tensor, first_query_col: torch.Tensor, query_len: int, visible: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask [B, 1, query_len, visible]: query column q of row b sees columns start[b]..q.

    A padding query (q < start[b]) sees only itself, so that no softmax row is empty (its output is
    never used). Masked entries get the dtype's lowest finite value, as transformers does, not -inf.
    """
    columns = torch.arange(visible, device=start.device)
    query_cols = first_query_col + torch.arange(query_len, device=start.device)
    key, query = columns[None, None, :], query_cols[None, :, None]
    allowed = ((key >= start[:, None, None]) & (key <= query)) | (key == query)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=start.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def bytes_per_row(config, dtype_bytes: int, columns: int) -> int:
    """GPU memory one batch row takes in the engine: its K and V over `columns` cache columns in every
    layer, and a few fp32 vocabulary-sized rows per decode step (the logits, and the sampling step's
    temporaries where it runs uncompiled; its random numbers are no longer a stored buffer).
    What a recipe sizes its `auto` batch with."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv_cache = columns * config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    return kv_cache + 4 * config.vocab_size * 4
