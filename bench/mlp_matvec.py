"""Batch-1 decode's MLP, alone: how fast each way reads a layer's gate/up and down weights (issue 54).

The engine's batch-1 step spends about half its kernel time in the MLP's matrix-vector products
(bench/results/generation/decode-ways-b1-packed-argmax-profile-*.json: about 19 µs a layer for its 26.1 MB of
weights, a third of an H200's copy bandwidth; down_proj, which computes SiLU-times-up again in each of its rows,
10.8 µs for 8.7 MB). This script times one decode token's MLP over every layer
(distinct weights a layer, so nothing stays in L2), replayed as one CUDA graph, each way:

- `reduction`: the engine's way today (fused.py's `_reduction_linear`, compiled with the engine's options);
- `cublas`: F.linear, compiled the same way;
- `triton-*`: the engine's two hand-written Triton kernels (engines/generation/triton_matvec.py: gate/up with
  SiLU-times-up in one, down_proj in the other), at several block sizes (the engine's first).

Baseline: the engine's way today (`reduction`) and cuBLAS (`cublas`), in the same process, on the same weights.
It prints µs a layer, the share of the copy bandwidth, and the largest difference from the eager bf16 MLP, each
way timed twice: replayed as one CUDA graph (as the engine's step runs) and launched one kernel after another on
the stream (`us_per_layer_stream`: the host's launches included).

`--pdl`: the Triton ways with programmatic dependent launch (triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH, set
before the process registers the ops: run it as a second process beside a plain one). Whether the kernels' early
start survives the CUDA graph's capture is what the two timings tell: the engine's step showed no gain that holds
(bench/RESULTS.md, "programmatic dependent launch"). `--grid`: the Triton ways at every block of GRID, not the few
of CONFIGS.
Usage: python bench/mlp_matvec.py [--hidden 896 --intermediate 4864 --layers 24] [--pdl] [--grid] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import generation as generation_bench  # noqa: E402

from bench.record import write_result  # noqa: E402
from gpuscale.engines.generation import triton_matvec  # noqa: E402
from gpuscale.engines.generation.fused import _reduction_linear  # noqa: E402


def eager_mlp(hidden, gate_up, down):
    gate, up = F.linear(hidden, gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down)


def reduction_mlp(hidden, gate_up, down):
    gate, up = _reduction_linear(hidden, gate_up, None).chunk(2, dim=-1)
    return hidden + _reduction_linear(F.silu(gate) * up, down, None)


def reduction_gate_up_only(hidden, gate_up, down):
    """The gate/up half alone (its activation realized: a graph output)."""
    gate, up = _reduction_linear(hidden, gate_up, None).chunk(2, dim=-1)
    return hidden + (F.silu(gate) * up)[..., : hidden.shape[-1]]


def reduction_down_only(activation):
    """The down half alone, over an activation already in memory."""
    return lambda hidden, gate_up, down: hidden + _reduction_linear(activation, down, None)


def triton_mlp(config):
    """The engine's Triton MLP (engines/generation/triton_matvec.py) with its blocks set to `config`: (gate/up
    rows a program, down_proj rows a program, the most of K a program loads, warps)."""

    def mlp(hidden, gate_up, down):
        (triton_matvec.GATE_UP_ROWS_PER_PROGRAM, triton_matvec.DOWN_ROWS_PER_PROGRAM, triton_matvec.MAX_BLOCK_K,
         triton_matvec.WARPS) = config
        return hidden + triton_matvec.matvec(triton_matvec.silu_gate_up(hidden, gate_up), down)

    return mlp


def compiled(fn, **options):
    from torch._inductor import list_mode_options

    return torch.compile(fn, options={**list_mode_options("default"), "emulate_precision_casts": True, **options})


# Triton blocks: (gate/up rows a program, down_proj rows a program, the most of K a program loads, warps); the
# engine's own first. CONFIGS: the few of 2026-11-30's call; GRID (--grid): every combination around them.
CONFIGS = [(4, 2, 1024, 4), (4, 1, 8192, 8), (2, 1, 4096, 4), (2, 2, 8192, 4), (1, 1, 8192, 4)]
GRID = [(g, d, k, w) for g in (1, 2, 4, 8) for d in (1, 2, 4) for k in (1024, 8192) for w in (2, 4, 8)]


def time_layers(mlp, hidden, layers, repeats: int = 50) -> tuple[float, float]:
    """µs a layer, every layer's MLP one after another: (captured as one CUDA graph and replayed, launched on the
    stream)."""

    def all_layers():
        x = hidden
        for gate_up, down in layers:
            x = mlp(x, gate_up, down)
        return x

    for _ in range(3):  # compile, autotune, warm
        all_layers()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_layers()
    graph.replay()
    torch.cuda.synchronize()
    return timed(graph.replay, repeats, len(layers)), timed(all_layers, repeats, len(layers))


def timed(fn, repeats: int, layers: int) -> float:
    """µs a layer of `repeats` calls of fn, timed by CUDA events around them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pdl", action="store_true", help="the Triton ways with programmatic dependent launch")
    parser.add_argument("--grid", action="store_true", help="the Triton ways at every block of GRID")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/mlp_matvec.py times CUDA kernels: no GPU here")
    torch.manual_seed(0)
    width, inner = args.hidden, args.intermediate
    layers = [(torch.randn(2 * inner, width, device="cuda", dtype=torch.bfloat16) / width**0.5,
               torch.randn(width, inner, device="cuda", dtype=torch.bfloat16) / inner**0.5)
              for _ in range(args.layers)]
    hidden = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
    layer_bytes = 3 * width * inner * 2
    bandwidth = generation_bench.copy_bandwidth(torch.device("cuda"), 1024)
    floor_us = layer_bytes / bandwidth * 1e6
    expected = eager_mlp(hidden, *layers[0]).float()

    activation = torch.randn(1, inner, device="cuda", dtype=torch.bfloat16)
    ways = {"reduction": compiled(reduction_mlp), "cublas": compiled(eager_mlp),
            "reduction-gate-up-only": compiled(reduction_gate_up_only),
            "reduction-down-only": compiled(reduction_down_only(activation))}
    # Inductor inlines a cheap pointwise producer into each row of a reduction that broadcasts it, unless its
    # op count passes `realize_opcount_threshold` (30): then it is computed once, stored, and read.
    for threshold in (4, 8, 16):
        ways[f"reduction-realize-{threshold}"] = compiled(reduction_mlp, realize_opcount_threshold=threshold)
    triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH = args.pdl  # before the ops' registration, once a process
    if triton_matvec.register(hidden.device):
        defaults = (triton_matvec.GATE_UP_ROWS_PER_PROGRAM, triton_matvec.DOWN_ROWS_PER_PROGRAM,
                    triton_matvec.MAX_BLOCK_K, triton_matvec.WARPS)
        for config in dict.fromkeys([defaults, *(GRID if args.grid else CONFIGS)]):
            ways["triton-g{}-d{}-k{}-w{}{}".format(*config, "-pdl" if args.pdl else "")] = triton_mlp(config)
    rows = []
    for name, mlp in ways.items():
        try:
            error = float((mlp(hidden, *layers[0]).float() - expected).abs().max())
            us, us_stream = time_layers(mlp, hidden, layers)
        except Exception as failure:  # a Triton config that does not compile is reported, not fatal
            rows.append({"way": name, "error": f"{type(failure).__name__}: {str(failure)[:300]}"})
            print(f"{name:28s} failed: {rows[-1]['error']}", flush=True)
            continue
        rows.append({"way": name, "us_per_layer": us, "bandwidth_share": floor_us / us,
                     "us_per_layer_stream": us_stream, "max_abs_difference_from_eager": error})
        print(f"{name:28s} {us:7.2f} µs a layer  {floor_us / us:6.1%} of copy bandwidth  "
              f"(launched on the stream: {us_stream:.2f})  max |diff| {error:.3g}", flush=True)
    figures = {"layer_bytes": layer_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9, "floor_us_per_layer": floor_us,
               "ways": rows}
    settings = {"hidden": width, "intermediate": inner, "layers": args.layers, "dtype": "bfloat16", "batch": 1,
                "pdl": args.pdl, "grid": args.grid}
    write_result("generation", "mlp-matvec-b1", settings, figures, out=args.out)


if __name__ == "__main__":
    main()
