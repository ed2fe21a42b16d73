"""Fast batched sampling with per-token log-probs, and cheap resampling of suffixes.

What it gives (see `GenerationEngine`):
- `generate(prompts, max_new_tokens, sampling, generator)`: left-padded batched sampling; each row stops
  at its own EOS (one or several ids) or budget. Per token: the log-prob under the raw model
  (temperature 1, no filtering) and under the distribution actually sampled from (after temperature,
  top-k, top-p), both fp32.
- `resample(generation, cut, max_new_tokens, ...)`: keep the first `cut[i]` generated tokens of each row
  (cut may differ per row) and sample the rest again, without re-encoding the kept prefix.
- `accept(current, proposal, accepted)`: per row, keep the proposal or the current sequence (the
  Metropolis-Hastings step of power sampling), KV cache included, so the next resample is cheap again.

Design
------
KV layout. The engine owns two KV "slots", each a buffer [batch, kv_heads, capacity, head_dim] per
layer. Every row of a batch is one contiguous run of columns: row i's token at sequence position k
lives in column start[i] + k. All rows write the same column at each step (lockstep decoding), so a
single decode step is one fixed-shape forward; rows of different lengths are left-padded, the padding
masked by a 4D additive attention mask built here (so any model that takes a 4D mask works the same,
eager or sdpa), and the position of a token is simply column - start[i].

Cut points. A resample copies ("gathers") each row's kept KV columns from the source slot into the
other slot, re-aligned so that all rows end at the same column (left padding again), then decodes.
Nothing is re-encoded: the model only runs on the last kept token (whose logits were never stored)
and the new tokens. The alternative, cropping the cache to the smallest cut of the batch and
teacher-forcing every row from there, re-encodes up to a whole suffix per row; the gather is a
memory copy of the kept KV (Qwen2.5-0.5B shape in bf16: 12 KiB per token, so about 0.4 GB read and
written at batch 64 x 512 columns, a fraction of a millisecond at HBM bandwidth; an estimate, not
yet measured). Per-row cuts cost no extra forward work, only lockstep: a resample runs
max_new_tokens - min(cut) steps, and needs up to max(prompt + cut) + that many KV columns.
Two slots are needed because MCMC rejects proposals: the current sequence's KV must survive the
proposal. `accept` copies the accepted rows of the proposal slot into the current slot.

Decode step. One function (`_decode_step`) does the forward over one token per row, the fp32
logits, the sampling and the bookkeeping (EOS, budgets, records), all with in-place updates of
fixed tensors. On CPU it runs eagerly and attention sees only the columns written so far (the
buffer is preallocated, the compute is that of a dynamic cache). On CUDA
attention sees the whole buffer (static shapes), and the step is captured once per (slot, sampling
settings) into a `torch.cuda.CUDAGraph` after two eager warm-up steps, then replayed. `static_shapes=True`
runs that exact static-shape step eagerly on CPU, so the CPU tests cover everything but the capture.

Kernel count. With graphs a step costs the GPU time of its kernels, and for a small model at batch
1 that is mostly their number (uncompiled, a Qwen2.5-0.5B step is ~1070 kernels of ~2.6 us). So:
- the decode mask is one buffer per call in which each step unmasks the column it writes (one
  kernel, not a mask rebuilt per step), and positions advance in place;
- Llama-style decoders (Llama, Qwen2, Mistral) decode through `_FusedDecode`: q/k/v and gate/up
  projections as one matmul each, over concatenated copies of their weights (by default when the
  copies take at most FUSED_WEIGHTS_MAX_BYTES; 3 matmuls fewer per layer);
- on CUDA the forward and the sampling + bookkeeping are each wrapped in torch.compile (`compile`,
  on by default with static shapes on CUDA): RMSNorm, rotary, KV writes, SiLU-mul, residual adds and
  the full-vocab sampling passes fuse into a few kernels (~10 per layer left instead of ~40). The
  CUDA graph is captured around the compiled code, which only updates the same fixed tensors in
  place. If compiling fails, the step runs uncompiled, with a warning;
- one query token per row attends with the query heads of each KV head stacked as that head's
  queries (`_grouped_query_sdpa`), so grouped K/V are read as stored, never copied per query head
  (transformers does the same in eager mode, but not under torch.compile).

Sampling uses the Gumbel-max trick with uniform noise drawn, before each step, from the caller's
`torch.Generator` into a fixed buffer: seeded, identical code on CPU and GPU, and graph-safe (no
RNG inside the captured graph). Logits are computed in fp32 from the model's last hidden state
(`torch.mm(..., out_dtype=float32)` on CUDA), so bf16 rounding of the logits does not enter the
log-probs, which matters when alpha * log p is summed over hundreds of tokens.

Limits: decoder-only models whose logits are a plain linear head over the last hidden state and
whose layers are all full attention (Llama, Qwen2, Mistral without sliding window, ...); others are
refused at construction with the reason. A greedy step's "sampled" log-prob is 0 (a point mass).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

# Buffers grow in steps of this many columns (and at least by half), so that a caller growing its
# sequences block by block does not reallocate and recapture CUDA graphs at every block.
COLUMN_GRANULE = 64
# On CUDA, checking "all rows finished" costs a device sync; do it every few steps only.
CUDA_STOP_CHECK_EVERY = 8
# Eager steps before a CUDA graph is captured (lazy cuBLAS/allocator initialisation, and the
# torch.compile compilation of the step, happen there).
CUDA_GRAPH_WARMUP_STEPS = 2
# torch.compile mode of the decode step. "max-autotune-no-cudagraphs" also benchmarks Triton matmul
# templates against cuBLAS (minutes more of compilation); never a mode with CUDA graphs of its own.
DEFAULT_COMPILE_MODE = "default"


class StaleGenerationError(ValueError):
    """The KV cache a Generation points to has since been overwritten by another engine call."""


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn. temperature 0 = greedy; top_k 0 and top_p 1.0 = no filtering."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def changes_distribution(self) -> bool:
        return self.temperature != 1 or self.top_k > 0 or self.top_p < 1


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature-scaled logits with the tokens top-k / top-p remove set to -inf.

    Same rules, in the same order, as transformers' warpers (temperature, then top-k, then top-p):
    top-k keeps every token scoring at least the k-th best; top-p keeps the smallest set of most
    likely tokens whose mass reaches top_p (always at least one).
    """
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores


