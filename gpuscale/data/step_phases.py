"""Where each second of a step goes: the phases' names, the figures a rank logs of them, the run's
summary of them and the advice read from it. Pure, no torch: the ranks (engines/step_phases.py marks
the phases), the supervisor (which summarises them at the run's end) and the front ends share it.

A rank logs, in the record of each step, the seconds of each phase of the time since its previous
logged step (`phase_seconds_<phase>`); the time no phase names is `other`, so that a step's phases
add up to its wall time. The summary (`summarise`) holds the mean step of the steady steps (the
first WARM_UP_STEPS of each rank left out): `step_phase_seconds` (phase -> seconds) and
`step_phases` (phase -> share of that step, adding up to 1), and, where the ranks differ,
`step_phase_seconds_by_rank`. `advice` reads them (and the cards' memory) into one line per thing
to change.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

# A training step's phases (transformers' loop, engines/trl_bridge.py), the generation recipes'
# (rft, grpo-mtl), the sampling ones' (power-sampling, the probe), and `other`, the time none names.
# EVALUATE and SAVE are the heartbeat's words too (runs/heartbeat.py takes them from here): the same
# thing, named once.
DATA, FORWARD_BACKWARD, OPTIMIZER, LOG = "data", "forward_backward", "optimizer", "log"
EVALUATE, SAVE = "evaluate", "save"
GENERATE, FILTER, REWARD, LOGPROBS, WEIGHT_SYNC = "generate", "filter", "reward", "logprobs", "weight_sync"
# Sampling without training (power-sampling, the probe): the prompts' KV computed, the tokens decoded, a
# Metropolis-Hastings move accepted or rejected, the answers scored.
PREFILL, DECODE, ACCEPT_REJECT, SCORE = "prefill", "decode", "accept_reject", "score"
# Waiting for the other ranks, on a rank that has others: in a blocking collective (engines/step_phases.py:
# time_collectives), and from a step's last gradient computed to its optimizer step (engines/trl_bridge.py:
# the slowest rank at DDP's gradient all-reduce, the part of it the backward pass did not hide, the
# gradient clipping).
WAIT = "wait"
OTHER = "other"

# How people read a phase's name; a name not here reads as itself, `_` as a space.
LABELS = {FORWARD_BACKWARD: "forward+backward", SAVE: "checkpoint", LOGPROBS: "reference/old log-probs",
          WEIGHT_SYNC: "weight sync", WAIT: "waiting for other ranks", DATA: "data", ACCEPT_REJECT: "accept/reject"}

FIGURE_PREFIX = "phase_seconds_"
# Logged steps of each rank left out of the summary: the first builds what later steps reuse (the
# optimizer's state, the allocator's blocks, kernels compiled on first use), as the steady rate does.
WARM_UP_STEPS = 1
# Ranks whose mean step, or a phase's share of it, differ by more than this keep their own figures.
RANKS_DIFFER = 0.05

# Advice thresholds: a rank this much slower than the ranks' median is a straggler; these
# shares of a step are too much of it; a card using less than this share of its memory could hold more.
STRAGGLER = 0.15
TOO_MUCH = {GENERATE: 0.5, DATA: 0.10, WAIT: 0.20}
MEMORY_USED_AT_LEAST = 1 / 3
# The live advice (the monitor, `gpuscale run`'s progress) reads each rank's last this many steady logged
# steps: a straggler is named within as many steps of its start.
LIVE_STEPS = 3


def label(phase: str) -> str:
    return LABELS.get(phase, phase.replace("_", " "))


def figure_name(phase: str) -> str:
    """The name of a phase's seconds in a step's record: `phase_seconds_forward_backward`."""
    return FIGURE_PREFIX + phase


def phases_of(record: Mapping) -> dict[str, float]:
    """The phase -> seconds of a logged record ({} for a record that holds none)."""
    return {name.removeprefix(FIGURE_PREFIX): float(value) for name, value in record.items()
            if name.startswith(FIGURE_PREFIX) and isinstance(value, (int, float))}


def mean_step(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each phase's seconds per step over `steps` (a phase a step lacks counts 0 there): the step
    they make up is their mean wall time, and each phase's share of it is its share of their time."""
    names = sorted({name for step in steps for name in step})
    return {name: sum(step.get(name, 0.0) for step in steps) / len(steps) for name in names}


def shares(seconds: Mapping[str, float]) -> dict[str, float]:
    """Each phase's share of the step its seconds add up to (adding up to 1; {} for an empty step)."""
    total = sum(seconds.values())
    return {name: value / total for name, value in seconds.items()} if total > 0 else {}


def summarise(steps_by_rank: Mapping[int, Sequence[Mapping[str, float]]],
              warm_up: int = WARM_UP_STEPS) -> dict[str, dict]:
    """The summary's figures from each rank's logged steps, in order (phase -> seconds each): the
    mean steady step of every rank together, and each rank's own where the ranks differ. {} where no
    rank has a steady step.

    A mean, not a median step: a recipe's steps need not be alike (rft logs its generation calls,
    then its optimizer steps), and a median taken phase by phase does not add up to a step; an
    occasional checkpoint or evaluation is part of where the time goes."""
    steady = {rank: list(steps[warm_up:]) for rank, steps in steps_by_rank.items() if len(steps) > warm_up}
    if not steady:
        return {}
    pooled = mean_step([step for steps in steady.values() for step in steps])
    figures: dict[str, dict] = {"step_phase_seconds": _rounded(pooled, 6), "step_phases": _rounded(shares(pooled), 4)}
    by_rank = {rank: mean_step(steps) for rank, steps in sorted(steady.items())}
    if len(by_rank) > 1 and _ranks_differ(by_rank):
        figures["step_phase_seconds_by_rank"] = {str(rank): _rounded(seconds, 6) for rank, seconds in by_rank.items()}
    return figures


