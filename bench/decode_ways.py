"""The engine's batch-1 decode step, one way of computing it at a time: which change moves it toward the
weight-read floor, and by how much.

    python bench/decode_ways.py                                  # GPU: Qwen2.5-0.5B shape, bf16, batch 1
    python bench/decode_ways.py --ways cublas-sdpa,today --device cpu --model random-tiny --new-tokens 8  # smoke

A way is a set of the engine's few-row switches (module constants of engines/generation) and a compile
mode; each runs in a process of its own (fresh compile caches), measured by the one decode measure the
node check shares (engines/generation/speed.py: N-token and 1-token calls, the difference a step), with
`--profile` also the kernels of an eager static step (bench/profile_decode.py's count). The floor is the
weights a step reads at the card's copy bandwidth, measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BASELINE = """Baseline: `cublas-sdpa`, the engine's step before the few-row reductions (cuBLAS matmuls, SDPA),
and transformers' generate() at its best (StaticCache + compile) in the same call (`--with-transformers`)."""

# way -> (the engine's switches by module, its compile mode, Inductor settings). `today` is the default.
NO_REDUCTIONS = {"fused.REDUCTION_LINEAR_MAX_ROWS": 0, "fused.REDUCTION_ATTENTION_MAX_ROWS": 0}
ONLY_THE_MLP = {"fused.TRITON_LAYER_AT_ONE_ROW": False}
TUNED = {"coordinate_descent_tuning": True}  # as gpt-fast compiles its decode step
WAYS = {
    "today": ({}, "default", {}),
    "uncompiled": ({}, None, {}),  # the eager step, no CUDA graphs: the reference of --agreement
    "cublas-sdpa": (NO_REDUCTIONS, "default", {}),  # the engine's step before the few-row reductions
    "matmul-attention": ({**NO_REDUCTIONS, "fused.MATMUL_ATTENTION_MIN_ROWS": 1}, "default", {}),
    "reduction-attention": ({"fused.REDUCTION_LINEAR_MAX_ROWS": 0}, "default", {}),
    "reduction-linear": ({"fused.REDUCTION_ATTENTION_MAX_ROWS": 0}, "default", {}),
    "tuned": (NO_REDUCTIONS, "default", TUNED),
    "reductions-tuned": ({}, "default", TUNED),
    "autotuned": (NO_REDUCTIONS, "max-autotune-no-cudagraphs", {}),
    "reductions-autotuned": ({}, "max-autotune-no-cudagraphs", {}),
    # q/k/v and o_proj (2 and 1.6 MB at Qwen2.5-0.5B's shape) as reductions, gate/up and down_proj on cuBLAS
    "reductions-small-weights": ({"fused.REDUCTION_LINEAR_MAX_WEIGHT_BYTES": 4 << 20}, "default", {}),
    # a row's argmax as torch's (one thread block a row), not as today's max of packed keys (sampling.row_argmax)
    "argmax": ({"sampling.PACKED_ARGMAX_MAX_ROWS": 0}, "default", {}),
    # Inductor computes a cheap producer (the MLP's SiLU-times-up, a norm, attention's softmax) again in every row
    # of a reduction that broadcasts it unless its op count passes `realize_opcount_threshold` (30); at 16, for
    # every compile of the process, those are stored once (measured 2026-11-30, not adopted)
    "realize-global": ({}, "default", {"realize_opcount_threshold": 16}),
    # only the MLP at one row as triton_matvec.py's kernels, the rest of the layer Inductor's (the default until
    # TRITON_LAYER_AT_ONE_ROW)
    "triton-mlp-only": (ONLY_THE_MLP, "default", {}),
    # the MLP too as Inductor's reductions
    "inductor-mlp": ({**ONLY_THE_MLP, "fused.TRITON_MLP_AT_ONE_ROW": False}, "default", {}),
    # that, with down_proj through cuBLAS at one row (its input stored once), the other matmuls reductions
    "down-cublas": ({**ONLY_THE_MLP, "fused.TRITON_MLP_AT_ONE_ROW": False, "fused.DOWN_PROJ_AS_REDUCTION": False},
                    "default", {}),
    # the layer kernels' launch shapes (triton_matvec.py's constants): programs of q/k/v of 1 or 2 rotary pairs (more
    # programs, each reading less), attention blocks of 32 columns, down_proj and o_proj 2 rows a program, 8 warps
    "qkv-pairs-1": ({"triton_matvec.QKV_PAIRS_PER_PROGRAM": 1}, "default", {}),
    "qkv-pairs-2": ({"triton_matvec.QKV_PAIRS_PER_PROGRAM": 2}, "default", {}),
    "attention-block-32": ({"triton_matvec.ATTENTION_BLOCK_COLUMNS": 32}, "default", {}),
    "down-rows-2": ({"triton_matvec.DOWN_ROWS_PER_PROGRAM": 2}, "default", {}),
    "warps-8": ({"triton_matvec.WARPS": 8}, "default", {}),
    # the layer's seven kernels before attention's combine and the post-attention norm moved into the last programs
    # of the kernels before them (triton_matvec.TAILS_IN_LAST_PROGRAM)
    "no-tails": ({"triton_matvec.TAILS_IN_LAST_PROGRAM": False}, "default", {}),
    # each layer kernel launched while the one before ends (triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH)
    "pdl": ({"triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH": True}, "default", {}),
    # with --batch 2 to 4: the reductions at a few rows, against `today` (cuBLAS and SDPA there)
    "reductions-up-to-4-rows": ({"fused.REDUCTION_LINEAR_MAX_ROWS": 4, "fused.REDUCTION_ATTENTION_MAX_ROWS": 4},
                                "default", {}),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ways", type=lambda text: text.split(","), default=list(WAYS),
                        help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also count the kernels of each way's eager step")
    parser.add_argument("--agreement", action="store_true",
                        help="also each way's greedy tokens and log-probs against an fp32 forward (`agreement`)")
    parser.add_argument("--with-transformers", action="store_true",
                        help="also transformers' generate() with a StaticCache and compile, in its own process")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a way may take")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: measure this way only
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def apply_way(way: str):
    import torch._inductor.config

    from gpuscale.engines.generation import fused, sampling, triton_matvec

    modules = {"fused": fused, "sampling": sampling, "triton_matvec": triton_matvec}
    switches, _, inductor = WAYS[way]
    for name, value in switches.items():
        module, constant = name.split(".")
        if not hasattr(modules[module], constant):
            raise SystemExit(f"{name}: no such switch")
        setattr(modules[module], constant, value)
    for name, value in inductor.items():
        setattr(torch._inductor.config, name, value)


def measure_one(args) -> dict:
    """In a child process: the way's ms a step (or transformers' at its best), the floor, the kernels."""
    import torch

    from gpuscale.data.models import build_random_model
    from gpuscale.engines.distributed import resolve_dtype
    from gpuscale.engines.generation import GenerationEngine
    from gpuscale.engines.generation.speed import engine_path, weight_bytes_read_a_step

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import generation as generation_bench
    import profile_decode

    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device)
    model = build_random_model(args.model, seed=0).to(device=device, dtype=dtype).eval()
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_tokens),
                            generator=torch.Generator().manual_seed(args.batch)).to(device)
    bandwidth = generation_bench.copy_bandwidth(device, 1024 if device.type == "cuda" else 64)
    row = {"way": args.one, "floor_ms": weight_bytes_read_a_step(model) / bandwidth * 1e3,
           "copy_bandwidth_gb_s": bandwidth / 1e9}
    with torch.no_grad():
        if args.one == "transformers":
            settings = argparse.Namespace(new_tokens=args.new_tokens, repeats=args.repeats)
            row["ms_per_step"] = generation_bench.bench_generate(model, prompts, settings, device, static=True)
            return row
        apply_way(args.one)
        switches, mode, inductor = WAYS[args.one]
        row.update(switches=switches, compile_mode=mode, inductor=inductor)
        engine = (GenerationEngine(model, pad_token_id=0, compile_mode=mode) if mode else
                  GenerationEngine(model, pad_token_id=0, compile=False, cuda_graphs=False, static_shapes=True))
        run = generation_bench.generate_call(engine, prompts, torch.Generator(device=device).manual_seed(0))
        row["first_call_s"] = generation_bench.timed(lambda: run(args.new_tokens), device)
        row["ms_per_step"] = generation_bench.ms_per_step(run, args.new_tokens, device, args.repeats)
        row["path"] = engine_path(engine)
        if args.agreement:
            row["agreement"] = agreement(engine)
        if args.profile and mode:
            settings = argparse.Namespace(compile_mode=mode, context=args.prompt_tokens + 64,
                                          prompt_tokens=args.prompt_tokens, steps=5, temperature=1.0)
            with tempfile.TemporaryDirectory() as folder:
                profiled = profile_decode.profile_one(model, args.batch, "compiled", settings, device, Path(folder))
            row["kernels"] = {key: value for key, value in profiled.items() if key.endswith("per_step")}
            row["top_kernels"] = [[name[:90], calls, round(us, 2)] for name, calls, us in profiled["rows"][:40]]
    return row


