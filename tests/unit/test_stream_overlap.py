"""bench/stream_overlap.py on hand-made Chrome traces whose figures are worked out by hand below: two streams
with events that overlap within a stream and across the streams, and one stream alone."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from bench_loader import load_bench

ROOT = Path(__file__).resolve().parents[2]
BASE = 5_000_000_000_000.0  # a real trace's microseconds are this large: offsets below are from here
LONG_NAME = "void long_kernel<" + "T, " * 60 + ">()"


@pytest.fixture(scope="module")
def bench():
    return load_bench("stream_overlap.py")


def device(cat: str, name: str, stream: int, start: float, end: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": BASE + start, "dur": end - start,
            "args": {"device": 0, "stream": stream, "correlation": 1}}


def annotation(cat: str, name: str, at: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": BASE + at, "dur": 1.0, "args": {}}


def two_streams() -> dict:
    """Stream 7: A [0, 10], A [5, 20], LONG [40, 50]; stream 13: B [15, 30], a memset [30, 32], a copy [44, 60]
    (microseconds); besides them CPU events that are no device work."""
    return {"traceEvents": [
        annotation("user_annotation", "gpuscale.phase/generate", -3),
        device("kernel", "A", 7, 0, 10),
        device("kernel", "A", 7, 5, 20),
        device("kernel", LONG_NAME, 7, 40, 50),
        device("kernel", "B", 13, 15, 30),
        device("gpu_memset", "Memset (Device)", 13, 30, 32),
        device("gpu_memcpy", "Memcpy DtoH", 13, 44, 60),
        annotation("user_annotation", "gpuscale.phase/train", 35),
        annotation("user_annotation", "not a phase", 36),
        annotation("cpu_op", "aten::mm", -20),  # before the window and after it: not device work
        annotation("cuda_runtime", "cudaLaunchKernel", 70),
        device("gpu_user_annotation", "gpuscale.phase/train", 13, 35, 90),  # the profiler's copy on the GPU
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": BASE},
    ]}


def test_two_streams_busy_union_overlap_idle(bench):
    figures = bench.analyse(two_streams(), bin_ms=0.025)
    assert figures["window_s"] == pytest.approx(60e-6)  # 0 to 60
    seven, thirteen = figures["streams"]["7"], figures["streams"]["13"]
    assert (seven["events"], thirteen["events"]) == (3, 3)
    assert seven["busy_s"] == pytest.approx(30e-6)  # [0, 20] and [40, 50]
    assert seven["summed_s"] == pytest.approx(35e-6)  # 10 + 15 + 10: A's two overlap
    assert seven["busy_share"] == pytest.approx(30 / 60)
    assert thirteen["busy_s"] == pytest.approx(33e-6)  # [15, 32] and [44, 60]
    assert thirteen["summed_s"] == pytest.approx(33e-6)
    assert figures["union_s"] == pytest.approx(52e-6)  # [0, 32] and [40, 60]
    assert figures["overlap_s"] == pytest.approx(11e-6)  # [15, 20] and [44, 50]
    assert figures["idle_s"] == pytest.approx(8e-6)  # (32, 40)
    assert [figures[f"{name}_share"] for name in ("union", "overlap", "idle")] == pytest.approx([52 / 60, 11 / 60,
                                                                                                8 / 60])


def test_two_streams_timeline_by_bin(bench):
    timeline = bench.analyse(two_streams(), bin_ms=0.025)["timeline"]
    # Bins [0, 25), [25, 50), [50, 60]: the last one as long as what is left of the window.
    assert (timeline["bins"], timeline["bin_s"]) == (3, pytest.approx(25e-6))
    assert timeline["streams"]["7"] == pytest.approx([20 / 25, 10 / 25, 0.0])  # [0, 20]; [40, 50]; none
    assert timeline["streams"]["13"] == pytest.approx([10 / 25, (7 + 6) / 25, 10 / 10])  # [15, 25]; [25, 32] and
    # [44, 50]; [50, 60]


def test_top_kernels_and_phases(bench):
    figures = bench.analyse(two_streams(), bin_ms=0.025)
    seven = figures["streams"]["7"]["top_kernels"]
    assert [(k["name"], k["count"]) for k in seven] == [("A", 2), (LONG_NAME[:100], 1)]
    assert [k["seconds"] for k in seven] == pytest.approx([25e-6, 10e-6])
    assert [k["name"] for k in figures["streams"]["13"]["top_kernels"]] == ["Memcpy DtoH", "B", "Memset (Device)"]
    assert [p["phase"] for p in figures["phases"]] == ["generate", "train"]
    assert [p["at_s"] for p in figures["phases"]] == pytest.approx([-3e-6, 35e-6])


def test_one_stream_has_no_overlap(bench):
    trace = {"traceEvents": [device("kernel", "A", 7, 0, 10), device("kernel", "A", 7, 20, 30)]}
    figures = bench.analyse(trace, bin_ms=0.010)
    assert list(figures["streams"]) == ["7"]
    assert figures["window_s"] == pytest.approx(30e-6)
    assert (figures["union_s"], figures["overlap_s"], figures["idle_s"]) == pytest.approx((20e-6, 0.0, 10e-6))
    assert figures["timeline"]["streams"]["7"] == pytest.approx([1.0, 0.0, 1.0])


def test_the_script_reads_a_gzipped_trace_and_writes_the_result(bench, tmp_path):
    folder = tmp_path / "async-1gpu"
    folder.mkdir()
    with gzip.open(folder / "rank0.trace.json.gz", "wt") as packed:
        json.dump(two_streams(), packed)
    out = tmp_path / "result.json"
    bench.main(["--from-trace", str(folder / "rank0.trace.json.gz"), "--bin-ms", "0.025", "--card", "1 x H200",
                "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["card"] == {"names": ["H200"], "count": 1}
    assert result["figures"]["traces"]["async-1gpu/rank0"]["overlap_s"] == pytest.approx(11e-6)


def test_without_card_the_result_names_the_devices_the_traces_were_made_on(bench, tmp_path):
    path = tmp_path / "rank0.trace.json"
    path.write_text(json.dumps({**two_streams(), "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
                                "cuda_runtime_version": 13000}))
    out = tmp_path / "result.json"
    bench.main(["--from-trace", str(path), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["card"] == {"names": ["NVIDIA H200"], "count": 1}
    made_on = result["figures"]["traces"][f"{tmp_path.name}/rank0"]["made_on"]
    assert made_on == {"devices": ["NVIDIA H200"], "cuda_runtime_version": 13000}


def test_a_trace_without_device_work_is_refused(bench, tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [annotation("cpu_op", "aten::mm", 0)]}))
    with pytest.raises(SystemExit, match="no device events"):
        bench.main(["--from-trace", str(path), "--out", str(tmp_path / "result.json")])
