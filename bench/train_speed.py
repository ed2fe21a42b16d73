"""Training speed: gpuscale's SFT (sft, and rft's training phase, which is the same code) against stock
TRL `SFTTrainer` on the same rows, the same model shape and the same precision, in one process, back
to back.

    python bench/train_speed.py [--model random-qwen2.5-0.5b] [--rows 4096] [--row-tokens 128]

The baseline is what a TRL user writes: `SFTTrainer(model, SFTConfig(bf16=True,
per_device_train_batch_size=B, completion_only_loss=True))` on prompt-completion rows, fp32 master
weights under bf16 autocast, TRL's defaults for everything else (padded batches, its fused output
head, fused AdamW). It is put at its best by a sweep of B (--stock-batches: doubled until a batch
runs out of memory or gains under 5% on the one before); the best B is the stock figure.

gpuscale's side is `recipes/shared/training.py:train_sft_dataset`, the function the sft and rft recipes train
with, at the same rows per optimizer step as the stock side's best batch, its micro-batch left auto
(cut to the card by engines/training_memory.py), in each of its variants: everything on (padding-free
rows with attention row by row, liger-kernel's fused layers), each optimisation off in turn, and
with rows packed into --pack-length-token sequences (where MFU is quoted at a packed length).

Rows: --rows random token rows (the tiny-math tokenizer's ids) whose lengths are uniform in
[row_tokens/2, 3 row_tokens/2], the first 40% of each the prompt (no loss), the rest the completion:
real data is ragged, and padding is what the padded side pays for it. Every side trains on the same
rows in the same order from the same weights.

Figures per configuration, over --steps timed optimizer steps after --warm-up: trained tokens/s (TRL's
own count of non-padding tokens, over the median step time), the median step time, peak GPU memory,
MFU (data/cards.py: tokens/s x FLOPs a token over the card's dense bf16 peak). Ratios: gpuscale's best
over stock's best (target >= 1.5) and gpuscale's auto micro-batch over the best micro-batch of a sweep
at the same rows per step (target >= 0.8). One JSON under bench/results/sft/.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import write_result  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Baseline: stock TRL SFTTrainer "
                                     "(bf16 autocast, TRL defaults) at its best batch, found by a sweep.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--row-tokens", type=int, default=128, help="mean tokens a row")
    parser.add_argument("--pack-length", type=int, default=512, help="packed sequence length of the packing variant")
    parser.add_argument("--pack-share", type=float, default=0.5, help="gpu_memory_share of the packing variant "
                        "(0.9: the card to itself, one micro-batch a step)")
    parser.add_argument("--stock-batches", default="8,16,32,64,128,256,512,1024")
    parser.add_argument("--micro-batches", default="", help="gpuscale micro-batches to sweep at the same step "
                        "rows (empty: powers of two up to the step's rows)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--only", default="", help="comma list of: stock, gpuscale, variants, "
                        "sweep, packed, grpo, compile (default: all but compile)")
    parser.add_argument("--step-rows", type=int, default=256, help="rows a step where the stock sweep is not run")
    parser.add_argument("--grpo-prompts", type=int, default=16)
    parser.add_argument("--grpo-generations", type=int, default=8)
    parser.add_argument("--grpo-completion-tokens", type=int, default=128)
    parser.add_argument("--grpo-stock-micro", default="32,64,128", help="stock GRPOTrainer's micro-batches to "
                        "try; its best is the baseline (128 on an H200, 2026-11-27: bench/RESULTS.md)")
    parser.add_argument("--grpo-compiled", action="store_true", help="also gpuscale's grpo-mtl with compile=true "
                        "(the engine's decode step compiled, replayed as CUDA graphs)")
    parser.add_argument("--profile", default="", help="a folder: torch profiler table of gpuscale's best step")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


# ---- rows and the step timer ---------------------------------------------------------------------


def make_rows(count: int, mean_tokens: int, vocab: int, seed: int = 0):
    import datasets
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(mean_tokens // 2, mean_tokens * 3 // 2 + 1, (1,), generator=generator))
        prompt = max(1, int(length * 0.4))
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (length - prompt)})
    return datasets.Dataset.from_list(rows)


def step_timer():
    """A TrainerCallback that records each optimizer step's end (after a CUDA sync) and TRL's
    cumulative token count at each log (logging_steps=1)."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends, self.tokens = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                self.tokens.append(float(logs["num_tokens"]))

    return StepTimer()


