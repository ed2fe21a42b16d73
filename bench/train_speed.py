"""Training speed: gpuscale's SFT (sft, and rft's training phase, which is the same code) against stock
TRL `SFTTrainer` at its best, and grpo-mtl's step against stock `GRPOTrainer` at its best, on the same
rows, the same model shape and the same precision, in one process, back to back.

    python bench/train_speed.py [--model random-qwen2.5-0.5b] [--rows 4096] [--row-tokens 128]

Stock SFTTrainer is what a TRL user writes: `SFTTrainer(model, SFTConfig(bf16=True,
per_device_train_batch_size=B, completion_only_loss=True, gradient_checkpointing=False))` on
prompt-completion rows, fp32 master weights under bf16 autocast, with TRL 1.16's own speed switches
(STOCK_SFT, --stock-variants; all by default): liger-kernel's layers (`use_liger_kernel`), padding-free
micro-batches (`padding_free`: the rows in one sequence, attention told their boundaries by position_ids),
packing (`packing`, bfd, into --pack-length sequences; padding-free too), each with the model's attention:
sdpa (transformers then builds one dense block-diagonal mask over the whole flattened micro-batch),
flex_attention (transformers' block mask over torch's FlexAttention: what this stack has of the
varlen kernel padding_free is made for) or flash_attention_2 (TRL's advice for padding_free: flash-attn
has no wheel on the package index, and the GPU machine can neither fetch nor build one, so that variant
records its ImportError); and `trl-defaults`, TRL's default gradient checkpointing on (the baseline of
bench/RESULTS.md's stock figures of 2026-11-27), the others off as gpuscale's side is. TRL's other routes are not on
this stack: Hub kernels (`model_init_kwargs={"use_kernels": True}`, `kernels-community/flash-attn`) need
the Hub, vLLM is not installed. On CPU the liger and flex variants are skipped, with the reason
(CPU_SKIPS). Each variant is put at its best by a sweep of B (--stock-batches, packed sequences for
packing: B x row_tokens / pack_length; doubled until a batch runs out of memory, fails or gains under 5%
on the one before); a variant that cannot run records its exception's line. The best variant at its
best B is the stock figure.

gpuscale's side is `recipes/shared/training.py:train_sft_dataset`, the function the sft and rft recipes train
with, at the same rows per optimizer step as the stock figure (for packing: its real tokens a step over
the rows' mean length, to a multiple of 8), its micro-batch left auto (cut to the card by
engines/training_memory.py). The comparison runs each side --repeats times, alternating (the sweep's
run of the best stock configuration is its first): each side's figure is the median of its runs, its
spread (max - min) / median; the ratio is gpuscale's median over stock's. Then, on their own, gpuscale's
variants: each optimisation off in turn, a micro-batch sweep, rows packed into --pack-length sequences
(where MFU is quoted at a packed length), torch.compile.

Rows: --rows random token rows (the tiny-math tokenizer's ids, from 3 up) whose lengths are uniform in
[row_tokens/2, 3 row_tokens/2], the first 40% of each the prompt (no loss), the rest the completion:
real data is ragged, and padding is what the padded side pays for it. Every side trains on the same
rows in the same order from the same weights, none cut (max_length none; packing: --pack-length).

Figures per configuration, over --steps timed optimizer steps after --warm-up: trained tokens/s (real
tokens, counted the same way on every side: the input ids the model is called with that are not the pad
token, over each step's time, the median step's rate; TRL's own count beside it, which for gpuscale's
padding-free micro-batches includes the few pad tokens of pad_to_multiple_of), the median step time,
the step rates' spread, peak GPU memory, MFU (data/cards.py: tokens/s x FLOPs a token over the card's
dense bf16 peak). Ratios: gpuscale over the stock figure (target >= 1.5) and gpuscale's auto
micro-batch over the best micro-batch of a sweep at the same rows per step (target >= 0.8). One JSON
under bench/results/sft/.

grpo-mtl (--only grpo): stock GRPOTrainer (bf16 autocast, beta 0, gradient checkpointing off as
gpuscale's side) with each generation path TRL 1.16 has without vLLM (STOCK_GRPO, --grpo-stock-variants):
its `model.generate` with the dynamic cache (its default) and with `cache_implementation="static"`
(TRL builds its GenerationConfig with disable_compile=True, so the static cache runs eager; asking for
compile through generation_kwargs raises the TypeError `static+compile` records; on a GPU the static
cache itself fails under bf16 autocast, allocated in the fp32 model's dtype while autocast writes bf16
keys: `index_copy_(): self and source expected to have the same dtype`, 1 x H200, 2026-11-29,
bench/results/grpo_mtl/train-speed-grpo-stock-cut-2026-11-29-h200.log.txt), transformers'
continuous batching (`use_transformers_continuous_batching`, paged sdpa, CUDA graphs as transformers
decides; TRL casts the model to bf16 in place for it, and trains those weights after), the same with
its compile level 1, and `torch_compile` (the training forward compiled). Its micro-batch
(--grpo-stock-micro) is swept on the first variant and chosen by the training part of a step (the
micro-batch moves nothing else); the other variants run at it. Against gpuscale's `gpuscale run
--recipe grpo-mtl` (engine) at the same shape: step, generation and training ratios over the fastest
stock variant, with that variant's step-time spread. On CPU pass tiny sizes and leave the compiled
variants out (minutes of compiling): tests/integration/test_bench_scripts.py runs it so.
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

# Stock SFTTrainer's variants: SFTConfig's fields, and `attention`, the model's attn_implementation (sdpa
# where none is named). Every variant but trl-defaults turns TRL's default gradient checkpointing off.
STOCK_SFT = {
    "padded": {},
    "liger": {"use_liger_kernel": True},
    "padding_free": {"padding_free": True},
    "padding_free+liger": {"padding_free": True, "use_liger_kernel": True},
    "padding_free+flex": {"padding_free": True, "attention": "flex_attention"},
    "padding_free+flex+liger": {"padding_free": True, "attention": "flex_attention", "use_liger_kernel": True},
    "padding_free+flash_attention_2": {"padding_free": True, "attention": "flash_attention_2"},
    "packing": {"packing": True},
    "packing+liger": {"packing": True, "use_liger_kernel": True},
    "packing+flex": {"packing": True, "attention": "flex_attention"},
    "packing+flex+liger": {"packing": True, "attention": "flex_attention", "use_liger_kernel": True},
    "trl-defaults": {"gradient_checkpointing": True},
}

# What a CPU cannot run, not tried there: (variant option, its value) -> why.
CPU_SKIPS = {
    ("use_liger_kernel", True): "liger-kernel's layers are Triton kernels: CUDA only",
    ("attention", "flex_attention"): "FlexAttention has no backward on CPU (NotImplementedError, torch 2.13)",
}

# Stock GRPOTrainer's generation paths without vLLM: GRPOConfig's fields.
STOCK_GRPO = {
    "generate": {},
    "static": {"cache_implementation": "static"},
    "static+compile": {"cache_implementation": "static", "generation_kwargs": {"disable_compile": False}},
    "continuous": {"use_transformers_continuous_batching": True},
    "continuous+compile": {"use_transformers_continuous_batching": True,
                           "transformers_continuous_batching_config": {"default_compile_level": 1}},
    "torch_compile": {"torch_compile": True},
}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Baseline: stock TRL SFTTrainer "
                                     "(bf16 autocast) in each variant of TRL's own switches (padding_free, "
                                     "liger, packing) at its best batch, found by a sweep; the best variant is "
                                     "the figure. Stock GRPOTrainer with each generation path TRL has "
                                     "(dynamic, static cache, continuous batching, compiled), the fastest the "
                                     "figure.", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b", help="a random-* shape, or tiny-math (CPU)")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--row-tokens", type=int, default=128, help="mean tokens a row")
    parser.add_argument("--pack-length", type=int, default=512, help="packed sequence length of the packing "
                        "variants, stock and gpuscale")
    parser.add_argument("--pack-share", type=float, default=0.5, help="gpu_memory_share of the packing variant "
                        "(0.9: the card to itself, one micro-batch a step)")
    parser.add_argument("--stock-batches", default="8,16,32,64,128,256,512,1024")
    parser.add_argument("--stock-variants", default=",".join(STOCK_SFT), help="comma list of STOCK_SFT's "
                        "variants (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side of the sft comparison")
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
                        "try on its first variant (128 on an H200, 2026-11-27: bench/RESULTS.md)")
    parser.add_argument("--grpo-stock-variants", default=",".join(STOCK_GRPO), help="comma list of STOCK_GRPO's "
                        "variants (default: all); the first is the one whose micro-batch is swept")
    parser.add_argument("--grpo-steps", type=int, default=5, help="timed GRPO steps")
    parser.add_argument("--grpo-warm-up", type=int, default=2)
    parser.add_argument("--grpo-compiled", action="store_true", help="also gpuscale's grpo-mtl with compile=true "
                        "(the engine's decode step compiled, replayed as CUDA graphs)")
    parser.add_argument("--profile", default="", help="a folder: torch profiler table of gpuscale's best step")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for option, table in (("stock_variants", STOCK_SFT), ("grpo_stock_variants", STOCK_GRPO)):
        names = [name.strip() for name in getattr(args, option).split(",") if name.strip()]
        unknown = [name for name in names if name not in table]
        if unknown:
            parser.error(f"--{option.replace('_', '-')}: unknown {unknown}; known: {', '.join(table)}")
        setattr(args, option, names)
    return args


# ---- the device: one CUDA GPU, or the CPU (the script's test) ------------------------------------


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device():
    import torch

    return torch.device("cuda" if on_cuda() else "cpu")


def synchronize() -> None:
    import torch

    if on_cuda():
        torch.cuda.synchronize()


def release() -> None:
    import torch

    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def precision_args() -> dict:
    """A trainer config's precision: bf16 autocast over fp32 masters on the GPU; fp32 on the CPU (TRL's
    configs default to bf16 even there)."""
    return {"bf16": True} if on_cuda() else {"bf16": False, "use_cpu": True}


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:300]


def spread(values: list[float]) -> float | None:
    """(max - min) / median, None under two values."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


