"""Where a decode step of GenerationEngine spends GPU time: kernels per step, their time, the top kernels.

    python bench/profile_decode.py --out prof/                         # GPU: Qwen2.5-0.5B shape, bf16
    python bench/profile_decode.py --device cpu --model random-tiny --out /tmp/prof   # smoke check

The step runs eagerly (no CUDA graph), so every kernel shows in torch.profiler; with graphs the same
kernels run back to back, so a graph step costs about their summed time plus ~1 us per kernel. Each
variant is the engine's static-shape step (what the graph captures):

    plain     the model's own forward, uncompiled                 (the engine before fusion/compile)
    fused     q/k/v and gate/up fused matmuls, uncompiled           (cuda_graphs + compile=False)
    compiled  fused + torch.compile of forward and sampling step    (the CUDA default)

Printed: one summary line per batch size and variant (kernels per step, kernel time per step split
into GEMM / attention / other), then the top kernels of the last variant for each batch size. In --out:
the full kernel table of every run (kernels_b{B}_{variant}.txt) and a gzipped Chrome trace.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.autograd import DeviceType

from gpuscale.data.models import build_random_model
from gpuscale.engines.distributed import resolve_dtype
from gpuscale.engines.generation import GenerationEngine, Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402

VARIANTS = {
    "plain": dict(fuse_weights=False, compile=False),
    "fused": dict(fuse_weights=None, compile=False),
    "compiled": dict(fuse_weights=None, compile=True),
}
# On CPU, aten ops that launch no kernel on a GPU (views, allocations) are left out of the counts.
NO_KERNEL_OPS = {"aten::" + name for name in (
    "view", "_unsafe_view", "as_strided", "alias", "empty", "empty_strided", "to", "reshape", "transpose",
    "t", "slice", "select", "unsqueeze", "squeeze", "expand", "detach", "lift_fresh", "_reshape_alias",
    "split", "split_with_sizes", "narrow", "unbind", "permute", "contiguous", "resolve_conj", "resolve_neg",
    "result_type", "resize_", "scalar_tensor", "is_nonzero", "_has_compatible_shallow_copy_type")}
# Kernel-name fragments of each category: SDPA backends; cuBLAS (nvjet, xmma, gemv, splitK), CUTLASS
# and Triton matmul templates (triton_tem_*); on CPU the aten ops.
ATTENTION_NAMES = ("fmha", "flash", "attention", "attn", "cudnn", "scaled_dot_product")
GEMM_NAMES = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "cublas", "triton_tem", "matmul",
              "aten::mm", "aten::addmm", "aten::bmm")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                        help="auto: as gpuscale runs (bf16 on compute capability 8.0+, fp16 below, fp32 on CPU)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=384,
                        help="KV columns reserved (the bench's 128 prompt + 256 new tokens)")
    parser.add_argument("--steps", type=int, default=5, help="decode steps profiled")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                        help="default: all three on CUDA, plain and fused on CPU")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top", type=int, default=25, help="kernels listed per batch size")
    parser.add_argument("--out", required=True, help="directory for the full tables and traces")
    return parser.parse_args(argv)


def category(name: str) -> str:
    lowered = name.lower()
    if lowered.startswith(("triton_poi", "triton_red", "triton_per")):  # inductor's fused kernels
        return "other"
    if any(part in lowered for part in ATTENTION_NAMES):
        return "attention"
    if any(part in lowered for part in GEMM_NAMES):
        return "gemm"
    return "other"


def prepare(model, batch: int, variant: str, args, device) -> tuple[GenerationEngine, torch.Generator]:
    """An engine whose slot 0 holds a prefilled batch, a few decode steps in (compiled, warm)."""
    warm_steps = 3
    engine = GenerationEngine(model, pad_token_id=0, cuda_graphs=False, static_shapes=True,
                              compile_mode=args.compile_mode, **VARIANTS[variant],
                              max_columns=max(args.context, args.prompt_tokens + warm_steps + args.steps + 2))
    generator = torch.Generator(device=device).manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_tokens),
                            generator=torch.Generator().manual_seed(batch)).to(device)
    begin = time.perf_counter()
    engine.generate(prompts, warm_steps, Sampling(args.temperature), generator=generator)
    synchronize(device)
    compiled = engine.compile and not engine._compile_errors()
    print(f"  b{batch} {variant}: fused={engine._fused is not None} compiled={compiled} "
          f"(setup {time.perf_counter() - begin:.1f} s)", flush=True)
    return engine, generator


def decode_steps(engine: GenerationEngine, steps: int, sampling: Sampling, generator):
    """Continue slot 0's decoding for `steps` steps, as GenerationEngine._decode does (noise, step)."""
    for _ in range(steps):
        if not sampling.greedy:
            engine._draw_noise_words(generator)
        engine._decode_step(0, sampling)
        engine._cursor.host_write_col += 1


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_one(model, batch: int, variant: str, args, device, out: Path) -> dict:
    engine, generator = prepare(model, batch, variant, args, device)
    sampling = Sampling(args.temperature)
    decode_steps(engine, 1, sampling, generator)
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode_steps(engine, args.steps, sampling, generator)
        synchronize(device)
    prof.export_chrome_trace(str(out / f"trace_b{batch}_{variant}.json.gz"))

    if device.type == "cuda":
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:  # CPU: the innermost aten ops that would be kernels on a GPU stand in for kernels
        events = [e for e in prof.events() if kernel_like(e)]
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        entry = kernels[event.name]
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()
    rows = sorted(((name, n / args.steps, us / args.steps) for name, (n, us) in kernels.items()),
                  key=lambda row: -row[2])
    by_category = collections.Counter()
    for name, _, us in rows:
        by_category[category(name)] += us
    summary = {
        "batch": batch, "variant": variant, "fused": engine._fused is not None,
        "compiled": engine.compile and not engine._compile_errors(),
        "kernels_per_step": sum(n for _, n, _ in rows), "kernel_us_per_step": sum(us for *_, us in rows),
        **{f"{name}_us_per_step": by_category[name] for name in ("gemm", "attention", "other")},
    }
    with open(out / f"kernels_b{batch}_{variant}.txt", "w") as f:
        f.write(json.dumps(summary) + "\n")
        f.write(kernel_table(rows, len(rows)))
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {**summary, "rows": rows}