def agreement(engine, prompts: int = 6, new_tokens: int = 40) -> dict:
    """How close the way's greedy decode stays to an fp32 forward of the same model: prompts of 32 random tokens,
    one a call (the batch-1 path), each continuation teacher-forced through the model in fp32. A bf16 step's
    greedy tokens part from another bf16 step's wherever the fp32 margin between the top two tokens is below
    bf16's error (a random model has many such near-ties): the way is as exact as the uncompiled step when its
    log-prob error and its share of fp32-argmax tokens are the uncompiled step's."""
    import copy

    import torch

    from gpuscale.engines.generation import Sampling

    truth = copy.deepcopy(engine.model).float()
    generator = torch.Generator().manual_seed(0)
    errors, agreeing, tokens = [], 0, []
    for _ in range(prompts):
        prompt = torch.randint(0, truth.config.vocab_size, (32,), generator=generator).tolist()
        out = engine.generate([prompt], new_tokens, Sampling(temperature=0))
        continuation = out.tokens[0, : int(out.lengths[0])]
        ids = torch.tensor([prompt + continuation.tolist()], device=continuation.device)
        with torch.no_grad():
            logits = truth(input_ids=ids).logits[0, len(prompt) - 1: -1]
        logprobs = logits.float().log_softmax(-1)
        exact = logprobs.gather(-1, continuation[:, None]).squeeze(-1)
        errors += (out.base_logprobs[0, : len(continuation)].float() - exact).abs().tolist()
        agreeing += int((logprobs.argmax(-1) == continuation).sum())
        tokens.append(continuation.tolist())
    del truth
    return {"mean_abs_logprob_error": sum(errors) / len(errors), "max_abs_logprob_error": max(errors),
            "fp32_argmax_share": agreeing / len(errors), "tokens": tokens}


