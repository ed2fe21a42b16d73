"""EGGROLL's per-member low-rank terms at the population's shapes: which way of adding them is fastest.

    python bench/row_terms.py                                   # GPU: Qwen2.5-0.5B's projections, bf16
    python bench/row_terms.py --device cpu --groups 4 --rows 8 --repeats 1 --calls 2 --out /tmp/r.json  # smoke

The engine adds, for every row of member g, y += scale * (x @ down[g]) @ up[g]^T to each perturbed
projection's output (engines/generation/row_terms.py, `RowTerm.add_into`). Ways timed, each on the
same output and inputs:

    engine         RowTerm.add_into as the engine runs it now (at rank 1: bmm_outer)
    bmm            the batched products (bmm, then baddbmm_ into the output); at rank 1 the second
                   is an outer product, a batched matmul of inner size 1
    bmm_outer      bmm, then at rank 1 the outer product added elementwise (addcmul_)
    bmm_blockdiag  bmm, then at rank 1 the outer products as one GEMM: [rows, G] holding each row's value
                   in its member's column (zeros elsewhere) times the members' up vectors [G, out]
    bmm_rank8      bmm with down and up padded with zero columns to rank 8 (exact; tensor cores)
    broadcast      (x * down[g]).sum(-1) per rank, then the outer product added (no matmul)
    *_compiled     each under torch.compile

Then, at rank 1, each projection with its terms: its GEMM then the engine's terms, against one GEMM
of [x | the rows' values by member] and the weight stacked on the members' up vectors (`stacked`).
On a GPU the calls are timed as the engine runs them, replayed from a CUDA graph (kernel time, not
launch time); elsewhere host-timed.

Printed: microseconds per call per projection shape, the sum over one decode step of a 24-layer
Qwen2.5-0.5B (7 projections a layer), and each way's largest error against fp32 arithmetic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from attention_decode import seconds_per_call as host_seconds_per_call  # noqa: E402  (the same timing loop)
from record import one_card, write_result  # noqa: E402

from gpuscale.engines.generation.row_terms import RowTerm  # noqa: E402

BASELINE = """No baseline of other code: it compares ways of adding the engine's per-member low-rank terms
(the engine's way, batched matmuls, an elementwise outer product, a block-diagonal GEMM, matmuls padded
to rank 8, a broadcast multiply-sum; eager and compiled) with one another at the population's shapes,
and the engine's projection-then-terms against one stacked GEMM."""

# (in, out, how many a layer) of Qwen2.5-0.5B's projections: q, k and v, o, gate and up, down.
PROJECTIONS = ((896, 896, 1), (896, 128, 2), (896, 896, 1), (896, 4864, 2), (4864, 896, 1))
LAYERS = 24


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--groups", type=int, default=256, help="population members (row groups)")
    parser.add_argument("--rows", type=int, default=4096, help="batch rows (population x prompts)")
    parser.add_argument("--tokens", type=int, default=1, help="tokens a row (1: a decode step)")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-compiled", action="store_true", help="the eager ways only (no torch.compile)")
    parser.add_argument("--out", default=None, help="default: bench/results/eggroll/row-terms-<date>-<card>.json")
    return parser.parse_args(argv)


def bmm(output, x, down, up, scale):
    groups = down.shape[0]
    low_rank = torch.bmm(x.reshape(groups, -1, x.shape[-1]), down) * scale
    output.view(groups, -1, output.shape[-1]).baddbmm_(low_rank, up.transpose(1, 2))


def broadcast(output, x, down, up, scale):
    groups = down.shape[0]
    grouped_x = x.reshape(groups, -1, 1, x.shape[-1])  # [G, n, 1, in]
    low_rank = (grouped_x * down.transpose(1, 2)[:, None]).sum(-1) * scale  # [G, n, r]
    grouped = output.view(groups, -1, output.shape[-1])
    grouped += (low_rank[..., None] * up.transpose(1, 2)[:, None]).sum(2)  # [G, n, out]


