"""The probe's node check against plain torch on the same GPUs, and with one GPU loaded by another process.

    python bench/node_check.py [--model random-qwen2.5-0.5b] [--batch-size auto] [--loaded-gpu 1]
    python bench/node_check.py --decode-agreement [--gpus 1] [--batch-size 1024]   # its decode figures alone
    python bench/node_check.py --decode-agreement --cpu --model random-tiny --precision fp32 --batch-size 2

Three parts, one result file (bench/results/probe/node_check-<date>-<card>.json):
1. `gpuscale run --recipe probe --gpus N` on every visible GPU (the node check as a user runs it),
   its wall time and its table as the CLI prints it;
2. plain torch on the same GPUs, in this process after the run ended, timed with CUDA events
   instead of the probe's clock: a 1 GiB device-to-device copy (GB/s, read plus written) and a bf16
   8192 x 8192 matmul (TFLOP/s) on each GPU, then a 256 MiB a rank all-reduce of fp32 over NCCL
   across all of them (torchrun; busbw = algbw x 2(n-1)/n, as nccl-tests computes it), the same sizes
   as the probe's. Each probe figure over the plain one: the target is within 5%. Beside them, the
   probe's own copy and matmul functions run in this process (`probe_code_in_this_process`): where
   the probe and plain torch disagree, the same code without the rank around it says which differs;
3. the probe again at the first run's throughput batch while another process runs bf16 matmuls on
   `--loaded-gpu`: that GPU must be flagged, and no other.

`--decode-agreement` does this alone instead (bench/results/probe/node_check_decode-<date>-<card>.json):
the probe on `--gpus` GPUs (a random-* model, bf16 by default), then, in this process after the run
ended, bench/generation.py's measure of the engine at its default (its `bench_engine`: on a GPU the
compiled step replayed as a CUDA graph) on each of those GPUs in turn, at the probe's shape: its prompt
tokens, its calls' new tokens (probe.node_check_new_tokens), batch 1 and its full batch, its number of calls. Each
probe decode figure over bench/generation.py's (tokens/s; the target: within 5%), and batch-1 decode's floor
share beside bench/generation.py's (its floor, the weights at its own copy's bandwidth, over its step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from benchruns import gpuscale_run  # noqa: E402
from record import write_result  # noqa: E402

from gpuscale.app.views.node_check import node_check_lines  # noqa: E402
from gpuscale.data.node_check import per_rank_name  # noqa: E402
from gpuscale.recipes.probe import MEASURE_SIZES, node_check_new_tokens  # noqa: E402

SIZES = MEASURE_SIZES["cuda"]  # the probe's own sizes and repeats on a GPU
COPY_BYTES, MATMUL_N, ALLREDUCE_BYTES, REPEATS = (SIZES.copy_mib * 2**20, SIZES.matmul_n, SIZES.allreduce_mib * 2**20,
                                                  SIZES.repeats)
AGREEMENT = 0.05  # the target: each figure within 5% of plain torch's
LOADER = ("import sys, torch\na = torch.randn(8192, 8192, device='cuda:' + sys.argv[1], dtype=torch.bfloat16)\n"
          "while True:\n    a = (a @ a).clamp_(-1, 1)\n")


def event_seconds(work, repeats: int = REPEATS) -> float:
    """Seconds a call of `work` takes on the current GPU, by CUDA events over `repeats` calls after
    as many untimed ones (as the probe's `timed`)."""
    import torch

    for _ in range(repeats):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def copy_gb_per_s() -> float:
    """A device-to-device copy of COPY_BYTES on the current GPU: bytes read plus written a second."""
    import torch

    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * COPY_BYTES / event_seconds(lambda: target.copy_(source)) / 1e9


def matmul_tflops() -> float:
    import torch

    a, b = (torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * MATMUL_N**3 / event_seconds(lambda: torch.mm(a, b)) / 1e12


def plain_gpu_figures(index: int) -> dict:
    import torch

    with torch.cuda.device(index):
        figures = {"copy_gb_per_s": copy_gb_per_s(), "matmul_tflops": matmul_tflops()}
        torch.cuda.empty_cache()
    return figures


def probe_code_figures(device) -> dict:
    """The probe's own copy and matmul measures (gpuscale/recipes/probe.py) run in this process: the
    rank's code without the rank's surroundings (its model, decode loop, process group). Where the
    probe and plain torch disagree, this says whether the code or the surroundings differ."""
    from types import SimpleNamespace

    import torch

    from gpuscale.recipes import probe

    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    ctx = SimpleNamespace(device=device, dtype=torch.bfloat16 if on_gpu else torch.float32,
                          synchronize=(lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None))
    sizes = probe.measure_sizes(device)
    figures = {"copy_gb_per_s": probe.copy_gb_per_s(ctx, sizes), "matmul_tflops": probe.matmul_tflops(ctx, sizes)}
    if on_gpu:
        torch.cuda.empty_cache()
    return figures


def allreduce_worker(out: str) -> None:
    """One torchrun rank: the copy again, every GPU at once (as the probe's ranks copy), then an
    all-reduce of ALLREDUCE_BYTES of fp32 over NCCL (the probe's dtype); rank 0 writes each rank's
    copy GB/s, and algbw and busbw of the ranks' mean time (nccl-tests' default average)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dist.barrier()  # every GPU copies at once, as the probe's ranks do
    copies = [None] * world
    dist.all_gather_object(copies, copy_gb_per_s())
    torch.cuda.empty_cache()
    tensor = torch.ones(ALLREDUCE_BYTES // 4, dtype=torch.float32, device="cuda")
    dist.barrier()
    seconds = torch.tensor([event_seconds(lambda: dist.all_reduce(tensor))], device="cuda")
    dist.all_reduce(seconds)
    if rank == 0:
        algbw = ALLREDUCE_BYTES / (seconds.item() / world) / 1e9
        with open(out, "w") as handle:
            json.dump({"allreduce_algbw_gb_per_s": algbw, "allreduce_busbw_gb_per_s": algbw * 2 * (world - 1) / world,
                       "copy_gb_per_s_all_gpus_at_once": copies}, handle)
    dist.destroy_process_group()


def plain_allreduce(gpus: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                        os.path.abspath(__file__), "--allreduce-worker", out.name], check=True)
        return json.loads(open(out.name).read())


def agreement(summary: dict, plain: list[dict], plain_allreduce_figures: dict) -> list[dict]:
    """Each probe figure beside plain torch's: ratio and whether it is within AGREEMENT."""
    rows = []
    for index, figures in enumerate(plain):
        for name, value in figures.items():
            probe = summary.get(per_rank_name(name, index))
            rows.append({"gpu": index, "figure": name, "probe": probe, "plain": value})
    for name, value in plain_allreduce_figures.items():
        if name.startswith("allreduce"):
            rows.append({"gpu": "all", "figure": name, "probe": summary.get(name), "plain": value})
    for row in rows:
        row["ratio"] = row["probe"] / row["plain"] if row["probe"] and row["plain"] else None
        row["within_5_percent"] = row["ratio"] is not None and abs(row["ratio"] - 1) <= AGREEMENT
    return rows


def probe_time_line(run_id: int) -> str | None:
    """Rank 0's `probe time: ...` line: where the probe's wall time went, part by part."""
    logs = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "logs", str(run_id), "--rank", "0"],
                          capture_output=True, text=True)
    return next((line.strip() for line in logs.stdout.splitlines() if "probe time:" in line), None)


