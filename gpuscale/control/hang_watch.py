"""A run that stopped advancing: found from the ranks' heartbeats, ended with the reason in one line.

The supervisor hands `HangWatch` every line the ranks write (control/metrics_tail.py's `Beat`s:
runs/heartbeat.py). A rank's silence is the time since its last line; how long it may last is its
allowance:

- a step (a training step, a generation batch): `hang_timeout`; `auto` (the default) is the larger of
  AUTO_FLOOR_S and AUTO_TIMES_P95 x the 95th percentile of the run's step times so far (each rank's
  first step left out: it compiles and warms up);
- loading (a rank's start to its first step, or a later phase's set-up: rft's SFT trainer after its
  generation), the first step after it, an evaluation (each of its batches) and a save (a checkpoint,
  the model): the larger of `hang_timeout` and PHASE_ALLOWANCE_S.

A run all of whose ranks are silent past their allowance is hung (one rank still advancing, alone in
an evaluation, is not); a rank that logged a later step than another waits on it, and is held to the
step's allowance, whatever phase it is in (`HangWatch.hung`). The supervisor then asks every rank for
its Python stacks (runs/heartbeat.py's STACKS_SIGNAL, into RunDir.stacks), names the rank(s) that hold
the others (`silent_ranks`), writes where each stood to RunDir.hung, and stops the run, which ends
`failed` with `hung_error`'s line. Before that, a rank silent for LATE_TIMES_P95 x its own p95 step
time (at least LATE_FLOOR_S) is `late`: a warning the front ends show live (app/views/collapse.py).
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from gpuscale.control.metrics_tail import Beat
from gpuscale.runs.heartbeat import LOADING, STEP

AUTO_FLOOR_S = 120.0
AUTO_TIMES_P95 = 5.0
# Loading a large model from a network disk, compiling the first step, a batch of a long evaluation
# and a checkpoint of tens of GB all take minutes with nothing to report in between.
PHASE_ALLOWANCE_S = 600.0
LATE_TIMES_P95 = 3.0
# A rank is never called late sooner: a heartbeat comes at most once a second, the supervisor looks
# once a tick, and a warning that comes and goes within seconds is noise.
LATE_FLOOR_S = 10.0
STEP_TIMES_KEPT = 1000  # per rank: the p95 follows the run's recent pace


def p95(values) -> float | None:
    """The 95th percentile (nearest rank), None without values."""
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1] if ordered else None


@dataclass
class RankState:
    """What the watch knows of one rank: its last line (`t`, `step`, `phase`), the steps it was seen
    to finish, and the seconds a step took (its first one left out)."""

    t: float
    step: int = 0
    phase: str = LOADING
    steps_done: int = 0
    anchor: tuple[float, int] | None = None  # (t, step) of its last step line, since it last changed phase
    step_times: deque = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))

    def saw(self, beat: Beat) -> None:
        self.t = max(self.t, beat.t)
        if beat.phase is None:
            return  # a summary or the announced total: alive, nothing more
        if beat.phase == LOADING:
            self.steps_done = 0  # loading again (a recipe's next phase): its first step is a first step again
        if beat.phase == STEP and self.phase == STEP and self.anchor and beat.step > self.anchor[1]:
            if self.steps_done:
                self.step_times.append((beat.t - self.anchor[0]) / (beat.step - self.anchor[1]))
            self.steps_done += 1
        if beat.phase == STEP and (self.phase != STEP or not self.anchor or beat.step > self.anchor[1]):
            self.anchor = (beat.t, beat.step)
        self.phase, self.step = beat.phase, beat.step


@dataclass(frozen=True)
class RankStand:
    """Where a rank stood when the run was found hung (or late)."""

    rank: int
    step: int
    phase: str
    silent_s: float
    allowance_s: float
    p95_s: float | None


class HangWatch:
    """`hang_timeout`: seconds, None for auto, 0 for off. `ranks`: the ranks expected (a rank that has
    written nothing yet counts as loading since `started_at`, the launch)."""

    def __init__(self, hang_timeout: float | None, started_at: float, ranks: range | list[int]):
        self.hang_timeout = hang_timeout
        self.ranks = {rank: RankState(started_at) for rank in ranks}

    def saw(self, beats: list[Beat]) -> None:
        for beat in beats:
            self.ranks.setdefault(beat.rank, RankState(beat.t)).saw(beat)

    def step_time_p95(self) -> float | None:
        return p95(t for state in self.ranks.values() for t in state.step_times)

    def timeout_s(self) -> float | None:
        """The silence a step may last: the setting, or auto's; None when off."""
        if self.hang_timeout == 0:
            return None
        if self.hang_timeout is not None:
            return float(self.hang_timeout)
        pace = self.step_time_p95()
        return max(AUTO_FLOOR_S, AUTO_TIMES_P95 * pace) if pace else AUTO_FLOOR_S

    def allowance_s(self, state: RankState, timeout: float) -> float:
        stepping = state.phase == STEP and state.steps_done > 0  # past its first step
        return timeout if stepping else max(timeout, PHASE_ALLOWANCE_S)

    def stands(self, now: float) -> list[RankStand]:
        timeout = self.timeout_s() or math.inf
        return [RankStand(rank, state.step, state.phase, now - state.t, self.allowance_s(state, timeout),
                          p95(state.step_times)) for rank, state in sorted(self.ranks.items())]

    def hung(self, now: float) -> list[RankStand] | None:
        """Where each rank stands, if none has advanced within its allowance; else None. The ranks move
        in step (a collective every step), so a rank that logged a later step than another waits on it:
        only the ranks at the earliest step are held to their own allowance (a save's, an evaluation's),
        the others to the step's. A rank frozen before a checkpoint step is then found at the step's
        timeout, not after the save's allowance of the peer that went on to the save and waits there."""
        if (timeout := self.timeout_s()) is None or not self.ranks:
            return None
        stands = self.stands(now)
        earliest = min(stand.step for stand in stands)
        held = [stand.silent_s > (stand.allowance_s if stand.step == earliest else timeout) for stand in stands]
        return stands if all(held) else None

    def late(self, now: float) -> list[RankStand]:
        """The ranks in a step for longer than LATE_TIMES_P95 x their p95 step time (at least LATE_FLOOR_S)."""
        return [stand for stand in self.stands(now) if stand.phase == STEP and stand.p95_s is not None
                and stand.silent_s > max(LATE_FLOOR_S, LATE_TIMES_P95 * stand.p95_s)]

    def progress(self, now: float) -> dict:
        """The run's progress fields (Throughput.progress's) the front ends warn from: `late`, one entry
        a late rank, and `hang_timeout_s`, the silence that ends a step as hung (None: off)."""
        late = self.late(now)
        if not late:
            return {}
        return {"late": [{"rank": s.rank, "step": s.step, "silent_s": round(s.silent_s, 1),
                          "p95_s": round(s.p95_s, 3)} for s in late],
                "hang_timeout_s": self.timeout_s()}