def padded(rank: int):
    def pad(tensor):
        return torch.nn.functional.pad(tensor, (0, rank - tensor.shape[-1])) if tensor.shape[-1] < rank else tensor

    def add(output, x, down, up, scale):
        bmm(output, x, pad(down), pad(up), scale)

    return add


def engine_way(output, x, down, up, scale):
    RowTerm(down, up, scale).add_into(output, x)


def bmm_outer(output, x, down, up, scale):
    if down.shape[-1] != 1:
        raise ValueError("an outer product is a rank-1 way")
    groups = down.shape[0]
    low_rank = torch.bmm(x.reshape(groups, -1, x.shape[-1]), down) * scale
    output.view(groups, -1, output.shape[-1]).addcmul_(low_rank, up.transpose(1, 2))


def rows_by_member(low_rank: torch.Tensor) -> torch.Tensor:
    """[G, n, 1] -> [G * n, G]: each row's value in its own member's column, zeros elsewhere."""
    groups, per_group = low_rank.shape[:2]
    spread = low_rank.new_zeros(groups, per_group, groups)
    spread.diagonal(dim1=0, dim2=2).copy_(low_rank[:, :, 0].transpose(0, 1))  # the diagonal view is [n, G]
    return spread.view(-1, groups)


def bmm_blockdiag(output, x, down, up, scale):
    if down.shape[-1] != 1:
        raise ValueError("a block-diagonal left factor is a rank-1 way")
    groups = down.shape[0]
    low_rank = torch.bmm(x.reshape(groups, -1, x.shape[-1]), down) * scale
    output.view(-1, output.shape[-1]).addmm_(rows_by_member(low_rank), up[:, :, 0])


def ways(compiled: bool = True):
    eager = {"engine": engine_way, "bmm": bmm, "bmm_outer": bmm_outer, "bmm_blockdiag": bmm_blockdiag,
             "bmm_rank8": padded(8), "broadcast": broadcast}
    if not compiled:
        return eager
    return {**eager, **{f"{name}_compiled": torch.compile(fn, dynamic=False) for name, fn in eager.items()}}


def one_shape(in_features: int, out_features: int, args, device, dtype) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    x = randn(args.rows, args.tokens, in_features)
    down, up = randn(args.groups, in_features, args.rank), randn(args.groups, out_features, args.rank)
    scale = torch.tensor(1e-3, device=device)
    base = randn(args.rows, args.tokens, out_features)
    reference = base.float().clone()
    bmm(reference, x.float(), down.float(), up.float(), scale)
    row = {"in": in_features, "out": out_features, "us": {}, "max_error": {}, "errors": {}}
    for name, fn in ways(compiled=not args.skip_compiled).items():
        try:
            output = base.clone()
            fn(output, x, down, up, scale)
            row["max_error"][name] = float((output.float() - reference).abs().max())
            row["us"][name] = seconds_per_call(fn, (base.clone(), x, down, up, scale), args, device) * 1e6
        except Exception as error:  # a way that fails at this shape: say so, time the others
            row["errors"][name] = f"{type(error).__name__}: {error}"[:300]
    return row