def run_child(way: str, args) -> dict:
    command = [sys.executable, __file__, "--one", way, "--model", args.model, "--device", args.device,
               "--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    command += ["--profile"] if args.profile else []
    command += ["--agreement"] if args.agreement else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"way": way, "error": f"over {args.timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"way": way, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:500]}
    return json.loads(lines[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args)), flush=True)
        return None
    unknown = [way for way in args.ways if way not in WAYS]
    if unknown:
        raise SystemExit(f"--ways: {', '.join(unknown)}: not one of {', '.join(WAYS)}")
    rows, cut = [], False
    for way in args.ways + (["transformers"] if args.with_transformers else []):
        try:
            row = run_child(way, args)
        except KeyboardInterrupt:  # a call's time bound (`timeout -s INT`): keep the ways measured so far
            print(f"{way:<22} CUT: interrupted; the ways before it are written", flush=True)
            cut = True
            break
        rows.append(row)
        if "error" in row:
            print(f"{way:<22} FAILED: {row['error']}", flush=True)
            continue
        kernels = row.get("kernels", {}).get("kernels_per_step")
        # A step that fell back to running uncompiled measures the fallback, not the way: say so on its line.
        failed = (row.get("path") or {}).get("compile_error")
        close = row.get("agreement")
        print(f"{way:<22} {row['ms_per_step']:.3f} ms/step, {row['ms_per_step'] / row['floor_ms']:.2f}x the floor "
              f"({row['floor_ms']:.3f} ms)" + (f", {kernels:.0f} kernels a step" if kernels else "")
              + (f"; against fp32: log-prob error {close['mean_abs_logprob_error']:.4f} (mean), "
                 f"{close['fp32_argmax_share']:.1%} of tokens its argmax" if close else "")
              + (f"; COMPILING FAILED, ran uncompiled: {failed[:120]}" if failed else ""), flush=True)
    measured = {row["way"]: row["ms_per_step"] for row in rows if "ms_per_step" in row}
    for baseline in ("cublas-sdpa", "transformers"):
        for row in rows:
            if baseline in measured and "ms_per_step" in row:
                row[f"speedup_vs_{baseline}"] = measured[baseline] / row["ms_per_step"]

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record import write_result

    settings = {key: value for key, value in vars(args).items() if key not in ("one", "out")}
    write_result("generation", f"decode-ways-b{args.batch}", settings, {"ways": rows, "cut": cut}, out=args.out,
                 card="cpu" if args.device == "cpu" else None)
    return rows


if __name__ == "__main__":
    main()
