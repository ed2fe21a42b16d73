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
    bmm_rank8      bmm with down and up padded with zero columns to rank 8 (exact; tensor cores)
    broadcast      (x * down[g]).sum(-1) per rank, then the outer product added (no matmul)
    *_compiled     each under torch.compile

Printed: microseconds per call per projection shape, the sum over one decode step of a 24-layer
Qwen2.5-0.5B (7 projections a layer), and each way's largest error against fp32 arithmetic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from attention_decode import seconds_per_call  # noqa: E402  (the same timing loop)
from record import one_card, write_result  # noqa: E402

from gpuscale.engines.generation.row_terms import RowTerm  # noqa: E402

BASELINE = """No baseline of other code: it compares ways of adding the engine's per-member low-rank terms
(the engine's way, batched matmuls, an elementwise outer product, matmuls padded to rank 8, a broadcast
multiply-sum; eager and compiled)
with one another at the population's shapes."""

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


def ways(compiled: bool = True):
    eager = {"engine": engine_way, "bmm": bmm, "bmm_outer": bmm_outer, "bmm_rank8": padded(8), "broadcast": broadcast}
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
    write_result("eggroll", "row-terms", vars(args),
                 {"device": card, "dtype": str(dtype), "shapes": [row for row, _ in shapes], "step_us": step},
                 out=args.out, card=one_card(card))


if __name__ == "__main__":
    main()
