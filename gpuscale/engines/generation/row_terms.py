"""Per-row terms on chosen layers (EGGROLL-style population perturbations): low-rank terms on linear
layers (`RowTerm`), and per-channel scales of an output (`RowScale`, a norm's perturbed gain).

The batch rows are split into G contiguous groups of equal size; group g's rows see the linear layer
W + scale * up[g] @ down[g]^T, i.e. every forward through the layer adds

    y[rows of g] += scale * (x[rows of g] @ down[g]) @ up[g]^T

(two small batched matmuls, never a materialised weight); a `RowScale` multiplies group g's rows of
the output by factors[g] channel by channel (an RMSNorm y = g * n(x) whose gain becomes g + d[g] is
y * (1 + d[g] / g): one multiply). The term's tensors are read at their
addresses on every forward, including the replay of a captured CUDA graph: the caller refills them
in place (`term.down.copy_(...)`, `term.scale.fill_(...)`) between engine calls. Replacing them by
new tensors works too, but costs a recapture.

Terms act during engine calls only: the hooks that add them do nothing when the model runs outside
the engine (a training step, a teacher-forced score), so the model itself stays unperturbed.

Two ways to add a term (the engine's `fuse_row_terms`), in the decode steps and in the prefill:
- hooks (the default): after each projection's matmul, its terms in place (`add_into`): a batched
  matmul x @ down[g] reading x again, then the up side as a read-modify-write of the whole output;
- in the projections (`added`): each projection and its terms as one out-of-place expression in the
  fused decode forward, written, when compiled, as sums of products that Inductor fuses into the
  kernels already around the matmul (the norm that writes x, the rotary/KV write of q/k/v, the
  SiLU-mul of gate/up, the residual adds), or into a Triton GEMM's epilogue under max-autotune.
  Run eagerly it is add_into's arithmetic out of place: the gain needs `compile`. The prefill then
  runs through the same fused wiring over all its tokens (`_FusedDecode.prefill`).
Why, in bytes a decode step at Qwen2.5-0.5B's shape (hidden 896, intermediate 4,864, 24 layers,
bf16), 512 members x 16 prompts = 8,192 rows, rank 1. A layer's 7 terms have inputs summing to
10,240 columns and outputs to 12,672. Plain decode reads 0.72 GB of weights and about 8 GB of the
projections' inputs and outputs (KV and logits besides). The hooks add, a layer, x read again
(8,192 x 10,240 x 2 B = 168 MB) and each output read and written again (2 x 8,192 x 12,672 x 2 B
= 415 MB): 14.5 GB a step, in generic broadcast kernels that run at about a quarter of the
bandwidth (bench/RESULTS.md: 0.72 of plain inference). In the projections, compiled, the output's
round trip goes (the term is added where the output is read anyway); left are the factors
(512 x (10,240 + 12,672) x 2 B = 23 MB a layer, 0.56 GB a step) and at most one more read of each
distinct input where Inductor does not fuse the down products with its producer (124 MB a layer).
Not chosen: one GEMM over [x | Z] against [W ; U] (Z: each row's x @ down[g] in its member's
column). It saves the round trip but grows the GEMMs' inner size by G x r = 512 per term (+57% of
the 896-input projections' FLOPs, 2.5 TFLOP a step, 3 ms on an H200's ~800 TFLOP/s, more than the
round trip costs at full bandwidth: 2 ms): at 8,192 rows the projections are compute-bound (500-750
FLOP a byte against the card's ~200). The compiled form gets a member-grouped epilogue's bytes
without a kernel of our own.
The prefill, in the same bytes: the same 8,192 rows x 48 columns (the longest of bench/eggroll.py's
16 prompts has 49 tokens; all but the last go in) = 393,216 tokens, each member's rows 768 tokens.
The terms' arithmetic is nothing (2 x 393,216 x 22,912 columns x r = 18 GFLOP a layer, against the
projections' 11.7 TFLOP) and their Python is 217 hooks a call (a few ms). Their bytes are not: the
hooks read x again (393,216 x 10,240 x 2 B = 8.1 GB a layer), read and write every output again
(2 x 393,216 x 12,672 x 2 B = 19.9 GB) and the norms' scales theirs (2.8 GB): 31 GB a layer, 0.74 TB
a prefill, 0.15 s even at the H200's full 4.8 TB/s, where 0.51 s were measured (bench/RESULTS.md: a
call of one token, 1.67 s with the terms against 1.16 s without; the broadcast kernels at about 30%
of the bandwidth). Compiled in the projections, the outputs' round trip goes (each output is read
anyway: by the rotary embedding, the KV write, the SiLU-mul, the residual add) and the down products
at most re-read a layer's four distinct inputs (393,216 x 7,552 x 2 B = 5.9 GB a layer, 30 ms a
prefill at full bandwidth) where Inductor does not fuse them into their producers; the norms' scales,
hooks traced into the compiled forward, become a multiply in the norm's kernel. Batched matmuls over
(member, tokens) would still write and re-read each [tokens, out] term; one GEMM over [x | Z] would
add 57% to the 896-input projections' FLOPs, and the prefill is compute-bound (393,216 rows).
With the recipe's antithetic pairs, a group is a pair (`mirrored`: its second half subtracts the term), so the
factors above are half as many: 256 groups, not 512.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


class RowTerm:
    """down [G, in_features, r], up [G, out_features, r], scale a float or a 0-dim tensor.

    A float scale becomes a 0-dim fp32 tensor on down's device, so it too can be changed in place
    (`term.scale.fill_(0.5)`) without recapturing CUDA graphs.

    `mirrored`: each group's rows are two halves, the first adding the term and the second subtracting it
    (antithetic pairs of members, +E and -E, one group a pair): the pair's factors are stored and read once.
    At 8,192 members, one row each, every decode step reads every member's factors (about 9 GB a step at
    Qwen2.5-0.5B's shape): mirrored, half of that.
    """

    def __init__(self, down: torch.Tensor, up: torch.Tensor, scale: float | torch.Tensor = 1.0,
                 mirrored: bool = False):
        if down.dim() != 3 or up.dim() != 3 or down.shape[0] != up.shape[0] or down.shape[2] != up.shape[2]:
            raise ValueError(f"need down [G, in, r] and up [G, out, r]; got {tuple(down.shape)} and "
                             f"{tuple(up.shape)}")
        if down.device != up.device or down.dtype != up.dtype:
            raise ValueError("down and up must share a device and a dtype")
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32, device=down.device)
        if scale.dim() != 0 or scale.device != down.device:
            raise ValueError("scale must be a float or a 0-dim tensor on down's device")
        self.down, self.up, self.scale = down, up, scale
        self.mirrored = mirrored

    @property
    def groups(self) -> int:
        return self.down.shape[0]

    def rows_alike(self, batch: int) -> int:
        """Rows of a batch that see the same term: a group's, or half a group's where mirrored."""
        return batch // self.groups // (2 if self.mirrored else 1)

    def add_into(self, output: torch.Tensor, x: torch.Tensor) -> None:
        """output += scale * (x_g @ down[g]) @ up[g]^T for every group g, in place. Batch rows of a
        group are contiguous, so the group's rows (and all their tokens) are one block of x and of
        the output. The second product is accumulated straight into the output instead of a term
        tensor added to it, which halves the memory traffic on the [B, ..., out] side, the large one.
        `output` may be a slice of a fused projection's output."""
        low_rank = self._low_rank(x)
        grouped_output = output.view(self.groups, -1, output.shape[-1])
        if self.down.shape[2] == 1:
            # At rank 1 the second product is an outer product: as a batched matmul (inner size 1)
            # cuBLAS runs it on a slow fp32 kernel (MAGMA's sgemmEx, the largest entry of the
            # population's kernel profile on an H200); an elementwise multiply-add reads and writes
            # the output once (bench/row_terms.py: `bmm_outer` against `bmm`).
            grouped_output.addcmul_(low_rank, self.up.transpose(1, 2))
        else:
            grouped_output.baddbmm_(low_rank, self.up.transpose(1, 2))

    def added(self, output: torch.Tensor, x: torch.Tensor, token_rows: torch.Tensor | None = None) -> torch.Tensor:
        """output + scale * (x_g @ down[g]) @ up[g]^T for every group g, as a new tensor (`add_into`'s
        sum out of place): how the fused decode forward puts the term inside its projection
        (`fuse_row_terms`). Under torch.compile it is sums of products in fp32, rounded once, which
        Inductor fuses with what reads the output (module docstring); run eagerly, add_into's kernels.
        `token_rows` [B, Q]: each token's batch row, given by the compiled prefill (`_fp32_term_of_rows`)."""
        if torch.compiler.is_compiling() and token_rows is not None:
            return (output.float() + self._fp32_term_of_rows(x, token_rows)).to(output.dtype)
        grouped_output = output.reshape(self.groups, -1, output.shape[-1])
        if torch.compiler.is_compiling():
            summed = (grouped_output.float() + self._fp32_term(x)).to(output.dtype)
        elif self.down.shape[2] == 1:
            summed = torch.addcmul(grouped_output, self._low_rank(x), self.up.transpose(1, 2))
        else:
            summed = torch.baddbmm(grouped_output, self._low_rank(x), self.up.transpose(1, 2))
        return summed.view(output.shape)

    def _low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """scale * x_g @ down[g]: [G, rows a group, r] (its second half negated where mirrored)."""
        return self._mirror(torch.bmm(x.reshape(self.groups, -1, x.shape[-1]), self.down) * self.scale)

    def _mirror(self, low_rank: torch.Tensor) -> torch.Tensor:
        """low_rank [G, rows a group, r] with the second half of each group's rows negated, where mirrored: the
        term's sign is carried by this small tensor, never by the output."""
        if not self.mirrored:
            return low_rank
        # The halves as one view times (+1, -1), not a cat of the two halves: the cat (two slices, then a copy) made
        # the 8,192-member decode slower than storing every member's factors (bench/RESULTS.md, eggroll's share
        # with pairs). The signs come from arange, not torch.tensor: no host copy inside a CUDA graph's capture.
        signs = 1 - 2 * torch.arange(2, dtype=low_rank.dtype, device=low_rank.device)
        return (low_rank.unflatten(1, (2, -1)) * signs[None, :, None, None]).flatten(1, 2)

    def _fp32_term(self, x: torch.Tensor) -> torch.Tensor:
        """scale * (x_g @ down[g]) @ up[g]^T in fp32, [G, rows a group, out], as broadcast products
        summed over in and over r: no matmul, so that Inductor makes it a reduction fused with the
        kernels around it, where a batched matmul of inner or outer size r would be a cuBLAS call of
        its own (and a slow one: bench/RESULTS.md, the rank-1 `sgemmEx`)."""
        grouped_x = x.reshape(self.groups, -1, 1, x.shape[-1]).float()  # [G, n, 1, in]
        down = self.down.transpose(1, 2)[:, None].float()  # [G, 1, r, in]
        low_rank = self._mirror((grouped_x * down).sum(-1) * self.scale)  # [G, n, r]
        up = self.up.transpose(1, 2)[:, None].float()  # [G, 1, r, out]
        return (low_rank[..., None] * up).sum(-2)

    def _fp32_term_of_rows(self, x: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
        """`_fp32_term` for x [B, Q, in] whose width Q is a symbolic size (the compiled prefill), [B, Q, out]:
        each token's factors are gathered by its member, `token_rows // (B / G)`, a division by a
        constant of a loaded number. Grouped as [G, B / G * Q, ...], every element's kernel would find
        its group by dividing its flat index by a multiple of Q: a 64-bit division by a runtime value
        on a GPU, which left the prefill's fused kernels far slower than their bytes allow (bench/RESULTS.md,
        eggroll: the prefill's profile and the share after this change)."""
        members = token_rows // (x.shape[0] // self.groups)  # [B, Q]
        down = self.down.transpose(1, 2).float()[members]  # [B, Q, r, in], gathered where it is read
        low_rank = (x[..., None, :].float() * down).sum(-1) * self.scale  # [B, Q, r]
        if self.mirrored:
            low_rank = low_rank * _half_signs(token_rows, x.shape[0] // self.groups)[..., None]
        up = self.up.transpose(1, 2).float()[members]  # [B, Q, r, out]
        return (low_rank[..., None] * up).sum(-2)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.down, self.up, self.scale

    def check_module(self, module: torch.nn.Module) -> None:
        in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if in_features is None or out_features is None:
            raise ValueError(f"{type(module).__name__} is not a linear layer (no in/out_features)")
        if (self.down.shape[1], self.up.shape[1]) != (in_features, out_features):
            raise ValueError(f"term of shapes down {tuple(self.down.shape)}, up {tuple(self.up.shape)} "
                             f"does not fit a linear layer {in_features} -> {out_features}")


def _half_signs(token_rows: torch.Tensor, rows_a_group: int) -> torch.Tensor:
    """+1 for a token of the first half of its group's rows, -1 for the second half (a mirrored term's sign)."""
    return torch.where(token_rows % rows_a_group < rows_a_group // 2, 1.0, -1.0)


class RowScale:
    """factors [G, channels]: group g's rows of the module's output are multiplied by factors[g].

    `mirrored` (as RowTerm's): the second half of each group's rows by 2 - factors[g], the mirror of factors[g] =
    1 + d about 1 (a norm's gain g + d, then g - d, as n(x) g (1 + d / g) and n(x) g (1 - d / g))."""

    def __init__(self, factors: torch.Tensor, mirrored: bool = False):
        if factors.dim() != 2:
            raise ValueError(f"need factors [G, channels]; got {tuple(factors.shape)}")
        self.factors = factors
        self.mirrored = mirrored

    @property
    def groups(self) -> int:
        return self.factors.shape[0]

    def rows_alike(self, batch: int) -> int:
        return batch // self.groups // (2 if self.mirrored else 1)

    def add_into(self, output: torch.Tensor, x: torch.Tensor) -> None:
        """output[rows of g] *= factors[g], in place (x, the module's input, is not needed)."""
        grouped = output.view(self.groups, -1, output.shape[-1])
        if not self.mirrored:
            grouped.mul_(self.factors[:, None, :])
            return
        # one product over the group's two halves (factors, then their mirror), not one a half
        mirrored = torch.stack([self.factors, 2 - self.factors], dim=1)  # [G, 2, channels]
        grouped.view(self.groups, 2, -1, grouped.shape[-1]).mul_(mirrored[:, :, None, :])

    def scaled_by_row(self, output: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
        """`add_into`'s product out of place for output [B, Q, channels] whose width Q is a symbolic size
        (the compiled prefill): each token's factors gathered by its member (`RowTerm._fp32_term_of_rows`
        says why)."""
        rows_a_group = output.shape[0] // self.groups
        factors = self.factors[token_rows // rows_a_group]
        if self.mirrored:  # 1 + signs x (factors - 1): factors, or 2 - factors
            factors = 1 + _half_signs(token_rows, rows_a_group)[..., None] * (factors - 1)
        return (output * factors).to(output.dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.factors,)

    def check_module(self, module: torch.nn.Module) -> None:
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 1 or weight.shape[0] != self.factors.shape[1]:
            raise ValueError(f"{type(module).__name__} has no gain vector of {self.factors.shape[1]} channels "
                             "for a row scale")


class RowTermHandle:
    """What `GenerationEngine.add_row_term` returns: `remove()` takes those terms off again."""

    def __init__(self, registry: RowTerms, entries: list):
        self._registry, self._entries = registry, entries

    def remove(self):
        self._registry.remove(self._entries)
        self._entries = []


class RowTerms:
    """The engine's terms and scales: one forward hook per (module, term), active only inside engine calls."""

    def __init__(self):
        self.entries: list[tuple[torch.nn.Module, RowTerm | RowScale, torch.utils.hooks.RemovableHandle]] = []
        self.active = False

    def add(self, modules: Sequence[torch.nn.Module], term: RowTerm | RowScale) -> RowTermHandle:
        for module in modules:
            term.check_module(module)
        added = [(module, term, module.register_forward_hook(self._hook(term))) for module in modules]
        self.entries += added
        return RowTermHandle(self, added)

    def _hook(self, term: RowTerm | RowScale):
        def add_term(module, args, output):
            if self.active:  # outside engine calls the model is left as it is
                term.add_into(output, args[0])

        return add_term

    def remove(self, entries):
        for entry in entries:
            if entry in self.entries:
                entry[2].remove()
                self.entries.remove(entry)

    def clear(self):
        self.remove(list(self.entries))

    def of(self, module: torch.nn.Module) -> list[RowTerm | RowScale]:
        return [term for m, term, _ in self.entries if m is module]

    def hook_ids(self) -> set[int]:
        return {handle.id for _, _, handle in self.entries}

    def signature(self) -> tuple:
        """Changes when a term is added or removed, or one of its tensors is replaced (captured graphs
        hold the old addresses)."""
        return tuple((id(m), id(term), *(t.data_ptr() for t in term.tensors())) for m, term, _ in self.entries)

    def check_batch(self, batch: int):
        for _, term, _ in self.entries:
            parts = term.groups * (2 if term.mirrored else 1)
            if batch % parts:
                raise ValueError(f"a row term has {term.groups} groups{', each two halves' if term.mirrored else ''}"
                                 f": the batch ({batch} rows) must split into {parts} parts of equal size")

    def share_prefill(self, batch: int, samples_per_prompt: int) -> bool:
        """A prompt's prefill can be shared by its k samples only if they all see the same term."""
        return all(term.rows_alike(batch) % samples_per_prompt == 0 for _, term, _ in self.entries)

    @contextlib.contextmanager
    def activated(self):
        before, self.active = self.active, True
        try:
            yield
        finally:
            self.active = before
