"""The decode forward of Llama-style decoders with fused projections, and attention of one query
token with grouped KV heads."""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
import torch.nn.functional as F

from . import triton_matvec
from .kv import _Cursor, _SlotCache
from .row_terms import RowScale, RowTerm, RowTerms

# --------------------------------------------------------------------------------------------------
# Attention of one query token with grouped KV heads
# --------------------------------------------------------------------------------------------------

_GROUPED_SDPA = "gpuscale_grouped_sdpa"


def _grouped_query_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa" attention, except that one query token per row with grouped KV heads
    stacks the query heads of each KV head as that head's queries ([B, H, 1, D] -> [B, KV, H/KV, D]).

    K and V are then read as stored. transformers does the same in eager mode but not under
    torch.compile, where it copies K and V once per query head first (repeat_kv: H/KV times the KV
    bytes written and read per layer). Anything else goes to transformers' own function.
    `as_reduction` (the fused forward's, at a few rows): the stacked queries through `_reduction_attention`.
    """
    as_reduction = kwargs.pop("as_reduction", False)  # gpuscale's own: never handed on to transformers
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
    scale = kwargs.get("scaling") or dim ** -0.5
    if as_reduction:
        out = _reduction_attention(grouped, key, value, attention_mask, scale)
    elif batch >= MATMUL_ATTENTION_MIN_ROWS:
        out = _matmul_attention(grouped, key, value, attention_mask, scale)
    else:
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scale)
    return out.reshape(batch, 1, heads, value.shape[-1]), None  # [B, q_len, heads, head_dim], as sdpa's


# From this many rows on, one query token per row attends through two batched matmuls and a softmax
# (`_matmul_attention`) instead of scaled_dot_product_attention: on an H200, at 3,840 rows x 256
# columns (and 4,096 x 64) the compiled matmuls read K and V at 1.6x (1.3x) the speed of SDPA's
# kernels, whose tiles are sized for many queries, not for a head group's 7
# (bench/results/generation/attention-decode-*.json). Below it SDPA is kept (not measured apart there).
MATMUL_ATTENTION_MIN_ROWS = 1024


def _matmul_attention(query, key, value, mask, scale):
    """softmax(q k^T * scale + mask) v over [B, KV, G, D] queries and [B, KV, C, D] keys/values, the
    scores in fp32 (on CUDA a bf16/fp16 matmul writes them in fp32 directly, as SDPA keeps them)."""
    rows, kv_heads, groups, dim = query.shape
    q = query.reshape(rows * kv_heads, groups, dim)
    k = key.reshape(rows * kv_heads, key.shape[2], dim).transpose(1, 2)
    if q.is_cuda and q.dtype != torch.float32:
        scores = torch.bmm(q, k, out_dtype=torch.float32)
    else:
        scores = torch.bmm(q.float(), k.float())
    scores = scores.view(rows, kv_heads, groups, -1) * scale + mask
    probabilities = scores.softmax(dim=-1).to(value.dtype)
    return torch.matmul(probabilities, value)


def _reduction_attention(query, key, value, mask, scale):
    """`_matmul_attention` written as products summed over a dimension, for Inductor to compile into
    kernels of its own (`REDUCTION_ATTENTION_MAX_ROWS`): the scores and the weighted values in fp32."""
    scores = (query.float().unsqueeze(-2) * key.float().unsqueeze(-3)).sum(-1) * scale + mask  # [B, KV, G, C]
    probabilities = scores.softmax(dim=-1)
    return (probabilities.unsqueeze(-1) * value.float().unsqueeze(-3)).sum(-2).to(value.dtype)


def _reduction_linear(x, weight, bias):
    """F.linear as products summed over the input features, accumulated in fp32 and rounded once, as
    cuBLAS does: compiled, one kernel that reads the weight once and takes the bias (and whatever
    Inductor fuses around it) along."""
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# Up to this many tokens a forward, the compiled fused forward runs its matmuls and one-query attention as
# reductions Inductor writes (`_reduction_linear`, `_reduction_attention`), not as cuBLAS and SDPA calls. At
# a handful of rows a matmul is a matrix-vector product: cuBLAS's kernels for it, and SDPA's tiles made for
# many queries, take several microseconds each whatever their size, and a 0.5B model's step runs about a
# hundred of them. At one row an H200's step was faster this way (bench/results/generation/decode-ways-*,
# bench/decode_ways.py); more rows were not measured, so they keep cuBLAS and SDPA. 0: never.
REDUCTION_LINEAR_MAX_ROWS = 1
REDUCTION_ATTENTION_MAX_ROWS = 1
# At one row, compiled on a GPU, a plain SiLU MLP (no biases, no row terms) as two hand-written Triton kernels
# (triton_matvec.py: gate/up with SiLU-times-up, then down_proj): on an H200 the step was faster this way than with
# Inductor's reductions in both orders of two calls (bench/decode_ways.py's `inductor-mlp` turns them off; the
# figures are in bench/RESULTS.md). Where Triton or CUDA is missing the MLP stays Inductor's.
TRITON_MLP_AT_ONE_ROW = True
# At one row, compiled on a GPU, a whole plain layer (RMSNorms, q/k/v with or without bias, rotary, full attention,
# SiLU MLP, no biases elsewhere, no row terms) as seven Triton kernels (triton_matvec.py), not Inductor's dozen or
# so beside the MLP's two: on an H200 at Qwen2.5-0.5B's shape the step took 0.67 ms against 0.84 ms with only the
# MLP's kernels, 193 kernels a step against 305 (bench/RESULTS.md, decode-ways-b1-triton-layer-seven-*). In bf16
# its log-probs are as close to an fp32 forward as the eager step's (decode_ways.py --agreement). Where Triton or
# CUDA is missing the layer stays Inductor's; decode_ways' way `triton-mlp-only` turns it off.
TRITON_LAYER_AT_ONE_ROW = True
# RMSNorm classes whose forward is exactly transformers' Llama one (what the layer kernels compute).
_PLAIN_RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
# Whether down_proj too is a reduction at those rows (bench/decode_ways.py's `down-cublas` turns it off: its input,
# the MLP's SiLU-times-up, is then stored once for cuBLAS rather than computed again in each of its rows).
DOWN_PROJ_AS_REDUCTION = True
# Only matmuls of weights up to this many bytes as reductions (None: all). On the H200 the reductions' kernels
# read the largest weights (gate/up, down_proj) slower than cuBLAS's and win on the small ones and on what
# they fuse: bench/decode_ways.py's `reductions-small-weights` measures the mix.
REDUCTION_LINEAR_MAX_WEIGHT_BYTES: int | None = None


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


def _hooked(module: torch.nn.Module, allowed_hook_ids=frozenset()) -> bool:
    """Does calling `module` do more than its class's forward (hooks, or a forward set on the object)?"""
    hook_ids = set(module._forward_hooks) | set(module._forward_pre_hooks)
    return bool(hook_ids - allowed_hook_ids) or "forward" in module.__dict__


class _FusedDecode:
    """The decoder forward of one token per row for Llama-style models, with each layer's q/k/v
    projections as one matmul and gate/up as another, over concatenated copies of their weights; and
    the same wiring over many tokens per row for the prefill (`prefill`, used with the engine's
    fuse_row_terms).

    Why: a small model's decode step costs about the number of its kernels, and this removes 3 of
    each layer's matmuls (k_proj, v_proj, up_proj); at larger batches it also gives cuBLAS wider
    matrices than k/v_proj's few columns. Norms, rotary embedding, activation, o_proj and down_proj
    are the model's own modules: only the wiring is ours. The copies follow the model: `refresh()`
    (at every engine call) copies them again, in place.

    The wiring bypasses the forward of the decoder, its layers, their attention and MLP modules and
    the five fused linears: `still_valid()` says whether those are still the modules it was built
    from, unhooked (the engine's own row-term hooks aside: `row_terms` adds those terms here). The compiled
    prefill runs a norm's forward alone where its only hooks are row scales, and applies those itself
    (`norm_scales`, set again by `use_row_terms` at every change of the model's hooks).
    o_proj and down_proj run as their matmul (`output_as_matmul`) where they are plain linears with no
    hooks but row terms added here; otherwise as the modules, their hooks adding their terms. With the
    row terms in the projections (`use_row_terms(..., in_projections=True)`), every term is added out
    of place as part of its projection's expression (`RowTerm.added`), o_proj's and down_proj's too
    (`output_terms`). Compiled, at a few rows the matmuls and attention are reductions (`_linear`).
    """

    # (submodule of a layer, its linears fused into one matmul, in output order)
    GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))

    def __init__(self, decoder):
        self.decoder = decoder
        first = decoder.layers[0]
        self.apply_rotary = inspect.getmodule(type(first.self_attn)).apply_rotary_pos_emb
        self.head_dim = first.self_attn.head_dim
        self.kv_heads = first.self_attn.k_proj.out_features // self.head_dim
        self.split_sizes = [[m.out_features for m in self._linears(first, group)] for group in self.GROUPS]
        self.activations = [mlp_activation(layer.mlp, decoder.config) for layer in decoder.layers]
        # weights[g][i], biases[g][i]: group g of layer i, concatenated (bias None where there is none).
        self.weights = [[self._cat(layer, group, "weight") for layer in decoder.layers]
                        for group in self.GROUPS]
        self.biases = [[self._cat(layer, group, "bias") for layer in decoder.layers] for group in self.GROUPS]
        # row_terms[g][i][j]: the row terms of linear j of group g in layer i (set by `use_row_terms`).
        self.row_terms: list[list[list[list[RowTerm]]]] = [
            [[[] for _ in names] for _ in decoder.layers] for _, names in self.GROUPS]
        # output_terms[i]: the terms of layer i's o_proj and down_proj added here (in_projections only).
        self.output_terms: list[tuple[list[RowTerm], list[RowTerm]]] = [([], []) for _ in decoder.layers]
        # norm_scales[i]: the row scales of layer i's two norms, applied here in the compiled prefill
        # (in_projections only, where the norms carry no other hooks; `_norm`).
        self.norm_scales: list[tuple[list[RowScale], list[RowScale]]] = [([], []) for _ in decoder.layers]
        self.terms_in_projections = False
        # output_as_matmul[i]: whether layer i's o_proj and down_proj run as their matmul here, not as modules.
        self.output_as_matmul: list[tuple[bool, bool]] = [(False, False) for _ in decoder.layers]
        self.triton_mlp_ready = self.triton_layer_ready = False
        self.compiled = False
        self._bypassed = self._bypassed_modules()

    @property
    def compiled(self) -> bool:
        """Set by the engine when this forward runs compiled: only then are `_reduction_*` and the Triton MLP
        worth taking."""
        return self._compiled

    @compiled.setter
    def compiled(self, compiled: bool) -> None:
        self._compiled = compiled
        # Decided here, outside compiled code, and only for a compiled forward (an uncompiled engine, a held-out
        # evaluation's, never imports Triton): SiLU MLPs on a device the kernels run on, a switch on; for the
        # whole layer, plain RMSNorms too.
        kernels = bool(compiled and (TRITON_MLP_AT_ONE_ROW or TRITON_LAYER_AT_ONE_ROW)
                       and all(map(_is_silu, self.activations)) and triton_matvec.register(self.weights[1][0].device))
        self.triton_mlp_ready = kernels and TRITON_MLP_AT_ONE_ROW
        self.triton_layer_ready = kernels and TRITON_LAYER_AT_ONE_ROW and all(
            _plain_rms_norm(norm) for layer in self.decoder.layers
            for norm in (layer.input_layernorm, layer.post_attention_layernorm))
        # (attention's, the norm's) counters of the kernels' tails, or None (triton_matvec.tail_counters)
        self.tail_counters = triton_matvec.tail_counters(
            self.decoder.config.num_attention_heads, self.weights[0][0].device) if (
            self.triton_layer_ready and triton_matvec.TAILS_IN_LAST_PROGRAM) else None

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
                if not all(_plain_linear(m) for m in linears):
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

    def _bypassed_modules(self) -> list[tuple[torch.nn.Module, bool]]:
        """(module, is a fused linear) for every module whose forward the fused wiring skips."""
        modules = [(self.decoder, False)]
        for layer in self.decoder.layers:
            modules += [(layer, False), (layer.self_attn, False), (layer.mlp, False)]
            modules += [(m, True) for group in self.GROUPS for m in self._linears(layer, group)]
        return modules

    def still_valid(self, row_term_hook_ids: set[int]) -> bool:
        """The modules are those the copies were made from, plain, and nobody hooks them (hooks on
        every module, registered globally, count too)."""
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return False
        now = self._bypassed_modules()
        if len(now) != len(self._bypassed) or any(a is not b for (a, _), (b, _) in zip(now, self._bypassed)):
            return False
        return all(not _hooked(m, row_term_hook_ids if linear else frozenset())
                   and (not linear or _plain_linear(m)) for m, linear in now)

    def use_row_terms(self, row_terms: RowTerms, in_projections: bool = False):
        """Add the engine's terms of the fused linears to their slices of the fused outputs; with
        `in_projections`, every term as part of its projection's expression (class docstring)."""
        self.terms_in_projections = in_projections
        for g, group in enumerate(self.GROUPS):
            for i, layer in enumerate(self.decoder.layers):
                self.row_terms[g][i] = [row_terms.of(m) for m in self._linears(layer, group)]
        hook_ids = row_terms.hook_ids()

        def as_matmul(module) -> bool:
            """A plain linear whose hooks, if any, are row terms added here: its matmul may replace it."""
            return _plain_linear(module) and not _hooked(module, hook_ids if in_projections else frozenset())

        outputs = [(layer.self_attn.o_proj, layer.mlp.down_proj) for layer in self.decoder.layers]
        self.output_as_matmul = [(as_matmul(o_proj), as_matmul(down)) for o_proj, down in outputs]
        # Terms added here (in_projections only); otherwise the module runs and its hooks add them.
        self.output_terms = [tuple(row_terms.of(m) if in_projections and matmul else []
                                   for m, matmul in zip(pair, flags))
                             for pair, flags in zip(outputs, self.output_as_matmul)]
        norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in self.decoder.layers]
        self.norm_scales = [tuple(row_terms.of(norm) if in_projections and not _hooked(norm, hook_ids) else []
                                  for norm in pair) for pair in norms]

    def _cat(self, layer, group, name):
        tensors = [getattr(m, name) for m in self._linears(layer, group)]
        return None if tensors[0] is None else torch.cat([t.detach() for t in tensors])

    @torch.no_grad()
    def refresh(self):
        """Copy the model's weights into the fused buffers again, in place (captured CUDA graphs keep
        their addresses). At every engine call, whether or not they changed: version counters cannot
        tell, since fused optimizer kernels (torch's AdamW(fused=True), transformers' Trainer's
        default) update weights without bumping them. The copy is one read and write of the fused
        weights, small beside a generate call."""
        for g, group in enumerate(self.GROUPS):
            for i, layer in enumerate(self.decoder.layers):
                for fused, name in ((self.weights[g][i], "weight"), (self.biases[g][i], "bias")):
                    if fused is not None:
                        torch.cat([getattr(m, name) for m in self._linears(layer, group)], out=fused)

    def __call__(self, input_ids, positions, mask, cache) -> torch.Tensor:
        """Last hidden states [B, H] of one token per row ([B] ids at [B] positions), attention
        through `mask` [B, 1, 1, visible] over the KV columns of `cache`."""
        hidden = self._layers(input_ids[:, None], positions[:, None], mask, cache)
        return self.decoder.norm(hidden)[:, -1]

    def prefill(self, input_ids, positions, mask, cache, token_rows=None) -> None:
        """Write the KV of Q tokens per row ([B, Q] ids at [B, Q] positions) into `cache` at the cursor's
        columns, attention through `mask` [B, 1, Q, C] over the cache's first C columns (the engine's
        prefill writes from column 0, so C = Q). Returns nothing: the prefill only fills the cache, so,
        compiled, the last layer's work after its KV write is dead code. `token_rows` [B, Q], each
        token's batch row: with it, compiled, the terms in the projections and the norms' row scales find
        each token's member by it (`RowTerm._fp32_term_of_rows` says why)."""
        self._layers(input_ids, positions, mask, cache, token_rows)

    def _layers(self, input_ids, positions, mask, cache, token_rows=None) -> torch.Tensor:
        """The decoder layers over input_ids [B, Q]: the hidden states [B, Q, H] before the final norm."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        position_embeddings = decoder.rotary_emb(hidden, positions)
        for i, layer in enumerate(decoder.layers):
            if self._layer_by_triton(i, layer, hidden, position_embeddings, cache):
                hidden = self._triton_layer(i, layer, hidden, position_embeddings, mask, cache)
                continue
            attention_in = self._norm(layer.input_layernorm, self.norm_scales[i][0], hidden, token_rows)
            hidden = hidden + self._attention(i, layer.self_attn, attention_in, position_embeddings, mask,
                                              cache, token_rows)
            mlp_in = self._norm(layer.post_attention_layernorm, self.norm_scales[i][1], hidden, token_rows)
            hidden = hidden + self._mlp(i, layer.mlp, mlp_in, token_rows)
        return hidden

    @staticmethod
    def _norm(norm, scales: list[RowScale], hidden: torch.Tensor, token_rows) -> torch.Tensor:
        """The norm, its row scales by its hooks; or, given token_rows and compiling, its own forward (no
        hooks) with its scales found by each token's row."""
        if token_rows is None or not scales or not torch.compiler.is_compiling():
            return norm(hidden)
        out = norm.forward(hidden)
        for scale in scales:
            out = scale.scaled_by_row(out, token_rows)
        return out

    def _projections(self, g: int, i: int, x: torch.Tensor, token_rows=None) -> list[torch.Tensor]:
        """The outputs of group g's linears in layer i: one matmul, split, plus their row terms."""
        outputs = self._linear(x, self.weights[g][i], self.biases[g][i]).split(self.split_sizes[g], dim=-1)
        return [self._with_terms(output, x, terms, token_rows)
                for output, terms in zip(outputs, self.row_terms[g][i])]

    def _with_terms(self, output: torch.Tensor, x: torch.Tensor, terms: list[RowTerm], token_rows=None) -> torch.Tensor:
        for term in terms:
            if self.terms_in_projections:
                output = term.added(output, x, token_rows)
            else:
                term.add_into(output, x)
        return output

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        few_rows = x.shape[:-1].numel() <= REDUCTION_LINEAR_MAX_ROWS
        small = REDUCTION_LINEAR_MAX_WEIGHT_BYTES is None or (
            weight.numel() * weight.element_size() <= REDUCTION_LINEAR_MAX_WEIGHT_BYTES)
        if self.compiled and few_rows and small:
            return _reduction_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _output_projection(self, i: int, which: int, module: torch.nn.Linear, x: torch.Tensor,
                           token_rows=None) -> torch.Tensor:
        """o_proj (which 0) or down_proj (1) of layer i: its matmul and the terms added here, or the module."""
        if not self.output_as_matmul[i][which]:
            return module(x)
        if which == 1 and not DOWN_PROJ_AS_REDUCTION:
            output = F.linear(x, module.weight, module.bias)
        else:
            output = self._linear(x, module.weight, module.bias)
        return self._with_terms(output, x, self.output_terms[i][which], token_rows)

    def _attention(self, i, attention, x, position_embeddings, mask, cache, token_rows=None):
        batch, tokens = x.shape[:2]
        q, k, v = (t.view(batch, tokens, -1, self.head_dim).transpose(1, 2)
                   for t in self._projections(0, i, x, token_rows))
        q, k = self.apply_rotary(q, k, *position_embeddings)
        # As many KV columns as the mask has: all the cache shows in decode, the written ones in prefill.
        keys, values = (t[:, :, : mask.shape[-1]] for t in cache.layers[i].update(k, v))
        as_reduction = self.compiled and tokens == 1 and batch <= REDUCTION_ATTENTION_MAX_ROWS
        out, _ = _grouped_query_sdpa(attention, q, keys, values, mask, dropout=0.0, scaling=attention.scaling,
                                     as_reduction=as_reduction)
        return self._output_projection(i, 0, attention.o_proj, out.reshape(batch, tokens, -1), token_rows)

    def _mlp(self, i, mlp, x, token_rows=None):
        if self._mlp_by_triton(i, mlp, x):
            return triton_matvec.matvec(triton_matvec.silu_gate_up(x, self.weights[1][i]), mlp.down_proj.weight)
        gate, up = self._projections(1, i, x, token_rows)
        return self._output_projection(i, 1, mlp.down_proj, self.activations[i](gate) * up, token_rows)

    def _layer_by_triton(self, i, layer, hidden, position_embeddings, cache) -> bool:
        """Whether layer i runs as triton_matvec's kernels here (`_triton_layer`): ready
        (`triton_layer_ready`), one row of a compiled step, and a plain layer: no bias but q/k/v's, no row terms or
        hooks, full attention over a one-row cache written at the cursor's column."""
        if not (self.triton_layer_ready and self.compiled and hidden.shape[:-1].numel() == 1):
            return False
        attention, cache_layer = layer.self_attn, cache.layers[i]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return (self._plain_mlp(i, layer.mlp)
                and attention.o_proj.bias is None and not any(self.row_terms[0][i])
                and self.output_as_matmul[i][0] and not self.output_terms[i][0]
                and not any(self.norm_scales[i]) and not any(_hooked(norm) for norm in norms)
                and getattr(attention, "sliding_window", None) is None
                and position_embeddings[0].shape[-1] == self.head_dim
                and cache_layer.is_initialized and cache_layer.cursor.row_stride == 1)

    def _triton_layer(self, i, layer, hidden, position_embeddings, mask, cache) -> torch.Tensor:
        """Layer i over one row as triton_matvec's kernels: norm + q/k/v + rotary + KV write, attention, o_proj +
        residual + norm (attention's combine and the norm in last programs; with TAILS_IN_LAST_PROGRAM off, kernels of
        their own), gate/up + SiLU-times-up, down_proj + residual."""
        attention, cache_layer = layer.self_attn, cache.layers[i]
        before, after = layer.input_layernorm, layer.post_attention_layernorm
        keys, values = cache_layer.keys, cache_layer.values
        query = triton_matvec.norm_qkv_rotary(hidden, before.weight, before.variance_epsilon, self.weights[0][i],
                                              self.biases[0][i], *position_embeddings, keys, values,
                                              cache_layer.cursor.write_col)
        heads_counters, norm_counter = self.tail_counters or (None, None)
        attended = triton_matvec.decode_attention(query, keys, values, mask, attention.scaling, heads_counters)
        attended = attended.view(*hidden.shape[:-1], -1)
        if norm_counter is not None:
            hidden, normed = triton_matvec.matvec_norm(attended, attention.o_proj.weight, hidden, after.weight,
                                                       after.variance_epsilon, norm_counter)
        else:
            hidden = triton_matvec.matvec(attended, attention.o_proj.weight, hidden)
            normed = triton_matvec.rms_norm(hidden, after.weight, after.variance_epsilon)
        return triton_matvec.matvec(triton_matvec.silu_gate_up(normed, self.weights[1][i]), layer.mlp.down_proj.weight,
                                    hidden)

    def _mlp_by_triton(self, i, mlp, x) -> bool:
        """Whether layer i's MLP runs as triton_matvec's kernels here: ready (`triton_mlp_ready`), one row of a
        compiled step, and a plain MLP (no biases, nothing added to its outputs)."""
        return self.triton_mlp_ready and self.compiled and x.shape[:-1].numel() == 1 and self._plain_mlp(i, mlp)

    def _plain_mlp(self, i, mlp) -> bool:
        return (self.biases[1][i] is None and mlp.down_proj.bias is None and not any(self.row_terms[1][i])
                and self.output_as_matmul[i][1] and not self.output_terms[i][1])