def sample_tokens(
    logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (tokens, raw log-prob, sampled-distribution log-prob), fp32.

    `noise` holds uniform [0, 1) numbers of the logits' shape (unused when greedy): Gumbel-max over
    the filtered log-probs samples exactly from the filtered distribution.

    Full-vocabulary work per step, the part that grows with batch x vocab: one log-softmax (a second
    one only when temperature/top-k/top-p change the distribution; the sort only with top_p < 1),
    the Gumbel transform and the argmax. Written as few whole-tensor expressions, so that
    torch.compile can fuse them into a few reductions over the logits and the noise.
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _pick(raw_logprobs, tokens), torch.zeros(tokens.shape, dtype=torch.float32,
                                                                  device=tokens.device)
    if sampling.changes_distribution:
        sampled_logprobs = torch.log_softmax(filter_logits(logits, sampling), dim=-1)
    else:  # plain sampling: the sampled distribution is the model's
        sampled_logprobs = raw_logprobs
    # argmax(log p + g) with Gumbel noise g = -log(-log u); u < 1 keeps g finite, so filtered
    # tokens (-inf) never win, and u = 0 only gives g = -inf.
    tokens = (sampled_logprobs - torch.log(-torch.log(noise))).argmax(dim=-1)
    raw_logprob = _pick(raw_logprobs, tokens)
    sampled_logprob = raw_logprob if sampled_logprobs is raw_logprobs else _pick(sampled_logprobs, tokens)
    return tokens, raw_logprob, sampled_logprob


def _pick(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """values[b, tokens[b]] for every row b."""
    return values.gather(-1, tokens[:, None]).squeeze(-1)


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Generation:
    """The generated part of B rows, aligned at the end of each prompt (index 0 = first new token).

    tokens [B, T] (pad where mask is False), mask [B, T] (True for real tokens, the EOS included),
    base_logprobs / sampled_logprobs [B, T] fp32 (0 where mask is False), prompt_ids [B, P]
    right-padded with prompt_lengths [B]. It also points into the engine's KV cache, which
    `resample` and `accept` use; another engine call may overwrite that cache (then they raise).
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
        """The generated tokens of each row, without padding."""
        return [row[keep].tolist() for row, keep in zip(self.tokens, self.mask)]

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


# --------------------------------------------------------------------------------------------------
# KV storage: a transformers Cache whose layers write at a shared column
# --------------------------------------------------------------------------------------------------


class _Cursor:
    """Where the next forward writes (a device tensor, so CUDA graphs can advance it) and how many
    columns attention sees (all of them with static shapes, else only those written so far)."""

    def __init__(self, device: torch.device):
        self.write_col = torch.zeros(1, dtype=torch.long, device=device)
        self.host_write_col = 0  # the same number, kept on the host to size eager forwards
        self.visible = 0

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
        self.keys.index_copy_(2, columns, key_states)
        self.values.index_copy_(2, columns, value_states)
        visible = self.cursor.visible
        return self.keys[:, :, :visible], self.values[:, :, :visible]

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

    def grow(self, capacity: int):
        """More columns, keeping what the slot holds (generations that point into it stay valid)."""
        for layer in self.layers:
            if layer.is_initialized:
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
                    new[:, :, : old.shape[2]] = old
                    setattr(layer, name, new)
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


# --------------------------------------------------------------------------------------------------
# Attention of one query token with grouped KV heads
# --------------------------------------------------------------------------------------------------

_GROUPED_SDPA = "gpuscale_grouped_sdpa"


def _grouped_query_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa" attention, except that one query token per row with grouped KV heads
    stacks the query heads of each KV head as that head's queries ([B, H, 1, D] -> [B, KV, H/KV, D]).

    K and V are then read as stored. transformers does the same in eager mode but not under
    torch.compile, where it copies K and V once per query head first (repeat_kv: for Qwen2.5-0.5B,
    7x the KV bytes written and read per layer). Anything else goes to transformers' own function.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        query.shape[2] == 1 and groups > 1 and not kwargs.get("dropout")
        and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1))
        and all(kwargs.get(name) is None for name in ("softcap", "sliding_window", "position_bias"))
        and not kwargs.get("output_attentions")
    )
    if not plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, heads // groups, groups, dim)  # head h = kv * groups + g, as repeat_kv
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                         scale=kwargs.get("scaling"))
    return out.reshape(batch, 1, heads, value.shape[-1]), None  # [B, q_len, heads, head_dim], as sdpa's


def _register_grouped_attention():
    """Make `_GROUPED_SDPA` a transformers attention implementation. Called by the engine: by then the
    model has imported transformers' modeling code, and importing this module stays cheap."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(_GROUPED_SDPA, _grouped_query_sdpa)
    AttentionMaskInterface.register(_GROUPED_SDPA, sdpa_mask)  # the mask sdpa would get, if ever built


@contextlib.contextmanager
def _grouped_attention(config):
    """Run the model's sdpa attention layers through `_grouped_query_sdpa` for the duration (only
    sdpa: another implementation the caller chose stays as it is)."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    # The private field, not the property: its setter also rewrites sub-configs.
    config._attn_implementation_internal = _GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"


# --------------------------------------------------------------------------------------------------
# Decode forward of Llama-style decoders with fused projections
# --------------------------------------------------------------------------------------------------

# Decoders whose layer is exactly: x += o_proj(attention(rotary(q/k/v_proj(norm(x))))),
# x += down_proj(act(gate_proj(norm(x))) * up_proj(norm(x))); checked numerically at construction too.
_LLAMA_STYLE_DECODERS = {"LlamaModel", "Qwen2Model", "MistralModel"}
# Fuse by default only up to this many bytes of weight copies: small models are launch-bound (fewer,
# larger matmuls help), large ones bandwidth-bound (fusion saves little and the copies cost memory).
FUSED_WEIGHTS_MAX_BYTES = 1 << 30


class _FusedDecode:
    """The decoder forward of one token per row for Llama-style models, with each layer's q/k/v
    projections as one matmul and gate/up as another, over concatenated copies of their weights.

    At batch 1 a step costs about the number of its kernels: this removes 3 of ~14 per layer
    (k_proj, v_proj, up_proj; ~0.2 ms of a ~1.2 ms step for Qwen2.5-0.5B), and at batch 64 it gives
    cuBLAS wider matrices than k/v_proj's 128 columns. Norms, rotary embedding, activation, o_proj
    and down_proj are the model's own modules: only the wiring is ours. The copies follow the model:
    `refresh()` (at every engine call) copies again, in place, any weight changed since.
    """

    # (submodule of a layer, its linears fused into one matmul, in output order)
    GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

    def __init__(self, decoder):
        self.decoder = decoder
        first = decoder.layers[0]
        self.apply_rotary = inspect.getmodule(type(first.self_attn)).apply_rotary_pos_emb
        self.head_dim = first.self_attn.head_dim
        self.split_sizes = [[m.out_features for m in self._linears(first, group)] for group in self.GROUPS]
        # weights[g][i], biases[g][i]: group g of layer i, concatenated (bias None where there is none).
        self.weights = [[self._cat(layer, group, "weight") for layer in decoder.layers]
                        for group in self.GROUPS]
        self.biases = [[self._cat(layer, group, "bias") for layer in decoder.layers] for group in self.GROUPS]
        self._seen = self._source_state()

    @staticmethod
    def _linears(layer, group) -> list:
        module, names = group
        return [getattr(getattr(layer, module), name, None) for name in names]

    @classmethod
    def eligible(cls, decoder) -> bool:
        if type(decoder).__name__ not in _LLAMA_STYLE_DECODERS or not hasattr(decoder, "rotary_emb"):
            return False
        if not hasattr(inspect.getmodule(type(decoder.layers[0].self_attn)), "apply_rotary_pos_emb"):
            return False
        for layer in decoder.layers:
            if hasattr(layer.self_attn, "q_norm"):  # Qwen3-style q/k norms: not this wiring
                return False
            for group in cls.GROUPS:
                linears = cls._linears(layer, group)
                if not all(isinstance(m, torch.nn.Linear) for m in linears):
                    return False
                if len({m.bias is None for m in linears}) > 1:  # some with a bias, some without
                    return False
        return all(isinstance(getattr(layer.self_attn, "o_proj", None), torch.nn.Linear)
                   and isinstance(getattr(layer.mlp, "down_proj", None), torch.nn.Linear)
                   for layer in decoder.layers)

    @classmethod
    def copy_bytes(cls, decoder) -> int:
        return sum(m.weight.numel() * m.weight.element_size()
                   for layer in decoder.layers for group in cls.GROUPS for m in cls._linears(layer, group))

    def _cat(self, layer, group, name):
        tensors = [getattr(m, name) for m in self._linears(layer, group)]
        return None if tensors[0] is None else torch.cat([t.detach() for t in tensors])

    def _source_state(self):
        """(address, version) of every copied tensor: in-place updates bump the version counter."""
        return [(t.data_ptr(), t._version) for layer in self.decoder.layers for group in self.GROUPS
                for m in self._linears(layer, group) for t in (m.weight, m.bias) if t is not None]

    def refresh(self):
        """Copy again, into the same buffers (captured CUDA graphs keep their addresses), if a weight
        changed since (an optimizer step, load_state_dict, ...)."""
        state = self._source_state()
        if state == self._seen:
            return
        with torch.no_grad():
            for g, group in enumerate(self.GROUPS):
                for i, layer in enumerate(self.decoder.layers):
                    self.weights[g][i].copy_(self._cat(layer, group, "weight"))
                    if self.biases[g][i] is not None:
                        self.biases[g][i].copy_(self._cat(layer, group, "bias"))
        self._seen = state

    def __call__(self, input_ids, positions, mask, cache) -> torch.Tensor:
        """Last hidden states [B, H] of one token per row ([B] ids at [B] positions), attention
        through `mask` [B, 1, 1, visible] over the KV columns of `cache`."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids[:, None])
        position_embeddings = decoder.rotary_emb(hidden, positions[:, None])
        for i, layer in enumerate(decoder.layers):
            attention_in = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(i, layer.self_attn, attention_in, position_embeddings, mask,
                                              cache)
            hidden = hidden + self._mlp(i, layer.mlp, layer.post_attention_layernorm(hidden))
        return decoder.norm(hidden)[:, -1]

    def _attention(self, i, attention, x, position_embeddings, mask, cache):
        batch = x.shape[0]
        qkv = F.linear(x, self.weights[0][i], self.biases[0][i])
        q, k, v = (t.view(batch, 1, -1, self.head_dim).transpose(1, 2)
                   for t in qkv.split(self.split_sizes[0], dim=-1))
        q, k = self.apply_rotary(q, k, *position_embeddings)
        keys, values = cache.layers[i].update(k, v)
        out, _ = _grouped_query_sdpa(attention, q, keys, values, mask, dropout=0.0, scaling=attention.scaling)
        return attention.o_proj(out.reshape(batch, 1, -1))

    def _mlp(self, i, mlp, x):
        gate, up = F.linear(x, self.weights[1][i], self.biases[1][i]).split(self.split_sizes[1], dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)


# --------------------------------------------------------------------------------------------------
# torch.compile with a way back
# --------------------------------------------------------------------------------------------------


class _CompiledOrEager:
    """`fn` under torch.compile (static shapes); if compiling fails, `fn` itself from then on, with a
    warning.

    Compilation happens at the first call with new shapes or settings, before any compiled code
    runs (with fullgraph=False, subgraphs before a break may have run: `fn` must be safe to run again
    after a partial run, as the decode forward is: it rewrites the same KV column). Never falls back
    while a CUDA graph is being captured: a failure there is a real error.
    """

    def __init__(self, fn: Callable, name: str, mode: str, fullgraph: bool):
        self.fn, self.name = fn, name
        # Round at every explicit dtype cast as eager does (bf16 RMSNorm, rotary...): fused kernels
        # otherwise skip those roundings and the bf16 log-probs move by ~1e-2 against the eager step.
        # torch.compile takes a mode or options, not both: the mode's options go in too.
        from torch._inductor import list_mode_options  # imported when compiling only: it is slow

        options = {**list_mode_options(mode), "emulate_precision_casts": True}
        self.compiled = torch.compile(fn, dynamic=False, fullgraph=fullgraph, options=options)
        self.error: BaseException | None = None

    def __call__(self, *args, **kwargs):
        if self.error is not None:
            return self.fn(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as error:  # dynamo/inductor raise many types (Unsupported, InductorError, ...)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            self.error = error
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            warnings.warn(f"torch.compile of the {self.name} failed, running it uncompiled: "
                          f"{type(error).__name__}: {reason}", RuntimeWarning, stacklevel=2)
            return self.fn(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Decode state: the fixed tensors a decode step reads and updates in place
# --------------------------------------------------------------------------------------------------


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
    noise: torch.Tensor | None  # [B, V] uniform numbers for the next step
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
            noise=zeros(batch, vocab, dtype=torch.float32),
            tokens=zeros(batch, capacity), raw_logprobs=zeros(batch, capacity, dtype=torch.float32),
            sampled_logprobs=zeros(batch, capacity, dtype=torch.float32),
            valid=zeros(batch, capacity, dtype=torch.bool),
        )


def _sample_and_record(s: _DecodeState, logits: torch.Tensor, sampling: Sampling, pad_token_id: int,
                       write_col: torch.Tensor):
    """Sample every row's next token, record it, and advance: in-place updates of `s` only (the second
    half of a decode step; compiled as one graph, its ~25 kernels become a few)."""
    tokens, raw_logprob, sampled_logprob = sample_tokens(logits, sampling, s.noise)
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


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


class GenerationEngine:
    """Batched sampler over one HF causal LM (see the module docstring for the design).

    eos_token_ids: one id or several (empty: rows stop only at their budget).
    cuda_graphs: capture the decode step (default: on CUDA devices).
    static_shapes: attention over the whole KV buffer at every step, as CUDA graphs need
        (default: same as cuda_graphs; True on CPU runs the graph's exact step eagerly, for tests).
    compile: torch.compile the decode step's forward and its sampling + bookkeeping (needs static
        shapes; default: on CUDA with static shapes). The first step of each new batch size or KV
        capacity then compiles the forward (tens of seconds for a 0.5B model), of each new sampling
        setting the sampling step (seconds).
    compile_mode: the torch.compile mode (one without its own CUDA graphs).
    fuse_weights: for Llama-style decoders (Llama, Qwen2, Mistral), run decode steps through
        `_FusedDecode`: q/k/v and gate/up projections as one matmul each, over copies of their
        weights (default: on where the copies take at most FUSED_WEIGHTS_MAX_BYTES, e.g. 0.47 GB
        for Qwen2.5-0.5B; larger models are bandwidth-bound, fusing helps them little).
    max_columns: KV columns to reserve up front (prompt + generated, plus, for resampling with
        different cuts per row, the spread between the longest kept prefix and the longest suffix);
        the buffers grow on demand otherwise.
    """

    def __init__(
        self,
        model,
        eos_token_ids: int | Sequence[int] = (),
        *,
        pad_token_id: int | None = None,
        cuda_graphs: bool | None = None,
        static_shapes: bool | None = None,
        compile: bool | None = None,
        compile_mode: str = DEFAULT_COMPILE_MODE,
        fuse_weights: bool | None = None,
        max_columns: int = 0,
    ):
        self.model = model.eval()  # dropout off: the log-probs must be those of the model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        self.eos_token_ids = tuple(int(i) for i in ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (ids[0] if ids else 0)
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.static_shapes = self.cuda_graphs if static_shapes is None else static_shapes
        if self.cuda_graphs and not (on_cuda and self.static_shapes):
            raise ValueError("cuda_graphs needs a CUDA model and static_shapes")
        self.compile = (on_cuda and self.static_shapes) if compile is None else compile
        if self.compile and not self.static_shapes:
            raise ValueError("compile needs static_shapes (a dynamic step would recompile at every step)")
        if "cudagraphs" in compile_mode or compile_mode == "reduce-overhead":
            raise ValueError(f"compile_mode {compile_mode!r} captures CUDA graphs of its own; the engine does")

        text_config = model.config.get_text_config(decoder=True)
        _refuse_unsupported_architecture(text_config)
        _register_grouped_attention()
        self._decoder = model.base_model
        self._head = model.get_output_embeddings()
        self._text_config = text_config
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in v5
        self._head_out_dtype = False
        self._check_plain_linear_head()

        self._num_layers = text_config.num_hidden_layers
        self._fused = self._make_fused_decode(fuse_weights)
        self._vocab = self._head.weight.shape[0]
        self._cursor = _Cursor(self.device)
        self._reserved_columns = max_columns
        self._batch = 0
        self._capacity = 0
        self._slots: list[_SlotCache] = []
        self._slot_versions = [0, 0]
        self._state: _DecodeState | None = None
        self._graphs: dict[tuple[int, Sampling], torch.cuda.CUDAGraph] = {}
        self._warmups: dict[tuple[int, Sampling], int] = {}
        # The two halves of a decode step, compiled or not (the head matmul between them stays eager:
        # one cuBLAS call either way, and its fp32 output dtype is best left to ATen).
        self._forward_step: Callable = self._decode_forward
        self._sample_step: Callable = _sample_and_record
        if self.compile:
            self._forward_step = _CompiledOrEager(self._decode_forward, "decode forward", compile_mode, False)
            self._sample_step = _CompiledOrEager(_sample_and_record, "sampling step", compile_mode, True)

    # ---- public API ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[torch.Tensor] | torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Sample up to max_new_tokens after each prompt (a list of token-id lists, or [B, P]).

        generator: a torch.Generator on the engine's device (None: torch's global RNG).
        """
        prompt_ids, prompt_lengths = self._pad_prompts(prompts)
        batch = prompt_ids.shape[0]
        zeros = torch.zeros(batch, dtype=torch.long, device=self.device)
        # Every prompt token but the last goes into the cache; the last is fed by the first step.
        first_col = int(prompt_lengths.max()) - 1
        self._reserve(batch, first_col + max_new_tokens)
        slot = 0
        start = first_col + 1 - prompt_lengths
        self._begin(slot, start, write_col=0)
        self._prefill(slot, prompt_ids, first_col)
        last_prompt_token = prompt_ids.gather(1, (prompt_lengths - 1)[:, None]).squeeze(1)
        finished = torch.full((batch,), max_new_tokens == 0, device=self.device)
        steps = self._decode(
            slot, last_prompt_token, zeros, finished, max_new_tokens, max_new_tokens, sampling, generator
        )
        return self._assemble(slot, None, prompt_ids, prompt_lengths, start, zeros, max_new_tokens, steps)

    @torch.no_grad()
    def resample(
        self,
        source: Generation,
        cut: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Keep the first cut[i] generated tokens of row i and sample the rest again.

        max_new_tokens bounds the whole generated part (kept + new), as in `generate`; a cut equal
        to the row's length extends it (a row that ended at EOS then stays as it is). The result
        holds complete rows: the kept prefix with the log-probs stored for it (so its sampled
        log-probs are those of the sampling settings it was drawn with) followed by the new suffix.
        `source` stays usable: the result goes to the other KV slot.
        """
        self._check_live(source)
        cut = torch.as_tensor(cut, dtype=torch.long, device=self.device).reshape(-1)
        lengths = source.lengths
        if cut.shape[0] != source.batch_size or bool((cut < 0).any() | (cut > lengths).any()):
            raise ValueError(f"cut must hold one value in [0, length] per row; lengths {lengths.tolist()}")
        if bool((cut > max_new_tokens).any()):
            raise ValueError("a cut is beyond max_new_tokens")
        finished = (cut >= max_new_tokens) | ((cut == lengths) & source.ended_with_eos)
        steps = int((max_new_tokens - cut)[~finished].max()) if bool((~finished).any()) else 0
        keep = source.prompt_lengths + cut
        first_col = int(keep.max()) - 1
        self._reserve(source.batch_size, first_col + steps)

        slot = 1 - source._slot
        start = first_col + 1 - keep
        self._begin(slot, start, write_col=first_col)
        # Row b's sequence position k sits at column source._start[b] + k in the source slot and goes
        # to column start[b] + k here; padding columns copy anything (they are masked).
        columns = torch.arange(first_col, device=self.device)[None]
        source_columns = (columns - start[:, None] + source._start[:, None]).clamp(0, self._capacity - 1)
        self._slots[slot].gather_columns(self._slots[source._slot], source_columns)

        prompt_last = source.prompt_ids.gather(1, (source.prompt_lengths - 1)[:, None]).squeeze(1)
        kept_last = source.tokens.gather(1, (cut - 1).clamp_min(0)[:, None]).squeeze(1)
        last_kept_token = torch.where(cut > 0, kept_last, prompt_last)
        steps = self._decode(slot, last_kept_token, cut, finished, max_new_tokens, steps, sampling, generator)
        return self._assemble(
            slot, source, source.prompt_ids, source.prompt_lengths, start, cut, max_new_tokens, steps
        )

    def extend(
        self,
        source: Generation,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Continue every row that has not ended up to max_new_tokens generated tokens in all
        (block-wise growth); the same as resampling with the cut at each row's end."""
        return self.resample(source, source.lengths, max_new_tokens, sampling, generator)

    @torch.no_grad()
    def accept(
        self, current: Generation, proposal: Generation, accepted: torch.Tensor | Sequence[bool]
    ) -> Generation:
        """Row by row, the proposal where accepted[i], else the current row; the KV cache follows.

        The result lives in current's slot (so `current` itself is stale afterwards if any row was
        accepted); the proposal stays usable.
        """
        self._check_live(current)
        self._check_live(proposal)
        if current._slot == proposal._slot or proposal.prompt_ids is not current.prompt_ids:
            raise ValueError("accept needs a generation and a proposal resampled from it")
        accepted = torch.as_tensor(accepted, dtype=torch.bool, device=self.device).reshape(-1)
        rows = accepted.nonzero().squeeze(1)
        version = current._version
        if rows.numel():
            self._slots[current._slot].copy_rows(self._slots[proposal._slot], rows)
            version = self._claim(current._slot)
        width = max(current.tokens.shape[1], proposal.tokens.shape[1])
        merged = {}
        fills = {"tokens": self.pad_token_id, "mask": False, "base_logprobs": 0.0, "sampled_logprobs": 0.0}
        for name, pad in fills.items():
            ours, theirs = (_pad_columns(getattr(g, name), width, pad) for g in (current, proposal))
            merged[name] = torch.where(accepted[:, None], theirs, ours)
        return Generation(
            **merged,
            ended_with_eos=torch.where(accepted, proposal.ended_with_eos, current.ended_with_eos),
            prompt_ids=current.prompt_ids, prompt_lengths=current.prompt_lengths,
            _engine=self, _slot=current._slot, _version=version,
            _start=torch.where(accepted, proposal._start, current._start),
        )

    # ---- buffers ---------------------------------------------------------------------------------

    def _reserve(self, batch: int, columns: int):
        """Make the slots and decode state fit `batch` rows and `columns` KV columns."""
        if batch == self._batch and columns <= self._capacity:
            return
        capacity = max(columns, self._reserved_columns, self._capacity * 3 // 2 if batch == self._batch else 0)
        capacity = -(-capacity // COLUMN_GRANULE) * COLUMN_GRANULE
        if batch == self._batch:
            for slot in self._slots:
                slot.grow(capacity)
        else:  # a new batch: nothing in the old slots is usable any more
            self._slots = [_SlotCache(self._cursor, self._num_layers, batch, capacity) for _ in range(2)]
            self._slot_versions = [v + 1 for v in self._slot_versions]
        self._batch, self._capacity = batch, capacity
        self._state = _DecodeState.allocate(
            batch, capacity, self._vocab, self.eos_token_ids, self.device, self.dtype
        )
        # Graphs hold the addresses of the old buffers.
        self._graphs.clear()
        self._warmups.clear()

    def _claim(self, slot: int) -> int:
        self._slot_versions[slot] += 1
        return self._slot_versions[slot]

    def _check_live(self, generation: Generation):
        if generation._engine is not self:
            raise ValueError("this Generation comes from another engine")
        if self._slot_versions[generation._slot] != generation._version:
            raise StaleGenerationError(
                "the KV cache of this Generation was overwritten by a later generate/resample/accept"
            )

    # ---- forward passes --------------------------------------------------------------------------

    def _begin(self, slot: int, start: torch.Tensor, write_col: int):
        self._claim(slot)
        if self._fused is not None:
            self._fused.refresh()
        self._state.start.copy_(start)
        self._cursor.move_to(write_col)

    def _run_decoder(self, slot: int, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Forward input_ids [B, Q] written at the cursor's columns; returns the last hidden states."""
        query_len = input_ids.shape[1]
        self._cursor.visible = self._capacity if self.static_shapes else self._cursor.host_write_col + query_len
        mask = attention_mask_4d(
            self._state.start, self._cursor.write_col, query_len, self._cursor.visible, self.dtype
        )
        with _grouped_attention(self._text_config):
            out = self._decoder(
                input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                **{self._cache_kwarg: self._slots[slot]},
            )
        return out.last_hidden_state

    def _prefill(self, slot: int, prompt_ids: torch.Tensor, first_col: int):
        """Write all prompt tokens but the last into columns [0, first_col), left-padded (the cursor
        is at column 0)."""
        if first_col == 0:
            return
        positions = torch.arange(first_col, device=self.device)[None] - self._state.start[:, None]
        ids = prompt_ids.gather(1, positions.clamp_min(0))
        ids = torch.where(positions >= 0, ids, self.pad_token_id)
        self._run_decoder(slot, ids, positions.clamp_min(0))
        self._cursor.move_to(first_col)

    def _fp32_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self._head.weight, self._head.bias
        if hidden.dtype == torch.float32:
            return F.linear(hidden, weight, bias)
        if self._head_out_dtype:  # fp32 result of a bf16/fp16 matmul: no rounding of the logits
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            return logits if bias is None else logits + bias.float()
        return F.linear(hidden, weight, bias).float()

    def _check_plain_linear_head(self):
        """Our logits = head(last hidden state); make sure that is what the model computes."""
        config = self.model.config.get_text_config(decoder=True)
        for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(config, name, None) not in (None, 1, 1.0):
                raise NotImplementedError(f"{type(self.model).__name__}: logits are rescaled ({name})")
        ids = torch.tensor([[1, 2, 3]], device=self.device)
        with torch.no_grad():
            expected = self.model(input_ids=ids).logits[:, -1].float()
            hidden = self._decoder(input_ids=ids).last_hidden_state[:, -1]
            if self.device.type == "cuda" and hidden.dtype != torch.float32:
                try:
                    torch.mm(hidden, self._head.weight.t(), out_dtype=torch.float32)
                    self._head_out_dtype = True
                except (RuntimeError, TypeError, NotImplementedError):
                    self._head_out_dtype = False  # then logits pass through the model dtype
            ours = self._fp32_logits(hidden)
        tolerance = 2e-2 * float(expected.abs().max()) + 1e-4
        if not torch.allclose(ours, expected, rtol=0, atol=tolerance):
            raise NotImplementedError(
                f"{type(self.model).__name__}: logits are not a linear head of the last hidden state"
            )

    # ---- the decode loop -------------------------------------------------------------------------

    def _decode(
        self, slot, first_input, generated, finished, limit: int, steps: int, sampling: Sampling, generator
    ) -> int:
        """Run up to `steps` decode steps in `slot`; returns how many ran."""
        s = self._state
        s.input_ids.copy_(first_input)
        s.positions.copy_(self._cursor.write_col - s.start)
        # The first query's mask; each step then unmasks the column it writes (see _decode_forward).
        s.mask.copy_(attention_mask_4d(s.start, self._cursor.write_col, 1, self._capacity, self.dtype))
        s.generated.copy_(generated)
        s.finished.copy_(finished)
        s.limit.fill_(limit)
        s.step.zero_()
        check_every = CUDA_STOP_CHECK_EVERY if self.cuda_graphs else 1
        for step in range(steps):
            if step % check_every == 0 and bool(s.finished.all()):
                return step
            if not sampling.greedy:
                s.noise.uniform_(generator=generator)
            self._step(slot, sampling)
            self._cursor.host_write_col += 1
        return steps

    def _decode_step(self, slot: int, sampling: Sampling, compiled: bool = True):
        """One token for every row, with in-place updates only (this is what a CUDA graph captures)."""
        s = self._state
        self._cursor.visible = self._capacity if self.static_shapes else self._cursor.host_write_col + 1
        forward, sample = (self._forward_step, self._sample_step) if compiled else (self._decode_forward,
                                                                                  _sample_and_record)
        with _grouped_attention(self._text_config):
            hidden = forward(self._slots[slot], s.input_ids, s.positions, s.mask, self._cursor.write_col)
        logits = self._fp32_logits(hidden)
        sample(s, logits, sampling, self.pad_token_id, self._cursor.write_col)

    def _decode_forward(self, cache, input_ids, positions, mask, write_col) -> torch.Tensor:
        """The model over one token per row, written at column write_col; the last hidden states [B, H].

        During decoding every row's query is a real token (start <= write column), so its mask only
        changes by the column it writes: one in-place fill per step instead of a rebuilt mask.
        """
        mask.index_fill_(-1, write_col, 0.0)
        mask = mask[..., : self._cursor.visible]
        if self._fused is not None:
            return self._fused(input_ids, positions, mask, cache)
        out = self._decoder(
            input_ids=input_ids[:, None], position_ids=positions[:, None], attention_mask=mask,
            use_cache=True, **{self._cache_kwarg: cache},
        )
        return out.last_hidden_state[:, -1]

    def _make_fused_decode(self, fuse_weights: bool | None) -> _FusedDecode | None:
        eligible = _FusedDecode.eligible(self._decoder)
        if fuse_weights is None:
            fuse_weights = eligible and _FusedDecode.copy_bytes(self._decoder) <= FUSED_WEIGHTS_MAX_BYTES
        if not fuse_weights:
            return None
        if not eligible:
            raise ValueError(f"fuse_weights: {type(self._decoder).__name__} is not a Llama-style decoder "
                             f"({', '.join(sorted(_LLAMA_STYLE_DECODERS))})")
        fused = _FusedDecode(self._decoder)
        if not self._same_decode(fused):
            warnings.warn(f"{type(self._decoder).__name__}: the fused decode forward does not reproduce the "
                          "model's; using the model's own forward", RuntimeWarning, stacklevel=3)
            return None
        return fused

    @torch.no_grad()
    def _same_decode(self, fused: _FusedDecode) -> bool:
        """Two tokens, one step each, through the model's forward and through `fused` (each with a
        throwaway cache): the second attends to the first, so q/k/v, rotary and MLP all count."""
        results = []
        for use_fused in (False, True):
            cursor = _Cursor(self.device)
            cache = _SlotCache(cursor, self._num_layers, batch=1, capacity=2)
            mask = torch.zeros(1, 1, 1, 2, dtype=self.dtype, device=self.device)
            for column, token in enumerate((1, 2)):
                cursor.visible = column + 1
                ids, positions = (torch.tensor([value], device=self.device) for value in (token, column))
                visible_mask = mask[..., : column + 1]
                if use_fused:
                    hidden = fused(ids, positions, visible_mask, cache)
                else:
                    hidden = self._decoder(
                        input_ids=ids[:, None], position_ids=positions[:, None], attention_mask=visible_mask,
                        use_cache=True, **{self._cache_kwarg: cache},
                    ).last_hidden_state[:, -1]
                results.append(hidden.float())
                cursor.move_to(column + 1)
        expected, ours = torch.cat(results[:2]), torch.cat(results[2:])
        # Concatenated weights may change cuBLAS's summation order: bf16 outputs then differ by a
        # rounding here and there; a wiring error (a swapped projection, rotary left out on a real
        # model) moves them by far more.
        relative = 1e-4 if self.dtype == torch.float32 else 2e-2
        return torch.allclose(ours, expected, rtol=0, atol=relative * float(expected.abs().max()) + 1e-6)

    def _step(self, slot: int, sampling: Sampling):
        if not self._slots[slot].allocated:
            # Nothing was prefilled (all prompts of one token): this step allocates the KV buffers,
            # which belongs neither in compiled code nor in a graph.
            return self._decode_step(slot, sampling, compiled=False)
        if not self.cuda_graphs:
            return self._decode_step(slot, sampling)
        with torch.cuda.device(self.device):  # streams and capture on the model's GPU
            self._graph_step(slot, sampling)

    def _graph_step(self, slot: int, sampling: Sampling):
        key = (slot, sampling)
        graph = self._graphs.get(key)
        if graph is None and self._warmups.get(key, 0) < CUDA_GRAPH_WARMUP_STEPS:
            # Real steps, run eagerly on a side stream as PyTorch recommends before capture.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._decode_step(slot, sampling)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._warmups[key] = self._warmups.get(key, 0) + 1
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records the step without running it
                self._decode_step(slot, sampling)
            self._graphs[key] = graph
        graph.replay()

    # ---- results ---------------------------------------------------------------------------------

    def _assemble(self, slot, source, prompt_ids, prompt_lengths, start, cut, width, steps) -> Generation:
        """Rows = kept prefix of `source` (positions < cut) + the tokens recorded by the decode steps."""
        s = self._state
        position = torch.arange(width, device=self.device)[None]
        record_index = position - cut[:, None]
        from_records = (record_index >= 0) & (record_index < steps)
        index = record_index.clamp(0, max(steps - 1, 0))

        def merge(records: torch.Tensor, kept_name: str, fill) -> torch.Tensor:
            recorded = records[:, : max(steps, 1)].gather(1, index)
            if source is None:
                kept = torch.full_like(recorded, fill)
            else:
                kept = _pad_columns(getattr(source, kept_name), width, fill)
            return torch.where(from_records, recorded, kept)

        # Kept positions are real tokens (cut <= the source's length); new ones if a step produced them.
        mask = torch.where(from_records, merge(s.valid, "mask", False), position < cut[:, None])
        tokens = torch.where(mask, merge(s.tokens, "tokens", 0), self.pad_token_id)
        raw = merge(s.raw_logprobs, "base_logprobs", 0.0) * mask
        sampled = merge(s.sampled_logprobs, "sampled_logprobs", 0.0) * mask
        ended = ((tokens[:, :, None] == s.eos_ids).any(-1) & mask).any(1)
        return Generation(
            tokens=tokens, mask=mask, base_logprobs=raw, sampled_logprobs=sampled, ended_with_eos=ended,
            prompt_ids=prompt_ids, prompt_lengths=prompt_lengths,
            _engine=self, _slot=slot, _version=self._slot_versions[slot], _start=start.clone(),
        )

    def _pad_prompts(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompt ids [B, P] and lengths [B] on the engine's device."""
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 2 and prompts.shape[1] > 0:
            batch, width = prompts.shape
            return prompts.to(self.device, torch.long), torch.full((batch,), width, device=self.device)
        rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu() for p in prompts]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("need at least one prompt, and no empty prompt")
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        padded = torch.full((len(rows), int(lengths.max())), self.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        return padded.to(self.device), lengths


def _pad_columns(tensor: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Cut or pad a [B, T] tensor to [B, width]."""
    if tensor.shape[1] >= width:
        return tensor[:, :width]
    padded = torch.full((tensor.shape[0], width), fill, dtype=tensor.dtype, device=tensor.device)
    padded[:, : tensor.shape[1]] = tensor
    return padded


def _refuse_unsupported_architecture(config):
    """The 4D mask built here is plain causal attention over each row's whole history."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        raise NotImplementedError(f"layer types {sorted(layer_types)}: only full attention is supported")
    if not layer_types and getattr(config, "sliding_window", None) is not None:
        raise NotImplementedError("sliding-window attention is not supported")