def figures_of(timer, warm_up: int, flops_per_token: float, card: str) -> dict:
    import torch

    from gpuscale.data.cards import mfu

    step_seconds = [b - a for a, b in zip(timer.ends, timer.ends[1:])][warm_up:]
    step_tokens = [b - a for a, b in zip([0.0, *timer.tokens], timer.tokens)][warm_up:]
    n = min(len(step_seconds), len(step_tokens))
    median_step = statistics.median(step_seconds[:n])
    # The median step's rate: a step slowed by something outside the run does not move it.
    tokens_per_s = statistics.median(tokens / seconds for tokens, seconds in zip(step_tokens[:n], step_seconds[:n]))
    return {"tokens_per_s": tokens_per_s, "step_seconds_median": median_step,
            "tokens_per_step": sum(step_tokens[:n]) / n, "timed_steps": n,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "mfu": mfu(tokens_per_s, flops_per_token, card)}


# ---- the two sides -------------------------------------------------------------------------------


def fresh_model(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    from gpuscale.data.models import random_model_config

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(random_model_config(name), dtype=torch.float32)
    return model


def release():
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def stock_sft(args, dataset, tokenizer, batch: int, steps: int, flops: float, card: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    model = fresh_model(args.model)
    timer = step_timer()
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, per_device_train_batch_size=batch, bf16=True, max_steps=steps,
                           logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                           completion_only_loss=True, dataloader_num_workers=0, max_length=None, seed=0)
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[timer])
        trainer.train()
    figures = figures_of(timer, args.warm_up, flops, card)
    del trainer, model
    release()
    return {"side": "stock", "batch": batch, **figures}


def gpuscale_sft(args, dataset, tokenizer, step_rows: int, steps: int, flops: float, card: str,
                 micro: int | None = None, profile: str = "", **options) -> dict:
    import torch

    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.reporter import Reporter
    from gpuscale.recipes.sft import Settings
    from gpuscale.recipes.shared.training import train_sft_dataset

    model = fresh_model(args.model).to(torch.bfloat16)  # as a rank loads it: in its dtype (training casts to fp32)
    release()
    timer = step_timer()
    # micro None: auto, the step's rows kept as 8 x gradient_accumulation (step_rows a multiple of 8).
    accumulation = step_rows // (micro or 8)
    settings = Settings(model=args.model, batch_size=micro, gradient_accumulation=accumulation, max_steps=steps,
                        max_length=args.pack_length if options.get("packing") else 4096, eval_examples=0,
                        save_model=False, checkpoint_every=0, **options)
    with tempfile.TemporaryDirectory() as run_dir:
        ctx = RankContext(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"), dtype=torch.bfloat16,
                          run_dir=run_dir)
        reporter = Reporter(run_dir, 0)
        callbacks = (timer, Profile(profile, args.warm_up)) if profile else (timer,)
        trained = train_sft_dataset(dataset, settings, ctx, reporter, model, tokenizer, callbacks=callbacks)
        reporter.close()
    figures = figures_of(timer, args.warm_up, flops, card)
    chosen = {key: trained.figures.get(key) for key in ("batch_size", "gradient_accumulation", "batch_size_reason",
                                                         "liger_kernels")}
    del trained, model
    release()
    return {"side": "gpuscale", "step_rows": step_rows, **options, **chosen, **figures}


class Profile:
    """A TrainerCallback that profiles one optimizer step after the warm-up and writes the kernel table."""

    def __new__(cls, folder: str, warm_up: int):
        from transformers import TrainerCallback

        class _Profile(TrainerCallback):
            def __init__(self):
                self.profiler = None

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == warm_up:
                    from torch.profiler import ProfilerActivity, profile

                    self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    self.profiler.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                if self.profiler is not None:
                    self.profiler.__exit__(None, None, None)
                    os.makedirs(folder, exist_ok=True)
                    table = self.profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                    with open(os.path.join(folder, "sft_step_kernels.txt"), "w") as handle:
                        handle.write(table)
                    self.profiler = None

        return _Profile()


# ---- the comparison ------------------------------------------------------------------------------

# gpuscale's variants beside its defaults: each optimisation off in turn, both off, and torch.compile.
VARIANTS = ({"padding_free": False}, {"liger_kernels": False}, {"padding_free": False, "liger_kernels": False})
COMPILED = ({"compile": True}, {"compile": True, "liger_kernels": False})


def best_stock(args, dataset, tokenizer, flops, card, log) -> list[dict]:
    import torch

    results = []
    for batch in [int(b) for b in args.stock_batches.split(",")]:
        try:
            row = stock_sft(args, dataset, tokenizer, batch, args.warm_up + args.steps, flops, card)
        except torch.cuda.OutOfMemoryError:
            release()
            log({"side": "stock", "batch": batch, "out_of_memory": True})
            results.append({"side": "stock", "batch": batch, "out_of_memory": True})
            break
        log(row)
        results.append(row)
        fitted = [r for r in results if not r.get("out_of_memory")]
        if len(fitted) >= 2 and fitted[-1]["tokens_per_s"] < 1.05 * fitted[-2]["tokens_per_s"]:
            break
    return results