def _plain_rms_norm(norm) -> bool:
    """transformers' Llama-style RMSNorm (its class's forward, a weight, `variance_epsilon`): what the layer
    kernels compute in its place."""
    return (type(norm).__name__ in _PLAIN_RMS_NORMS and "forward" not in norm.__dict__
            and isinstance(getattr(norm, "weight", None), torch.Tensor) and hasattr(norm, "variance_epsilon"))


def _is_silu(activation) -> bool:
    """Whether the activation computes SiLU (whatever its class: torch's, transformers', a fused one's)."""
    probe = torch.linspace(-6, 6, 25)
    try:
        return torch.allclose(activation(probe), F.silu(probe), rtol=1e-5, atol=1e-6)
    except Exception:  # an activation that takes other input (a module expecting its own shapes) is not SiLU
        return False


def mlp_activation(mlp, config):
    """The gate's activation: the MLP's own `act_fn`, or the config's where the module fuses it into its
    forward and has none (liger-kernel's SwiGLU, put on a model the training recipes patch on CUDA).
    `_same_decode` checks the wiring against the model's forward either way."""
    from transformers.activations import ACT2FN

    return getattr(mlp, "act_fn", None) or ACT2FN[config.hidden_act]


def _plain_linear(module) -> bool:
    """An nn.Linear whose forward is nn.Linear's (not a subclass computing something else)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def make_fused_decode(decoder, fuse_weights: bool | None, cache_kwarg: str) -> _FusedDecode | None:
    """A `_FusedDecode` of `decoder` if asked for (None: by default, where it is eligible and its copies
    are small enough) and if it reproduces the model's own decode forward; else None, with a warning."""
    eligible = _FusedDecode.eligible(decoder)
    if fuse_weights is None:
        fuse_weights = eligible and _FusedDecode.copy_bytes(decoder) <= FUSED_WEIGHTS_MAX_BYTES
    if not fuse_weights:
        return None
    if not eligible:
        raise ValueError(f"fuse_weights: {type(decoder).__name__} is not a Llama-style decoder "
                         f"({', '.join(sorted(_LLAMA_STYLE_DECODERS))})")
    fused = _FusedDecode(decoder)
    if not _same_decode(decoder, fused, cache_kwarg):
        warnings.warn(f"{type(decoder).__name__}: the fused decode forward does not reproduce the "
                      "model's; using the model's own forward", RuntimeWarning, stacklevel=3)
        return None
    return fused


