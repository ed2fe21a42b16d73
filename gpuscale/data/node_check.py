"""The node check's arithmetic (the probe's figures per GPU): all-reduce bus bandwidth as nccl-tests
computes it, the rounds in which every pair of ranks measures its link, and the rules that flag a GPU
slower than its peers and a link slower than the others.

Pure arithmetic, no torch: the ranks compute the figures and the flags with it, the tests check it
on made-up figures.
"""

from __future__ import annotations

import statistics

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


def slow_gpus(gpus: list[str], figures: dict[str, list[float | None]],
              share: float = SLOW_SHARE) -> list[str]:
    """One line for each GPU and figure where the GPU is more than `share` below the median of its
    peers (the other GPUs' values of that figure): `GPU 2: memory bandwidth 1,200 GB/s is 60% below
    its peers' median 3,000 GB/s`. `gpus` names the GPUs in rank order; `figures` maps a NODE_FIGURES
    name to its value per GPU (None where not measured). A lone GPU has no peers and is never
    flagged."""
    lines = []
    for node_figure in NODE_FIGURES:
        values = figures.get(node_figure.name) or []
        for index, value in enumerate(values):
            peers = [v for i, v in enumerate(values) if i != index and v is not None]
            if value is None or not peers:
                continue
            median = statistics.median(peers)
            if value < (1 - share) * median:
                below = 1 - value / median
                lines.append(f"{gpus[index]}: {node_figure.label} {_number(value)} {node_figure.unit} is "
                             f"{below:.0%} below its peers' median {_number(median)} {node_figure.unit}")
    return lines


def _number(value: float) -> str:
    """Four significant digits, whole numbers with thousands separators from 1,000 on (as the views
    write figures: `3,210`, `0.1123`)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def link_name(pair: str) -> str:
    """The summary's figure of the link between ranks `a-b`: `link_gb_per_s_0_1`."""
    return "link_gb_per_s_" + pair.replace("-", "_")


def slow_links(links: dict[str, float], gpus: list[str], share: float = SLOW_SHARE) -> list[str]:
    """One line for each link (`"<rank>-<rank>"` -> GB/s each way) more than `share` below the median
    of the other links: `link GPU 0 - GPU 2: 20 GB/s each way is 60% below the other links' median
    50 GB/s`. With one link there is nothing to compare it with."""
    lines = []
    for pair, value in links.items():
        others = [v for other, v in links.items() if other != pair]
        if not others:
            continue
        median = statistics.median(others)
        if value < (1 - share) * median:
            a, b = (gpus[int(rank)] for rank in pair.split("-"))
            lines.append(f"link {a} - {b}: {_number(value)} GB/s each way is {1 - value / median:.0%} below the "
                         f"other links' median {_number(median)} GB/s")
    return lines
