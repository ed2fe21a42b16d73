"""Batch-1 decode's MLP as two hand-written Triton matrix-vector kernels, for the compiled one-row step.

Why by hand: at one row the MLP's matmuls are matrix-vector products that read the weights once. Written as
reductions, Inductor computes the SiLU-times-up input of down_proj again inside each of its rows (its default
inlines a cheap producer into every reduction row that broadcasts it), and down_proj then runs at about a fifth
of the card's bandwidth (bench/mlp_matvec.py, bench/RESULTS.md). Here gate/up and their SiLU-times-up are one
kernel that stores its output once; down_proj is a second that reads it. Rounding follows the eager bf16 (or
fp32) MLP: gate and up rounded to the model's dtype, SiLU rounded, the product rounded, down_proj's sum
rounded.

On by default (fused.TRITON_MLP_AT_ONE_ROW); measured in the engine's step by `python bench/decode_ways.py
--ways today,inductor-mlp`. Without Triton or CUDA nothing here is imported.
The kernels register as torch.library Triton ops, so torch.compile puts them inside the compiled step and
its CUDA graph.
"""

from __future__ import annotations

import functools
import warnings

import torch

# Rows of gate/up (each with its partner in the other half) and of down_proj a program computes, and the most
# of K a program loads at once. The best of the blocks tried on an H200 at Qwen2.5-0.5B's shape
# (bench/results/generation/mlp-matvec-b1-realize-2026-11-30-h200x2.json, `triton-g2-d1-gk1024-dk8192-w4`).
GATE_UP_ROWS_PER_PROGRAM = 2
DOWN_ROWS_PER_PROGRAM = 1
MAX_BLOCK_K = 8192
WARPS = 4


def register(device: torch.device) -> bool:
    """Register the ops (once a process) where they can run, a CUDA device with Triton: whether they can. Call
    it outside compiled code; compiled code then calls `silu_gate_up` and `matvec`."""
    return device.type == "cuda" and _registered()


@functools.cache
def _registered() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        _register()
    except Exception as error:  # a Triton or torch.library this code was not written for: the MLP stays Inductor's
        warnings.warn(f"the one-row Triton MLP is unavailable: {type(error).__name__}: {error}", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


def silu_gate_up(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) of one row x [..., K] (one row in all), gate_up_weight [2N, K] the gate's
    rows then the up's: [..., N] in x's dtype."""
    return torch.ops.gpuscale.silu_gate_up(x, gate_up_weight)


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T of one row x [..., K], weight [N, K]: [..., N] in x's dtype."""
    return torch.ops.gpuscale.matvec(x, weight)


def _register() -> None:
    """The kernels (compiled by Triton at their first launch) and their torch.library ops."""
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def silu_gate_up_kernel(x_ptr, w_ptr, out_ptr, n_out, K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            both = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w_gate = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=both, other=0.0)
            w_up = tl.load(w_ptr + (rows[:, None] + n_out) * K + cols[None, :], mask=both, other=0.0)
            gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
        dtype = out_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rows, (activated * up).to(dtype), mask=row_ok)

    @triton.jit
    def matvec_kernel(x_ptr, w_ptr, out_ptr, n_out, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
            total += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)

    def block_k(k: int) -> int:
        return min(triton.next_power_of_2(k), MAX_BLOCK_K)

    @triton_op("gpuscale::silu_gate_up", mutates_args=())
    def silu_gate_up_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        n_out, k = weight.shape[0] // 2, weight.shape[1]
        out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(n_out, GATE_UP_ROWS_PER_PROGRAM),)
        wrap_triton(silu_gate_up_kernel)[grid](x, weight, out, n_out, k, BLOCK_N=GATE_UP_ROWS_PER_PROGRAM,
                                               BLOCK_K=block_k(k), num_warps=WARPS)
        return out

    @triton_op("gpuscale::matvec", mutates_args=())
    def matvec_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        n_out, k = weight.shape
        out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(n_out, DOWN_ROWS_PER_PROGRAM),)
        wrap_triton(matvec_kernel)[grid](x, weight, out, n_out, k, BLOCK_N=DOWN_ROWS_PER_PROGRAM,
                                         BLOCK_K=block_k(k), num_warps=WARPS)
        return out
