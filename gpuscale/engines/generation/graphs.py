"""CUDA graphs of the decode step: each key's first steps run eagerly, the next is captured into a
graph, and every later step replays it (the engine's keys: a KV slot and the sampling settings)."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Hashable, Iterator, Mapping

import torch

# Eager steps before a CUDA graph is captured (lazy cuBLAS/allocator initialisation, and the
# torch.compile compilation of the step, happen there).
CUDA_GRAPH_WARMUP_STEPS = 2


class _StepGraphs(Mapping):
    """The captured graphs of one engine's decode step, by key (a read-only mapping), and each key's
    warm-up count. `clear` drops them all: a graph holds the addresses of the buffers and the model
    structure it was captured with."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._warmups: dict[Hashable, int] = {}

    def __getitem__(self, key: Hashable) -> torch.cuda.CUDAGraph:
        return self._graphs[key]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._graphs)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._warmups.clear()

    def step(self, key: Hashable, step: Callable[[], None]) -> None:
        """One decode step for `key`: `step` run eagerly (the first CUDA_GRAPH_WARMUP_STEPS), then
        captured once, then its graph replayed."""
        with torch.cuda.device(self.device):  # streams and capture on the model's GPU
            graph = self._graphs.get(key)
            if graph is None and self._warmups.get(key, 0) < CUDA_GRAPH_WARMUP_STEPS:
                # Real steps, run eagerly on a side stream as PyTorch recommends before capture.
                side = _warmup_stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream(self.device).wait_stream(side)
                self._warmups[key] = self._warmups.get(key, 0) + 1
                return
            if graph is None:
                graph = _captured(step)
                self._graphs[key] = graph
            graph.replay()


@functools.cache
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream a GPU for every engine's warm-up steps. cuBLAS keeps a workspace (tens of MiB) for
    every stream it has run on, for the life of the process: a new stream per warm-up (torch hands out
    up to 32 of its pool in turn) left one more after each engine, e.g. after every held-out evaluation."""
    return torch.cuda.Stream(device)


def _captured(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `step`, recorded without running it. Two things outside the step must not
    touch CUDA while it records, or the capture fails ("operation failed due to a previous error
    during capture"; seen in sft's evaluation on 4 GPUs, 12 runs at once): Python's garbage collector,
    which may free another engine's graphs or events mid-capture (so it runs first, which also gives
    dead engines' graph memory back, and is off during), and other threads, such as NCCL's watchdog
    polling the events of earlier collectives (so the capture checks this thread only, as
    torch.compile's CUDA graphs do). An engine captures a few graphs in a run, so the collection's
    cost is paid a few times."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        return graph
    finally:
        if collecting:
            gc.enable()
