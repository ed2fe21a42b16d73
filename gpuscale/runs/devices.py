"""This machine's devices and the plan of a run's ranks on them: which GPUs NVML sees (narrowed by
CUDA_VISIBLE_DEVICES), and `plan_devices`, the one rule that turns the `gpus` setting into a number
of ranks and their GPUs. No torch, no history: every process may use it (the front ends, the
supervisor, the tuner's child and the recipes' own checks)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from gpuscale.runs.settings import SettingsError


@lru_cache(maxsize=1)
def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:  # no driver, no library, no GPU: the CPU path takes over
        return False


def visible_gpu_indices() -> list[int]:
    """The NVML indices this process may use: all GPUs, narrowed by CUDA_VISIBLE_DEVICES if set
    (SLURM and containers set it); only plain integer lists are understood there."""
    if not nvml_available():
        return []
    import pynvml

    count = pynvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    indices = [int(p) for p in visible.split(",") if p.strip().isdigit()]
    return [i for i in indices if i < count]


@dataclass(frozen=True)
class DevicePlan:
    """Where the ranks of this node run: `gpu_indices` empty means CPU ranks on gloo."""

    nproc: int
    gpu_indices: tuple[int, ...]

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu_indices)

    def describe(self) -> str:
        if self.on_gpu:
            return f"{self.nproc} GPU(s): {','.join(map(str, self.gpu_indices))}"
        return f"{self.nproc} CPU rank(s) (gloo)"


def plan_devices(gpus: str | int | list[int], available: list[int] | None = None) -> DevicePlan:
    """Resolve the `gpus` setting against this machine; refuses more GPUs than exist."""
    available = visible_gpu_indices() if available is None else available
    if not available:
        return _plan_cpu(gpus)
    if gpus == "all":
        return DevicePlan(len(available), tuple(available))
    if isinstance(gpus, int):
        if gpus > len(available):
            raise SettingsError(f"gpus: {gpus}: only {len(available)} GPU(s) here ({_span(available)})")
        return DevicePlan(gpus, tuple(available[:gpus]))
    missing = [i for i in gpus if i not in available]
    if missing:
        raise SettingsError(f"gpus: {','.join(map(str, gpus))}: no GPU {missing[0]} here ({_span(available)})")
    return DevicePlan(len(gpus), tuple(gpus))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what taskset, a container's cpuset or SLURM's
    --cpus-per-task leave it), not every core of the machine, which is what os.cpu_count() counts."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this OS (macOS)
        return os.cpu_count() or 1


# CPU ranks a core may carry: more ranks than cores run (slowly: the launch warns, control/host_load.py),
# so that a run planned for 4 GPUs can be tried on a laptop's gloo ranks; many more is a typo.
CPU_RANKS_PER_CORE = 4


def _plan_cpu(gpus: str | int | list[int]) -> DevicePlan:
    cores = usable_cores()
    if gpus == "all":
        return DevicePlan(1, ())
    if isinstance(gpus, list):
        raise SettingsError(
            f"gpus: {','.join(map(str, gpus))}: this machine has no NVIDIA GPU; give a number of CPU ranks"
        )
    if gpus > CPU_RANKS_PER_CORE * cores:
        raise SettingsError(f"gpus: {gpus}: no GPU here, and {cores} CPU cores take at most "
                            f"{CPU_RANKS_PER_CORE * cores} CPU ranks")
    return DevicePlan(gpus, ())


def _span(indices: list[int]) -> str:
    return "GPU " + ",".join(map(str, indices))