def kernel_like(event) -> bool:
    """An aten op that would launch a kernel on a GPU, and none of whose callees would."""
    return _could_launch(event) and not any(_launches(child) for child in event.cpu_children)


def _could_launch(event) -> bool:
    return event.name.startswith("aten::") and event.name not in NO_KERNEL_OPS


def _launches(event) -> bool:
    return _could_launch(event) or any(_launches(child) for child in event.cpu_children)


def kernel_table(rows, top: int) -> str:
    lines = [f"{'us/step':>9} {'calls/step':>10} {'avg us':>8}  kernel"]
    for name, calls, us in rows[:top]:
        lines.append(f"{us:>9.1f} {calls:>10.1f} {us / calls:>8.2f}  {name[:110]}")
    return "\n".join(lines) + "\n"


BASELINE = """No baseline of other code: it profiles the engine's own step in three variants; `plain` (the model's
own forward, uncompiled) is the reference among them."""


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    variants = args.variants or (list(VARIANTS) if device.type == "cuda" else ["plain", "fused"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_random_model(args.model).to(device=device, dtype=dtype).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} {str(dtype).removeprefix('torch.')} on {name}, {args.prompt_tokens} prompt tokens, "
          f"{args.context} KV columns, {args.steps} steps profiled per run", flush=True)

    results = []
    with torch.no_grad():
        for batch in args.batch_sizes:
            for variant in variants:
                try:
                    results.append(profile_one(model, batch, variant, args, device, out))
                except Exception as error:  # keep the other runs' figures
                    traceback.print_exc()
                    print(f"  b{batch} {variant}: FAILED: {type(error).__name__}: {str(error)[:200]}", flush=True)

    unit = "kernel" if device.type == "cuda" else "aten op"
    print(f"\nper decode step ({unit}s; time = summed {unit} time, eager)")
    print(f"{'batch':>5}  {'variant':<9} {unit + 's':>9}  {'total ms':>8}  "
          + "  ".join(f"{title:>7}" for title in ("gemm", "attn", "other")))
    for r in results:
        milliseconds = [r[f"{name}_us_per_step"] / 1e3 for name in ("kernel", "gemm", "attention", "other")]
        print(f"{r['batch']:>5}  {r['variant']:<9} {r['kernels_per_step']:>9.0f}  {milliseconds[0]:>8.3f}  "
              + "  ".join(f"{ms:>7.3f}" for ms in milliseconds[1:]))
    for r in results:
        if r["variant"] == variants[-1]:
            print(f"\ntop {args.top} {unit}s, batch {r['batch']}, {r['variant']}")
            print(kernel_table(r["rows"], args.top), end="")
    write_result("generation", "profile-decode", vars(args),
                 {"device": name, "runs": [{k: v for k, v in r.items() if k != "rows"} for r in results]},
                 out=out / "summary.json", card=one_card(name))
    print(f"\nfull tables and traces in {out}")


if __name__ == "__main__":
    main()
