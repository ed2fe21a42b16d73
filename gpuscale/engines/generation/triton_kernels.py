"""The Triton kernels of triton_matvec.py's ops (its docstring says what each computes and why). Imported only
where Triton is installed, by `triton_matvec._register`."""

import triton
import triton.language as tl

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    PROGRAMMATIC_LAUNCH_AVAILABLE = True
except ImportError:
    PROGRAMMATIC_LAUNCH_AVAILABLE = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_for_the_kernel_before(USE_PDL: tl.constexpr):
    """With programmatic dependent launch (USE_PDL, the kernel launched with `launch_pdl`): wait until the kernel
    before has ended and its stores are visible, then let the kernel after start launching. What a program does
    before this may read only what no kernel of the step writes (the weights), and may store nothing: the kernel
    before may still be reading the memory a store would reuse. Without USE_PDL, nothing (the launch itself waited)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def rounded(value, dtype: tl.constexpr):
    """`value` rounded to the model's dtype, back in fp32: where the eager modules round, this does."""
    return value.to(dtype).to(tl.float32)


@triton.jit
def rms_normed(h_ptr, norm_ptr, cols, col_ok, inv_rms, dtype: tl.constexpr, CACHE: tl.constexpr):
    """Columns `cols` of the norm's output, as transformers' Llama/Qwen2 RMSNorm computes it. CACHE: the load's
    cache modifier (".cg", from L2, where other programs of the same kernel wrote h)."""
    h = tl.load(h_ptr + cols, mask=col_ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
    weight = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return rounded(weight * rounded(h * inv_rms, dtype), dtype)


@triton.jit
def inverse_rms(h_ptr, eps, K, BLOCK_K: tl.constexpr, CACHE: tl.constexpr):
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + cols, mask=cols < K, other=0.0, cache_modifier=CACHE).to(tl.float32)
        squares += h * h
    # fp32 whatever eps arrives as (Inductor passes a Python float as fp64)
    return (1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)).to(tl.float32)


@triton.jit
def silu_gate_up_kernel(x_ptr, w_ptr, out_ptr, n_out, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_out
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        both = row_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=both, other=0.0)
        w_up = tl.load(w_ptr + (rows[:, None] + n_out) * K + cols[None, :], mask=both, other=0.0)
        if start == 0:  # the first block's weights on their way while the kernel before ends
            wait_for_the_kernel_before(USE_PDL)
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    gate = rounded(gate, dtype)
    activated = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + rows, (activated * rounded(up, dtype)).to(dtype), mask=row_ok)


