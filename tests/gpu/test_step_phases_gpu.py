"""On a CUDA machine only: the step phases' CUDA path (engines/step_phases.py's CudaClock). A phase's
seconds are the stream's time between its marks, never resolved by waiting inside a step: a step
whose last mark the GPU has not reached yet stays pending, and CPU work done while the GPU is busy
with queued kernels costs the stream nothing."""

import time

import pytest

from gpuscale.engines.step_phases import StepPhases

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# GPU clock cycles torch.cuda._sleep spins for: 0.1-0.2 s at an H200's 1-2 GHz.
BUSY_CYCLES = 200_000_000


def test_phases_are_the_stream_s_time_and_a_step_is_never_waited_for_inside_the_run():
    device = torch.device("cuda", torch.cuda.current_device())
    timer = StepPhases()
    timer.use_cuda(device)
    torch.cuda.synchronize(device)
    timer.restart("forward_backward")
    torch.cuda._sleep(BUSY_CYCLES)  # queued: the CPU goes on at once
    timer.switch("data")
    time.sleep(0.02)  # CPU work while the GPU is still busy: hidden behind the queued kernel
    timer.switch("log")
    timer.finish(1)
    assert timer.ready() == []  # the GPU has not reached the step's last mark: nothing waited for
    [(step, seconds)] = timer.ready(wait=True)
    assert step == 1 and set(seconds) == {"forward_backward", "data", "log"}
    assert seconds["forward_backward"] > 0.03  # the kernel's time, which the CPU never saw
    assert seconds["data"] < seconds["forward_backward"] / 10  # the CPU's 20 ms overlapped it
    # The events come back to the pool and are reused by the next step.
    timer.switch("forward_backward")
    timer.finish(2)
    [(step, _)] = timer.ready(wait=True)
    assert step == 2 and len(timer.clock._free) >= 3
