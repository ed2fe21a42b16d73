"""The prefill and decode seconds of one `generate` call, measured without waiting for the device."""

from __future__ import annotations

import torch

from gpuscale.engines.step_phases import CudaClock, WallClock


class CallMarks:
    """Marks of a `generate` call: before its prefill, after it, and after its last decode step (CUDA
    events on the current stream on a GPU, perf_counter on a CPU: engines/step_phases.py's clocks).
    Recording a mark does not synchronize, so the timing leaves the call as it was; `seconds` is read
    once the call's results are on the host, when the marks have completed (or it waits for them)."""

    def __init__(self, device: torch.device):
        self.clock = CudaClock(device) if device.type == "cuda" else WallClock()
        self._marks: list = []

    def start(self) -> None:
        """A new call: the last call's marks go back to the clock's pool, and the first mark is made."""
        for mark in self._marks:
            self.clock.release(mark)
        self._marks = []
        self.mark()

    def mark(self) -> None:
        self._marks.append(self.clock.mark())

    def seconds(self) -> dict[str, float]:
        """{"prefill": s, "decode": s} of the last call (after its three marks)."""
        if len(self._marks) != 3:
            raise RuntimeError(f"a generate call makes 3 marks; the last one made {len(self._marks)}")
        before_prefill, after_prefill, after_decode = self._marks
        self.clock.wait(after_decode)
        return {"prefill": self.clock.seconds(before_prefill, after_prefill),
                "decode": self.clock.seconds(after_prefill, after_decode)}


class NoMarks:
    """What `generate` marks with when no one times it."""

    def start(self) -> None:
        pass

    def mark(self) -> None:
        pass