@triton.jit
def store_rms_norm(h_ptr, norm_ptr, out_ptr, eps, K, BLOCK_K: tl.constexpr, CACHE: tl.constexpr):
    """The norm of one row h [K] stored into out, by one program."""
    inv_rms = inverse_rms(h_ptr, eps, K, BLOCK_K, CACHE)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        normed = rms_normed(h_ptr, norm_ptr, cols, col_ok, inv_rms, out_ptr.dtype.element_ty, CACHE)
        tl.store(out_ptr + cols, normed.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def rms_norm_kernel(h_ptr, norm_ptr, out_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One program: the norm of one row, stored once (gate/up's thousands of programs then read it, rather than
    each computing it again)."""
    wait_for_the_kernel_before(USE_PDL)
    store_rms_norm(h_ptr, norm_ptr, out_ptr, eps, K, BLOCK_K, "")


@triton.jit
def last_program(counter_ptr, programs):
    """Whether this program is the last of `programs` to get here (all of them count on `counter_ptr`, which starts
    at 0 and is left at 0 by that last program): once it knows, every other program's stores before the count are
    visible to it through L2 (".cg" loads). How a kernel does a small tail over all its programs' output without a
    kernel of its own (a launch, a few microseconds at batch 1)."""
    tl.debug_barrier()  # every thread's stores of this program issued before the count (atomics are acq_rel)
    last = tl.atomic_add(counter_ptr, 1) == programs - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def matvec_kernel(x_ptr, w_ptr, out_ptr, residual_ptr, n_out, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    matvec_rows(x_ptr, w_ptr, out_ptr, residual_ptr, n_out, K, BLOCK_N, BLOCK_K, HAS_RESIDUAL, USE_PDL)


@triton.jit
def matvec_norm_kernel(x_ptr, w_ptr, out_ptr, residual_ptr, norm_ptr, normed_ptr, counter_ptr, eps, n_out,
                       K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """matvec_kernel with its residual, then the last program to finish stores the norm of the whole output."""
    matvec_rows(x_ptr, w_ptr, out_ptr, residual_ptr, n_out, K, BLOCK_N, BLOCK_K, True, USE_PDL)
    if last_program(counter_ptr, tl.num_programs(0)):
        store_rms_norm(out_ptr, norm_ptr, normed_ptr, eps, n_out, NORM_BLOCK, ".cg")


@triton.jit
def matvec_rows(x_ptr, w_ptr, out_ptr, residual_ptr, n_out, K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_out
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if start == 0:  # the first block's weights on their way while the kernel before ends
            wait_for_the_kernel_before(USE_PDL)
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        total += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_RESIDUAL:
        total = rounded(total, dtype) + tl.load(residual_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, total.to(dtype), mask=row_ok)


@triton.jit
def norm_qkv_rotary_kernel(h_ptr, norm_ptr, eps, w_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, col_ptr,
                           head_stride, q_heads, kv_heads, K: tl.constexpr, D: tl.constexpr,
                           PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           USE_PDL: tl.constexpr):
    # Program p: PAIRS rotary pairs of one head, rows `low` and `low + D/2` of the fused q/k/v weight.
    dtype = q_ptr.dtype.element_ty
    half: tl.constexpr = D // 2
    programs_a_head: tl.constexpr = half // PAIRS
    head = tl.program_id(0) // programs_a_head
    dims = (tl.program_id(0) % programs_a_head) * PAIRS + tl.arange(0, PAIRS)  # within the head's first half
    low, high = head * D + dims, head * D + dims + half
    first = tl.arange(0, BLOCK_K)  # the first block's weights on their way while the kernel before ends
    first_low = tl.load(w_ptr + low[:, None] * K + first[None, :], mask=first[None, :] < K, other=0.0)
    first_high = tl.load(w_ptr + high[:, None] * K + first[None, :], mask=first[None, :] < K, other=0.0)
    wait_for_the_kernel_before(USE_PDL)
    inv_rms = inverse_rms(h_ptr, eps, K, BLOCK_K, "")
    a = tl.zeros([PAIRS], dtype=tl.float32)
    b = tl.zeros([PAIRS], dtype=tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = rms_normed(h_ptr, norm_ptr, cols, col_ok, inv_rms, dtype, "")
        if start == 0:
            w_low, w_high = first_low, first_high
        else:
            w_low = tl.load(w_ptr + low[:, None] * K + cols[None, :], mask=col_ok[None, :], other=0.0)
            w_high = tl.load(w_ptr + high[:, None] * K + cols[None, :], mask=col_ok[None, :], other=0.0)
        a += tl.sum(w_low.to(tl.float32) * x[None, :], axis=1)
        b += tl.sum(w_high.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        a += tl.load(b_ptr + low).to(tl.float32)
        b += tl.load(b_ptr + high).to(tl.float32)
    a, b = rounded(a, dtype), rounded(b, dtype)
    # Rotary on q and k, as transformers' x * cos + rotate_half(x) * sin: each product and the sum rounded.
    if head < q_heads + kv_heads:
        cos_low = tl.load(cos_ptr + dims).to(tl.float32)
        sin_low = tl.load(sin_ptr + dims).to(tl.float32)
        cos_high = tl.load(cos_ptr + dims + half).to(tl.float32)
        sin_high = tl.load(sin_ptr + dims + half).to(tl.float32)
        a, b = (rounded(rounded(a * cos_low, dtype) + rounded(-b * sin_low, dtype), dtype),
                rounded(rounded(b * cos_high, dtype) + rounded(a * sin_high, dtype), dtype))
    at = ((head - q_heads) % kv_heads) * head_stride + tl.load(col_ptr) * D + dims  # k's or v's cache
    if head < q_heads:
        tl.store(q_ptr + low, a.to(dtype))
        tl.store(q_ptr + high, b.to(dtype))
    elif head < q_heads + kv_heads:
        tl.store(k_ptr + at, a.to(dtype))
        tl.store(k_ptr + at + half, b.to(dtype))
    else:
        tl.store(v_ptr + at, a.to(dtype))
        tl.store(v_ptr + at + half, b.to(dtype))


@triton.jit
def attention_partials_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, best_ptr, total_ptr, acc_ptr, counter_ptr, out_ptr,
                              n_cols, scale, head_stride, groups, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, COMBINE_IN_LAST: tl.constexpr,
                              USE_PDL: tl.constexpr):
    """Program (query head h, block b): softmax statistics of h's scores over columns b * BLOCK_C ... (their max,
    the sum of their exponentials from it, and those exponentials times V), for `combine_head`: with
    COMBINE_IN_LAST, by the last of h's programs to finish (h's count at counter_ptr + h), else by
    `attention_combine_kernel`. Many small programs rather than one a head walking every column: a head's blocks
    are read side by side."""
    head, block = tl.program_id(0), tl.program_id(1)
    blocks = tl.num_programs(1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    cols = block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    both = col_ok[:, None] & dim_ok[None, :]
    at = (head // groups) * head_stride + cols[:, None] * D + dims[None, :]
    wait_for_the_kernel_before(USE_PDL)  # q and this step's cache column come from the kernel before
    q = tl.load(q_ptr + head * D + dims, mask=dim_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + at, mask=both, other=0.0).to(tl.float32)
    scores = (tl.sum(k * q[None, :], axis=1) * scale).to(tl.float32)  # scale may arrive as fp64 (Inductor)
    scores += tl.load(mask_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    scores = tl.where(col_ok, scores, float("-inf"))
    best = tl.max(scores, axis=0)
    weights = tl.exp(scores - best)
    v = tl.load(v_ptr + at, mask=both, other=0.0).to(tl.float32)
    slot = head * blocks + block
    tl.store(best_ptr + slot, best)
    tl.store(total_ptr + slot, tl.sum(weights, axis=0))
    tl.store(acc_ptr + slot * BLOCK_D + dims, tl.sum(weights[:, None] * v, axis=0))
    if COMBINE_IN_LAST:
        if last_program(counter_ptr + head, blocks):
            combine_head(best_ptr, total_ptr, acc_ptr, out_ptr, head, blocks, D, BLOCK_D, BLOCK_B)


@triton.jit
def attention_combine_kernel(best_ptr, total_ptr, acc_ptr, out_ptr, blocks, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr):
    """Program h: `combine_head` of query head h."""
    wait_for_the_kernel_before(USE_PDL)
    combine_head(best_ptr, total_ptr, acc_ptr, out_ptr, tl.program_id(0), blocks, D, BLOCK_D, BLOCK_B)


@triton.jit
def combine_head(best_ptr, total_ptr, acc_ptr, out_ptr, head, blocks, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_B: tl.constexpr):
    """Query head `head`'s attention output from its blocks' statistics, rescaled to their common max (loads from
    L2: other programs of the partials' kernel may have just written them)."""
    dims = tl.arange(0, BLOCK_D)
    parts = tl.arange(0, BLOCK_B)
    part_ok = parts < blocks
    slots = head * blocks + parts
    best = tl.load(best_ptr + slots, mask=part_ok, other=float("-inf"), cache_modifier=".cg")
    scale = tl.where(part_ok, tl.exp(best - tl.max(best, axis=0)), 0.0)
    total = tl.sum(scale * tl.load(total_ptr + slots, mask=part_ok, other=0.0, cache_modifier=".cg"), axis=0)
    acc = tl.load(acc_ptr + slots[:, None] * BLOCK_D + dims[None, :], mask=part_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    out = tl.sum(scale[:, None] * acc, axis=0) / total
    tl.store(out_ptr + head * D + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)
