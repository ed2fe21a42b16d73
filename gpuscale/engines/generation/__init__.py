"""Fast batched sampling with per-token log-probs, and cheap resampling of suffixes.

What it gives (see `GenerationEngine`):
- `generate(prompts, max_new_tokens, sampling, generator, samples_per_prompt=1)`: left-padded batched
  sampling; each row stops at its own EOS (one or several ids) or budget. Per token: the log-prob
  under the raw model (temperature 1, no filtering) and under the distribution actually sampled from
  (after temperature, top-k, top-p), both fp32. k samples per prompt share one prefill.
- `resample(generation, cut, max_new_tokens, ...)`: keep the first `cut[i]` generated tokens of each row
  (cut may differ per row) and sample the rest again, without re-encoding the kept prefix.
- `accept(current, proposal, accepted)`: per row, keep the proposal or the current sequence (the
  Metropolis-Hastings step of power sampling), KV cache included, so the next resample is cheap again.
- `add_row_term(modules, RowTerm(down, up, scale))`: a low-rank term per group of rows on chosen
  linear layers (EGGROLL's population members), from buffers the caller refills in place; a
  `RowScale(factors)` per group of rows scales a layer's output channels (a member's norm gains).
  `fuse_row_terms=True` adds the linears' terms inside each projection's expression instead of
  after it, in the decode steps and in the prefill (row_terms.py says why).

Safe inside a training loop: each call runs the model in eval mode and leaves every module's mode
as it found it, and notices what changed in the model since the last call (optimizer steps, LoRA
adapters, hooks, wrapped layers) and follows it.

Where to read: `engine.py` (the calls and the decode loop), then `kv.py` (the KV layout),
`fused.py` (the fused decode forward), `state.py` + `sampling.py` (one step's sampling and
bookkeeping), `graphs.py` (capturing and replaying the decode step's CUDA graphs), `row_terms.py`,
`model_state.py`, `compiled.py`; `speed.py` times its decode steps (bench/generation.py and the probe's
node check). Measured figures: bench/RESULTS.md.

Design
------
KV layout. The engine owns two KV "slots", each a buffer [batch, kv_heads, capacity, head_dim] per
layer. Every row of a batch is one contiguous run of columns: row i's token at sequence position k
lives in column start[i] + k. All rows write the same column at each step (lockstep decoding), so a
single decode step is one fixed-shape forward; rows of different lengths are left-padded, the padding
masked by a 4D additive attention mask built here (so any model that takes a 4D mask works the same,
eager or sdpa), and the position of a token is simply column - start[i]. With k samples per prompt,
the prompt is prefilled once into the first of its k rows and its columns copied to the others.

Cut points. A resample copies ("gathers") each row's kept KV columns from the source slot into the
other slot, re-aligned so that all rows end at the same column (left padding again), then decodes.
Nothing is re-encoded: the model only runs on the last kept token (whose logits were never stored)
and the new tokens. The alternative, cropping the cache to the smallest cut of the batch and
teacher-forcing every row from there, re-encodes up to a whole suffix per row; the gather is only a
memory copy of the kept KV. Per-row cuts cost no extra forward work, only lockstep: a resample runs
max_new_tokens - min(cut) steps, and needs up to max(prompt + cut) + that many KV columns.
Two slots are needed because MCMC rejects proposals: the current sequence's KV must survive the
proposal. `accept` copies the accepted rows of the proposal slot into the current slot.

Decode step. One function (`_decode_step`) does the forward over one token per row, the fp32
logits, the sampling and the bookkeeping (EOS, budgets, records), all with in-place updates of
fixed tensors. On CPU it runs eagerly and attention sees only the columns written so far (the
buffer is preallocated, the compute is that of a dynamic cache). On CUDA attention sees the whole
buffer (static shapes), and the step is captured once per (slot, sampling settings) into a
`torch.cuda.CUDAGraph` after two eager warm-up steps, then replayed. `static_shapes=True` runs that
exact static-shape step eagerly on CPU, so the CPU tests cover everything but the capture. A call
that finds the model's structure changed (a hook, an adapter, a replaced layer, row terms) drops
the captured graphs and compiled steps first: they would replay the old structure.

Kernel count. With graphs a step costs the GPU time of its kernels, and for a small model at small
batches that is mostly their number. So:
- the decode mask is one buffer per call in which each step unmasks the column it writes (one
  kernel, not a mask rebuilt per step), and positions advance in place;
- Llama-style decoders (Llama, Qwen2, Mistral) decode through `_FusedDecode`: q/k/v and gate/up
  projections as one matmul each, over concatenated copies of their weights (by default when the
  copies take at most FUSED_WEIGHTS_MAX_BYTES; 3 matmuls fewer per layer). It holds only while those
  linears are plain, unhooked and unreplaced: otherwise the call decodes through the model's modules;
- on CUDA the forward (`compile`, on by default with static shapes on CUDA) and the sampling +
  bookkeeping (always on CUDA) are each wrapped in torch.compile: RMSNorm, rotary, KV writes,
  SiLU-mul, residual adds and the full-vocab sampling passes fuse into a few kernels. The CUDA
  graph is captured around the compiled code, which only updates the same fixed tensors in place.
  If compiling fails, the step runs uncompiled, with a warning;
- one query token per row attends with the query heads of each KV head stacked as that head's
  queries (`_grouped_query_sdpa`), so grouped K/V are read as stored, never copied per query head
  (transformers does the same in eager mode, but not under torch.compile); from
  `fused.MATMUL_ATTENTION_MIN_ROWS` rows on, through two batched matmuls and a softmax instead of
  SDPA's kernels, whose tiles are sized for many queries per head, not a group's few.

Sampling uses the Gumbel-max trick. Its uniform numbers are a hash of (the step's two key words,
the row, the token id) (`sampling.counter_uniform`): the key words are drawn before each step from
the caller's `torch.Generator` (seeded; graph-safe: no RNG inside the captured graph), and the
numbers themselves are computed inside the compiled sampling kernel, never written to memory (at a
large batch a [rows, vocab] buffer of them cost more than the model's matmuls). Logits are computed
in fp32 from the model's last hidden state (`torch.mm(..., out_dtype=float32)` on CUDA), so bf16
rounding of the logits does not enter the log-probs, which matters when alpha * log p is summed over
hundreds of tokens.

Limits: decoder-only models whose logits are a plain linear head over the last hidden state and
whose layers are all full attention (Llama, Qwen2, Mistral without sliding window, ...); others are
refused at construction with the reason. The head is applied as a matmul over its weight and the
decoder is called directly, so hooks on the head or on the top-level model do not run. A greedy
step's "sampled" log-prob is 0 (a point mass).
"""

from .engine import (
    COLUMN_GRANULE,
    CUDA_STOP_CHECK_EVERY,
    DEFAULT_COMPILE_MODE,
    GenerationEngine,
)
from .fused import FUSED_WEIGHTS_MAX_BYTES
from .graphs import CUDA_GRAPH_WARMUP_STEPS
from .kv import attention_mask_4d, bytes_per_row
from .results import Generation, StaleGenerationError
from .row_terms import RowScale, RowTerm, RowTermHandle
from .sampling import Sampling, filter_logits, sample_tokens

__all__ = [
    "COLUMN_GRANULE", "CUDA_GRAPH_WARMUP_STEPS", "CUDA_STOP_CHECK_EVERY", "DEFAULT_COMPILE_MODE",
    "FUSED_WEIGHTS_MAX_BYTES", "Generation", "GenerationEngine", "RowScale", "RowTerm", "RowTermHandle",
    "Sampling", "StaleGenerationError", "attention_mask_4d", "bytes_per_row", "filter_logits", "sample_tokens",
]
