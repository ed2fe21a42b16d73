"""On a CUDA machine only: the probe's node check against a plain torch measurement of the same
things in the same session, and a GPU loaded by another process flagged (and no other)."""

import subprocess
import sys
import time

import pytest
from bench_loader import load_bench

from conftest import run_json

torch = pytest.importorskip("torch")
# `alone`: a timing comparison; the acceptance check runs it after its runs, on idle GPUs.
pytestmark = [pytest.mark.gpu, pytest.mark.alone, pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROBE = ["run", "--recipe", "probe", "--model", "random-qwen2.5-0.5b", "--batch-size", "64"]


def node_check_bench():
    """bench/node_check.py: its plain torch measures (CUDA events, the probe's sizes) and its loader."""
    return load_bench("node_check.py")


def test_the_node_check_agrees_with_plain_torch_within_5_percent(home):
    run = run_json(*PROBE, "--gpus", "1")
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    plain = node_check_bench().plain_gpu_figures(0)
    copy, matmul = plain["copy_gb_per_s"], plain["matmul_tflops"]
    assert summary["copy_gb_per_s_rank_0"] == pytest.approx(copy, rel=0.05), (summary, copy)
    assert summary["matmul_tflops_rank_0"] == pytest.approx(matmul, rel=0.05), (summary, matmul)
    assert summary["latency_tokens_per_s_rank_0"] < summary["throughput_tokens_per_s_rank_0"]
    # The engine's fastest path, said so; a batch-1 step cannot read the weights faster than the copy moves bytes.
    assert summary["node_check_decode"].startswith("compiled step, CUDA graphs"), summary["node_check_decode"]
    assert 0 < summary["decode_batch1_floor_share_rank_0"] <= 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_gpu_loaded_by_another_process_is_flagged_and_no_other(home):
    count = torch.cuda.device_count()
    loader = subprocess.Popen([sys.executable, "-c", node_check_bench().LOADER, "1"])
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