def timed_run(arguments: list[str], env: dict | None = None) -> tuple[dict, float]:
    started = time.perf_counter()
    run = gpuscale_run(arguments, env)
    return run, time.perf_counter() - started


def loaded_run(arguments: list[str], loaded_gpu: int) -> tuple[dict, list[str], bool]:
    loader = subprocess.Popen([sys.executable, "-c", LOADER, str(loaded_gpu)])
    try:
        time.sleep(10)  # its CUDA context and first kernels
        run, _ = timed_run(arguments)
    finally:
        loader.kill()
        loader.wait()
    flags = run["summary"].get("node_check_flags") or []
    name = run["summary"]["node_check_gpus"][loaded_gpu]
    gpu_flags = [flag for flag in flags if not flag.startswith("link ")]
    right = bool(gpu_flags) and all(flag.startswith(f"{name}:") for flag in gpu_flags) \
        and all(name in flag for flag in flags)  # a slow link, if any, is the loaded GPU's
    return run, flags, right


BASELINE = """Baseline: plain torch measuring the same things on the same GPUs in the same call, at the probe's sizes
(copy, matmul, all-reduce), timed by CUDA events, each GPU alone and all at once; for the flag, the same
probe with no other process on the GPUs. For --decode-agreement: bench/generation.py's measure of the engine
at its default configuration, on each of the probe's GPUs alone after the run, at the probe's shape."""

