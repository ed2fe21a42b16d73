"""Telemetry: per-GPU samples through NVML (nvidia-ml-py), or host CPU and rank RSS through psutil;
and the energy a run's GPUs used, from NVML's energy counter (`EnergyMeter`).

A sampler is built once per run and called once per tick; each call returns plain dicts shaped like
rows of the store's `samples` table: its identity and the fields `control/sample_fields.py` declares, by
name (`NVML_READS` says how NVML gives each one-query field). NVML is queried directly (never by
running nvidia-smi): a tick of a few queries per GPU costs tens of microseconds. The run's own GPU
memory is the memory NVML attributes to the processes of the run's PID tree, and its own utilization the
SM utilization NVML attributes to them since the last tick (`run_util`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import psutil

from gpuscale.control import sample_fields
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
RUN_UTILIZATION_FIELD = "run_util"


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


@functools.lru_cache(maxsize=256)
def _is_mps_server(pid: int) -> bool:
    try:
        return psutil.Process(pid).name() == "nvidia-cuda-mps-server"
    except psutil.Error:
        return False


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
    # NVML's timestamp (us) of the newest per-process utilization sample read, per GPU index.
    _utilization_seen: dict[int, int] = field(default_factory=dict)

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
        # A process that reaches the card through MPS is listed apart, as an MPS client.
        mps_clients = _safe(lambda: nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle), [])
        listed = _safe(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle), [])
        procs = {p.pid: p.usedGpuMemory or 0 for p in [*listed, *mps_clients]}
        run_mem = sum(used for pid, used in procs.items() if pid in run_pids)
        # Through MPS, NVML credits the MPS server with a client's kernels: the run's own share is unknown, not 0.
        # NVML's documentation lists the clients as MPS processes; the runs of an acceptance through MPS on an H200
        # still read 0% (2026-12-01), so a run listed among the card's processes beside an MPS server counts too.
        through_mps = any(p.pid in run_pids for p in mps_clients) or (
            run_pids.intersection(procs) and any(_is_mps_server(p.pid) for p in listed if p.pid not in run_pids))
        measured = {"mem_used_mb": memory.used / MB, "mem_total_mb": memory.total / MB, "run_mem_mb": run_mem / MB,
                    RUN_UTILIZATION_FIELD: None if through_mps else self._run_utilization(index, handle, run_pids)}
        for field_name in sample_fields.field_names():
            if field_name in NVML_READS:
                measured[field_name] = _safe(lambda read=NVML_READS[field_name]: read(nvml, handle))
        return {"run_id": self.run_id, "t": now, "kind": "gpu", "idx": index, "name": name, **measured}

    def _run_utilization(self, index: int, handle, run_pids: set[int]) -> float | None:
        """The % of the time since the last tick that the run's processes had kernels running on this GPU:
        NVML's per-process SM utilization samples newer than the last read, averaged per process and summed
        over the run's. 0 where NVML has no new sample (no process ran kernels); None where the card or the
        driver does not report it."""
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._utilization_seen.get(index, 0))
        except Exception as error:
            return 0.0 if str(error) == "Not Found" else None  # NVML_ERROR_NOT_FOUND: no sample since
        by_pid: dict[int, list[int]] = {}
        for sample in samples:
            self._utilization_seen[index] = max(self._utilization_seen.get(index, 0), sample.timeStamp)
            if sample.pid in run_pids:
                by_pid.setdefault(sample.pid, []).append(sample.smUtil)
        return float(min(100.0, sum(sum(utils) / len(utils) for utils in by_pid.values())))


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


# ---- energy: NVML's cumulative counter, read when the run starts and when it ends ----------------

NO_GPU = "no NVML GPU (CPU run)"
# The token counts a summary may hold, in order of preference, for the energy per 1,000 tokens where
# the ranks logged none (their logged `tokens`, generated and trained, are preferred: they cover
# every phase of a run, rft's generation and training alike).
SUMMARY_TOKEN_COUNTS = ("tokens", "train_tokens", "decoded_tokens")


@dataclass
class EnergyMeter:
    """The joules each of a run's GPUs used, from NVML's cumulative energy counter
    (nvmlDeviceGetTotalEnergyConsumption: millijoules since the driver was loaded; Volta and newer),
    read once when the run starts and once when it ends. Exact whatever the sampling interval, where
    summing sampled power would miss what happens between ticks. The counter is the whole card's: a
    process of someone else on the same GPU counts too (another run of the history is named:
    `shared_gpu_figures`). `unavailable` says why there is no figure: a
    CPU run, NVML not there, a GPU without the counter (NVMLError_NotSupported)."""

    indices: list[int]
    start_mj: dict[int, int] = field(default_factory=dict)
    unavailable: str | None = None

    @classmethod
    def start(cls, indices: list[int]) -> EnergyMeter:
        if not indices:
            return cls([], unavailable=NO_GPU)
        if not nvml_available():
            return cls(list(indices), unavailable="NVML cannot be initialised (no NVIDIA driver?)")
        start, why = read_energy_mj(indices)
        return cls(list(indices), start or {}, why)

    def joules_by_gpu(self) -> tuple[dict[int, float] | None, str | None]:
        """Each GPU's joules since `start`, or None and why. A counter lower than at the start was
        reset (the driver reloaded during the run): what it counted before is lost, so no figure
        rather than a wrong or negative one."""
        if self.unavailable:
            return None, self.unavailable
        end, why = read_energy_mj(self.indices)
        if end is None:
            return None, why
        for index in self.indices:
            if end[index] < self.start_mj[index]:
                return None, (f"GPU {index}'s energy counter went back during the run "
                              f"({self.start_mj[index]} -> {end[index]} mJ: the driver reloaded?)")
        return {index: (end[index] - self.start_mj[index]) / 1000.0 for index in self.indices}, None

    def figures(self, summary: dict, logged_tokens: float = 0.0) -> dict:
        """The run's energy figures (data/figures.py), or `energy_unavailable` and why."""
        joules, why = self.joules_by_gpu()
        if joules is None:
            return {"energy_unavailable": why}
        return energy_figures(joules, summary, logged_tokens)