def _ranks_differ(by_rank: Mapping[int, Mapping[str, float]]) -> bool:
    totals = [sum(seconds.values()) for seconds in by_rank.values()]
    middle = statistics.median(totals)
    if middle > 0 and max(abs(total - middle) for total in totals) / middle > RANKS_DIFFER:
        return True
    rank_shares = [shares(seconds) for seconds in by_rank.values()]
    names = {name for share in rank_shares for name in share}
    return any(max(share.get(name, 0.0) for share in rank_shares) - min(share.get(name, 0.0) for share in rank_shares)
               > RANKS_DIFFER for name in names)


def _rounded(values: Mapping[str, float], digits: int) -> dict[str, float]:
    return {name: round(value, digits) for name, value in values.items()}


def recent_by_rank(steps_by_rank: Mapping[int, Sequence[Mapping[str, float]]], steps: int = LIVE_STEPS,
                   warm_up: int = WARM_UP_STEPS) -> dict[str, dict[str, float]]:
    """Each rank's mean step over its last `steps` steady logged steps (phase -> seconds), by rank as
    text (the supervisor puts them in the run's progress, a JSON record); a rank without a steady step
    is left out."""
    return {str(rank): _rounded(mean_step(list(logged[warm_up:])[-steps:]), 6)
            for rank, logged in sorted(steps_by_rank.items()) if len(logged) > warm_up}


def live_advice(recent: Mapping[str, Mapping[str, float]] | None, gpu_of_rank: Mapping[str, str] | None = None
                ) -> list[str]:
    """`advice` on the ranks' recent steps (`recent_by_rank`): a straggler, and the shares of the ranks'
    steps together (the memory rule needs the run's peaks: `gpuscale show` adds it)."""
    if not recent:
        return []
    pooled = mean_step(list(recent.values()))
    return advice(shares(pooled), recent, gpu_of_rank=gpu_of_rank)


def where_a_step_goes(step_phases: Mapping[str, float]) -> str:
    """One line of the shares, largest first, `other` last: `forward+backward 71% · optimizer 12% ·
    data 3% · other 2%` (a share under half a percent left out)."""
    named = sorted(((share, name) for name, share in step_phases.items() if name != OTHER), reverse=True)
    ordered = [(name, share) for share, name in named]
    if OTHER in step_phases:
        ordered.append((OTHER, step_phases[OTHER]))
    return " · ".join(f"{label(name)} {share:.0%}" for name, share in ordered if share >= 0.005)


def advice(step_phases: Mapping[str, float] | None = None,
           seconds_by_rank: Mapping[str, Mapping[str, float]] | None = None,
           memory_mb: Mapping[str, tuple[float, float]] | None = None,
           gpu_of_rank: Mapping[str, str] | None = None) -> list[str]:
    """What to change, one line each naming the figure and the knob; [] where nothing is wrong.

    `step_phases` is phase -> share of a step; `seconds_by_rank` rank -> phase -> seconds (a rank's
    mean steady step: a straggler is a rank whose work, its WAIT for the others left out, takes
    STRAGGLER more than the ranks' median: ranks that meet at an all-reduce every step all take the
    same time a step, the faster ones waiting); `memory_mb` card -> (memory used, memory it has);
    `gpu_of_rank` rank -> its card's name, to say which card a straggler is on."""
    lines = _straggler_lines(seconds_by_rank or {}, gpu_of_rank or {})
    shares_now = step_phases or {}
    for phase, line in ((GENERATE, "generation takes {share:.0%} of a step: raise the generation batch, or give "
                                    "generation its own GPUs"),
                        (DATA, "data loading takes {share:.0%} of a step: tokenize the rows ahead and keep "
                               "them short, or feed the trainer from more worker processes"),
                        (WAIT, "waiting for the other ranks at the all-reduce takes {share:.0%} of a step: a "
                               "straggler or a slow link; more rows a rank a step (batch_size, gradient_accumulation) "
                               "or fewer ranks")):
        if shares_now.get(phase, 0.0) > TOO_MUCH[phase]:
            lines.append(line.format(share=shares_now[phase]))
    for card, (used, total) in sorted((memory_mb or {}).items()):
        if total and used < total * MEMORY_USED_AT_LEAST:
            lines.append(f"{card} uses {used / 1024:,.1f} of its {total / 1024:,.0f} GiB ({used / total:.0%}): "
                         "raise batch_size (--batch-size auto sizes it to the card)")
    return lines


def _straggler_lines(seconds_by_rank: Mapping[str, Mapping[str, float]], gpu_of_rank: Mapping[str, str]) -> list[str]:
    work = {rank: sum(seconds.values()) - seconds.get(WAIT, 0.0) for rank, seconds in seconds_by_rank.items()}
    if len(work) < 2:
        return []
    middle = statistics.median(work.values())
    lines = []
    for rank, busy in sorted(work.items(), key=lambda item: int(item[0])):
        if middle > 0 and busy > middle * (1 + STRAGGLER):
            where = f" ({gpu_of_rank[rank]})" if rank in gpu_of_rank else ""
            lines.append(f"rank {rank}{where} is a straggler: it works {busy:.3g} s a step, {busy / middle - 1:.0%} "
                         f"over the ranks' median {middle:.3g} s (waits for others left out); look at what else "
                         "runs on its card, its clocks and its share of the rows")
    return lines