@torch.no_grad()
def _same_decode(decoder, fused: _FusedDecode, cache_kwarg: str) -> bool:
    """Two tokens, one step each, through the model's forward and through `fused` (each with a
    throwaway cache): the second attends to the first, so q/k/v, rotary and MLP all count."""
    weight = decoder.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    results = []
    for use_fused in (False, True):
        cursor = _Cursor(device)
        cache = _SlotCache(cursor, len(decoder.layers), batch=1, capacity=2)
        mask = torch.zeros(1, 1, 1, 2, dtype=dtype, device=device)
        for column, token in enumerate((1, 2)):
            cursor.visible = column + 1
            ids, positions = (torch.tensor([value], device=device) for value in (token, column))
            visible_mask = mask[..., : column + 1]
            if use_fused:
                hidden = fused(ids, positions, visible_mask, cache)
            else:
                hidden = decoder(
                    input_ids=ids[:, None], position_ids=positions[:, None], attention_mask=visible_mask,
                    use_cache=True, **{cache_kwarg: cache},
                ).last_hidden_state[:, -1]
            results.append(hidden.float())
            cursor.move_to(column + 1)
    expected, ours = torch.cat(results[:2]), torch.cat(results[2:])
    # Concatenated weights may change cuBLAS's summation order: bf16 outputs then differ by a
    # rounding here and there; a wiring error (a swapped projection, rotary left out on a real
    # model) moves them by far more.
    relative = 1e-4 if dtype == torch.float32 else 2e-2
    return torch.allclose(ours, expected, rtol=0, atol=relative * float(expected.abs().max()) + 1e-6)
