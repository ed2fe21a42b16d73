"""The node check's arithmetic (the probe's figures per GPU): all-reduce bus bandwidth as nccl-tests
computes it, the rounds in which every pair of ranks measures its link, and the rules that flag a GPU
slower than its peers and a link slower than the others, where the measurement's own spread allows a
verdict.

Pure arithmetic, no torch: the ranks compute the figures and the flags with it, the tests check it
on made-up figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gpuscale.data.figures import FIGURES

SLOW_SHARE = 0.15  # a GPU more than this share below the median of its peers is flagged

# The per-GPU figures of the node check, each higher-is-better, in the table's column order: the
# catalogue's entries (data/figures.py: name, label, unit), each a summary figure per rank,
# `<name>_rank_<r>`.
NODE_FIGURES = tuple(FIGURES[name] for name in (
    "copy_gb_per_s", "matmul_tflops", "latency_tokens_per_s", "throughput_tokens_per_s"))


def per_rank_name(figure: str, rank: int) -> str:
    return f"{figure}_rank_{rank}"


def bus_bandwidth(nbytes: float, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) of an all-reduce of `nbytes` a rank that took `seconds`, in bytes/s, as
    nccl-tests computes them: algbw = bytes / time; busbw = algbw x 2(n-1)/n, the share of the data
    each rank's link carries in a ring, so that busbw is comparable with the link's speed whatever
    the rank count (and 0 for one rank, which sends nothing)."""
    if seconds <= 0 or ranks < 1:
        raise ValueError(f"all-reduce of {nbytes} bytes on {ranks} ranks in {seconds} s: needs ranks >= 1 and time > 0")
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (ranks - 1) / ranks


def pair_rounds(ranks: int) -> list[list[tuple[int, int]]]:
    """Every pair of ranks once, in ranks - 1 rounds (one more for an odd count) of disjoint pairs
    (the circle method of a round-robin tournament): a round's pairs are measured at the same time."""
    players = list(range(ranks)) + ([None] if ranks % 2 else [])
    rounds = []
    for _ in range(len(players) - 1):
        half = len(players) // 2
        pairs = [(players[i], players[-1 - i]) for i in range(half)]
        rounds.append([tuple(sorted(pair)) for pair in pairs if None not in pair])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


@dataclass(frozen=True)
class Repeats:
    """One figure of one rank from its timed repeats: the rate over all of them (work / total time, as
    bandwidthTest and nccl-tests count) and their spread (`repeat_spread`), None for a single repeat."""

    value: float
    spread: float | None


def repeats_rate(work_per_repeat: float, seconds: list[float]) -> Repeats:
    """The `Repeats` of repeats that each did `work_per_repeat` in `seconds` (one time a repeat)."""
    return Repeats(work_per_repeat * len(seconds) / sum(seconds), repeat_spread(seconds))


def repeat_spread(seconds: list[float]) -> float | None:
    """How far a measurement's repeats are from each other: (slowest - fastest) / median, as a share.
    On a quiet GPU a few percent; on CPU ranks that share cores, a preempted repeat makes it tens of
    percent or more, and the figure itself is off by as much. None for fewer than two repeats."""
    if len(seconds) < 2:
        return None
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


@dataclass(frozen=True)
class Gap:
    """A value more than the share below its peers' median: `judged` where the gap is also wider than
    the noise (the spread of its own repeats, or the median spread of its peers'), else a measurement
    too noisy to call it slow."""

    what: str  # `GPU 2: memory bandwidth` or `link GPU 0 - GPU 3`
    value: float
    median: float
    unit: str
    peers: str  # "its peers'" or "the other links'"
    noise: float | None
    way: str = ""  # after the value alone: a link's " each way"

    @property
    def below(self) -> float:
        return 1 - self.value / self.median

    @property
    def judged(self) -> bool:
        return self.noise is None or self.below > self.noise

    def line(self) -> str:
        text = (f"{self.what} {_number(self.value)} {self.unit}{self.way} is {self.below:.0%} below "
                f"{self.peers} median {_number(self.median)} {self.unit}")
        if self.judged:
            return text
        return f"{text}, within its measurement's spread ({self.noise:.0%} between repeats)"


