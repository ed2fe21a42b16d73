"""probe: does every GPU work, how fast, at what memory? The node check.

Each rank first measures its card alone (the node check's first part, below), then loads the
model, prefills `batch_size` random prompts of `prompt_tokens` tokens, then runs `steps` greedy
decode steps with the KV cache, timing each one. It reports tokens/s, step time and peak memory per
rank; rank 0 gathers them into the run's summary. It exercises the whole spine: launcher, ranks,
metrics, telemetry and store.

The node check, on every rank: device memory bandwidth (a device-to-device copy) and dense matmul
TFLOP/s in the run's dtype, before the model is loaded; after the decode loop, decode tokens/s
through the generation engine at batch 1 (latency) and at `batch_size` (throughput: what
`--batch-size auto` tunes), batch-1 decode as a share of its floor (the weights a step reads, at the
copy's bandwidth), and the all-reduce bus bandwidth across the ranks (nccl on GPUs, gloo on CPU ranks).
The decode figures run the engine as it runs by default, its fastest path (on a GPU the compiled step
replayed as a CUDA graph; on CPU ranks the uncompiled one), and time its decode steps as
bench/generation.py does (engines/generation/speed.py: a call of `node_check_new_tokens` new tokens less a
call of 1);
the first call at each batch compiles the step, lapped apart. Each figure is timed over repeats (the
engine's over `decode_calls` calls of each length), whose spread says how far the measurement itself
can be trusted. Rank 0 flags a GPU more than 15% below its peers where the gap is also wider than that
spread, and names the gaps it cannot judge (data/node_check.py); app/views/node_check.py writes the
table. The sizes scale with the device (MEASURE_SIZES): large enough on a GPU to reach its bandwidth,
small on CPU ranks.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from pydantic import Field

from gpuscale.data.node_check import DecodeCalls, Repeats, floor_share, repeats_rate
from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.runs import heartbeat
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
    # Not the node check's decode figures (one GPU's decode steps through the engine as it runs by
    # default, its compiled step on a GPU: data/figures.py's ENGINE_DECODE).
    figure_notes = {"tokens_per_s": "decode steps alone, all ranks together, through transformers' forward with "
                                    "its KV cache; the prefill and warm-up steps untimed"}
    smoke_settings = {"steps": 2, "prompt_tokens": 4, "warmup_steps": 0, "batch_size": 2}
    tuning = Tuning(figure="tokens_per_s", knob="sequences decoded together per rank",
                    shape_settings=("prompt_tokens",), start=8,
                    not_shaping=("steps",))  # how many decode steps a trial times, not their size

    def run(self, settings: Settings, ctx, reporter) -> None:
        run_probe(settings, ctx, reporter)

    def trial_session(self, settings: Settings, ctx):
        return probe_trial_session(settings, ctx)


def load_probe_model(settings: Settings, ctx):
    from gpuscale.data import models

    if settings.model in models.RANDOM_CONFIGS:
        # Made on the GPU in the run's dtype: random weights serve the probe whatever their values.
        on_gpu = ctx.device.type == "cuda"
        model = models.build_random_model(settings.model, seed=settings.seed, device=ctx.device if on_gpu else None,
                                          dtype=ctx.dtype if on_gpu else None)
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

    from gpuscale.data import step_phases as phases
    from gpuscale.data.seeds import derived_seed
    from gpuscale.engines import step_phases
    from gpuscale.recipes.shared.device_trials import out_of_memory_names

    laps = Laps()
    laps.lap("start-up")
    # The card's own figures first, in a fresh process: measured after the decode loop's batch had
    # come and gone, the same copy read 10% under plain torch's on every GPU of a 4 x H200 node
    # (bench/RESULTS.md).
    hardware = hardware_figures(ctx, laps)
    model = load_probe_model(settings, ctx)
    laps.lap("model load")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(derived_seed(settings.seed, "prompts", ctx.rank))
    prompts = torch.randint(0, vocab, (settings.batch_size, settings.prompt_tokens), generator=generator)
    reporter.total(settings.steps)
    step_times = []
    cache_kwarg = cache_name(model)
    with torch.inference_mode():
        ctx.synchronize()
        start = time.perf_counter()
        step_phases.restart(phases.PREFILL)  # in the first logged step, which the summary leaves out
        out = model(input_ids=prompts.to(ctx.device), use_cache=True)
        ctx.synchronize()
        prefill_s = time.perf_counter() - start
        cache, next_tokens = getattr(out, cache_kwarg), out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(settings.warmup_steps + settings.steps):
            step_phases.switch(phases.DECODE)  # a step: one decode step, then its record written
            start = time.perf_counter()
            with out_of_memory_names(settings.batch_size, step + 1, settings.warmup_steps + settings.steps):
                out = model(input_ids=next_tokens, use_cache=True, **{cache_kwarg: cache})
            next_tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            ctx.synchronize()
            elapsed = time.perf_counter() - start
            step_phases.switch(phases.LOG)
            if step >= settings.warmup_steps:
                step_times.append(elapsed)
                reporter.log(
                    step=step - settings.warmup_steps + 1, tokens=settings.batch_size, samples=0,
                    step_time_ms=elapsed * 1000, mem_mb=ctx.peak_memory_mb(),
                )
    step_phases.restart()  # the decode loop is done: the node check's measurements are no steps
    mine = {
        "rank": ctx.rank,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "tokens_per_s": settings.batch_size * len(step_times) / sum(step_times),
        "step_time_ms_median": statistics.median(step_times) * 1000,
        "prefill_tokens_per_s": settings.batch_size * settings.prompt_tokens / prefill_s,
        "peak_mem_mb": ctx.peak_memory_mb(),
    }
    # The decode loop's KV cache goes before the node check's engine makes its own at the same batch
    # (a batch tuned to fill the card would not fit twice), and back to the device: the engine's CUDA
    # graphs allocate from a pool of their own.
    del out, cache, next_tokens
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    laps.lap("decode loop")
    reporter.beat(heartbeat.EVALUATE)  # the node check: measurements, not steps, and collectives among them
    mine.update(hardware, **node_check(model, settings, ctx, laps))
    mine.update(decode_floor(model, mine))
    print(laps.line(), flush=True)
    everyone = ctx.gather(mine)
    if ctx.is_main:
        from gpuscale.recipes.shared.summary import summary_opening

        reporter.summary(
            {
                **summary_opening(ctx),
                **node_check_summary(everyone, settings),
                "tokens_per_s": sum(r["tokens_per_s"] for r in everyone),
                "tokens_per_s_per_rank": [round(r["tokens_per_s"], 1) for r in everyone],
                "step_time_ms_median": statistics.median(r["step_time_ms_median"] for r in everyone),
                "peak_mem_mb_per_rank": [round(r["peak_mem_mb"], 1) for r in everyone],
                "devices": [r["device"] for r in everyone],
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )


@dataclass(frozen=True)
class MeasureSizes:
    copy_mib: int  # bytes copied device to device a repeat (read and written: twice this moved)
    matmul_n: int  # square matrices of n x n multiplied
    allreduce_mib: int  # bytes all-reduced a rank a repeat
    repeats: int  # timed repeats of each, after one untimed
    decode_calls: int  # timed generate calls of each length of the decode figures, after one untimed
    decode_new_tokens: int  # new tokens of the longer of those calls, at least (the probe's `steps` if more)


# On a GPU large enough to reach the card's bandwidth and peak (as nccl-tests and bandwidthTest use
# hundreds of MiB), and repeated long enough (a few tenths of a second) for the clocks to settle: 50
# matmuls of 8192 spread 8% between the GPUs of one node. On CPU ranks small, so the tests stay fast;
# ten repeats of a fraction of a millisecond each, so that their spread shows a rank preempted by its
# peer or the machine's other work (a decode call takes a fraction of a second there: two of each length).
# A GPU's decode calls at least 256 tokens long, not the probe's 32: a batch-1 step (the difference of two calls over
# their tokens) from calls of 32 tokens (about 24 ms a call) was 5.2% off bench/generation.py's at the same shape;
# from calls of 256, 0.5% and 4.3% off in two calls (bench/RESULTS.md: the node check's decode "with calls of 256
# new tokens").
MEASURE_SIZES = {
    "cuda": MeasureSizes(copy_mib=1024, matmul_n=8192, allreduce_mib=256, repeats=200, decode_calls=3,
                         decode_new_tokens=256),
    "cpu": MeasureSizes(copy_mib=8, matmul_n=256, allreduce_mib=1, repeats=10, decode_calls=2, decode_new_tokens=2),
}


def measure_sizes(device) -> MeasureSizes:
    return MEASURE_SIZES["cuda" if device.type == "cuda" else "cpu"]


def timed(work, repeats: int, ctx) -> list[float]:
    """Seconds each of `repeats` calls of `work` took, after as many untimed ones (allocation, kernel
    choice, and the GPU's clocks, which may still be low after the host-bound decode loop). On a GPU by
    CUDA events between the queued calls, as bandwidthTest times a copy: the device's time, not the
    host's launches and wake-ups."""
    import torch

    for _ in range(repeats):
        work()
    ctx.synchronize()
    if ctx.device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        events[0].record()
        for event in events[1:]:
            work()
            event.record()
        events[-1].synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in zip(events, events[1:])]
    seconds = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start_s)
    return seconds