# ---- grpo-mtl: a GRPO step against stock GRPOTrainer ---------------------------------------------


def grpo_rows_for(args, tokenizer) -> list[dict]:
    """Prompts both sides train on: tiny-math training questions as grpo-mtl builds its rows."""
    from gpuscale.data.tasks import load_examples
    from gpuscale.recipes.grpo_mtl.data import grpo_rows

    count = args.grpo_prompts * (args.warm_up + args.steps)
    rows, _ = grpo_rows(load_examples("tiny-math", "train", count), tokenizer, 256)
    return rows


def stock_grpo(args, rows, tokenizer, micro: int) -> dict:
    """Stock GRPOTrainer, its own generate path, `micro` completions a micro-batch (accumulation makes
    up the step's prompts x generations), bf16 autocast, beta 0. Generation is timed around TRL's
    `_generate` (a CUDA sync either side); the rest of a step is its training part."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPO(GRPOTrainer):
        generation: list[float] = []

        def _generate(self, prompts):
            torch.cuda.synchronize()
            started = time.perf_counter()
            result = super()._generate(prompts)
            torch.cuda.synchronize()
            self.generation.append(time.perf_counter() - started)
            return result

    def reward(completions, **kwargs):  # any reward: its cost is nothing beside the step
        return [len(str(c)) / 100 for c in completions]

    completions = args.grpo_prompts * args.grpo_generations
    model = fresh_model(args.model)
    timer = step_timer()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=micro,
                            gradient_accumulation_steps=completions // micro, num_generations=args.grpo_generations,
                            max_completion_length=args.grpo_completion_tokens, temperature=1.0, beta=0.0,
                            bf16=True, max_steps=args.warm_up + args.steps, logging_steps=1, report_to="none",
                            save_strategy="no", disable_tqdm=True, learning_rate=1e-6, seed=0)
        trainer = TimedGRPO(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                            callbacks=[timer])
        trainer.train()
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args.warm_up:]
    generation = trainer.generation[args.warm_up:]
    del trainer, model
    release()
    return {"side": "stock-grpo", "micro_batch": micro, "step_seconds_median": statistics.median(steps),
            "generation_seconds_per_step": statistics.median(generation),
            "training_seconds_per_step": statistics.median(s - g for s, g in zip(steps, generation))}


def gpuscale_grpo(args, compile: bool = False) -> dict:
    """A real `gpuscale run --recipe grpo-mtl` at the same shape, generator=engine, batch_size auto;
    with `compile`, the engine's decode step compiled and replayed as CUDA graphs (`compile=true`)."""
    from benchruns import gpuscale_run

    settings = {"generator": "engine", "compile": str(compile).lower(), "num_generations": args.grpo_generations,
                "prompts_per_step": args.grpo_prompts, "max_completion_length": args.grpo_completion_tokens,
                "max_steps": args.warm_up + args.steps, "learning_rate": 1e-6, "temperature": 1.0, "beta": 0.0,
                "eval_examples": 0, "save_model": "false",
                "max_examples": args.grpo_prompts * (args.warm_up + args.steps)}
    arguments = ["--recipe", "grpo-mtl", "--gpus", "1", "--model", args.model, "--precision", "bf16"]
    for key, value in settings.items():
        arguments += ["--set", f"{key}={value}"]
    summary = gpuscale_run(arguments)["summary"]
    return {"side": "gpuscale-grpo", "batch_size": summary.get("batch_size"),
            **{key: summary.get(key) for key in ("step_seconds_median", "generation_seconds_per_step",
                                                 "training_seconds_per_step", "mfu", "liger_kernels")},
            "command": "gpuscale run " + " ".join(arguments)}


def grpo_comparison(args, tokenizer, log) -> dict:
    rows = grpo_rows_for(args, tokenizer)
    completions = args.grpo_prompts * args.grpo_generations
    stock = []
    micros = [int(m) for m in args.grpo_stock_micro.split(",")]
    for micro in (m for m in micros if completions % m == 0):  # its best micro-batch
        stock.append(stock_grpo(args, rows, tokenizer, micro))
        log(stock[-1])
    best = min(stock, key=lambda r: r["step_seconds_median"])
    figures = {"stock": stock, "stock_best": best}
    for name, compile in (("gpuscale", False), ("gpuscale_compiled", True))[: 2 if args.grpo_compiled else 1]:
        mine = gpuscale_grpo(args, compile)
        log(mine)
        figures.update({name: mine, **{f"{part}_stock_over_{name}": best[f"{part}_seconds_per_step"] / mine[
            f"{part}_seconds_per_step"] for part in ("generation", "training")},
            f"step_stock_over_{name}": best["step_seconds_median"] / mine["step_seconds_median"]})
    return figures


