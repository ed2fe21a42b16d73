"""On a CUDA machine only: the probe's node check against a plain torch measurement of the same
things in the same session, and a GPU loaded by another process flagged (and no other)."""

import subprocess
import sys
import time

import pytest

from conftest import run_json

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROBE = ["run", "--recipe", "probe", "--model", "random-qwen2.5-0.5b", "--batch-size", "64"]


def plain_torch_figures(device: int) -> tuple[float, float]:
    """(copy GB/s counting read and write, bf16 matmul TFLOP/s) on one GPU, timed with CUDA events."""
    with torch.cuda.device(device):
        source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def seconds(work, repeats: int = 50) -> float:
            for _ in range(5):
                work()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                work()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000 / repeats

        copy = 2 * source.numel() / seconds(lambda: target.copy_(source)) / 1e9
        matmul = 2 * 8192**3 / seconds(lambda: torch.mm(a, b)) / 1e12
    return copy, matmul


def test_the_node_check_agrees_with_plain_torch_within_5_percent(home):
    run = run_json(*PROBE, "--gpus", "1")
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    copy, matmul = plain_torch_figures(0)
    assert summary["copy_gb_per_s_rank_0"] == pytest.approx(copy, rel=0.05), (summary, copy)
    assert summary["matmul_tflops_rank_0"] == pytest.approx(matmul, rel=0.05), (summary, matmul)
    assert summary["latency_tokens_per_s_rank_0"] < summary["throughput_tokens_per_s_rank_0"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_gpu_loaded_by_another_process_is_flagged_and_no_other(home):
    count = torch.cuda.device_count()
    load = ("import torch\na = torch.randn(8192, 8192, device='cuda:1', dtype=torch.bfloat16)\n"
            "while True:\n    a = (a @ a).clamp_(-1, 1)\n")
    loader = subprocess.Popen([sys.executable, "-c", load])
    try:
        time.sleep(10)  # the loader's CUDA context and its first kernels
        run = run_json(*PROBE, "--gpus", str(count))
    finally:
        loader.kill()
        loader.wait()
    assert run["status"] == "succeeded", run["error"]
    flags = run["summary"]["node_check_flags"]
    gpu_flags = [flag for flag in flags if not flag.startswith("link ")]
    assert gpu_flags and all(flag.startswith("GPU 1:") for flag in gpu_flags), flags
    assert all("GPU 1" in flag for flag in flags), flags  # a slow link, if any, is one of GPU 1's
