"""The node check's arithmetic (the probe's figures per GPU): all-reduce bus bandwidth as nccl-tests
computes it, the rounds in which every pair of ranks measures its link, a decode step's seconds from
timed generate calls (bench/generation.py's measure, which the node check shares) and batch-1 decode as
a share of its weight-read floor, and the rules that flag a GPU slower than its peers and a link slower
than the others, where the measurement's own spread allows a verdict.

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
    "copy_gb_per_s", "matmul_tflops", "latency_tokens_per_s", "throughput_tokens_per_s", "decode_batch1_floor_share"))


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
class DecodeCalls:
    """Seconds of generate calls of `new_tokens` new tokens a row (`long`) and of one (`short`), after
    the same prompts: a decode step is their medians' difference over the `new_tokens - 1` steps between
    them, the prefill and each call's own overheads being in both (bench/generation.py's measure; the
    node check's decode figures on every device)."""

    new_tokens: int
    long: tuple[float, ...]
    short: tuple[float, ...]

    def __post_init__(self):
        if self.new_tokens < 2 or not self.long or not self.short:
            raise ValueError(f"a decode step needs calls of 2 or more new tokens and of 1, each timed at least "
                             f"once: {self.new_tokens} new tokens, {len(self.long)} and {len(self.short)} calls")

    @property
    def difference(self) -> float:
        return (statistics.median(self.long) - statistics.median(self.short)) / (self.new_tokens - 1)

    @property
    def from_difference(self) -> bool:
        """False where the difference is not positive: calls whose own noise exceeds their decode steps
        (CPU ranks sharing cores, a few steps a call; never seen on a GPU)."""
        return self.difference > 0

    @property
    def step_seconds(self) -> float:
        """Seconds of a decode step: the difference; where it is not positive, the long call's seconds a
        new token (its prefill counted: an upper bound), so that a figure stays a time."""
        return self.difference if self.from_difference else statistics.median(self.long) / self.new_tokens

    @property
    def spread(self) -> float | None:
        """How far the measurement can move: the long calls' and the short calls' ranges over the steps
        between them, as a share of the step (`repeat_spread`'s meaning); the long calls' own spread where
        the step is not their difference. None with a single call of each."""
        if not self.from_difference:
            return repeat_spread(list(self.long))
        if len(self.long) < 2 and len(self.short) < 2:
            return None
        ranges = sum(max(calls) - min(calls) for calls in (self.long, self.short))
        return ranges / (self.new_tokens - 1) / self.difference

    def rate(self, rows: int) -> Repeats:
        """Decode tokens/s of `rows` rows decoded together, with the measurement's spread."""
        return Repeats(rows / self.step_seconds, self.spread)


def floor_share(weight_bytes: float, copy_gb_per_s: Repeats, batch1_tokens_per_s: Repeats) -> Repeats:
    """Batch-1 decode as a share of its floor: the time to read `weight_bytes` (the weights a decode step
    reads) once at the copy bandwidth measured on the same GPU (bytes read plus written a second, as
    bench/generation.py's floor counts it), over the measured seconds of a batch-1 step (1 / its tokens/s).
    1.0 is a step at the memory roofline. Its spread: the two measurements' spreads added (None where
    neither has one)."""
    if weight_bytes <= 0 or copy_gb_per_s.value <= 0 or batch1_tokens_per_s.value <= 0:
        raise ValueError(f"a floor share needs weights, a bandwidth and a rate above 0: {weight_bytes} bytes, "
                         f"{copy_gb_per_s.value} GB/s, {batch1_tokens_per_s.value} tokens/s")
    floor_seconds = weight_bytes / (copy_gb_per_s.value * 1e9)
    spreads = [s for s in (copy_gb_per_s.spread, batch1_tokens_per_s.spread) if s is not None]
    return Repeats(floor_seconds * batch1_tokens_per_s.value, sum(spreads) if spreads else None)


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
    percent: bool = False  # a share (the floor share), written as one: `18.4%`

    @property
    def below(self) -> float:
        return 1 - self.value / self.median

    @property
    def judged(self) -> bool:
        return self.noise is None or self.below > self.noise

    def line(self) -> str:
        text = (f"{self.what} {self._value(self.value)}{self.way} is {self.below:.0%} below "
                f"{self.peers} median {self._value(self.median)}")
        if self.judged:
            return text
        return f"{text}, within its measurement's spread ({self.noise:.0%} between repeats)"

    def _value(self, value: float) -> str:
        return f"{value:.1%}" if self.percent else f"{_number(value)} {self.unit}"


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
        found += [Gap(f"{gpus[index]}: {node_figure.label}", value, median, node_figure.unit, "its peers'", noise,
                      percent=node_figure.format == "percent")
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