def gaps(values: dict[str, float | None], spreads: dict[str, float | None], share: float = SLOW_SHARE
         ) -> list[tuple[str, float, float, float | None]]:
    """(key, value, peers' median, noise) of each value more than `share` below the median of the
    others (None values left out); the noise is the largest of its own spread and its peers' median
    spread (None where no spread is known)."""
    found = []
    for key, value in values.items():
        peers = {k: v for k, v in values.items() if k != key and v is not None}
        if value is None or not peers:
            continue
        median = statistics.median(peers.values())
        if value < (1 - share) * median:
            known = [s for s in (spreads.get(key), _median([spreads.get(k) for k in peers])) if s is not None]
            found.append((key, value, median, max(known) if known else None))
    return found


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def gpu_gaps(gpus: list[str], figures: dict[str, list[float | None]], share: float = SLOW_SHARE,
             spreads: dict[str, list[float | None]] | None = None) -> list[Gap]:
    """Each GPU and figure more than `share` below the median of its peers (the other GPUs' values of
    that figure). `gpus` names the GPUs in rank order; `figures` maps a NODE_FIGURES name to its value
    per GPU (None where not measured), `spreads` the same names to each value's `repeat_spread`. A lone
    GPU has no peers and is never flagged."""
    found = []
    for node_figure in NODE_FIGURES:
        values = dict(enumerate(figures.get(node_figure.name) or []))
        spread = dict(enumerate((spreads or {}).get(node_figure.name) or []))
        found += [Gap(f"{gpus[index]}: {node_figure.label}", value, median, node_figure.unit, "its peers'", noise)
                  for index, value, median, noise in gaps(values, spread, share)]
    return found


def slow_gpus(gpus: list[str], figures: dict[str, list[float | None]], share: float = SLOW_SHARE,
              spreads: dict[str, list[float | None]] | None = None) -> list[str]:
    """One line for each GPU and figure judged slow (`gpu_gaps`): `GPU 2: memory bandwidth 1,200 GB/s
    is 60% below its peers' median 3,000 GB/s`. A gap no wider than the noise of the measurement is no
    verdict (`unjudged`): two CPU ranks on a quiet machine read 47% apart."""
    return [gap.line() for gap in gpu_gaps(gpus, figures, share, spreads) if gap.judged]


def unjudged(found: list[Gap]) -> list[str]:
    """The lines of the gaps too noisy to judge, saying so."""
    return [gap.line() for gap in found if not gap.judged]


def _number(value: float) -> str:
    """Four significant digits, whole numbers with thousands separators from 1,000 on (as the views
    write figures: `3,210`, `0.1123`)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def link_name(pair: str) -> str:
    """The summary's figure of the link between ranks `a-b`: `link_gb_per_s_0_1`."""
    return "link_gb_per_s_" + pair.replace("-", "_")


def link_gaps(links: dict[str, float], gpus: list[str], share: float = SLOW_SHARE,
              spreads: dict[str, float | None] | None = None) -> list[Gap]:
    """Each link (`"<rank>-<rank>"` -> GB/s each way) more than `share` below the median of the other
    links; with one link there is nothing to compare it with."""
    found = []
    for pair, value, median, noise in gaps(dict(links), spreads or {}, share):
        a, b = (gpus[int(rank)] for rank in pair.split("-"))
        found.append(Gap(f"link {a} - {b}:", value, median, "GB/s", "the other links'", noise, way=" each way"))
    return found


def slow_links(links: dict[str, float], gpus: list[str], share: float = SLOW_SHARE,
               spreads: dict[str, float | None] | None = None) -> list[str]:
    """One line for each link judged slow (`link_gaps`): `link GPU 0 - GPU 2: 20 GB/s each way is 60%
    below the other links' median 50 GB/s`."""
    return [gap.line() for gap in link_gaps(links, gpus, share, spreads) if gap.judged]