# ---- rows, models and the step timer -------------------------------------------------------------


def make_rows(count: int, mean_tokens: int, vocab: int, seed: int = 0):
    import datasets
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(mean_tokens // 2, mean_tokens * 3 // 2 + 1, (1,), generator=generator))
        prompt = max(1, int(length * 0.4))
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()  # never the pad token (0)
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * (length - prompt)})
    return datasets.Dataset.from_list(rows)


def model_config(name: str):
    from transformers import AutoConfig

    from gpuscale.data.models import RANDOM_CONFIGS, model_path, random_model_config

    if name in RANDOM_CONFIGS:
        return random_model_config(name)
    return AutoConfig.from_pretrained(str(model_path(name)), local_files_only=True)


def tokenizer_for(name: str):
    from gpuscale.data.models import RANDOM_CONFIGS, load_tokenizer
    from gpuscale.recipes.shared.models import stand_in_tokenizer

    return stand_in_tokenizer(name) if name in RANDOM_CONFIGS else load_tokenizer(name)


def fresh_model(name: str, attention: str = "sdpa"):
    """The model both sides start from, in fp32 on the device: a random shape drawn as a gpuscale rank
    draws it (seed 0, on the device), or tiny-math's own weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpuscale.data.models import RANDOM_CONFIGS, model_path

    torch.manual_seed(0)
    if name not in RANDOM_CONFIGS:
        return AutoModelForCausalLM.from_pretrained(str(model_path(name)), local_files_only=True, dtype=torch.float32,
                                                    attn_implementation=attention).to(device())
    with torch.device(device()):
        return AutoModelForCausalLM.from_config(model_config(name), dtype=torch.float32, attn_implementation=attention)


def step_timer(model=None, pad_id: int = 0):
    """A TrainerCallback that records each optimizer step's end (after a device sync), the real tokens each
    step trained and TRL's cumulative count at each log (logging_steps=1). Real tokens are counted as the
    model is called: its input ids that are not the pad token (the rows' ids start at 3), whatever the
    layout (padded, padding-free, packed), the count kept on the device until the step's end."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends, self.tokens, self.trl_tokens = [], [], []
            self.pending = 0
            if model is not None:
                model.register_forward_pre_hook(self.count, with_kwargs=True)

        def count(self, module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                self.pending = self.pending + (ids != pad_id).sum()

        def on_train_begin(self, args, state, control, **kwargs):
            synchronize()
            self.ends.append(time.perf_counter())
            self.pending = 0

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.ends.append(time.perf_counter())
            self.tokens.append(int(self.pending))
            self.pending = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                self.trl_tokens.append(float(logs["num_tokens"]))

    return StepTimer()


def figures_of(timer, warm_up: int, flops_per_token: float, card: str) -> dict:
    import torch

    from gpuscale.data.cards import mfu

    step_seconds = [b - a for a, b in zip(timer.ends, timer.ends[1:])][warm_up:]
    step_tokens = timer.tokens[warm_up:]
    trl_tokens = [b - a for a, b in zip([0.0, *timer.trl_tokens], timer.trl_tokens)][warm_up:]
    n = min(len(step_seconds), len(step_tokens))
    rates = [tokens / seconds for tokens, seconds in zip(step_tokens[:n], step_seconds[:n])]
    # The median step's rate: a step slowed by something outside the run does not move it.
    tokens_per_s = statistics.median(rates)
    return {"tokens_per_s": tokens_per_s, "step_seconds_median": statistics.median(step_seconds[:n]),
            "tokens_per_step": sum(step_tokens[:n]) / n,
            "trl_tokens_per_step": sum(trl_tokens[:n]) / n if len(trl_tokens) >= n else None,
            "timed_steps": n, "step_rate_spread": spread(rates),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda() else None,
            "mfu": mfu(tokens_per_s, flops_per_token, card)}


# ---- stock SFTTrainer ----------------------------------------------------------------------------


def stock_sft(args, dataset, tokenizer, variant: str, batch: int, flops: float, card: str) -> dict:
    """One stock run: `variant` of STOCK_SFT at `batch` (packed sequences where it packs)."""
    from trl import SFTConfig, SFTTrainer

    options = dict(STOCK_SFT[variant])
    attention = options.pop("attention", "sdpa")
    model = fresh_model(args.model, attention)
    timer = step_timer(model, tokenizer.pad_token_id)
    fields = dict(per_device_train_batch_size=batch, max_steps=args.warm_up + args.steps, logging_steps=1,
                  report_to="none", save_strategy="no", disable_tqdm=True, completion_only_loss=True,
                  dataloader_num_workers=0, max_length=None, seed=0, gradient_checkpointing=False,
                  **precision_args())
    fields.update(options)
    if options.get("packing"):
        fields.update(packing_strategy="bfd", max_length=args.pack_length)
    with tempfile.TemporaryDirectory() as out:
        trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=out, **fields), train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    figures = figures_of(timer, args.warm_up, flops, card)
    # Rows a step: the batch, or for packed sequences the real tokens a step over the rows' mean length.
    rows = figures["tokens_per_step"] / args.mean_row_tokens if options.get("packing") else batch
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    del trainer, model
    return {"side": "stock", "variant": variant, "batch": batch, "rows_per_step": rows,
            "gradient_checkpointing": checkpointing, **figures}


def cpu_skip(variant: str) -> str | None:
    """Why the CPU does not run `variant`, or None."""
    if on_cuda():
        return None
    options = STOCK_SFT[variant]
    return "; ".join(why for (name, value), why in CPU_SKIPS.items() if options.get(name) == value) or None


def variant_batches(args, variant: str) -> list[int]:
    """--stock-batches, in packed sequences where the variant packs: the same tokens a step."""
    batches = [int(b) for b in args.stock_batches.split(",")]
    if not STOCK_SFT[variant].get("packing"):
        return batches
    return sorted({max(1, batch * args.row_tokens // args.pack_length) for batch in batches})


def sweep_stock_variant(args, variant, dataset, tokenizer, flops, card, log) -> list[dict]:
    """`variant` at each of its batches, doubled until one runs out of memory, fails or gains under 5%."""
    import torch

    skipped = cpu_skip(variant)
    if skipped:
        log({"side": "stock", "variant": variant, "skipped": skipped})
        return [{"side": "stock", "variant": variant, "skipped": skipped}]
    results = []
    for batch in variant_batches(args, variant):
        try:
            row = stock_sft(args, dataset, tokenizer, variant, batch, flops, card)
        except torch.cuda.OutOfMemoryError:
            row = {"side": "stock", "variant": variant, "batch": batch, "out_of_memory": True}
        except Exception as error:  # a variant this stack cannot run: its reason, and on to the next
            row = {"side": "stock", "variant": variant, "batch": batch, "error": one_line(error)}
        release()
        log(row)
        results.append(row)
        fitted = [r for r in results if "tokens_per_s" in r]
        if "tokens_per_s" not in row or (len(fitted) >= 2 and fitted[-1]["tokens_per_s"] < 1.05 * fitted[-2][
                "tokens_per_s"]):
            break
    return results


def best_of(rows: list[dict]) -> dict | None:
    fitted = [r for r in rows if "tokens_per_s" in r]
    return max(fitted, key=lambda r: r["tokens_per_s"]) if fitted else None


def stock_summary(rows: list[dict]) -> dict:
    """Each variant: its best batch and tokens/s, or why it did not run (skipped, its error, out of
    memory at its first batch)."""
    summary = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        best = best_of(mine)
        if best:
            summary[variant] = {"batch": best["batch"], "tokens_per_s": best["tokens_per_s"]}
        else:
            last = mine[-1]
            summary[variant] = {"not_run": last.get("skipped") or last.get("error") or "out of memory"}
    return summary


# ---- gpuscale's SFT ------------------------------------------------------------------------------


def gpuscale_sft(args, dataset, tokenizer, step_rows: int, steps: int, flops: float, card: str,
                 micro: int | None = None, profile: str = "", **options) -> dict:
    import torch

    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.reporter import Reporter
    from gpuscale.recipes.sft import Settings
    from gpuscale.recipes.shared.device_defaults import resolved_for_device
    from gpuscale.recipes.shared.training import train_sft_dataset

    dtype = torch.bfloat16 if on_cuda() else torch.float32
    model = fresh_model(args.model).to(dtype)  # as a rank loads it: in its dtype (training casts to fp32)
    release()
    timer = step_timer(model, tokenizer.pad_token_id)
    # micro None: auto, the step's rows kept as 8 x gradient_accumulation (step_rows a multiple of 8).
    accumulation = step_rows // (micro or 8)
    settings = Settings(model=args.model, batch_size=micro, gradient_accumulation=accumulation, max_steps=steps,
                        max_length=args.pack_length if options.get("packing") else 4096, eval_examples=0,
                        save_model=False, checkpoint_every=0, **options)
    settings = resolved_for_device(settings, on_cuda())  # what a rank does with the settings left `auto`
    with tempfile.TemporaryDirectory() as run_dir:
        ctx = RankContext(rank=0, local_rank=0, world_size=1, device=device(), dtype=dtype, run_dir=run_dir)
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


def rows_for_gpuscale(stock_best: dict) -> int:
    """gpuscale's rows a step: the stock figure's, to a multiple of 8 (its auto micro-batch keeps the step
    as 8 x gradient_accumulation)."""
    return max(8, round(stock_best["rows_per_step"] / 8) * 8)


def compare_sft(args, dataset, tokenizer, step_rows: int, stock_best: dict | None, flops, card, log) -> dict:
    """gpuscale's defaults at `step_rows` and the best stock configuration again, --repeats runs a side,
    alternating (the sweep's run is stock's first); each side's median, its spread, and the ratio."""
    steps = args.warm_up + args.steps
    mine, theirs = [], [stock_best] if stock_best else []
    for repeat in range(1, args.repeats + 1):
        mine.append({**gpuscale_sft(args, dataset, tokenizer, step_rows, steps, flops, card), "repeat": repeat})
        log(mine[-1])
        if stock_best and len(theirs) < args.repeats:
            theirs.append({**stock_sft(args, dataset, tokenizer, stock_best["variant"], stock_best["batch"], flops,
                                       card), "repeat": len(theirs) + 1})
            release()
            log(theirs[-1])
    figures = {"gpuscale_runs": mine, "gpuscale_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
               "gpuscale_spread": spread([r["tokens_per_s"] for r in mine])}
    if theirs:
        stock = statistics.median(r["tokens_per_s"] for r in theirs)
        figures.update(stock_runs=theirs, stock_tokens_per_s=stock, stock_spread=spread(
            [r["tokens_per_s"] for r in theirs]), ratio_over_stock_best=figures["gpuscale_tokens_per_s"] / stock)
    return figures


def print_table(header: str, lines: dict[str, str]) -> None:
    print(f"\n{header}")
    for name, text in lines.items():
        print(f"{name:<32} {text}")
    print(flush=True)


def sft_lines(summary: dict, best: dict | None) -> dict[str, str]:
    """print_table's lines of stock_summary: each variant's best batch and tokens/s, or why it did not run."""
    lines = {}
    for variant, row in summary.items():
        mark = "  <- best" if best and variant == best["variant"] else ""
        lines[variant] = (f"not run: {row['not_run'][:120]}" if "not_run" in row
                          else f"{row['batch']:>10} {row['tokens_per_s']:>10.0f}{mark}")
    return lines


# ---- grpo-mtl: a GRPO step against stock GRPOTrainer ---------------------------------------------


def grpo_steps(args) -> int:
    return args.grpo_warm_up + args.grpo_steps


def grpo_rows_for(args, tokenizer) -> list[dict]:
    """Prompts both sides train on: tiny-math training questions as grpo-mtl builds its rows."""
    from gpuscale.data.tasks import load_examples
    from gpuscale.recipes.grpo_mtl.data import grpo_rows

    rows, _ = grpo_rows(load_examples("tiny-math", "train", args.grpo_prompts * grpo_steps(args)), tokenizer, 256)
    return rows


def grpo_variant_fields(args, variant: str) -> dict:
    """STOCK_GRPO's fields of `variant`; on CPU continuous batching gets a paged cache of what a step fills
    (transformers sizes it by free memory, on CPU the machine's RAM, allocated at every call: as
    gpuscale/recipes/grpo_mtl/trainer.py:continuous_cache_on_cpu)."""
    fields = {key: dict(value) if isinstance(value, dict) else value for key, value in STOCK_GRPO[variant].items()}
    if fields.get("use_transformers_continuous_batching") and not on_cuda():
        pages = -(-(256 + args.grpo_completion_tokens) // 256)
        config = fields.setdefault("transformers_continuous_batching_config", {})
        config["num_blocks"] = args.grpo_prompts * args.grpo_generations * pages
    return fields


def stock_grpo(args, rows, tokenizer, variant: str, micro: int) -> dict:
    """Stock GRPOTrainer in `variant` of STOCK_GRPO, `micro` completions a micro-batch (accumulation makes
    up the step's prompts x generations), beta 0. Generation is timed around TRL's `_generate` (a device
    sync either side); the rest of a step is its training part."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    generation: list[float] = []

    class TimedGRPO(GRPOTrainer):
        def _generate(self, prompts):
            synchronize()
            started = time.perf_counter()
            result = super()._generate(prompts)
            synchronize()
            generation.append(time.perf_counter() - started)
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
                            max_steps=grpo_steps(args), logging_steps=1, report_to="none", save_strategy="no",
                            disable_tqdm=True, learning_rate=1e-6, seed=0, gradient_checkpointing=False,
                            **precision_args(), **grpo_variant_fields(args, variant))
        trainer = TimedGRPO(model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                            callbacks=[timer])
        trainer.train()
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args.grpo_warm_up:]
    generated = generation[args.grpo_warm_up:]
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    del trainer, model
    return {"side": "stock-grpo", "variant": variant, "micro_batch": micro, "gradient_checkpointing": checkpointing,
            "step_seconds_median": statistics.median(steps), "step_spread": spread(steps), "timed_steps": len(steps),
            "generation_seconds_per_step": statistics.median(generated),
            "training_seconds_per_step": statistics.median(s - g for s, g in zip(steps, generated))}


def try_stock_grpo(args, rows, tokenizer, variant: str, micro: int) -> dict:
    import torch

    try:
        return stock_grpo(args, rows, tokenizer, variant, micro)
    except torch.cuda.OutOfMemoryError:
        return {"side": "stock-grpo", "variant": variant, "micro_batch": micro, "out_of_memory": True}
    except Exception as error:  # a path this stack cannot run: its reason, and on to the next
        return {"side": "stock-grpo", "variant": variant, "micro_batch": micro, "error": one_line(error)}
    finally:
        release()


def grpo_lines(stock: list[dict], best: dict | None) -> dict[str, str]:
    """print_table's lines of the stock GRPO runs: each variant at each micro-batch it ran."""
    lines = {}
    for row in stock:
        name = f"{row['variant']} (micro {row['micro_batch']})"
        if "step_seconds_median" not in row:
            lines[name] = f"not run: {row.get('error', 'out of memory')[:120]}"
            continue
        mark = "  <- best" if row is best else ""
        lines[name] = (f"{row['step_seconds_median']:.3f}, {row['generation_seconds_per_step']:.3f}, "
                       f"{row['training_seconds_per_step']:.3f} (step spread {row['step_spread'] or 0:.0%}){mark}")
    return lines


def gpuscale_grpo(args, compile: bool = False) -> dict:
    """A real `gpuscale run --recipe grpo-mtl` at the same shape, generator=engine, batch_size auto;
    with `compile`, the engine's decode step compiled and replayed as CUDA graphs (`compile=true`)."""
    from benchruns import gpuscale_run

    settings = {"generator": "engine", "compile": str(compile).lower(), "num_generations": args.grpo_generations,
                "prompts_per_step": args.grpo_prompts, "max_completion_length": args.grpo_completion_tokens,
                "max_steps": grpo_steps(args), "learning_rate": 1e-6, "temperature": 1.0, "beta": 0.0,
                "eval_examples": 0, "save_model": "false", "max_examples": args.grpo_prompts * grpo_steps(args)}
    arguments = ["--recipe", "grpo-mtl", "--gpus", "1", "--model", args.model,
                 "--precision", "bf16" if on_cuda() else "auto"]
    for key, value in settings.items():
        arguments += ["--set", f"{key}={value}"]
    summary = gpuscale_run(arguments)["summary"]
    return {"side": "gpuscale-grpo", "batch_size": summary.get("batch_size"),
            **{key: summary.get(key) for key in ("step_seconds_median", "generation_seconds_per_step",
                                                 "training_seconds_per_step", "mfu", "liger_kernels")},
            "command": "gpuscale run " + " ".join(arguments)}


def grpo_comparison(args, tokenizer, log) -> dict:
    """The first stock variant at each micro-batch, the one whose training part is the shortest kept for
    the other variants; the fastest step of them all is the stock figure."""
    rows = grpo_rows_for(args, tokenizer)
    completions = args.grpo_prompts * args.grpo_generations
    first, *others = args.grpo_stock_variants
    stock = []
    for micro in (int(m) for m in args.grpo_stock_micro.split(",") if completions % int(m) == 0):
        stock.append(try_stock_grpo(args, rows, tokenizer, first, micro))
        log(stock[-1])
    ran = [r for r in stock if "step_seconds_median" in r]
    micro = min(ran, key=lambda r: r["training_seconds_per_step"])["micro_batch"] if ran else stock[-1][
        "micro_batch"]
    for variant in others:
        stock.append(try_stock_grpo(args, rows, tokenizer, variant, micro))
        log(stock[-1])
    ran = [r for r in stock if "step_seconds_median" in r]
    best = min(ran, key=lambda r: r["step_seconds_median"]) if ran else None
    figures = {"stock": stock, "stock_micro_batch": micro, "stock_best": best,
               "stock_not_run": {r["variant"]: r.get("error", "out of memory") for r in stock
                                 if "step_seconds_median" not in r}}
    print_table("stock GRPOTrainer variant        step, generation, training (s)", grpo_lines(stock, best))
    for name, compile in (("gpuscale", False), ("gpuscale_compiled", True))[: 2 if args.grpo_compiled else 1]:
        mine = gpuscale_grpo(args, compile)
        log(mine)
        figures[name] = mine
        if best:
            figures[f"step_stock_over_{name}"] = best["step_seconds_median"] / mine["step_seconds_median"]
            figures.update({f"{part}_stock_over_{name}": best[f"{part}_seconds_per_step"] / mine[
                f"{part}_seconds_per_step"] for part in ("generation", "training")})
    return figures


def main(argv=None) -> dict:
    args = parse(argv)
    # One GPU: with several visible, stock Trainer wraps the model in DataParallel and GRPOTrainer refuses
    # to start (2 x H200, 2026-11-27); gpuscale's runs here ask for one GPU anyway.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    import torch

    from gpuscale.data.cards import model_flops_shape, training_flops_per_token

    only = set(filter(None, args.only.split(","))) or {"stock", "gpuscale", "variants", "sweep", "packed", "grpo"}
    card = torch.cuda.get_device_name(0) if on_cuda() else "cpu"
    tokenizer = tokenizer_for(args.model)
    dataset = make_rows(args.rows, args.row_tokens, len(tokenizer))
    args.mean_row_tokens = statistics.mean(len(ids) for ids in dataset["input_ids"])
    matmul, layers, width = model_flops_shape(model_config(args.model))
    flops = training_flops_per_token(matmul, layers, width, args.row_tokens / 2)
    rows: list[dict] = []

    def log(row: dict) -> None:
        rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "batch_size_reason"}
        print(shown, flush=True)

    steps = args.warm_up + args.steps
    stock = []
    if "stock" in only:
        for variant in args.stock_variants:
            stock += sweep_stock_variant(args, variant, dataset, tokenizer, flops, card, log)
    if os.environ.get("GPUSCALE_HOME") is None:  # the grpo side's real run keeps its history apart
        os.environ["GPUSCALE_HOME"] = tempfile.mkdtemp(prefix="gpuscale-bench-train-")
    best = best_of(stock)
    step_rows = rows_for_gpuscale(best) if best else args.step_rows
    figures = {"rows": rows, "stock_variants": stock_summary(stock) if stock else {}, "stock_best": best,
               "step_rows": step_rows}
    if stock:
        print_table(f"{'stock SFTTrainer variant':<32} {'best batch':>10} {'tokens/s':>10}",
                    sft_lines(figures["stock_variants"], best))
    if "gpuscale" in only:
        figures.update(compare_sft(args, dataset, tokenizer, step_rows, best, flops, card, log))
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
    if "packed" in only:
        packed_rows = max(8, step_rows * args.row_tokens // args.pack_length // 8 * 8)
        figures["packed"] = gpuscale_sft(args, dataset, tokenizer, packed_rows, steps, flops, card, packing=True,
                                         gpu_memory_share=args.pack_share)
        log(figures["packed"])
    if args.profile:  # a run of its own: the profiler's overhead stays out of every timed figure
        gpuscale_sft(args, dataset, tokenizer, step_rows, args.warm_up + 1, flops, card, profile=args.profile)
    if "grpo" in only:
        figures["grpo"] = grpo_comparison(args, tokenizer, log)
    swept = [r for r in sweep if not r.get("out_of_memory")]
    if "gpuscale_tokens_per_s" in figures and swept:
        figures["auto_over_best_micro_batch"] = figures["gpuscale_tokens_per_s"] / max(
            r["tokens_per_s"] for r in swept)
    print({k: v for k, v in figures.items() if k.startswith(("ratio", "auto", "stock_spread", "gpuscale_spread"))},
          flush=True)
    if "grpo" in figures:
        print({k: v for k, v in figures["grpo"].items() if "_over_" in k}, flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_result("sft", "train-speed", settings, figures, out=args.out)
    return figures


if __name__ == "__main__":
    main()
