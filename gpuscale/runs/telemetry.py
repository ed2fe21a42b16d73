"""Telemetry: per-GPU samples through NVML (nvidia-ml-py), or host CPU and rank RSS through psutil.

A sampler is built once per run and called once per tick; each call returns plain dicts shaped like
rows of the store's `samples` table: its identity and the fields `runs/sample_fields.py` declares, by
name (`NVML_READS` says how NVML gives each one-query field). NVML is queried directly (never by
running nvidia-smi): a tick of a few queries per GPU costs tens of microseconds. The run's own GPU
memory is the memory NVML attributes to the processes of the run's PID tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from gpuscale.runs import sample_fields
from gpuscale.runs.devices import nvml_available, visible_gpu_indices

MB = 1024 * 1024

# How NVML gives each declared sample field that is one query (through `_safe`: a card may not report
# it). The memory fields come from `_gpu_row`'s memory and process queries, read once for all three.
NVML_READS = {
    "util": lambda nvml, handle: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
    "power_w": lambda nvml, handle: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
    "temp_c": lambda nvml, handle: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
    "sm_clock_mhz": lambda nvml, handle: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
}
MEMORY_FIELDS = ("mem_used_mb", "mem_total_mb", "run_mem_mb")


def list_gpus() -> list[dict]:
    """Name and memory of each visible GPU now (for `gpuscale gpus` and the TUI's picker)."""
    if not nvml_available():
        return []
    import pynvml

    return [_gpu_info(pynvml, index) for index in visible_gpu_indices()]


def _gpu_info(pynvml, index: int) -> dict:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {
        "index": index,
        "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "mem_total_mb": memory.total / MB,
        "mem_used_mb": memory.used / MB,
        "mem_free_mb": memory.free / MB,
        "util": _safe(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "compute_capability": list(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
    }


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _safe(query, default=None):
    """Fields a GPU may not support (power on some boards, clocks under MIG) read as None."""
    try:
        return query()
    except Exception:
        return default


def process_tree(root_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class RunTree:
    """The run's processes, re-read every few seconds only: walking /proc is the costliest part of
    a tick, and a run's ranks are started once."""

    REFRESH_S = 5.0

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self._procs: list[psutil.Process] = []
        self._read_at = float("-inf")

    def processes(self) -> list[psutil.Process]:
        if time.monotonic() - self._read_at > self.REFRESH_S or not all(p.is_running() for p in self._procs):
            self._procs, self._read_at = process_tree(self.root_pid), time.monotonic()
        return self._procs


@dataclass
class GpuSampler:
    """Samples the given NVML indices; the run's memory is what its PID tree holds on each GPU."""

    run_id: int
    indices: list[int]
    root_pid: int
    _handles: list = field(default_factory=list)

    def __post_init__(self):
        import pynvml

        self._tree = RunTree(self.root_pid)
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]

    def sample(self, now: float | None = None) -> list[dict]:
        now = now or time.time()
        run_pids = {p.pid for p in self._tree.processes()}
        return [self._gpu_row(index, handle, name, now, run_pids)
                for index, handle, name in zip(self.indices, self._handles, self._names)]

    def _gpu_row(self, index: int, handle, name: str, now: float, run_pids: set[int]) -> dict:
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        procs = _safe(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle), [])
        run_mem = sum((p.usedGpuMemory or 0) for p in procs if p.pid in run_pids)
        measured = {"mem_used_mb": memory.used / MB, "mem_total_mb": memory.total / MB, "run_mem_mb": run_mem / MB}
        for field_name in sample_fields.field_names():
            if field_name in NVML_READS:
                measured[field_name] = _safe(lambda read=NVML_READS[field_name]: read(nvml, handle))
        return {"run_id": self.run_id, "t": now, "kind": "gpu", "idx": index, "name": name, **measured}


@dataclass
class HostSampler:
    """The CPU path: host CPU % and memory, plus the RSS of each rank of the run."""

    run_id: int
    root_pid: int
    _ranks: dict[int, int | None] = field(default_factory=dict)  # pid -> rank, read once per pid

    def __post_init__(self):
        self._tree = RunTree(self.root_pid)
        psutil.cpu_percent(None)  # the first call only sets the reference point

    def _rank_of(self, proc: psutil.Process) -> int | None:
        if proc.pid not in self._ranks:
            try:
                rank = proc.environ().get("RANK")
                self._ranks[proc.pid] = int(rank) if rank is not None else None
            except (psutil.Error, ValueError):
                self._ranks[proc.pid] = None
        return self._ranks[proc.pid]

    def sample(self, now: float | None = None) -> list[dict]:
        now = now or time.time()
        memory = psutil.virtual_memory()
        tree = self._tree.processes()
        rows = [
            {
                "run_id": self.run_id, "t": now, "kind": "host", "idx": -1, "name": "cpu",
                "mem_used_mb": (memory.total - memory.available) / MB, "mem_total_mb": memory.total / MB,
                "util": psutil.cpu_percent(None), "run_mem_mb": _rss(tree) / MB,
            }
        ]
        for proc in tree:
            rank = self._rank_of(proc)
            if rank is not None:
                rows.append(
                    {
                        "run_id": self.run_id, "t": now, "kind": "rank", "idx": rank, "name": f"rank {rank}",
                        "run_mem_mb": _rss([proc]) / MB, "mem_total_mb": memory.total / MB,
                    }
                )
        return rows


def _rss(procs: list[psutil.Process]) -> int:
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def make_sampler(run_id: int, gpu_indices: list[int], root_pid: int):
    if gpu_indices and nvml_available():
        return GpuSampler(run_id, gpu_indices, root_pid)
    return HostSampler(run_id, root_pid)
