"""The probe's node check against plain torch on the same GPUs, and with one GPU loaded by another process.

    python bench/node_check.py [--model random-qwen2.5-0.5b] [--batch-size auto] [--loaded-gpu 1]

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
from gpuscale.recipes.probe import MEASURE_SIZES  # noqa: E402

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


def timed_run(arguments: list[str]) -> tuple[dict, float]:
    started = time.perf_counter()
    run = gpuscale_run(arguments)
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
probe with no other process on the GPUs."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--batch-size", default="auto", help="the throughput batch (auto: tuned, as a user would)")
    parser.add_argument("--loaded-gpu", type=int, default=1)
    parser.add_argument("--loaded-batch-size", default=None, help="default: the first run's throughput batch")
    parser.add_argument("--out", default=None)
    parser.add_argument("--allreduce-worker", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.allreduce_worker:
        return allreduce_worker(opts.allreduce_worker)
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