# ---- what the ranks' stacks say ---------------------------------------------------------------------

# faulthandler's lines: a thread's header, then its frames, the innermost first.
THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
MAIN_FRAMES = ("_run_module_as_main", "<module>")  # the outermost frame of a process's main thread
COLLECTIVES = "/torch/distributed/"
WRAPPERS = ("wrapper",)  # torch.distributed's logging decorator, between the call and its work
GPUSCALE_CODE = "/gpuscale/"
# Autograd's engine, where Python's frames end inside loss.backward(): DDP's gradient all-reduce runs in
# its C++ hooks, so a rank waiting there on a peer shows no torch.distributed frame.
AUTOGRAD_ENGINE = ("/torch/autograd/graph.py", "_engine_run_backward")


def main_thread_frames(stacks: str) -> list[dict]:
    """The frames of the main thread (the one started by `python -m`), innermost first; [] if none."""
    threads, frames = [], None
    for line in stacks.splitlines():
        if THREAD_HEADER.match(line):
            frames = []
            threads.append(frames)
        elif (match := FRAME.match(line)) and frames is not None:
            frames.append(match.groupdict())
    return next((frames for frames in threads if frames and frames[-1]["function"] in MAIN_FRAMES), [])


def where(frames: list[dict], peers: bool = True) -> str | None:
    """Where a main thread stands, in words: `waits in all_gather_into_tensor (distributed_c10d.py:4413)
    from _gather (trainer.py:426)` in a torch.distributed call (the outermost one, the call gpuscale
    made); `waits in the gradient all-reduce (inside backward, _engine_run_backward)` in autograd's
    engine where the rank has `peers` (DDP's all-reduce runs there); else `in FUNCTION (FILE:LINE)` of
    its innermost frame; `from` the innermost frame of gpuscale's own code where that is another; None
    without frames."""
    if not frames:
        return None
    own = next((index for index, frame in enumerate(frames) if GPUSCALE_CODE in frame["file"]), len(frames))
    calls = [frame for frame in frames[:own] if COLLECTIVES in frame["file"] and frame["function"] not in WRAPPERS]
    shown = calls[-1] if calls else frames[0]
    if calls:
        text = f"waits in {place(shown)}"
    elif peers and in_autograd_engine(shown):
        text = f"waits in the gradient all-reduce (inside backward, {shown['function']})"
    else:
        text = f"in {place(shown)}"
    return text if own in (len(frames), frames.index(shown)) else f"{text} from {place(frames[own])}"