def copy_repeats(ctx, sizes: MeasureSizes) -> Repeats:
    """Device memory bandwidth: bytes read plus bytes written by a device-to-device copy, per second
    (as CUDA's bandwidthTest counts a device-to-device copy), in GB/s, with its repeats' spread."""
    import torch

    source = torch.empty(sizes.copy_mib * 2**20, dtype=torch.uint8, device=ctx.device)
    target = torch.empty_like(source)
    return repeats_rate(2 * source.numel() / 1e9, timed(lambda: target.copy_(source), sizes.repeats, ctx))


def copy_gb_per_s(ctx, sizes: MeasureSizes) -> float:
    return copy_repeats(ctx, sizes).value


def matmul_repeats(ctx, sizes: MeasureSizes) -> Repeats:
    """Dense matmul throughput in the run's dtype (bf16 on a GPU that has it), TFLOP/s: 2n^3 FLOPs a
    product; with its repeats' spread."""
    import torch

    n = sizes.matmul_n
    a, b = (torch.randn(n, n, device=ctx.device).to(ctx.dtype) for _ in range(2))
    return repeats_rate(2 * n**3 / 1e12, timed(lambda: torch.mm(a, b), sizes.repeats, ctx))


def matmul_tflops(ctx, sizes: MeasureSizes) -> float:
    return matmul_repeats(ctx, sizes).value


