"""GenerationEngine: generate / resample / accept, and the decode loop (see the package docstring)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from gpuscale.data.step_phases import PREFILL
from gpuscale.engines import step_phases

from .call_marks import CallMarks, NoMarks
from .compiled import _CompiledOrEager
from .fused import (
    _FusedDecode,
    _grouped_attention,
    _register_grouped_attention,
    make_fused_decode,
)
from .graphs import _StepGraphs
from .kv import _Cursor, _SlotCache, attention_mask_4d
from .model_state import evaluation_mode, structure_signature
from .results import Generation, StaleGenerationError, _pad_columns
from .row_terms import RowScale, RowTerm, RowTermHandle, RowTerms
from .sampling import Sampling
from .state import _DecodeState, _sample_and_record

# Buffers grow in steps of this many columns (and at least by half), so that a caller growing its
# sequences block by block does not reallocate and recapture CUDA graphs at every block.
COLUMN_GRANULE = 64
# On CUDA, checking "all rows finished" costs a device sync; do it every few steps only.
CUDA_STOP_CHECK_EVERY = 8
# torch.compile mode of the decode step. "max-autotune-no-cudagraphs" also benchmarks Triton matmul
# templates against cuBLAS (minutes more of compilation); never a mode with CUDA graphs of its own.
DEFAULT_COMPILE_MODE = "default"


def _engine_call(method):
    """A public call that runs the model: no autograd, the model in eval mode (then each module back
    in its own mode), row terms on, and the engine in step with the model as it is now."""

    @functools.wraps(method)
    def call(self: GenerationEngine, *args, **kwargs):
        with torch.no_grad(), evaluation_mode(self.model), self._row_terms.activated():
            self._follow_model()
            return method(self, *args, **kwargs)

    return call


class GenerationEngine:
    """Batched sampler over one HF causal LM (see the package docstring for the design).

    eos_token_ids: one id or several (empty: rows stop only at their budget).
    cuda_graphs: capture the decode step (default: on CUDA devices).
    static_shapes: attention over the whole KV buffer at every step, as CUDA graphs need
        (default: same as cuda_graphs; True on CPU runs the graph's exact step eagerly, for tests).
    compile: torch.compile the decode step's forward (needs static shapes; default: on CUDA with
        static shapes). The first step of each new batch size or KV capacity then compiles the
        forward (tens of seconds for a 0.5B model). The sampling + bookkeeping half of the step is
        compiled on CUDA either way (seconds, at each new batch size, capacity or sampling setting):
        it computes its random numbers inside its kernel.
    compile_mode: the torch.compile mode (one without its own CUDA graphs).
    fuse_weights: for Llama-style decoders (Llama, Qwen2, Mistral), run decode steps through
        `_FusedDecode`: q/k/v and gate/up projections as one matmul each, over copies of their
        weights (default: on where the copies take at most FUSED_WEIGHTS_MAX_BYTES; larger models
        are bandwidth-bound, fusing helps them little). Calls made while a fused linear is hooked or
        replaced (a LoRA adapter, a wrapper) decode through the model's own modules instead.
    fuse_row_terms: in the fused decode forward, add the row terms of the linear layers as part of
        each projection's expression, out of place, instead of in place after its matmul (and, for
        o_proj and down_proj, instead of their hooks): compiled, Inductor fuses them into the kernels
        around the matmuls (row_terms.py's docstring says why, in bytes). The prefill then runs
        through the same fused wiring over all its tokens (`_FusedDecode.prefill`, with or without
        terms), compiled with `compile`, its prompt width a dynamic size (one compilation for every
        width), attending to the columns it writes only. Default off; eggroll's recipe turns it on
        where it compiles (bench/eggroll.py --share-only --paths hooks,fused measures both). Models that do not decode
        fused prefill and decode through their own modules, the terms by hooks, either way.
    max_columns: KV columns to reserve up front (prompt + generated, plus, for resampling with
        different cuts per row, the spread between the longest kept prefix and the longest suffix);
        the buffers grow on demand otherwise.

    The model may be changed between calls (optimizer steps, LoRA adapters, hooks, wrapped layers):
    each call notices and follows. Its train/eval mode is left as found.
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
        fuse_row_terms: bool = False,
        max_columns: int = 0,
    ):
        self.model = model
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
        if compile_mode in ("reduce-overhead", "max-autotune"):  # "max-autotune-no-cudagraphs" is fine
            raise ValueError(f"compile_mode {compile_mode!r} captures CUDA graphs of its own; the engine does")
        self._compile_mode = compile_mode
        self.fuse_row_terms = fuse_row_terms
        # Whether `generate` marks its prefill as a step phase of its own (engines/step_phases.py), inside
        # the caller's: a recipe whose step is sampling (power-sampling) sets it; one whose generation is
        # a phase of a training step (rft, grpo-mtl: `generate`) keeps it whole.
        self.marks_prefill = False
        # Set to a CallMarks to time each `generate` call's prefill and decode (rft's bench split).
        self.call_marks: CallMarks | NoMarks = NoMarks()

        # A peft model wraps the causal LM; the decoder and head are the wrapped model's.
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        text_config = causal_lm.config.get_text_config(decoder=True)
        _refuse_unsupported_architecture(text_config)
        _register_grouped_attention()
        self._decoder = causal_lm.base_model
        self._head = causal_lm.get_output_embeddings()
        self._text_config = text_config
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in v5
        self._head_out_dtype = False
        self._num_layers = text_config.num_hidden_layers
        with torch.no_grad(), evaluation_mode(model):
            self._check_plain_linear_head()
            self._fused: _FusedDecode | None = make_fused_decode(self._decoder, fuse_weights, self._cache_kwarg)
        if self._fused is not None:
            self._fused.compiled = self.compile
        self._vocab = self._head.weight.shape[0]
        self._cursor = _Cursor(self.device)
        self._reserved_columns = max_columns
        self._batch = 0
        self._capacity = 0
        self._slots: list[_SlotCache] = []
        self._slot_versions = [0, 0]
        self._state: _DecodeState | None = None
        self._graphs = _StepGraphs(self.device)  # per (slot, sampling settings), on CUDA
        self._row_terms = RowTerms()
        # Set by _follow_model: the model's structure at the last call, and whether fusion still holds.
        self._structure: tuple | None = None
        self._use_fused = False
        self._follow_model()

    # ---- public API ------------------------------------------------------------------------------

    @_engine_call
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[torch.Tensor] | torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
        samples_per_prompt: int = 1,
        noise_period: int | None = None,
    ) -> Generation:
        """Sample up to max_new_tokens after each prompt (a list of token-id lists, or [B, P]).

        generator: a torch.Generator on the engine's device (None: torch's global RNG).
        samples_per_prompt: k rows per prompt, row i * k + j being sample j of prompt i; the prompt's
            KV is computed once and copied to its k rows (unless row terms put those rows in
            different groups: then each row computes its own).
        noise_period: rows i and i + noise_period draw with the same random numbers at every step
            (common random numbers: row groups that answer the same prompts with different row
            terms then differ only where their terms change a draw, which takes the sampling noise
            out of comparisons between groups). None: every row draws its own.
        """
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        prompt_ids, prompt_lengths = self._pad_prompts(prompts)
        batch = prompt_ids.shape[0] * samples_per_prompt
        self._row_terms.check_batch(batch)
        if noise_period is not None and (noise_period < 1 or batch % noise_period):
            raise ValueError(f"noise_period must divide the batch ({batch} rows), got {noise_period}")
        sharing = samples_per_prompt if self._row_terms.share_prefill(batch, samples_per_prompt) else 1
        # Prefill rows: each prompt once per group of `sharing` samples.
        prefill_ids, prefill_lengths = (t.repeat_interleave(samples_per_prompt // sharing, 0)
                                        for t in (prompt_ids, prompt_lengths))
        prompt_ids, prompt_lengths = (t.repeat_interleave(samples_per_prompt, 0)
                                      for t in (prompt_ids, prompt_lengths))
        zeros = torch.zeros(batch, dtype=torch.long, device=self.device)
        # Every prompt token but the last goes into the cache; the last is fed by the first step.
        first_col = int(prompt_lengths.max()) - 1
        self._reserve(batch, first_col + max_new_tokens)
        slot = 0
        start = first_col + 1 - prompt_lengths
        self._begin(slot, start, write_col=0)
        self.call_marks.start()
        with step_phases.phase(PREFILL) if self.marks_prefill else nullcontext():
            self._prefill(slot, prefill_ids, prefill_lengths, first_col, sharing)
        self.call_marks.mark()
        last_prompt_token = prompt_ids.gather(1, (prompt_lengths - 1)[:, None]).squeeze(1)
        finished = torch.full((batch,), max_new_tokens == 0, device=self.device)
        steps = self._decode(
            slot, last_prompt_token, zeros, finished, max_new_tokens, max_new_tokens, sampling, generator,
            noise_period,
        )
        self.call_marks.mark()
        return self._assemble(slot, None, prompt_ids, prompt_lengths, start, zeros, max_new_tokens, steps)

    @_engine_call
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
        `source` stays usable: the result goes to the other KV slot. The kept prefix's KV is reused
        as it was computed: if the model changed since, only the new suffix sees the change.
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
        accepted); the proposal stays usable. Only copies: the model does not run.
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

    def add_row_term(
        self, modules: str | torch.nn.Module | Sequence[str | torch.nn.Module], term: RowTerm | RowScale
    ) -> RowTermHandle:
        """Add `term` to the output of each given layer (a module, or its name in the model) in every
        forward of later engine calls, prefill and decode: rows of group g of a linear layer's output
        get scale * (x @ term.down[g]) @ term.up[g]^T; a RowScale multiplies them by factors[g] (see
        `row_terms`). Refill the term's tensors in place between calls; `handle.remove()` or
        `remove_row_terms()` takes terms off again."""
        if isinstance(modules, (str, torch.nn.Module)):
            modules = [modules]
        resolved = [self.model.get_submodule(m) if isinstance(m, str) else m for m in modules]
        if term.tensors()[0].device != self.device:
            raise ValueError(f"row term tensors must be on {self.device}, like the model")
        if isinstance(term, RowTerm) and term.down.dtype != self.dtype:  # a RowScale's factors may be fp32
            raise ValueError(f"a row term's down and up must be {self.dtype}, like the model")
        return self._row_terms.add(resolved, term)

    def row_terms_in_forward(self):
        """A context in which the model's own forward passes add the row terms too, as engine calls
        do: to score given tokens (teacher forcing) under each group's low-rank term."""
        return self._row_terms.activated()

    def remove_row_terms(self):
        """Take every row term off."""
        self._row_terms.clear()

    # ---- following the model between calls -------------------------------------------------------

    def _follow_model(self):
        """Once per call: if the model's structure changed since the last call (a LoRA adapter, a hook,
        a wrapped or replaced layer, a parameter reallocated, row terms added or removed), decide
        again whether the fused decode still reproduces it, and drop compiled steps and captured
        CUDA graphs, which hold the old structure. Nothing changed: nothing to do."""
        structure = (structure_signature(self.model), self._row_terms.signature())
        if structure == self._structure:
            return
        self._structure = structure
        self._use_fused = self._fused is not None and self._fused.still_valid(self._row_terms.hook_ids())
        if self._fused is not None:
            self._fused.use_row_terms(self._row_terms, in_projections=self.fuse_row_terms)
        self._graphs.clear()
        # The two halves of a decode step, compiled or not (the head matmul between them stays eager:
        # one cuBLAS call either way, and its fp32 output dtype is best left to ATen).
        self._forward_step: Callable = self._decode_forward
        self._sample_step: Callable = _sample_and_record
        # The prefill through the fused wiring, its terms in the projections (fuse_row_terms), or None:
        # through the model's modules, the terms by hooks.
        self._prefill_step: Callable | None = self._fused.prefill if self._use_fused and self.fuse_row_terms else None
        mode = self._compile_mode
        if self.compile:
            self._forward_step = _CompiledOrEager(self._decode_forward, "decode forward", mode, False)
            if self._prefill_step is not None:
                # Dynamic where `_fused_prefill` marks it so (the prompt width): not one compilation a width.
                self._prefill_step = _CompiledOrEager(self._prefill_step, "prefill forward", mode, False, dynamic=None)
        if self.compile or self.device.type == "cuda":
            # Compiled on CUDA whatever `compile` says: its random numbers (`counter_uniform`) are an
            # expression that, run uncompiled, writes [rows, vocab] integers a dozen times a step.
            self._sample_step = _CompiledOrEager(_sample_and_record, "sampling step", mode, True)

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
        self._row_terms.check_batch(start.shape[0])
        self._claim(slot)
        if self._use_fused:
            self._fused.refresh()
        self._state.start.copy_(start)
        self._cursor.move_to(write_col)

    def _run_decoder(self, slot: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     start: torch.Tensor) -> torch.Tensor:
        """Forward input_ids [B, Q] written at the cursor's columns (rows from `start`); returns the
        last hidden states."""
        query_len = input_ids.shape[1]
        self._cursor.visible = self._capacity if self.static_shapes else self._cursor.host_write_col + query_len
        mask = attention_mask_4d(start, self._cursor.write_col, query_len, self._cursor.visible, self.dtype)
        with _grouped_attention(self._text_config):
            out = self._decoder(
                input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                **{self._cache_kwarg: self._slots[slot]},
            )
        return out.last_hidden_state

    def _prefill(self, slot: int, prompt_ids: torch.Tensor, prompt_lengths: torch.Tensor, first_col: int,
                 rows_per_prompt: int):
        """Write all prompt tokens but the last into columns [0, first_col), left-padded (the cursor
        is at column 0). Prompt i goes to row i * rows_per_prompt, then to the rows after it."""
        if first_col == 0:
            return
        start = first_col + 1 - prompt_lengths
        positions = torch.arange(first_col, device=self.device)[None] - start[:, None]
        ids = prompt_ids.gather(1, positions.clamp_min(0))
        ids = torch.where(positions >= 0, ids, self.pad_token_id)
        self._cursor.row_stride = rows_per_prompt
        try:
            if self._prefill_step is not None:
                self._fused_prefill(slot, ids, positions.clamp_min(0), start)
            else:
                self._run_decoder(slot, ids, positions.clamp_min(0), start)
        finally:
            self._cursor.row_stride = 1
        if rows_per_prompt > 1:
            self._slots[slot].share_first_row_of_groups(rows_per_prompt, first_col)
        self._cursor.move_to(first_col)

    def _fused_prefill(self, slot: int, input_ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor):
        """`_prefill`'s forward through the fused wiring (fuse_row_terms): input_ids [B, Q] written
        from column 0, each query attending to the Q columns written (the rest of the cache is empty).
        The width Q is marked dynamic, so that a compiled prefill serves every prompt width."""
        cache, width = self._slots[slot], input_ids.shape[1]
        if not cache.allocated:
            cache.allocate(self._fused.kv_heads, self._fused.head_dim, self.dtype, self.device)
        self._cursor.visible = self._capacity  # what each layer's update returns; the forward keeps Q of them
        mask = attention_mask_4d(start, self._cursor.write_col, width, width, self.dtype)
        # Each token's batch row, for the row terms (`_FusedDecode.prefill`): a tensor, not a division
        # by the symbolic width in every element's index.
        token_rows = None
        if self._row_terms.entries:
            token_rows = torch.arange(input_ids.shape[0], device=self.device)[:, None].expand_as(input_ids).contiguous()
        for tensor, dims in ((input_ids, [1]), (positions, [1]), (mask, [2, 3]), (token_rows, [1])):
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, dims)
        self._prefill_step(input_ids, positions, mask, cache, token_rows)

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
        config = self._text_config
        for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            if getattr(config, name, None) not in (None, 1, 1.0):
                raise NotImplementedError(f"{type(self.model).__name__}: logits are rescaled ({name})")
        ids = torch.tensor([[1, 2, 3]], device=self.device)
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
        self, slot, first_input, generated, finished, limit: int, steps: int, sampling: Sampling, generator,
        noise_period: int | None = None,
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
        torch.arange(s.noise_rows.shape[0], out=s.noise_rows)
        if noise_period is not None:
            s.noise_rows.remainder_(noise_period)
        check_every = CUDA_STOP_CHECK_EVERY if self.cuda_graphs else 1
        for step in range(steps):
            if step % check_every == 0 and bool(s.finished.all()):
                return step
            if not sampling.greedy:
                self._draw_noise_words(generator)
            self._step(slot, sampling)
            self._cursor.host_write_col += 1
        return steps

    def _draw_noise_words(self, generator):
        """The next step's key words, drawn outside the graph from the caller's generator (one tiny
        kernel; the step computes its uniform numbers from them, `counter_uniform`)."""
        self._state.noise_words.random_(-(1 << 31), 1 << 31, generator=generator)

    def _step(self, slot: int, sampling: Sampling):
        if not self._slots[slot].allocated:
            # Nothing was prefilled (all prompts of one token): this step allocates the KV buffers,
            # which belongs neither in compiled code nor in a graph.
            return self._decode_step(slot, sampling, compiled=False)
        if not self.cuda_graphs:
            return self._decode_step(slot, sampling)
        self._graphs.step((slot, sampling), lambda: self._decode_step(slot, sampling))

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

    def _compile_errors(self) -> dict[str, BaseException]:
        """The compiled steps that failed to compile and run uncompiled since (the engine warned), by name."""
        steps = {"decode": self._forward_step, "sampling": self._sample_step, "prefill": self._prefill_step}
        return {name: step.error for name, step in steps.items() if getattr(step, "error", None) is not None}

    def _decode_forward(self, cache, input_ids, positions, mask, write_col) -> torch.Tensor:
        """The model over one token per row, written at column write_col; the last hidden states [B, H].

        During decoding every row's query is a real token (start <= write column), so its mask only
        changes by the column it writes: one in-place fill per step instead of a rebuilt mask.
        """
        mask.index_fill_(-1, write_col, 0.0)
        mask = mask[..., : self._cursor.visible]
        if self._use_fused:
            return self._fused(input_ids, positions, mask, cache)
        out = self._decoder(
            input_ids=input_ids[:, None], position_ids=positions[:, None], attention_mask=mask,
            use_cache=True, **{self._cache_kwarg: cache},
        )
        return out.last_hidden_state[:, -1]

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


def _refuse_unsupported_architecture(config):
    """The 4D mask built here is plain causal attention over each row's whole history."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        raise NotImplementedError(f"layer types {sorted(layer_types)}: only full attention is supported")
    if not layer_types and getattr(config, "sliding_window", None) is not None:
        raise NotImplementedError("sliding-window attention is not supported")