def with_projection(in_features: int, out_features: int, args, device, dtype) -> dict:
    """The projection and its terms together, two ways: the projection's GEMM then the engine's terms
    added into its output (what the engine runs), or one GEMM of [x | rows_by_member(x B)] against the
    weight stacked on the members' up vectors, [W^T ; U] (the terms' outer products inside the
    projection's own GEMM: K grows by G). Rank 1 only."""
    generator = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    rows = args.rows * args.tokens
    x = randn(args.rows, args.tokens, in_features)
    weight = randn(out_features, in_features)
    down, up = randn(args.groups, in_features, 1), randn(args.groups, out_features, 1)
    scale = torch.tensor(1e-3, device=device)
    output = torch.empty(rows, out_features, device=device, dtype=dtype)
    stacked_weight = torch.cat([weight.t(), up[:, :, 0]])  # [in + G, out], made once (the noise refills U in place)
    extended = torch.cat([x.reshape(rows, in_features), x.new_zeros(rows, args.groups)], dim=1)  # [x | S]

    def separate():
        torch.mm(x.reshape(rows, in_features), weight.t(), out=output)
        RowTerm(down, up, scale).add_into(output.view(args.rows, args.tokens, out_features), x)

    def stacked():
        low_rank = torch.bmm(extended[:, :in_features].reshape(args.groups, -1, in_features), down) * scale
        extended[:, in_features:].copy_(rows_by_member(low_rank))
        torch.mm(extended, stacked_weight, out=output)

    reference = x.reshape(rows, in_features).float() @ weight.float().t()
    bmm(reference.view(args.rows, args.tokens, out_features), x.float(), down.float(), up.float(), scale)
    row = {"in": in_features, "out": out_features, "us": {}, "max_error": {}}
    for name, fn in {"projection_then_terms": separate, "stacked": stacked}.items():
        fn()
        row["max_error"][name] = float((output.float() - reference).abs().max())
        row["us"][name] = seconds_per_call(fn, (), args, device) * 1e6
    return row


def seconds_per_call(fn, inputs, args, device) -> float:
    """On a GPU, per call of `fn` replayed from one CUDA graph of `calls` calls (as the engine replays its
    decode step: kernel time, not launch time); elsewhere, host-timed calls."""
    if device.type != "cuda":
        return host_seconds_per_call(fn, inputs, args, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            fn(*inputs)
    return host_seconds_per_call(graph.replay, (), args, device) / args.calls


def main(argv=None):
    args = parse_args(argv)
    if args.rows % args.groups:
        raise SystemExit(f"--rows: {args.rows}: must split into --groups {args.groups} groups of equal size")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with torch.no_grad():
        shapes = [(one_shape(i, o, args, device, dtype), count) for i, o, count in PROJECTIONS]
    step = {}
    for row, count in shapes:
        print(f"{row['in']:>5} -> {row['out']:<5} us/call  " +
              "  ".join(f"{name} {us:8.1f} (err {row['max_error'][name]:.1e})" for name, us in row["us"].items()),
              flush=True)
        for name, error in row["errors"].items():
            print(f"{'':>14}{name}: {error[:120]}", flush=True)
        for name, us in row["us"].items():
            step[name] = step.get(name, 0.0) + LAYERS * count * us
    print("one decode step's terms, 24 layers: " + "  ".join(f"{name} {us / 1e3:.2f} ms" for name, us in step.items()))
    projections, projection_step = [], {}
    if args.rank == 1:
        with torch.no_grad():
            projections = [(with_projection(i, o, args, device, dtype), count) for i, o, count in PROJECTIONS]
        for row, count in projections:
            print(f"{row['in']:>5} -> {row['out']:<5} with the projection, us/call  " +
                  "  ".join(f"{name} {us:8.1f} (err {row['max_error'][name]:.1e})" for name, us in row["us"].items()),
                  flush=True)
            for name, us in row["us"].items():
                projection_step[name] = projection_step.get(name, 0.0) + LAYERS * count * us
        print("one decode step's projections with their terms, 24 layers: " +
              "  ".join(f"{name} {us / 1e3:.2f} ms" for name, us in projection_step.items()))
    write_result("eggroll", "row-terms", vars(args),
                 {"device": card, "dtype": str(dtype),
                  "timed": "CUDA graph replay" if device.type == "cuda" else "host",
                  "shapes": [row for row, _ in shapes], "step_us": step,
                  "with_projection": [row for row, _ in projections], "with_projection_step_us": projection_step},
                 out=args.out, card=one_card(card))


if __name__ == "__main__":
    main()