def in_autograd_engine(frame: dict) -> bool:
    path, function = AUTOGRAD_ENGINE
    return frame["function"] == function and frame["file"].endswith(path)


def place(frame: dict) -> str:
    return f"{frame['function']} ({Path(frame['file']).name}:{frame['line']})"


def silent_ranks(stands: list[RankStand], states: dict[int, str], places: dict[int, str | None]) -> list[int]:
    """The ranks that hold the others: those stopped or that gave no stack (`states`: a rank's process
    state, `places`: `where` it stands, None for no stack); else those not waiting in a collective
    while others are; else the one whose last line is the oldest."""
    ranks = [stand.rank for stand in stands]
    unanswering = [rank for rank in ranks if states.get(rank) == "stopped" or not places.get(rank)]
    if unanswering:
        return unanswering
    working = [rank for rank in ranks if not places[rank].startswith("waits in")]
    if working and len(working) < len(ranks):
        return working
    return [max(stands, key=lambda stand: stand.silent_s).rank]


# A rank process's state (psutil's, or "gone"), in words, where it says more than its stack.
STATE_WORDS = {"stopped": "stopped: SIGSTOP or a debugger holds it", "gone": "its process is gone",
               "disk-sleep": "in uninterruptible sleep: I/O or a driver", "zombie": "its process has ended"}


def rank_state_words(stand: RankStand, state: str | None, place: str | None) -> str:
    """`stopped: SIGSTOP ...`, `waits in all_reduce (...)`, `evaluate, in generate (...)`: a rank's
    process state or stack, its phase first where it was not in a step."""
    words = STATE_WORDS.get(state or "", place or "gave no stack")
    return words if stand.phase == STEP else f"{stand.phase}, {words}"


def hung_error(stands: list[RankStand], states: dict[int, str], places: dict[int, str | None],
               errors_dir: Path, idle_gpus: list[int] | None = None) -> str:
    """The run's error: `hung: rank 1 made no progress for 23 s at step 12 (stopped: SIGSTOP or a
    debugger holds it); rank 0 at step 12 waits in all_reduce (distributed_c10d.py:2850); stacks in
    RUN_DIR/errors/`; `idle_gpus`: the run's GPUs, where NVML saw every one at 0% utilization."""
    silent = silent_ranks(stands, states, places)
    by_rank = {stand.rank: stand for stand in stands}
    words = {stand.rank: rank_state_words(stand, states.get(stand.rank), places.get(stand.rank)) for stand in stands}
    first = by_rank[silent[0]]
    if len(silent) == 1:
        head = (f"hung: rank {first.rank} made no progress for {first.silent_s:.0f} s at step {first.step} "
                f"({words[first.rank]})")
    else:
        each = "; ".join(f"rank {rank} at step {by_rank[rank].step}: {words[rank]}" for rank in silent)
        head = f"hung: ranks {', '.join(map(str, silent))} made no progress for {first.silent_s:.0f} s ({each})"
    others = [f"rank {stand.rank} at step {stand.step} {words[stand.rank]}"
              for stand in stands if stand.rank not in silent]
    parts = [head, *others]
    if idle_gpus:  # NVML's second signal: the GPUs idle while no rank advances
        parts.append(f"GPU{'s' if len(idle_gpus) > 1 else ''} {', '.join(map(str, idle_gpus))} at 0% utilization")
    return "; ".join([*parts, f"stacks in {errors_dir}/"])
