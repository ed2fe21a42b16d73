"""probe: does every GPU work, how fast, at what memory?

Each rank loads the model, prefills `batch_size` random prompts of `prompt_tokens` tokens, then runs
`steps` greedy decode steps with the KV cache, timing each one. It reports tokens/s, step time and
peak memory per rank; rank 0 gathers them into the run's summary. It exercises the whole spine:
launcher, ranks, metrics, telemetry and store.
"""

from __future__ import annotations

import inspect
import statistics
import time
from contextlib import contextmanager

from pydantic import Field

from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.runs.settings import RunSettings


class Settings(RunSettings):
    ENV_ALIASES = {"PROBE_STEPS": "steps"}

    batch_size: int = Field(8, ge=1, description="sequences decoded together per rank")
    steps: int = Field(32, ge=1, le=100_000, description="decode steps to time")
    prompt_tokens: int = Field(64, ge=1, le=32_768, description="prompt length before decoding")
    warmup_steps: int = Field(2, ge=0, le=1000, description="untimed decode steps first")


class Probe(Recipe):
    name = "probe"
    summary = "decode speed and memory of a model on every GPU (a health check of the node)"
    settings_cls = Settings
    reads_questions = False  # it decodes made-up prompts of prompt_tokens tokens
    promised_figures = ("world_size", "tokens_per_s", "step_time_ms_median", "peak_mem_mb_per_rank")
    smoke_settings = {"steps": 2, "prompt_tokens": 4, "warmup_steps": 0, "batch_size": 2}
    tuning = Tuning(figure="tokens_per_s", knob="sequences decoded together per rank",
                    shape_settings=("prompt_tokens",), start=8)

    def run(self, settings: Settings, ctx, reporter) -> None:
        run_probe(settings, ctx, reporter)

    def trial_session(self, settings: Settings, ctx):
        return probe_trial_session(settings, ctx)


def load_probe_model(settings: Settings, ctx):
    from gpuscale.data import models

    if settings.model in models.RANDOM_CONFIGS:
        model = models.build_random_model(settings.model, seed=settings.seed)
    else:
        model, _tokenizer = models.load_model(settings.model)
    return model.to(device=ctx.device, dtype=ctx.dtype).eval()


def cache_name(model) -> str:
    """The keyword (and output field) of the KV cache: `cache` in transformers 5 (where the older
    `past_key_values` still works but warns, into `tune`'s output and the rank logs), else
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def run_probe(settings: Settings, ctx, reporter) -> None:
    import torch

    from gpuscale.data.seeds import derived_seed
    from gpuscale.recipes.shared.device_trials import out_of_memory_names

    model = load_probe_model(settings, ctx)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(derived_seed(settings.seed, "prompts", ctx.rank))
    prompts = torch.randint(0, vocab, (settings.batch_size, settings.prompt_tokens), generator=generator)
    reporter.total(settings.steps)
    step_times = []
    cache_kwarg = cache_name(model)
    with torch.inference_mode():
        ctx.synchronize()
        start = time.perf_counter()
        out = model(input_ids=prompts.to(ctx.device), use_cache=True)
        ctx.synchronize()
        prefill_s = time.perf_counter() - start
        cache, next_tokens = getattr(out, cache_kwarg), out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(settings.warmup_steps + settings.steps):
            start = time.perf_counter()
            with out_of_memory_names(settings.batch_size, step + 1, settings.warmup_steps + settings.steps):
                out = model(input_ids=next_tokens, use_cache=True, **{cache_kwarg: cache})
            next_tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            ctx.synchronize()
            elapsed = time.perf_counter() - start
            if step >= settings.warmup_steps:
                step_times.append(elapsed)
                reporter.log(
                    step=step - settings.warmup_steps + 1, tokens=settings.batch_size, samples=0,
                    step_time_ms=elapsed * 1000, mem_mb=ctx.peak_memory_mb(),
                )
    mine = {
        "rank": ctx.rank,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "tokens_per_s": settings.batch_size * len(step_times) / sum(step_times),
        "step_time_ms_median": statistics.median(step_times) * 1000,
        "prefill_tokens_per_s": settings.batch_size * settings.prompt_tokens / prefill_s,
        "peak_mem_mb": ctx.peak_memory_mb(),
    }
    everyone = ctx.gather(mine)
    if ctx.is_main:
        from gpuscale.recipes.shared.common import summary_opening

        reporter.summary(
            {
                **summary_opening(ctx),
                "tokens_per_s": sum(r["tokens_per_s"] for r in everyone),
                "tokens_per_s_per_rank": [round(r["tokens_per_s"], 1) for r in everyone],
                "step_time_ms_median": statistics.median(r["step_time_ms_median"] for r in everyone),
                "peak_mem_mb_per_rank": [round(r["peak_mem_mb"], 1) for r in everyone],
                "devices": [r["device"] for r in everyone],
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )


TRIAL_STEPS = 8  # decode steps timed per trial, after `warmup_steps` (at least 2) untimed ones


@contextmanager
def probe_trial_session(settings: Settings, ctx):
    """The probe's work at a batch size: prefill random prompts, decode; tokens/s of the timed steps."""
    import torch

    from gpuscale.engines.batch_search import Trial
    from gpuscale.recipes.shared.device_trials import timed_steps

    model = load_probe_model(settings, ctx)
    generator = torch.Generator().manual_seed(settings.seed)
    cache_kwarg = cache_name(model)

    def trial(batch_size: int) -> Trial:
        prompts = torch.randint(0, model.config.vocab_size, (batch_size, settings.prompt_tokens), generator=generator)
        with torch.inference_mode():
            out = model(input_ids=prompts.to(ctx.device), use_cache=True)
            state = {"cache": getattr(out, cache_kwarg), "next": out.logits[:, -1].argmax(-1, keepdim=True)}

            def decode_step() -> int:
                out = model(input_ids=state["next"], use_cache=True, **{cache_kwarg: state["cache"]})
                state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
                return batch_size

            rate, seconds = timed_steps(decode_step, min(settings.steps, TRIAL_STEPS), ctx.synchronize,
                                        warm_up=max(2, settings.warmup_steps))
        return Trial(batch_size, throughput=rate, step_seconds=seconds)

    yield trial
