"""The probe's node check as one table: each GPU's measured figures beside its card's data-sheet
figures, the all-reduce bus bandwidth across the ranks, and the GPUs flagged as slower than their
peers. The CLI's end of a run, `gpuscale show` and the TUI's run page write the same lines.
"""

from __future__ import annotations

from gpuscale.app.views.runs import figure_text
from gpuscale.app.views.text import MISSING, format_number
from gpuscale.data.cards import memory_bandwidth, peak_flops, unknown_card_note
from gpuscale.data.node_check import NODE_FIGURES, link_name, per_rank_name

# The table's column of each NODE_FIGURES figure, in its order, headed by this and the catalogue's unit
# (`memory GB/s`); `{batch}` is the summary's throughput_batch_size.
COLUMN_HEADINGS = {"copy_gb_per_s": "memory", "matmul_tflops": "matmul", "latency_tokens_per_s": "decode b=1",
                   "throughput_tokens_per_s": "decode b={batch}", "decode_batch1_floor_share": "b=1 of floor"}
# What the decode columns count, after how the summary says they were measured: beside the summary's
# tokens_per_s (transformers' forward on every rank). A probe from before the summary said so timed whole
# generate calls, the prefill with them, without torch.compile.
DECODE_NOTE = "decode: {how}; the summary's tokens_per_s, not these columns, counts transformers' forward on every rank"
EARLIER_DECODE = "one GPU's generate calls through gpuscale's engine, the prompt's prefill timed with them"
FLOOR_NOTE = ("b=1 of floor: the time to read the weights a decode step reads ({weights}) once at the GPU's "
              "measured memory bandwidth, over its batch-1 decode step")
# The summary's figures the table shows (besides the per-rank ones), left out of the plain list.
TABLE_FIGURES = ("node_check_gpus", "node_check_flags", "node_check_unjudged", "allreduce_busbw_gb_per_s",
                 "allreduce_algbw_gb_per_s", "allreduce_mib", "throughput_batch_size", "node_check_decode",
                 "decode_weight_bytes")


def has_node_check(summary: dict) -> bool:
    return isinstance(summary.get("node_check_gpus"), list) and bool(summary["node_check_gpus"])


def table_names(summary: dict) -> set[str]:
    """Every summary figure the node check's table shows (none where the summary has no node check)."""
    if not has_node_check(summary):
        return set()
    ranks = range(len(summary["node_check_gpus"]))
    links = {name for name in summary if name.startswith(LINK_PREFIX)}
    return set(TABLE_FIGURES) | {per_rank_name(f.name, r) for f in NODE_FIGURES for r in ranks} | links


LINK_PREFIX = link_name("")


def links_line(summary: dict) -> str | None:
    """`links (GB/s each way): GPU 0-GPU 1 48.2 · ...`, or None where no link was measured."""
    gpus = summary["node_check_gpus"]
    links = []
    for name, value in summary.items():
        ranks = name.removeprefix(LINK_PREFIX).split("_")
        if name.startswith(LINK_PREFIX) and len(ranks) == 2 and all(r.isdigit() and int(r) < len(gpus) for r in ranks):
            links.append(f"{gpus[int(ranks[0])]} - {gpus[int(ranks[1])]} {format_number(value)}")
    return "links (GB/s each way, a pair at a time): " + " · ".join(links) if links else None


def _measured_and_spec(name: str, measured, spec: float | None) -> str:
    """`3,210 (96% of 3,350)`, or the measured value alone (as the catalogue writes figure `name`: a
    share as `18.4%`) where the card has no data-sheet figure."""
    if not isinstance(measured, (int, float)):
        return MISSING
    if not spec:
        return figure_text(name, measured, unit=False)
    return f"{format_number(measured)} ({measured / spec:.0%} of {format_number(spec)})"


def decode_lines(summary: dict) -> list[str]:
    """What the decode columns count and how they ran, then what the floor share measures."""
    lines = [DECODE_NOTE.format(how=summary.get("node_check_decode") or EARLIER_DECODE)]
    weights = summary.get("decode_weight_bytes")
    if isinstance(weights, (int, float)):
        lines.append(FLOOR_NOTE.format(weights=f"{format_number(weights / 2**20)} MiB"))
    return lines


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def node_check_lines(summary: dict) -> list[str]:
    """The node check's table, its all-reduce line, the data-sheet note of a card not in the table and
    the flags (`slow: none` where no GPU is slow); no lines for a summary without a node check."""
    if not has_node_check(summary):
        return []
    gpus, devices = summary["node_check_gpus"], summary.get("devices") or []
    batch = summary.get("throughput_batch_size")
    headings = [" ".join(filter(None, (COLUMN_HEADINGS[f.name].format(batch=batch if batch else "?"), f.unit)))
                for f in NODE_FIGURES]
    rows = [["GPU", "device", *headings]]
    unknown = []
    for rank, gpu in enumerate(gpus):
        device = devices[rank] if rank < len(devices) else None
        if device and device not in unknown and (memory_bandwidth(device) is None or peak_flops(device) is None):
            unknown.append(device)
        bandwidth, flops = memory_bandwidth(device), peak_flops(device)
        spec = {"copy_gb_per_s": bandwidth and bandwidth / 1e9, "matmul_tflops": flops and flops / 1e12}
        rows.append([str(gpu), str(device or MISSING), *(
            _measured_and_spec(f.name, summary.get(per_rank_name(f.name, rank)), spec.get(f.name))
            for f in NODE_FIGURES)])
    lines = ["node check:", *("  " + line for line in _aligned(rows)), *("  " + line for line in decode_lines(summary))]
    lines.append("  " + allreduce_line(summary))
    if links := links_line(summary):
        lines.append("  " + links)
    lines += ["  " + unknown_card_note(device) for device in unknown]
    flags, noisy = summary.get("node_check_flags") or [], summary.get("node_check_unjudged") or []
    beyond = " beyond the spread of its own repeats" if noisy else ""
    lines += ["  slow: " + flag for flag in flags] or [f"  slow: none (no GPU more than 15% below its peers{beyond})"]
    lines += ["  not judged: " + line for line in noisy]
    return lines


def allreduce_line(summary: dict) -> str:
    busbw = summary.get("allreduce_busbw_gb_per_s")
    if not isinstance(busbw, (int, float)):
        return "all-reduce: one rank, nothing to measure"
    return (f"all-reduce bus bandwidth {format_number(busbw)} GB/s across {len(summary['node_check_gpus'])} ranks "
            f"(algbw {format_number(summary.get('allreduce_algbw_gb_per_s'))} GB/s, "
            f"{format_number(summary.get('allreduce_mib'))} MiB a rank; busbw as nccl-tests computes it)")