def main(argv=None) -> dict:
    args = parse(argv)
    # One GPU: with several visible, stock Trainer wraps the model in DataParallel and GRPOTrainer refuses
    # to start (2 x H200, 2026-11-27); gpuscale's runs here ask for one GPU anyway.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    import torch

    from gpuscale.data.cards import model_flops_shape, training_flops_per_token
    from gpuscale.data.models import random_model_config
    from gpuscale.recipes.shared.models import stand_in_tokenizer

    only = set(filter(None, args.only.split(","))) or {"stock", "gpuscale", "variants", "sweep", "packed", "grpo"}
    card = torch.cuda.get_device_name(0)
    tokenizer = stand_in_tokenizer(args.model)
    dataset = make_rows(args.rows, args.row_tokens, len(tokenizer))
    matmul, layers, width = model_flops_shape(random_model_config(args.model))
    flops = training_flops_per_token(matmul, layers, width, args.row_tokens / 2)
    rows: list[dict] = []

    def log(row: dict) -> None:
        rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "batch_size_reason"}
        print(shown, flush=True)

    steps = args.warm_up + args.steps
    stock = best_stock(args, dataset, tokenizer, flops, card, log) if "stock" in only else []
    if os.environ.get("GPUSCALE_HOME") is None:  # the grpo side's real run keeps its history apart
        os.environ["GPUSCALE_HOME"] = tempfile.mkdtemp(prefix="gpuscale-bench-train-")
    fitted = [r for r in stock if not r.get("out_of_memory")]
    best = (max(fitted, key=lambda r: r["tokens_per_s"]) if fitted
            else {"batch": args.step_rows, "tokens_per_s": None})
    step_rows = best["batch"]
    mine = None
    if "gpuscale" in only:
        mine = gpuscale_sft(args, dataset, tokenizer, step_rows, steps, flops, card)
        log(mine)
    if "variants" in only:
        # The defaults once more between the variants: how far two runs of one configuration differ.
        for options in (*VARIANTS, {}):
            log(gpuscale_sft(args, dataset, tokenizer, step_rows, steps, flops, card, **options))
    if "compile" in only:
        for options in COMPILED:
            log(gpuscale_sft(args, dataset, tokenizer, step_rows, steps, flops, card, **options))
    sweep = []
    if "sweep" in only:
        micros = [int(m) for m in args.micro_batches.split(",") if m] or [
            m for m in (8, 16, 32, 64, 128, 256, 512) if m <= step_rows and step_rows % m == 0]
        for micro in micros:
            try:
                row = gpuscale_sft(args, dataset, tokenizer, step_rows, steps, flops, card, micro=micro)
            except torch.cuda.OutOfMemoryError:
                release()
                row = {"side": "gpuscale", "batch_size": micro, "out_of_memory": True}
            log(row)
            sweep.append(row)
    packed = None
    if "packed" in only:
        packed_flops = training_flops_per_token(matmul, layers, width, args.row_tokens / 2)
        packed_rows = max(8, step_rows * args.row_tokens // args.pack_length // 8 * 8)
        packed = gpuscale_sft(args, dataset, tokenizer, packed_rows, steps, packed_flops, card, packing=True,
                              gpu_memory_share=args.pack_share)
        log(packed)
    if args.profile:  # a run of its own: the profiler's overhead stays out of every timed figure
        gpuscale_sft(args, dataset, tokenizer, step_rows, args.warm_up + 1, flops, card, profile=args.profile)
    figures = {"rows": rows, "stock_best": best, "gpuscale": mine, "packed": packed}
    if "grpo" in only:
        figures["grpo"] = grpo_comparison(args, tokenizer, log)
    if mine and best.get("tokens_per_s"):
        figures["ratio_over_stock_best"] = mine["tokens_per_s"] / best["tokens_per_s"]
    swept = [r for r in sweep if not r.get("out_of_memory")]
    if mine and swept:
        figures["auto_over_best_micro_batch"] = mine["tokens_per_s"] / max(r["tokens_per_s"] for r in swept)
    print({k: v for k, v in figures.items() if k.startswith(("ratio", "auto"))}, flush=True)
    if "grpo" in figures:
        print({k: v for k, v in figures["grpo"].items() if "_over_" in k}, flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_result("sft", "train-speed", settings, figures, out=args.out)
    return figures


if __name__ == "__main__":
    main()
