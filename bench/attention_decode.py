"""Attention of one query token per row over a KV buffer, as the engine's decode step runs it: which
kernel is fastest at the engine's shapes.

    python bench/attention_decode.py                          # GPU: Qwen2.5-0.5B's heads, bf16
    python bench/attention_decode.py --device cpu --shapes 2x64 --repeats 2 --out /tmp/a.json   # smoke

Each shape is ROWSxCOLUMNS (batch rows, KV columns attended). The query heads of each KV head are
stacked as that head's queries ([B, KV, H/KV, D], the engine's grouped layout) and an additive mask
[B, 1, 1, C] hides a left padding and the unwritten columns, as in the engine. Ways timed:

    cudnn, efficient, math   torch's scaled_dot_product_attention with that one backend
    default                  scaled_dot_product_attention, torch's own pick
    matmul                   two batched matmuls and a softmax, written out (q k^T, mask, softmax, p v)
    matmul_compiled          the same under torch.compile (what inductor makes of it inside the step)

Printed: microseconds per call (median of --repeats timed loops of --calls calls, after warm-up) and
the bandwidth that is (K and V bytes read / time), against the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402

BASELINE = """No baseline of other code: it compares torch's attention kernels (each SDPA backend, and two
matmuls written out, eager and compiled) with one another at the engine's decode shapes."""

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", default=["1x384", "64x384", "128x384", "3840x256", "4096x64"],
                        help="ROWSxCOLUMNS")
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None,
                        help="default: bench/results/generation/attention-decode-<date>-<card>.json")
    return parser.parse_args(argv)


def matmul_attention(query, key, value, mask, scale):
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale + mask
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


def make_inputs(rows: int, columns: int, args, device, dtype):
    generator = torch.Generator(device=device).manual_seed(0)
    groups = args.heads // args.kv_heads
    query = torch.randn(rows, args.kv_heads, groups, args.head_dim, device=device, dtype=dtype, generator=generator)
    key, value = (torch.randn(rows, args.kv_heads, columns, args.head_dim, device=device, dtype=dtype,
                              generator=generator) for _ in range(2))
    mask = torch.zeros(rows, 1, 1, columns, device=device, dtype=dtype)
    mask[..., : columns // 8] = torch.finfo(dtype).min  # a left padding
    mask[..., columns * 3 // 4:] = torch.finfo(dtype).min  # columns not written yet
    return query, key, value, mask


def ways(args):
    compiled = torch.compile(matmul_attention, dynamic=False)
    out = {name: (lambda q, k, v, m, s, b=backend: _sdpa(q, k, v, m, s, b)) for name, backend in BACKENDS.items()}
    out["default"] = lambda q, k, v, m, s: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=s)
    out["matmul"] = matmul_attention
    out["matmul_compiled"] = compiled
    return out


def _sdpa(query, key, value, mask, scale, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def seconds_per_call(fn, inputs, args, device) -> float:
    for _ in range(3):
        fn(*inputs)
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        for _ in range(args.calls):
            fn(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - begin) / args.calls)
    return statistics.median(times)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = args.head_dim ** -0.5
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = []
    with torch.no_grad():
        for shape in args.shapes:
            rows, columns = (int(part) for part in shape.split("x"))
            query, key, value, mask = make_inputs(rows, columns, args, device, dtype)
            reference = matmul_attention(query.float(), key.float(), value.float(), mask.float(), scale)
            kv_bytes = 2 * key.numel() * key.element_size()
            row = {"rows": rows, "columns": columns, "kv_bytes": kv_bytes, "us": {}, "max_error": {}, "errors": {}}
            for name, fn in ways(args).items():
                inputs = (query, key, value, mask, scale)
                try:
                    out = fn(*inputs)
                    row["max_error"][name] = float((out.float() - reference).abs().max())
                    row["us"][name] = seconds_per_call(fn, inputs, args, device) * 1e6
                except Exception as error:  # a backend that refuses the shape: say so, time the others
                    row["errors"][name] = f"{type(error).__name__}: {error}"[:300]
            results.append(row)
            timed = "  ".join(f"{name} {us:8.1f}" for name, us in row["us"].items())
            best = min(row["us"], key=row["us"].get)
            print(f"{shape:>10}: us/call {timed}  | best {best}, "
                  f"{kv_bytes / row['us'][best] / 1e3:.0f} GB/s of K and V", flush=True)
            for name, error in row["errors"].items():
                print(f"{'':>10}  {name}: {error[:120]}", flush=True)
    write_result("generation", "attention-decode", vars(args), {"device": card, "dtype": str(dtype), "shapes": results},
                 out=args.out, card=one_card(card))


if __name__ == "__main__":
    main()
