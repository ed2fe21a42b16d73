"""Batch-1 decode's layer as hand-written Triton kernels, for the compiled one-row step.

Why by hand: at one row every matmul of a layer is a matrix-vector product that reads its weight once, and a small
model's step costs about the number of its kernels (Inductor wrote about 13 a layer: norms, the q/k/v reduction,
rotary for q and for k, the cache writes, two for attention, o_proj, and the MLP's). Here a layer is five:
1. `norm_qkv_rotary`: input norm, q/k/v (and their bias), rotary; k and v written into the KV cache at the
   cursor's column, q returned (each of its few hundred programs computes the norm again: cheap at that count);
2. `decode_attention`: one program per query head and block of columns (each block's softmax statistics); the
   last of a head's programs to finish combines its blocks (fp32);
3. `matvec_norm`: o_proj plus the residual; its last program to finish stores the post-attention norm of the sum
   once (gate/up's thousands of programs would each compute it again);
4. `silu_gate_up`: gate/up and SiLU-times-up, stored once (Inductor otherwise computes it again inside each row of
   down_proj's reduction);
5. `matvec(..., residual)`: down_proj plus the residual.
"The last program to finish" (triton_kernels.last_program): each program counts itself on a zeroed counter after its
stores; the one that counts last sees all the others' output and does the tail, in the kernel rather than in a
kernel of its own (a launch and a ramp, a microsecond or two at batch 1). With TAILS_IN_LAST_PROGRAM off, the
combine and the norm are kernels of their own (`decode_attention` without counters, `matvec`, `rms_norm`): seven.

Rounding follows the eager bf16 (or fp32) layer: each value the eager modules round to the model's dtype is
rounded here too (the norm's output, q/k/v, each rotary product and sum, o_proj's and down_proj's sums, gate, up,
SiLU and their product, each residual sum); sums and softmax run in fp32.

The whole layer's kernels are on by default (fused.TRITON_LAYER_AT_ONE_ROW), and the MLP's two also where the rest
of a layer is not plain (fused.TRITON_MLP_AT_ONE_ROW). Measured in the engine's step by
`python bench/decode_ways.py --ways today,no-tails,triton-mlp-only,inductor-mlp`. Without Triton or CUDA
nothing here is imported. The kernels register as torch.library Triton ops, so torch.compile puts them inside the
compiled step and its CUDA graph.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

# Rows of gate/up (each with its partner in the other half) and of down_proj a program computes, and the most
# of K a program loads at once. The best of the blocks tried on an H200 at Qwen2.5-0.5B's shape
# (bench/results/generation/mlp-matvec-b1-realize-2026-11-30-h200x2.json, `triton-g2-d1-gk1024-dk8192-w4`).
GATE_UP_ROWS_PER_PROGRAM = 2
DOWN_ROWS_PER_PROGRAM = 1
MAX_BLOCK_K = 8192
WARPS = 4
# q/k/v: rotary pairs (row i and row i + head_dim/2 of a head) a program computes, at most (a power of two that
# divides head_dim/2); columns of the KV cache an attention program reads (its block).
QKV_PAIRS_PER_PROGRAM = 4
ATTENTION_BLOCK_COLUMNS = 64
# Attention's combine and the post-attention norm done by the last program of the kernel before them (attention's
# partials, o_proj's matvec), not as kernels of their own: five kernels a layer, not seven. Set it before the
# process's first compiled step: on an H200 a process that compiled the step with it off and then with it on failed
# the second compile ("Attempted to unset UNKNOWN_MODE" from torch's handling of user Triton kernels; a guess, not
# tested: the same `attention_partials_kernel` served an op that mutates nothing, then one that mutates the
# counters), where each alone compiles (bench/RESULTS.md, "the five kernels' closeness").
TAILS_IN_LAST_PROGRAM = True
# Programmatic dependent launch (Hopper and later): each kernel is launched while the one before it ends, loads its
# first block of weights, and only then waits for the one before (triton_kernels.wait_for_the_kernel_before), which
# hides part of each kernel's launch and ramp (five a layer, 120 a step). torch.compile's path for user Triton kernels
# passes no `launch_pdl`, so with this on the ops are opaque custom ops that launch their kernels themselves (the
# compiled step calls them; the engine's CUDA graph records the launches with their programmatic edges). Off until
# measured: `python bench/decode_ways.py --ways today,pdl`. Set it before the process's first compiled step, as above.
PROGRAMMATIC_DEPENDENT_LAUNCH = False


def register(device: torch.device) -> bool:
    """Register the ops (once a process) where they can run, a CUDA device with Triton: whether they can. Call
    it outside compiled code; compiled code then calls the functions below."""
    return device.type == "cuda" and _registered()


@functools.cache
def _registered() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        _register()
    except Exception as error:  # a Triton or torch.library this code was not written for: Inductor's code stays
        warnings.warn(f"the one-row Triton kernels are unavailable: {type(error).__name__}: {error}", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


def silu_gate_up(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) of one row x [..., K] (one row in all), gate_up_weight [2N, K] the gate's
    rows then the up's: [..., N] in x's dtype."""
    return torch.ops.gpuscale.silu_gate_up(x, gate_up_weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One row x [..., K] through transformers' Llama-style RMSNorm of `weight` and `eps`, in x's dtype."""
    return torch.ops.gpuscale.rms_norm(x, weight, eps)


def matvec(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T of one row x [..., K], weight [N, K]: [..., N] in x's dtype; plus `residual` [..., N] if given."""
    return torch.ops.gpuscale.matvec(x, weight, residual)


def norm_qkv_rotary(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                    qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, write_col: torch.Tensor) -> torch.Tensor:
    """One row's hidden state [..., K] RMS-normed, through q/k/v ([q_heads + 2 kv_heads) * head_dim, K], the
    bias if any), rotary on q and k (cos, sin [..., head_dim] at the row's position): k and v written into the
    cache `keys`/`values` [1, kv_heads, columns, head_dim] at column write_col [1]; q returned, [q_heads * head_dim]."""
    return torch.ops.gpuscale.norm_qkv_rotary(hidden, norm_weight, eps, qkv_weight, qkv_bias, cos, sin, keys,
                                              values, write_col)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float, counters: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for one row: query [q_heads * head_dim], keys/values [1, kv_heads, columns,
    head_dim] (query head h reads kv head h // (q_heads / kv_heads)), mask [..., visible] additive over the first
    `visible` columns: [q_heads * head_dim] in the query's dtype. Given `counters` (int32 [q_heads], zeros, left at
    zeros: `tail_counters`), each head's last block program combines the head's blocks, one kernel in all."""
    if counters is None:
        return torch.ops.gpuscale.decode_attention(query, keys, values, mask, scale)
    return torch.ops.gpuscale.decode_attention_combined_in_last(query, keys, values, mask, scale, counters)


def matvec_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = x W^T + residual of one row (`matvec`, then `rms_norm` of `norm_weight` and `eps`),
    one kernel: its last program to finish normalizes (counter: int32 [1], zero, left at zero: `tail_counters`)."""
    return torch.ops.gpuscale.matvec_norm(x, weight, residual, norm_weight, eps, counter)


def tail_counters(heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed counters that `decode_attention` (one a head) and `matvec_norm` (one) need when each kernel's
    last program does a tail (TAILS_IN_LAST_PROGRAM); every kernel leaves them at zero, so one pair serves every
    layer of a step, the kernels running one after another."""
    return (torch.zeros(heads, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device))


def _check_cache(keys: torch.Tensor, values: torch.Tensor) -> None:
    """The kernels address the cache as one row of [kv_heads, columns, head_dim], each column's head_dim together."""
    for cache in (keys, values):
        if cache.shape[0] != 1 or cache.stride(-1) != 1 or cache.stride(-2) != cache.shape[-1]:
            raise ValueError(f"KV cache of shape {tuple(cache.shape)}, strides {cache.stride()}: not one row with "
                             "contiguous columns")
    if keys.stride() != values.stride():
        raise ValueError("keys and values are laid out differently")


def _op_and_launcher(programmatic: bool):
    """(op, launch): how `_register` declares an op (a decorator taking the op's name and mutated arguments) and
    launches a kernel (`launch(kernel, grid)(*args, **meta)`). Without programmatic launch: torch.library's Triton
    ops, which torch.compile traces into, their kernels launched through wrap_triton. With it: opaque custom ops whose
    fake (shapes only) is the same function with its launches skipped, their kernels launched by Triton itself with
    `launch_pdl` and the kernels' USE_PDL (not in Triton's interpreter, which runs no grid dependency control)."""
    import os

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.library import custom_op, triton_op, wrap_triton

    if not programmatic:
        def through_torch(kernel, grid):
            launcher = wrap_triton(kernel)[grid]
            return lambda *args, **meta: launcher(*args, USE_PDL=False, **meta)
        return triton_op, through_torch

    def opaque(name: str, mutates_args: tuple[str, ...]):
        def declare(fn):
            declared = custom_op(name, mutates_args=mutates_args)(fn)
            declared.register_fake(fn)
            return declared
        return declare

    programmatic_meta = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"USE_PDL": True, "launch_pdl": True}

    def by_triton(kernel, grid):
        def run(*args, **meta):
            if not any(isinstance(arg, FakeTensor) for arg in args):  # a fake call computes shapes only
                kernel[grid](*args, **{"USE_PDL": False, **programmatic_meta, **meta})
        return run
    return opaque, by_triton


def _register() -> None:
    """The kernels (compiled by Triton at their first launch) and their torch.library ops: Triton ops that
    torch.compile traces into, or with PROGRAMMATIC_DEPENDENT_LAUNCH opaque custom ops (`_op_and_launcher`)."""
    import triton

    from .triton_kernels import (
        PROGRAMMATIC_LAUNCH_AVAILABLE,
        attention_combine_kernel,
        attention_partials_kernel,
        matvec_kernel,
        matvec_norm_kernel,
        norm_qkv_rotary_kernel,
        rms_norm_kernel,
        silu_gate_up_kernel,
    )

    if PROGRAMMATIC_DEPENDENT_LAUNCH and not PROGRAMMATIC_LAUNCH_AVAILABLE:  # a launch_pdl without the kernels'
        # wait would let each kernel read its input before the one before had written it
        warnings.warn("PROGRAMMATIC_DEPENDENT_LAUNCH: this Triton has no grid dependency control (triton.language."
                      "extra.cuda.gdc_wait): the kernels launch through torch.compile", RuntimeWarning, stacklevel=3)
    op, launch = _op_and_launcher(PROGRAMMATIC_DEPENDENT_LAUNCH and PROGRAMMATIC_LAUNCH_AVAILABLE)

    def block_k(k: int, most: int = MAX_BLOCK_K) -> int:
        """The K a program loads at once (a norm's kernels, which also hold the norm's input, at most 2,048)."""
        return min(triton.next_power_of_2(k), most)

    @op("gpuscale::silu_gate_up", mutates_args=())
    def silu_gate_up_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        n_out, k = weight.shape[0] // 2, weight.shape[1]
        out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(n_out, GATE_UP_ROWS_PER_PROGRAM),)
        launch(silu_gate_up_kernel, grid)(x, weight, out, n_out, k, BLOCK_N=GATE_UP_ROWS_PER_PROGRAM,
                                          BLOCK_K=block_k(k), num_warps=WARPS)
        return out

    @op("gpuscale::rms_norm", mutates_args=())
    def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        k = x.shape[-1]
        launch(rms_norm_kernel, (1,))(x, weight, out, eps, k, BLOCK_K=block_k(k, 2048), num_warps=WARPS)
        return out

    @op("gpuscale::matvec", mutates_args=())
    def matvec_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        n_out, k = weight.shape
        out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
        residual = None if residual is None else residual.contiguous()
        grid = (triton.cdiv(n_out, DOWN_ROWS_PER_PROGRAM),)
        launch(matvec_kernel, grid)(x, weight, out, out if residual is None else residual, n_out, k,
                                    BLOCK_N=DOWN_ROWS_PER_PROGRAM, BLOCK_K=block_k(k),
                                    HAS_RESIDUAL=residual is not None, num_warps=WARPS)
        return out

    @op("gpuscale::matvec_norm", mutates_args=("counter",))
    def matvec_norm_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight, residual = x.contiguous(), weight.contiguous(), residual.contiguous()
        n_out, k = weight.shape
        out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
        normed = torch.empty_like(out)
        grid = (triton.cdiv(n_out, DOWN_ROWS_PER_PROGRAM),)
        launch(matvec_norm_kernel, grid)(x, weight, out, residual, norm_weight, normed, counter, eps, n_out, k,
                                         BLOCK_N=DOWN_ROWS_PER_PROGRAM, BLOCK_K=block_k(k),
                                         NORM_BLOCK=block_k(n_out, 2048), num_warps=WARPS)
        return out, normed

    @op("gpuscale::norm_qkv_rotary", mutates_args=("keys", "values"))
    def norm_qkv_rotary_op(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                           qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, write_col: torch.Tensor) -> torch.Tensor:
        hidden, qkv_weight = hidden.contiguous(), qkv_weight.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        kv_heads, head_dim = keys.shape[1], keys.shape[-1]
        _check_cache(keys, values)
        q_heads = qkv_weight.shape[0] // head_dim - 2 * kv_heads
        pairs = math.gcd(head_dim // 2, QKV_PAIRS_PER_PROGRAM)
        query = torch.empty(q_heads * head_dim, dtype=hidden.dtype, device=hidden.device)
        grid = ((q_heads + 2 * kv_heads) * (head_dim // 2) // pairs,)
        k = hidden.shape[-1]
        launch(norm_qkv_rotary_kernel, grid)(
            hidden, norm_weight, eps, qkv_weight, qkv_weight if qkv_bias is None else qkv_bias, cos, sin, query,
            keys, values, write_col, keys.stride(1), q_heads, kv_heads, k, head_dim, PAIRS=pairs,
            BLOCK_K=block_k(k, 2048), HAS_BIAS=qkv_bias is not None, num_warps=WARPS)
        return query

    def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                  counters: torch.Tensor | None) -> torch.Tensor:
        """The partials' kernel, then the combine's, or (given counters) the partials' alone, combining in each
        head's last program."""
        kv_heads, head_dim = keys.shape[1], keys.shape[-1]
        _check_cache(keys, values)
        q_heads = query.numel() // head_dim
        mask = mask.reshape(-1).contiguous()
        columns, block_d = mask.numel(), triton.next_power_of_2(head_dim)
        blocks = triton.cdiv(columns, ATTENTION_BLOCK_COLUMNS)
        best, total = (torch.empty(q_heads * blocks, dtype=torch.float32, device=query.device) for _ in range(2))
        acc = torch.empty(q_heads * blocks * block_d, dtype=torch.float32, device=query.device)
        out = torch.empty_like(query)
        combine_in_last = counters is not None
        launch(attention_partials_kernel, (q_heads, blocks))(
            query, keys, values, mask, best, total, acc, counters if combine_in_last else best, out, columns, scale,
            keys.stride(1), q_heads // kv_heads, head_dim, BLOCK_D=block_d, BLOCK_C=ATTENTION_BLOCK_COLUMNS,
            BLOCK_B=triton.next_power_of_2(blocks), COMBINE_IN_LAST=combine_in_last, num_warps=WARPS)
        if not combine_in_last:
            launch(attention_combine_kernel, (q_heads,))(best, total, acc, out, blocks, head_dim, BLOCK_D=block_d,
                                                         BLOCK_B=triton.next_power_of_2(blocks), num_warps=WARPS)
        return out

    @op("gpuscale::decode_attention", mutates_args=())
    def decode_attention_op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
        return attention(query, keys, values, mask, scale, None)

    @op("gpuscale::decode_attention_combined_in_last", mutates_args=("counters",))
    def decode_attention_combined_in_last_op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                             mask: torch.Tensor, scale: float, counters: torch.Tensor) -> torch.Tensor:
        return attention(query, keys, values, mask, scale, counters)