# The node check's decode figures, each at its batch (None: the probe's full batch).
DECODE_FIGURES = (("latency_tokens_per_s", 1), ("throughput_tokens_per_s", None))


def generation_bench():
    """bench/generation.py as a module (bench/ is on the path)."""
    import generation

    return generation


def torch_device(gpu: str):
    """The probe's name of a rank's device (`GPU 3` as nvidia-smi numbers it, `cpu 0`) as this process's
    torch device (CUDA_VISIBLE_DEVICES maps nvidia-smi's numbers to torch's)."""
    import torch

    kind, number = gpu.split()
    if kind == "cpu":
        return torch.device("cpu")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return torch.device("cuda", visible.index(number) if visible else int(number))


def bench_decode(device, settings: dict, batches: list[int], precision: str) -> list[dict]:
    """bench/generation.py's measure of the engine at its default on `device` at the probe's shape (its
    model, seed, prompt tokens, decode steps), at each of `batches`: ms a step, its first call's seconds
    (the compile), how it ran; its floor (weights / its copy's bandwidth); on a GPU, batch 1 again with
    attention kept off cuDNN as the ranks keep it (engines/distributed.py's avoid_cudnn_attention), which
    bench/generation.py does not: a gap between the two figures that this closes is that setting's."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)  # the copy's CUDA events, and the engine's streams, on this GPU
    generation = generation_bench()
    dtype = generation.resolve_dtype(precision, device)
    model = generation.build_random_model(settings["model"], seed=settings["seed"]).to(device=device, dtype=dtype)
    model.eval()
    sizes = MEASURE_SIZES["cuda" if device.type == "cuda" else "cpu"]
    new_tokens = node_check_new_tokens(settings["steps"], device)
    args = generation.parse_args(["--device", str(device), "--prompt-tokens", str(settings["prompt_tokens"]),
                                  "--new-tokens", str(new_tokens), "--repeats", str(sizes.decode_calls),
                                  "--seed", str(settings["seed"])])
    floor_ms = generation.weight_bytes_read_a_step(model) / generation.copy_bandwidth(device, sizes.copy_mib) * 1e3

    def measure(batch: int) -> dict:
        prompts = torch.randint(0, model.config.vocab_size, (batch, settings["prompt_tokens"]),
                                generator=torch.Generator().manual_seed(settings["seed"] + batch)).to(device)
        with torch.no_grad():
            measured = generation.bench_engine(model, prompts, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return measured

    measured = [{"batch": batch, "floor_ms_per_step": floor_ms, **measure(batch)} for batch in batches]
    if device.type == "cuda":
        from gpuscale.engines.distributed import avoid_cudnn_attention

        allowed = torch.backends.cuda.cudnn_sdp_enabled()
        avoid_cudnn_attention()
        try:
            measured[0]["ms_per_step_cudnn_attention_off"] = measure(1)["ms_per_step"]
        finally:
            torch.backends.cuda.enable_cudnn_sdp(allowed)
    return measured


def decode_rows(summary: dict, settings: dict, precision: str) -> list[dict]:
    """Each rank's decode figures beside bench/generation.py's on its device, at the same batch."""
    from gpuscale.engines.generation.speed import path_text

    full = summary["throughput_batch_size"]
    batches = [batch or full for _, batch in DECODE_FIGURES]
    rows = []
    for rank, gpu in enumerate(summary["node_check_gpus"]):
        for (figure, _), bench in zip(DECODE_FIGURES, bench_decode(torch_device(gpu), settings, batches, precision)):
            probe = summary[per_rank_name(figure, rank)]
            bench_rate = bench["batch"] / (bench["ms_per_step"] / 1e3)
            row = {"gpu": gpu, "figure": figure, "batch": bench["batch"], "probe_tokens_per_s": probe,
                   "bench_tokens_per_s": bench_rate, "probe_ms_per_step": bench["batch"] / probe * 1e3,
                   "bench_ms_per_step": bench["ms_per_step"], "ratio": probe / bench_rate,
                   "within_5_percent": abs(probe / bench_rate - 1) <= AGREEMENT, "bench_warmup_s": bench["warmup_s"],
                   "bench_path": path_text(bench)}
            if bench["batch"] == 1:
                row.update(probe_floor_share=summary[per_rank_name("decode_batch1_floor_share", rank)],
                           bench_floor_share=bench["floor_ms_per_step"] / bench["ms_per_step"])
            if "ms_per_step_cudnn_attention_off" in bench:  # bench/generation.py's step as a rank sets up its GPU
                off = bench["ms_per_step_cudnn_attention_off"]
                row.update(bench_ms_per_step_cudnn_attention_off=off,
                           ratio_cudnn_attention_off=probe / (bench["batch"] / off * 1e3))
            rows.append(row)
    return rows


def decode_agreement(opts) -> None:
    """`--decode-agreement`: the probe, then bench/generation.py's measure at its shape; one result file."""
    import torch

    from gpuscale.data.models import RANDOM_CONFIGS

    if opts.model not in RANDOM_CONFIGS:
        sys.exit(f"--model {opts.model}: bench/generation.py measures a random-* model ({', '.join(RANDOM_CONFIGS)})")
    gpus = opts.gpus or (1 if opts.cpu else torch.cuda.device_count())
    if not opts.cpu and not 1 <= gpus <= torch.cuda.device_count():
        sys.exit(f"--gpus {gpus}: {torch.cuda.device_count()} GPUs visible (--cpu for a CPU rank)")
    shape = [*(["--set", f"steps={opts.steps}"] if opts.steps else []),
             *(["--set", f"prompt_tokens={opts.prompt_tokens}"] if opts.prompt_tokens else [])]
    run, wall = timed_run(["--recipe", "probe", "--gpus", str(gpus), "--model", opts.model, "--precision",
                           opts.precision, "--batch-size", opts.batch_size, *shape],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""} if opts.cpu else None)
    table, laps = node_check_lines(run["summary"]), probe_time_line(run["id"])
    print("\n".join(table), f"\nprobe run {run['id']}: {wall:.1f} s wall; rank 0's {laps}", sep="\n", flush=True)
    rows = decode_rows(run["summary"], run["settings"], opts.precision)
    for row in rows:
        print(f"  {row['gpu']} batch {row['batch']}: probe {row['probe_ms_per_step']:.4g} ms a step / "
              f"bench/generation.py {row['bench_ms_per_step']:.4g} ms ({row['bench_path']}): tokens/s ratio "
              f"{row['ratio']:.3f} ({'within' if row['within_5_percent'] else 'NOT within'} 5%)"
              + (f"; floor share {row['probe_floor_share']:.1%} / {row['bench_floor_share']:.1%}"
                 if "probe_floor_share" in row else "")
              + (f"; with attention off cuDNN as in a rank: {row['bench_ms_per_step_cudnn_attention_off']:.4g} ms, "
                 f"ratio {row['ratio_cudnn_attention_off']:.3f}" if "ratio_cudnn_attention_off" in row else ""),
              flush=True)
    write_result("probe", "node_check_decode", vars(opts), {
        "gpus": gpus, "probe_run": run["summary"], "probe_settings": run["settings"], "probe_wall_s": wall,
        "probe_laps_rank_0": laps, "table": table, "rows": rows,
        "all_within_5_percent": all(row["within_5_percent"] for row in rows)},
        out=opts.out, card="cpu" if opts.cpu else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--batch-size", default="auto", help="the throughput batch (auto: tuned, as a user would)")
    parser.add_argument("--loaded-gpu", type=int, default=1)
    parser.add_argument("--loaded-batch-size", default=None, help="default: the first run's throughput batch")
    parser.add_argument("--out", default=None)
    decode = parser.add_argument_group("--decode-agreement: the node check's decode figures beside "
                                       "bench/generation.py's, alone")
    decode.add_argument("--decode-agreement", action="store_true")
    decode.add_argument("--gpus", type=int, default=None, help="the probe's GPUs (default: every visible GPU)")
    decode.add_argument("--cpu", action="store_true", help="one CPU rank, no GPU (the script's test)")
    decode.add_argument("--precision", default="bf16")
    decode.add_argument("--steps", type=int, default=None, help="the probe's decode steps (default: its default)")
    decode.add_argument("--prompt-tokens", type=int, default=None, help="the probe's prompt (default: its default)")
    parser.add_argument("--allreduce-worker", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.allreduce_worker:
        return allreduce_worker(opts.allreduce_worker)
    if opts.decode_agreement:
        return decode_agreement(opts)
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2 or opts.loaded_gpu >= gpus:
        sys.exit(f"--loaded-gpu {opts.loaded_gpu}: needs at least 2 GPUs and a GPU of that index ({gpus} visible)")
    probe = ["--recipe", "probe", "--gpus", str(gpus), "--model", opts.model, "--precision", "bf16"]
    run, wall = timed_run([*probe, "--batch-size", opts.batch_size])
    table = node_check_lines(run["summary"])
    laps = probe_time_line(run["id"])
    print("\n".join(table), f"\nprobe run {run['id']}: {wall:.1f} s wall; rank 0's {laps}", sep="\n", flush=True)
    plain = [plain_gpu_figures(index) for index in range(gpus)]
    plain_reduce = plain_allreduce(gpus)
    rows = agreement(run["summary"], plain, plain_reduce)
    for row in rows:
        print(f"  GPU {row['gpu']} {row['figure']}: probe {row['probe']:.4g} / plain torch {row['plain']:.4g} = "
              f"{row['ratio']:.3f} ({'within' if row['within_5_percent'] else 'NOT within'} 5%)", flush=True)
    probe_code = [probe_code_figures(torch.device("cuda", index)) for index in range(gpus)]
    for index, figures in enumerate(probe_code):
        print(f"  GPU {index}, the probe's code in this process / plain torch: " + ", ".join(
            f"{name} {value:.4g} / {plain[index][name]:.4g}" for name, value in figures.items()), flush=True)
    batch = opts.loaded_batch_size or str(run["summary"]["throughput_batch_size"])
    loaded, flags, right = loaded_run([*probe, "--batch-size", batch], opts.loaded_gpu)
    loaded_table = node_check_lines(loaded["summary"])
    print("\n".join(loaded_table), f"GPU {opts.loaded_gpu} loaded: flagged alone: {right}", sep="\n", flush=True)
    write_result("probe", "node_check", vars(opts), {
        "gpus": gpus, "probe_run": run["summary"], "probe_wall_s": wall, "probe_laps_rank_0": laps, "table": table,
        "plain_torch": plain, "plain_allreduce": plain_reduce, "agreement": rows,
        "probe_code_in_this_process": probe_code,
        "all_within_5_percent": all(row["within_5_percent"] for row in rows),
        "loaded_gpu": opts.loaded_gpu, "loaded_run": loaded["summary"], "loaded_table": loaded_table,
        "loaded_flags": flags, "loaded_gpu_flagged_alone": right}, out=opts.out)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
