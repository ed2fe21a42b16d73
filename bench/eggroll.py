"""EGGROLL: the whole population in one batched forward, against the seed's structure and against
plain batched inference.

    python bench/eggroll.py [--gpus 2] [--model random-qwen2.5-0.5b] [--population 256]

1. Members per second, from real `gpuscale run --recipe eggroll` runs at the same settings:
   `method=eggroll` on 1 GPU (and on --gpus GPUs) against `method=naive` on 1 GPU (the seed's
   structure: per member, perturb the weights in place, generate every prompt, restore). The figure
   is the run summary's `members_per_s` (population / median step time; the first step, which
   captures CUDA graphs, is left out when there are more).
2. The population's throughput as a share of plain batched inference: in one process, the engine
   generates the same rows (population x prompts) with the members' low-rank terms and without any,
   greedy, same prompts, same length budget; the share is tokens/s with terms over tokens/s without,
   for each way the engine adds the terms (`--paths`: `hooks`, after each projection; `fused`,
   inside each projection's expression, its `fuse_row_terms`, which also runs the prefill through
   the fused wiring, compiled with --compile), of the whole call, of its decode alone (a call of one
   new token taken off) and of that call of one token (the prefill and a step). Each path's plain
   side is an engine set as the path is, without terms (`plain`: hooks; `plain_fused`: fused): with
   `fuse_row_terms` the prefill changes with or without terms, so each share compares like with like:

       python bench/eggroll.py --share-only --population 512 --repeats 5 [--compile]

Both parts perturb the norms' gains too (a row scale per norm), as the recipe does by default;
`--frozen-norms` leaves them out (the figures measured before perturb_norms existed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import write_result  # noqa: E402


def run(method: str, gpus: int, args, steps: int, batch_size: int, population: int | None = None) -> dict:
    cmd = [
        sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "eggroll", "--gpus", str(gpus),
        "--model", args.model, "--dataset", args.dataset, "--batch-size", str(batch_size),
        "--set", f"method={method}", "--set", f"population={population or args.population}",
        "--set", f"rank={args.rank}", "--set", f"perturb_norms={not args.frozen_norms}",
        "--set", f"prompts_per_step={args.prompts}", "--set", f"max_new_tokens={args.max_new_tokens}",
        "--set", f"fitness={args.fitness}",
        "--set", f"steps={steps}", "--set", "eval_examples=8", "--set", "eval_every=0",
        "--set", "save_model=false", "--set", f"seed={args.seed}", "--json",
    ]
    print("$ gpuscale", " ".join(cmd[3:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], flush=True)
        raise SystemExit(f"{method} on {gpus} GPU(s) failed")
    summary = json.loads(done.stdout)["summary"]
    print(f"  -> {summary['members_per_s']:.2f} members/s, {summary['tokens_per_s']:.0f} tokens/s, "
          f"median step {summary['step_seconds_median']:.3f} s", flush=True)
    phases = {key.removesuffix("_seconds_median"): value for key, value in summary.items()
              if key.endswith("_seconds_median") and key != "step_seconds_median" and value is not None}
    if phases:  # where a step goes: what splits over the ranks (generate, score) and what does not
        print("     a step's phases (median s): " + ", ".join(f"{name} {value:.3f}" for name, value in phases.items()),
              flush=True)
    return summary


# --paths: how the engine adds the population's terms (its fuse_row_terms).
ROW_TERM_PATHS = {"hooks": False, "fused": True}
# The plain side (no terms) of each fuse_row_terms setting, by its key in the figures.
PLAIN_SIDES = {False: "plain", True: "plain_fused"}


def share_of_plain_inference(args) -> dict:
    """Tokens/s of the engine with the population's row terms over tokens/s without, same rows, for
    each way of adding the terms (--paths), against an engine set the same way: the whole call, its
    decode alone and a call of one token (the prefill's share)."""
    import torch

    from gpuscale.data.models import build_random_model, load_model
    from gpuscale.data.prompts import prompt_ids
    from gpuscale.data.tasks import load_examples
    from gpuscale.recipes.shared.models import stand_in_tokenizer

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: fp32, as a CPU run
    if args.model.startswith("random-"):
        model, tokenizer = build_random_model(args.model).to(device, dtype), stand_in_tokenizer(args.model)
    else:
        model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    model.eval()
    questions = [e["question"] for e in load_examples(args.dataset, "train", args.prompts)]
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    rows = [p for _ in range(args.population) for p in prompts]
    result = {"rows": len(rows), "tokens": len(rows) * args.max_new_tokens, "dtype": str(dtype),
              "mirrored_pairs": not args.unpaired}
    for fuse_row_terms in dict.fromkeys(ROW_TERM_PATHS[path] for path in args.paths):
        side = PLAIN_SIDES[fuse_row_terms]
        result[side] = timed_engine(model, rows, args, terms=[], fuse_row_terms=fuse_row_terms, label=side)
    terms = population_terms(model, args)
    for path in args.paths:
        side = PLAIN_SIDES[ROW_TERM_PATHS[path]]
        timing = timed_engine(model, rows, args, terms, fuse_row_terms=ROW_TERM_PATHS[path], label=path)
        plain = result[side]
        timing.update({"plain_side": side, "share": plain["seconds"] / timing["seconds"],
                       "decode_share": plain["decode_seconds"] / timing["decode_seconds"],
                       "one_token_share": plain["one_token_seconds"] / timing["one_token_seconds"]})
        result[path] = timing
    return result


def population_terms(model, args) -> list:
    """(module, term): a random rank-r term of `population` members on every linear the recipe perturbs,
    and a row scale on every norm unless --frozen-norms (the recipe's terms, at the share's scale): as the
    recipe's antithetic pairs, one group of factors a pair (`mirrored`), unless --unpaired."""
    import torch

    from gpuscale.engines.generation import RowScale, RowTerm
    from gpuscale.recipes.eggroll.trainer import perturbed_linears, perturbed_norms

    weight = next(model.parameters())
    mirrored = not args.unpaired
    groups = args.population // 2 if mirrored else args.population
    terms = []
    for _, module in perturbed_linears(model):
        down, up = (torch.randn(groups, size, args.rank, device=weight.device, dtype=weight.dtype)
                    for size in (module.in_features, module.out_features))
        terms.append((module, RowTerm(down, up, scale=1e-3 / math.sqrt(args.rank), mirrored=mirrored)))
    for _, module in [] if args.frozen_norms else perturbed_norms(model):
        factors = 1 + 1e-3 * torch.randn(groups, module.weight.shape[0], device=weight.device)
        terms.append((module, RowScale(factors, mirrored=mirrored)))
    return terms


def timed_engine(model, rows, args, terms, fuse_row_terms: bool, label: str) -> dict:
    """A new engine's timing (`engine_timing`) with `terms`; they are taken off after (another engine's
    hooks would keep the next one from decoding fused), and its graphs and KV slots freed."""
    import gc

    import torch

    from gpuscale.engines.generation import GenerationEngine

    started = time.perf_counter()
    mode = {"compile_mode": args.compile_mode} if args.compile_mode else {}
    engine = GenerationEngine(model, [], pad_token_id=0, compile=args.compile, fuse_row_terms=fuse_row_terms, **mode)
    for module, term in terms:
        engine.add_row_term(module, term)
    timing = engine_timing(engine, rows, args, label)
    # A call's time bound may cut the next engine: say what this one gave, and how long it took with its compile.
    print(f"  {label}: {timing['seconds']:.3f} s a call, {timing['one_token_seconds']:.3f} s a call of one token "
          f"({time.perf_counter() - started:.0f} s with its compile and warm-up)", flush=True)
    engine.remove_row_terms()
    engine = None  # the last reference: collected now, before the next engine allocates its own
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return timing


def engine_timing(engine, rows, args, label: str) -> dict:
    """Median seconds of a greedy call of --max-new-tokens tokens a row (no EOS: every row decodes them
    all) and of a call of one (prefill and one step), alternating, after a first call that captures the
    graphs and compiles; their difference is the decode of the other steps."""
    import torch

    from gpuscale.engines.generation import Sampling

    greedy = Sampling(temperature=0.0)
    on_cuda = engine.device.type == "cuda"

    def seconds(new_tokens: int) -> float:
        if on_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        engine.generate(rows, new_tokens, greedy)
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    seconds(args.max_new_tokens)
    calls = [(seconds(args.max_new_tokens), seconds(1)) for _ in range(args.repeats)]
    whole, one_token = (statistics.median(times) for times in zip(*calls))
    decode = whole - one_token
    if args.profile:
        print_profile(engine, rows, args, greedy, label)
    return {"seconds": whole, "one_token_seconds": one_token, "decode_seconds": decode,
            "tokens_per_s": len(rows) * args.max_new_tokens / whole,
            "decode_tokens_per_s": len(rows) * (args.max_new_tokens - 1) / decode,
            "fused_decode": engine._use_fused,
            "terms_in_projections": engine._use_fused and engine._fused.terms_in_projections,
            "fused_prefill": engine._prefill_step is not None,
            # Compiled steps that failed to compile and ran uncompiled (the engine warns): their figures are eager ones.
            "compile_fallbacks": sorted(engine._compile_errors())}


def print_profile(engine, rows, args, sampling, label: str) -> None:
    """The GPU kernels of one engine call, by total time (where the population's extra time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(rows, args.max_new_tokens, sampling)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    print(f"\n{label}:\n{table}", flush=True)


BASELINE = """Baseline (1): `method=naive`, the seed's structure (per member: perturb the weights in place, generate
every prompt, restore), a real `gpuscale run --recipe eggroll` on 1 GPU that uses the same gpuscale
generation engine, noise and update, so only the structure differs. How it is put at its best: not
swept; it runs at --prompts rows per engine call (one member's prompts) and only --naive-steps steps.
Baseline (2): plain batched inference of the same rows by the same GenerationEngine without low-rank
terms (greedy; torch.compile only with --compile), in this process."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--dataset", default="tiny-math")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--population", type=int, default=256)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--fitness", choices=["correctness", "gold_logprob"], default="correctness",
                        help="of the runs: correctness decodes every member's answers (--max-new-tokens), "
                             "gold_logprob (the recipe's default) scores the gold answers by teacher forcing "
                             "and decodes nothing")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (every member answers each)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="ES steps of the eggroll runs")
    parser.add_argument("--naive-steps", type=int, default=2, help="ES steps of the naive run (slow)")
    parser.add_argument("--repeats", type=int, default=3, help="timed engine calls of the share measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frozen-norms", action="store_true", help="perturb the linear layers only")
    parser.add_argument("--unpaired", action="store_true",
                        help="the share's terms one group a member, not one an antithetic pair (the recipe's)")
    parser.add_argument("--share-only", action="store_true", help="only the share of plain inference")
    parser.add_argument("--skip-naive", action="store_true", help="leave out the (slow) naive run")
    parser.add_argument("--profile", action="store_true", help="print the GPU kernels of one call of each engine")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine's step in the share "
                        "measurement (the recipe's runs compile only with --set compile=true)")
    parser.add_argument("--compile-mode", default=None,
                        help="with --compile, torch.compile's mode (default: the engine's; max-autotune-no-cudagraphs: "
                             "Inductor may put the terms in a Triton GEMM's epilogue, minutes of compiling)")
    parser.add_argument("--paths", type=lambda text: text.split(","), default=list(ROW_TERM_PATHS),
                        help="how the share's population adds its terms, each timed against plain inference set the "
                             "same way: hooks (after each projection, in place), fused (inside each projection's "
                             "expression, the prefill through the fused wiring: the engine's fuse_row_terms); "
                             f"default {','.join(ROW_TERM_PATHS)}")
    parser.add_argument("--device", default="cuda", help="of the share measurement (cpu: for tests; its figures "
                                                         "mean nothing)")
    parser.add_argument("--out", default=None, help="default: bench/results/eggroll/<what>-<date>-<card>.json")
    args = parser.parse_args(argv)
    if unknown := set(args.paths) - set(ROW_TERM_PATHS):
        parser.error(f"--paths: {','.join(sorted(unknown))}: not one of {','.join(ROW_TERM_PATHS)}")
    rows = args.population * args.prompts
    results = {}
    if not args.share_only:
        if not args.skip_naive:
            results["naive_1gpu"] = run("naive", 1, args, args.naive_steps, args.prompts)
        results["eggroll_1gpu"] = run("eggroll", 1, args, args.steps, rows)
        if args.gpus > 1:
            # Strong scaling (the same population split over the GPUs) and weak scaling (each GPU
            # keeps the one-GPU run's members: a population args.gpus times larger).
            results[f"eggroll_{args.gpus}gpu"] = run("eggroll", args.gpus, args, args.steps, rows // args.gpus)
            results[f"eggroll_{args.gpus}gpu_weak"] = run("eggroll", args.gpus, args, args.steps, rows,
                                                          population=args.population * args.gpus)
    results["share"] = share_of_plain_inference(args)
    write_result("eggroll", "share" if args.share_only else "speed", vars(args), results, out=args.out)
    print_tables(results, args)


def print_tables(results: dict, args) -> None:
    runs = [name for name in results if "gpu" in name and "members_per_s" in results[name]]
    if runs:
        naive = results.get("naive_1gpu", {}).get("members_per_s")
        one = results["eggroll_1gpu"]["members_per_s"]
        print(f"\n{'run':<19} {'members/s':>10} {'vs naive':>9} {'vs 1 GPU':>9}")
        for name in runs:
            rate = results[name]["members_per_s"]
            versus_naive = f"{rate / naive:>8.1f}x" if naive else f"{'-':>9}"
            print(f"{name:<19} {rate:>10.2f} {versus_naive} {rate / one:>8.2f}x")
    share = results["share"]
    print(f"\n{share['rows']} rows x {args.max_new_tokens} tokens")
    for side in (side for side in PLAIN_SIDES.values() if side in share):
        plain = share[side]
        print(f"{side} inference (no terms, prefill {'fused' if plain['fused_prefill'] else 'by the model'}): "
              f"{plain['tokens_per_s']:.0f} tokens/s (decode alone {plain['decode_tokens_per_s']:.0f}); "
              f"a call of one token {plain['one_token_seconds']:.3f} s")
    for name in (name for name in [*PLAIN_SIDES.values(), *args.paths] if share.get(name, {}).get("compile_fallbacks")):
        print(f"{name}: ran uncompiled after failing to compile: {', '.join(share[name]['compile_fallbacks'])}")
    for path in args.paths:
        timing = share[path]
        print(f"population, terms by {path} (against {timing['plain_side']}): {timing['tokens_per_s']:.0f} tokens/s, "
              f"share {timing['share']:.3f}; decode alone {timing['decode_tokens_per_s']:.0f} tokens/s, share "
              f"{timing['decode_share']:.3f}; a call of one token {timing['one_token_seconds']:.3f} s, share "
              f"{timing['one_token_share']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