def allreduce_seconds(ctx, sizes: MeasureSizes) -> float | None:
    """Seconds this rank took for one all-reduce of `allreduce_mib` MiB (the mean of the repeats);
    None on a single rank, which has nothing to reduce with."""
    if ctx.world_size < 2:
        return None
    import torch
    import torch.distributed as dist

    tensor = torch.ones(sizes.allreduce_mib * 2**20 // 4, dtype=torch.float32, device=ctx.device)
    dist.barrier()
    return statistics.mean(timed(lambda: dist.all_reduce(tensor), sizes.repeats, ctx))


def link_gb_per_s(ctx, sizes: MeasureSizes) -> dict[str, Repeats]:
    """Each link of this rank to another, `"<a>-<b>"` -> GB/s each way with its repeats' spread: the
    pair sends each other `allreduce_mib` MiB at once (both directions together), bytes / time. Empty
    on one rank."""
    if ctx.world_size < 2:
        return {}
    import torch
    import torch.distributed as dist

    from gpuscale.data.node_check import pair_rounds

    outgoing = torch.ones(sizes.allreduce_mib * 2**20 // 4, dtype=torch.float32, device=ctx.device)
    incoming = torch.empty_like(outgoing)
    links = {}
    for pairs in pair_rounds(ctx.world_size):
        partner = next((b if a == ctx.rank else a for a, b in pairs if ctx.rank in (a, b)), None)
        dist.barrier()
        if partner is None:
            continue
        seconds = timed(partial(exchange, outgoing, incoming, partner), sizes.repeats, ctx)
        low, high = sorted((ctx.rank, partner))
        links[f"{low}-{high}"] = repeats_rate(outgoing.numel() * 4 / 1e9, seconds)
    return links


def exchange(outgoing, incoming, partner: int) -> None:
    """Send `outgoing` to rank `partner` while receiving its tensor into `incoming`."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, outgoing, partner), dist.P2POp(dist.irecv, incoming, partner)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def node_check_new_tokens(steps: int, device) -> int:
    """New tokens a row of the node check's longer generate calls: the probe's `steps`, and at least the device's
    `decode_new_tokens` (at least 2: a decode step is the difference of a call of these and a call of 1)."""
    return max(steps, measure_sizes(device).decode_new_tokens)


@dataclass(frozen=True)
class EngineDecode:
    """One batch's decode figure of the node check, how the engine ran, and the calls it came from."""

    rate: Repeats  # tokens/s of the batch's decode steps
    path: str  # how they ran (engines/generation/speed.py's path_text)
    calls: DecodeCalls


def engine_decode(model, ctx, batch_size: int, settings: Settings, laps: Laps) -> EngineDecode:
    """Decode tokens/s through the generation engine at `batch_size` as it runs by default (its fastest
    path: on a GPU the compiled step, replayed as a CUDA graph), plain sampling after random prompts of
    `prompt_tokens` tokens, timed as bench/generation.py times it (engines/generation/speed.py) over the
    device's `decode_calls`; the first call, which compiles the step and captures its graph, lapped
    apart. A fresh engine, so that one batch size's graphs do not hold memory at the next."""
    measured = timed_engine_decode(model, ctx, batch_size, settings, laps)
    free_device_memory(ctx)  # the engine is gone with timed_engine_decode's frame
    return measured


def timed_engine_decode(model, ctx, batch_size: int, settings: Settings, laps: Laps) -> EngineDecode:
    import torch

    from gpuscale.data.seeds import derived_seed
    from gpuscale.engines.generation import GenerationEngine
    from gpuscale.engines.generation.speed import call_seconds, decode_calls, engine_path, generate_call, path_text

    seed = derived_seed(settings.seed, "node-check", ctx.rank)
    prompts = torch.randint(0, model.config.vocab_size, (batch_size, settings.prompt_tokens),
                            generator=torch.Generator().manual_seed(seed))
    engine = GenerationEngine(model, ())  # its defaults: compiled step and CUDA graphs on a GPU
    run = generate_call(engine, prompts.to(ctx.device), torch.Generator(device=ctx.device).manual_seed(seed))
    new_tokens = node_check_new_tokens(settings.steps, ctx.device)
    call_seconds(lambda: run(new_tokens), ctx.synchronize)  # KV buffers, the step's compile, its graph
    laps.lap(f"{'compile' if engine.compile else 'warm-up'} b={batch_size}")
    calls = decode_calls(run, new_tokens, measure_sizes(ctx.device).decode_calls, ctx.synchronize)
    if not calls.from_difference:
        print(f"node check, batch {batch_size}: the calls' noise exceeds their decode steps; tokens/s from the "
              f"call of {new_tokens} new tokens, its prefill counted", flush=True)
    return EngineDecode(calls.rate(batch_size), path_text(engine_path(engine)), calls)


def engine_rate(model, ctx, prompts, steps: int, timed_calls: int) -> tuple[float, float]:
    """(tokens/s, median seconds of a decode step) of greedy generation of `steps` tokens after each
    of `prompts` (`generation_seconds`): the tuning trial's figure."""
    seconds = generation_seconds(model, ctx, prompts, steps, timed_calls)
    return prompts.shape[0] * steps * len(seconds) / sum(seconds), statistics.median(seconds) / steps


def generation_seconds(model, ctx, prompts, steps: int, timed_calls: int) -> list[float]:
    """Seconds of each of `timed_calls` greedy generations of `steps` tokens after each of `prompts`
    through a fresh engine (CUDA graphs on a GPU, no torch.compile: a trial at each batch size must take
    seconds, not a compile each; fresh, so that one batch size's graphs do not hold memory at the next),
    after one untimed call (buffers, graph capture), the prefill counted."""
    seconds = timed_generation(model, ctx, prompts, steps, timed_calls)
    free_device_memory(ctx)  # the engine is gone with timed_generation's frame
    return seconds


def timed_generation(model, ctx, prompts, steps: int, timed_calls: int) -> list[float]:
    from gpuscale.engines.generation import GenerationEngine, Sampling
    from gpuscale.recipes.shared.device_trials import timed_calls as timed_calls_of

    engine = GenerationEngine(model, (), compile=False)
    greedy = Sampling(temperature=0.0)

    def generate() -> int:
        engine.generate(prompts, steps, greedy)
        return prompts.shape[0] * steps

    return timed_calls_of(generate, timed_calls, ctx.synchronize, warm_up=1)[1]


def free_device_memory(ctx) -> None:
    """A dropped engine's KV buffers and CUDA graphs back to the device now, not at some later garbage
    collection: the next batch size's trial, or the throughput measure after the latency one, needs
    the memory."""
    import gc

    import torch

    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def gpu_name(ctx) -> str:
    """`GPU <index>` as nvidia-smi numbers it (CUDA_VISIBLE_DEVICES maps the rank's device), or
    `cpu <rank>` for a CPU rank."""
    if ctx.device.type != "cuda":
        return f"cpu {ctx.rank}"
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    index = ctx.device.index or 0
    return f"GPU {visible[index] if index < len(visible) else index}"


def hardware_figures(ctx, laps: Laps) -> dict:
    """This rank's card alone: memory bandwidth and matmul throughput, each lapped into `laps`."""
    sizes = measure_sizes(ctx.device)
    return measured({"copy_gb_per_s": lambda: copy_repeats(ctx, sizes),
                     "matmul_tflops": lambda: matmul_repeats(ctx, sizes)}, laps, ctx)


def node_check(model, settings: Settings, ctx, laps: Laps) -> dict:
    """The rest of this rank's node-check figures (data/node_check.py's NODE_FIGURES): decode through
    the engine and how it ran, and its all-reduce time and links, each part's wall time lapped into
    `laps`."""
    sizes = measure_sizes(ctx.device)
    figures = measured({
        "latency_tokens_per_s": lambda: engine_decode(model, ctx, 1, settings, laps),
        "throughput_tokens_per_s": lambda: engine_decode(model, ctx, settings.batch_size, settings, laps),
        "allreduce_seconds": lambda: allreduce_seconds(ctx, sizes),
        "links": lambda: link_gb_per_s(ctx, sizes),
    }, laps, ctx)
    latency, throughput = figures.pop("latency_tokens_per_s"), figures.pop("throughput_tokens_per_s")
    return {"gpu": gpu_name(ctx), "allreduce_mib": sizes.allreduce_mib, **figures,
            "latency_tokens_per_s": latency.rate, "throughput_tokens_per_s": throughput.rate,
            "decode_note": decode_note(latency, throughput, settings.batch_size)}


def decode_note(latency: EngineDecode, throughput: EngineDecode, batch_size: int) -> str:
    """How this rank's decode figures were measured, for the summary: the engine's path at each batch
    (once where they agree) and what was timed."""
    path = latency.path if latency.path == throughput.path else f"b=1 {latency.path}; b={batch_size} {throughput.path}"
    calls = latency.calls
    return (f"{path}; a decode step = (a call of {calls.new_tokens} new tokens - a call of 1) / "
            f"{calls.new_tokens - 1}, medians of {len(calls.long)} calls each, plain sampling "
            f"(bench/generation.py's measure)")


def decode_floor(model, figures: dict) -> dict:
    """Batch-1 decode as a share of its floor on this rank's card: the weights a step reads, at the
    bandwidth its copy measured (`figures`: this rank's copy_gb_per_s and latency_tokens_per_s)."""
    from gpuscale.engines.generation.speed import weight_bytes_read_a_step

    weights = weight_bytes_read_a_step(model)
    return {"decode_weight_bytes": weights, "decode_batch1_floor_share": floor_share(
        weights, figures["copy_gb_per_s"], figures["latency_tokens_per_s"])}


def measured(parts: dict, laps: Laps, ctx) -> dict:
    """Each part measured by every rank at once (a barrier first): CPU ranks share the machine's cores
    and memory, and one rank's copy timed while its peer still loads would compare unlike things."""
    import torch.distributed as dist

    figures = {}
    for name, measure in parts.items():
        if ctx.world_size > 1:
            dist.barrier()
        figures[name] = measure()
        laps.lap(name)
    return figures


class Laps:
    """Wall seconds of each part of the probe on this rank, for its log: where a node check's time
    goes. The first lap counts from the process's start (imports, process group)."""

    def __init__(self):
        import psutil

        self.seconds: dict[str, float] = {}
        self._last = psutil.Process().create_time()

    def lap(self, name: str) -> None:
        now = time.time()
        self.seconds[name], self._last = now - self._last, now

    def line(self) -> str:
        return "probe time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())


def node_check_summary(everyone: list[dict], settings: Settings) -> dict:
    """The summary's node-check figures from every rank's: one figure per rank and per NODE_FIGURES
    name (`copy_gb_per_s_rank_0`: so `gpuscale compare` sets each against another probe's), the
    all-reduce bandwidths (the ranks' mean time, as nccl-tests averages it) and the slow-GPU flags."""
    from gpuscale.data.node_check import (
        NODE_FIGURES,
        bus_bandwidth,
        gpu_gaps,
        link_gaps,
        link_name,
        per_rank_name,
        unjudged,
    )

    gpus = [r["gpu"] for r in everyone]
    notes = {r["decode_note"] for r in everyone}
    summary: dict = {"node_check_gpus": gpus, "throughput_batch_size": settings.batch_size,
                     "node_check_decode": notes.pop() if len(notes) == 1 else
                     "; ".join(f"{r['gpu']}: {r['decode_note']}" for r in everyone),
                     "decode_weight_bytes": everyone[0]["decode_weight_bytes"]}
    for figure in NODE_FIGURES:
        digits = 4 if figure.format == "percent" else 3  # a share: to a hundredth of a percent
        summary.update({per_rank_name(figure.name, r["rank"]): round(r[figure.name].value, digits) for r in everyone})
    times = [r["allreduce_seconds"] for r in everyone if r["allreduce_seconds"] is not None]
    if times:
        nbytes = everyone[0]["allreduce_mib"] * 2**20
        algbw, busbw = bus_bandwidth(nbytes, statistics.mean(times), len(everyone))
        summary.update(allreduce_mib=everyone[0]["allreduce_mib"], allreduce_algbw_gb_per_s=round(algbw / 1e9, 3),
                       allreduce_busbw_gb_per_s=round(busbw / 1e9, 3))
    # A link as its lower rank measured it (both ends time the same exchange).
    links = {pair: gbps for r in everyone for pair, gbps in r["links"].items() if pair.startswith(f"{r['rank']}-")}
    summary.update({link_name(pair): round(gbps.value, 3) for pair, gbps in sorted(links.items())})
    found = [*gpu_gaps(gpus, {f.name: [r[f.name].value for r in everyone] for f in NODE_FIGURES},
                       spreads={f.name: [r[f.name].spread for r in everyone] for f in NODE_FIGURES}),
             *link_gaps({pair: gbps.value for pair, gbps in links.items()}, gpus,
                        spreads={pair: gbps.spread for pair, gbps in links.items()})]
    summary["node_check_flags"] = [gap.line() for gap in found if gap.judged]
    summary["node_check_unjudged"] = unjudged(found)
    return summary


TRIAL_STEPS = 64  # at most this many decode steps a trial (the run decodes `steps`)


@contextmanager
def probe_trial_session(settings: Settings, ctx):
    """The probe's throughput figure at a batch size (what `--batch-size auto` tunes): greedy decode
    of random prompts through the generation engine, whole calls without torch.compile (a compile at
    each batch tried would take minutes; the node check then measures the chosen batch compiled); tokens/s."""
    import torch

    from gpuscale.engines.batch_search import Trial

    model = load_probe_model(settings, ctx)
    generator = torch.Generator().manual_seed(settings.seed)

    def trial(batch_size: int) -> Trial:
        prompts = torch.randint(0, model.config.vocab_size, (batch_size, settings.prompt_tokens), generator=generator)
        rate, seconds = engine_rate(model, ctx, prompts, min(settings.steps, TRIAL_STEPS), timed_calls=2)
        return Trial(batch_size, throughput=rate, step_seconds=seconds)

    yield trial