def read_energy_mj(indices: list[int]) -> tuple[dict[int, int] | None, str | None]:
    """NVML's energy counter of each GPU now, in millijoules; None and why where one cannot be read."""
    import pynvml

    readings = {}
    for index in indices:
        try:
            readings[index] = int(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(index)))
        except Exception as error:  # NVMLError_NotSupported before Volta and on some boards
            return None, f"GPU {index} gives no energy counter (NVML: {error})"
    return readings, None


def energy_figures(joules_by_gpu: dict[int, float], summary: dict, logged_tokens: float = 0.0) -> dict:
    """`energy_j` (every GPU of the run on this node), `energy_j_by_gpu`; per 1,000 tokens where the
    run counted any (the ranks' logged tokens, else the summary's count); per correct held-out answer
    where the run got one right (`correct_answers`)."""
    total = sum(joules_by_gpu.values())
    figures = {"energy_j": round(total, 3),
               "energy_j_by_gpu": {f"gpu{index}": round(j, 3) for index, j in sorted(joules_by_gpu.items())}}
    counts = [logged_tokens] + [summary.get(name) for name in SUMMARY_TOKEN_COUNTS]
    tokens = next((count for count in counts if _positive(count)), None)
    if tokens:
        figures["energy_j_per_1k_tokens"] = round(1000.0 * total / tokens, 4)
    correct = correct_answers(summary)
    if correct:
        figures["energy_j_per_correct_answer"] = round(total / correct, 4)
    return figures


def correct_answers(summary: dict) -> int:
    """The held-out answers a run got right: a training recipe's final greedy accuracy over its
    `eval_examples`; a sampling run's (power sampling's) accuracy over every answer it counted,
    `problems` x `chains`; 0 where the summary has neither."""
    accuracy, answers = summary.get("accuracy_greedy_after"), summary.get("eval_examples")
    if accuracy is None:
        accuracy, answers = summary.get("accuracy"), (summary.get("problems") or 0) * (summary.get("chains") or 1)
    return round(accuracy * answers) if _positive(accuracy) and _positive(answers) else 0


# The figures that divide the GPUs' energy by this run's own work: wrong where other runs' work counts too.
PER_WORK_ENERGY = ("energy_j_per_1k_tokens", "energy_j_per_correct_answer")
LEFT_OUT = "no energy per 1,000 tokens or per correct answer"


def shared_gpu_figures(figures: dict, sharing: dict[int, list[int]] | None) -> dict:
    """A run's energy figures once the runs that shared its GPUs while it lived are known (`sharing`:
    their ids, each with the GPUs shared; None: the history could not say). NVML's counter is the
    whole card's, so `energy_j` stays (what the GPUs used while the run lived) and says so:
    `energy_shared_with` and `energy_shared` (why); the figures per unit of this run's work are left
    out rather than charged with the others' work (bench/acceptance.py --gpus 1: 17 runs on one card)."""
    if sharing == {}:
        return figures
    kept = {name: value for name, value in figures.items() if name not in PER_WORK_ENERGY}
    if sharing is None:
        return {**kept, "energy_shared": "whether other runs shared the GPU is unknown (the history could not be "
                                         f"read), and NVML counts the whole GPU: {LEFT_OUT}"}
    runs_by_gpu: dict[int, list[int]] = {}
    for run_id, gpus in sorted(sharing.items()):
        for gpu in gpus:
            runs_by_gpu.setdefault(gpu, []).append(run_id)
    where = "; ".join(f"GPU {gpu} shared with {_runs_text(ids)}" for gpu, ids in sorted(runs_by_gpu.items()))
    return {**kept, "energy_shared_with": sorted(sharing),
            "energy_shared": f"{where}: NVML counts the whole GPU, their work included: {LEFT_OUT}"}


def _runs_text(ids: list[int]) -> str:
    return f"run {ids[0]}" if len(ids) == 1 else f"runs {', '.join(map(str, ids))}"


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
