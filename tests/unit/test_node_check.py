"""The node check's arithmetic and table on made-up figures: all-reduce bus bandwidth as nccl-tests
computes it, a decode step from timed calls and batch-1 decode's share of its weight-read floor, the
rule that flags a GPU slower than its peers, the card table's data-sheet figures (an unknown card has
none, and the table says so), and `compare` of two probes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuscale.app.views.node_check import node_check_lines, table_names
from gpuscale.app.views.runs import compare_runs, summary_lines
from gpuscale.data.cards import memory_bandwidth, peak_flops
from gpuscale.data.figures import figure
from gpuscale.data.node_check import (
    NODE_FIGURES,
    DecodeCalls,
    Repeats,
    bus_bandwidth,
    floor_share,
    gpu_gaps,
    link_name,
    pair_rounds,
    per_rank_name,
    repeat_spread,
    slow_gpus,
    slow_links,
    unjudged,
)
from gpuscale.recipes.probe import node_check_summary

H100 = "NVIDIA H100 80GB HBM3"


def test_busbw_is_nccl_tests_algbw_times_2_n_minus_1_over_n():
    assert bus_bandwidth(1e9, 0.5, 2) == (2e9, 2e9)  # 2(n-1)/n = 1 on two ranks
    assert bus_bandwidth(1e9, 0.5, 4) == (2e9, 3e9)  # 1.5 on four
    algbw, busbw = bus_bandwidth(256 * 2**20, 0.002, 8)
    assert algbw == pytest.approx(134.2e9, rel=1e-3) and busbw == pytest.approx(algbw * 1.75)
    assert bus_bandwidth(1e9, 1.0, 1) == (1e9, 0.0)  # one rank sends nothing
    with pytest.raises(ValueError, match="time > 0"):
        bus_bandwidth(1e9, 0.0, 4)


def node(**values: list) -> dict[str, list]:
    return {f.name: values.get(f.name, [100.0] * 4) for f in NODE_FIGURES}


GPUS = ["GPU 0", "GPU 1", "GPU 2", "GPU 3"]


def test_a_gpu_more_than_15_percent_below_its_peers_median_is_flagged_in_one_line():
    flags = slow_gpus(GPUS, node(copy_gb_per_s=[3300.0, 3310.0, 2000.0, 3290.0]))
    assert flags == ["GPU 2: memory bandwidth 2,000 GB/s is 39% below its peers' median 3,300 GB/s"]
    # Each figure on its own: a GPU slow at matmul and at decode gets a line for each.
    flags = slow_gpus(GPUS, node(matmul_tflops=[700.0, 80.0, 710.0, 705.0],
                                 throughput_tokens_per_s=[9000.0, 5000.0, 9100.0, 8900.0]))
    assert flags == ["GPU 1: matmul 80 TFLOP/s is 89% below its peers' median 705 TFLOP/s",
                     "GPU 1: decode at full batch 5,000 tokens/s is 44% below its peers' median 9,000 tokens/s"]


def test_within_15_percent_a_lone_gpu_or_a_missing_figure_is_not_flagged():
    assert slow_gpus(GPUS, node(copy_gb_per_s=[100.0, 100.0, 86.0, 100.0])) == []  # 14% below
    assert slow_gpus(GPUS, node(copy_gb_per_s=[100.0, 100.0, 84.0, 100.0])) != []  # 16% below
    assert slow_gpus(["GPU 0"], {"copy_gb_per_s": [1.0]}) == []  # no peers
    assert slow_gpus(GPUS, node(copy_gb_per_s=[100.0, None, 100.0, 100.0])) == []
    # Two GPUs: the slow one is flagged, not the fast one (whose peer is the slow one).
    assert slow_gpus(GPUS[:2], {"copy_gb_per_s": [100.0, 50.0]}) == [
        "GPU 1: memory bandwidth 50 GB/s is 50% below its peers' median 100 GB/s"]


def test_no_verdict_where_the_gap_is_within_the_measurements_own_spread():
    """Two CPU ranks of a quiet machine read 47% apart with repeats that spread as much: no verdict,
    and the gap is named as one the measurement cannot judge. The same gap from steady repeats (a
    GPU's few percent) is a verdict. The spreads are `repeat_spread`'s of made-up repeat times."""
    calm = [repeat_spread([0.0101, 0.0100, 0.0102])] * 2  # 2% between repeats
    noisy = repeat_spread([0.010, 0.021, 0.012])  # one repeat preempted: 92%
    assert calm[0] == pytest.approx(0.0002 / 0.0101) and noisy == pytest.approx(11 / 12)
    values = {"copy_gb_per_s": [9.0, 4.77]}  # 47% below its peer
    assert slow_gpus(["cpu 0", "cpu 1"], values, spreads={"copy_gb_per_s": calm}) == [
        "cpu 1: memory bandwidth 4.77 GB/s is 47% below its peers' median 9 GB/s"]
    for spreads in ([calm[0], noisy], [noisy, calm[0]]):  # its own repeats, or its peer's, too noisy
        found = gpu_gaps(["cpu 0", "cpu 1"], values, spreads={"copy_gb_per_s": spreads})
        assert slow_gpus(["cpu 0", "cpu 1"], values, spreads={"copy_gb_per_s": spreads}) == []
        assert unjudged(found) == ["cpu 1: memory bandwidth 4.77 GB/s is 47% below its peers' median 9 GB/s, "
                                   "within its measurement's spread (92% between repeats)"]
    # A spread under the gap still leaves a verdict; a figure measured once (no spread) is judged as before.
    assert slow_gpus(["cpu 0", "cpu 1"], values, spreads={"copy_gb_per_s": [0.3, 0.3]}) != []
    assert repeat_spread([0.01]) is None
    assert slow_gpus(["cpu 0", "cpu 1"], values, spreads={"copy_gb_per_s": [None, None]}) != []
    # Links: the same rule.
    links = {"0-1": 48.0, "0-2": 47.0, "0-3": 20.0, "1-2": 48.5, "1-3": 47.5, "2-3": 48.2}
    assert slow_links(links, GPUS, spreads=dict.fromkeys(links, 0.03)) != []
    assert slow_links(links, GPUS, spreads={**dict.fromkeys(links, 0.03), "0-3": 0.8}) == []


def test_the_table_names_the_gaps_it_cannot_judge():
    summary = {**probe_summary(["cpu", "cpu"], [9.0, 4.77]), "node_check_unjudged": ["cpu 1: memory bandwidth ..."]}
    lines = node_check_lines(summary)
    assert lines[-2:] == ["  slow: none (no GPU more than 15% below its peers beyond the spread of its own repeats)",
                          "  not judged: cpu 1: memory bandwidth ..."]
    assert "node_check_unjudged" in table_names(summary)
    # What the decode columns count, beside the summary's tokens_per_s: a summary without node_check_decode
    # is an earlier probe's, which timed whole generate calls; it had no floor share either.
    assert any(line.startswith("  decode: one GPU's generate calls through gpuscale's engine, the prompt's prefill "
                               "timed with them") for line in lines)
    assert not any(line.startswith("  b=1 of floor") for line in lines)


def test_the_card_table_gives_data_sheet_figures_the_most_specific_name_first():
    assert memory_bandwidth(H100) == 3350e9 and peak_flops(H100) == 989e12
    assert memory_bandwidth("NVIDIA H100 PCIe") == 2000e9
    assert memory_bandwidth("NVIDIA H200") == 4800e9 and memory_bandwidth("NVIDIA H20") == 4000e9
    assert memory_bandwidth("NVIDIA A100-SXM4-40GB") == 1555e9 and memory_bandwidth("NVIDIA A100-SXM4-80GB") == 2039e9
    assert memory_bandwidth("NVIDIA GH200 480GB") == 4000e9
    assert memory_bandwidth("Tesla T4") is None and peak_flops("Tesla T4") is None
    assert memory_bandwidth(None) is None and memory_bandwidth("cpu") is None


def probe_summary(devices: list[str], copy: list[float], flags: list[str] = ()) -> dict:
    summary = {"world_size": len(devices), "devices": devices,
               "node_check_gpus": [f"GPU {i}" for i in range(len(devices))],
               "throughput_batch_size": 64, "node_check_flags": list(flags),
               "allreduce_mib": 256, "allreduce_algbw_gb_per_s": 200.0, "allreduce_busbw_gb_per_s": 300.0}
    for rank, value in enumerate(copy):
        summary.update({per_rank_name("copy_gb_per_s", rank): value, per_rank_name("matmul_tflops", rank): 700.0,
                        per_rank_name("latency_tokens_per_s", rank): 250.0,
                        per_rank_name("throughput_tokens_per_s", rank): 90000.0})
    return summary


def test_the_table_puts_each_figure_beside_the_cards_and_says_when_a_card_has_none():
    lines = node_check_lines(probe_summary([H100, "Tesla T4"], [3216.0, 300.0], ["GPU 1: memory bandwidth ..."]))
    assert lines[0] == "node check:"
    header, first, second = lines[1:4]
    assert header.split()[:2] == ["GPU", "device"] and "decode b=64 tokens/s" in header
    assert "3,216 (96% of 3,350)" in first and "700 (71% of 989)" in first and "90,000" in first
    assert "Tesla T4" in second and "300" in second and "% of" not in second
    assert ("  all-reduce bus bandwidth 300 GB/s across 2 ranks (algbw 200 GB/s, 256 MiB a rank; busbw as "
            "nccl-tests computes it)") in lines
    assert "  no data-sheet figures for Tesla T4 (not in gpuscale/data/cards.py)" in lines
    assert lines[-1] == "  slow: GPU 1: memory bandwidth ..."
    calm = node_check_lines(probe_summary([H100, H100], [3216.0, 3200.0]))
    assert calm[-1] == "  slow: none (no GPU more than 15% below its peers)"
    assert not any("no data-sheet" in line for line in calm)
    # Every per-rank figure is in the table, so the summary's plain list leaves them out.
    names = table_names(probe_summary([H100] * 2, [1.0] * 2))
    assert {"copy_gb_per_s_rank_1", "node_check_gpus", "allreduce_busbw_gb_per_s"} <= names
    assert node_check_lines({"tokens_per_s": 5.0}) == [] and table_names({"tokens_per_s": 5.0}) == set()


def test_every_node_check_figure_is_catalogued_higher_is_better():
    for name in ["copy_gb_per_s_rank_3", "matmul_tflops_rank_0", "latency_tokens_per_s_rank_1",
                 "throughput_tokens_per_s_rank_2", "decode_batch1_floor_share_rank_0", "allreduce_busbw_gb_per_s"]:
        assert figure(name) is not None and figure(name).direction == "higher", name


def test_compare_of_two_probes_shows_which_gpu_changed_and_which_way():
    def run(run_id: int, copy: list[float]) -> dict:
        return {"id": run_id, "recipe": "probe", "status": "succeeded", "settings": {},
                "summary": probe_summary([H100, H100], copy)}

    diff = compare_runs(run(1, [3300.0, 3300.0]), run(2, [3300.0, 2000.0]))
    assert list(diff["figures"]) == ["copy_gb_per_s_rank_1"]
    assert diff["figures"]["copy_gb_per_s_rank_1"]["better"] == "a"


@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 8])
def test_the_links_are_every_pair_once_in_rounds_of_disjoint_pairs(ranks):
    rounds = pair_rounds(ranks)
    pairs = [pair for round_ in rounds for pair in round_]
    assert sorted(pairs) == [(a, b) for a in range(ranks) for b in range(a + 1, ranks)]
    assert len(rounds) == ranks - 1 + ranks % 2
    for round_ in rounds:  # no rank in two pairs of a round: they are measured at once
        ranks_in_round = [rank for pair in round_ for rank in pair]
        assert len(ranks_in_round) == len(set(ranks_in_round))


def test_a_link_well_below_the_others_is_flagged_naming_its_two_gpus():
    links = {"0-1": 48.0, "0-2": 47.0, "0-3": 20.0, "1-2": 48.5, "1-3": 47.5, "2-3": 48.2}
    assert slow_links(links, GPUS) == [
        "link GPU 0 - GPU 3: 20 GB/s each way is 58% below the other links' median 48 GB/s"]
    assert slow_links({"0-1": 1.0}, GPUS) == []  # one link: nothing to compare it with
    summary = {**probe_summary([H100] * 4, [3300.0] * 4), **{link_name(pair): v for pair, v in links.items()}}
    assert "  links (GB/s each way, a pair at a time): GPU 0 - GPU 1 48 · GPU 0 - GPU 2 47 · GPU 0 - GPU 3 20 · " \
        "GPU 1 - GPU 2 48.5 · GPU 1 - GPU 3 47.5 · GPU 2 - GPU 3 48.2" in node_check_lines(summary)
    assert "link_gb_per_s_0_3" in table_names(summary) and figure("link_gb_per_s_0_3").direction == "higher"


def test_a_decode_step_is_the_medians_difference_of_a_long_and_a_short_call_over_the_steps_between():
    calls = DecodeCalls(32, long=(0.052, 0.050, 0.051), short=(0.011, 0.012, 0.010))
    assert calls.from_difference and calls.step_seconds == pytest.approx((0.051 - 0.011) / 31)
    # Spread: both sides' ranges (2 ms each) over the 31 steps, as a share of the step.
    assert calls.spread == pytest.approx(0.004 / 31 / calls.step_seconds)
    assert calls.rate(64).value == pytest.approx(64 / calls.step_seconds)
    assert calls.rate(64).spread == calls.spread
    assert DecodeCalls(4, long=(0.05,), short=(0.01,)).spread is None  # one call of each: no spread
    # Calls whose noise exceeds their few steps (CPU ranks sharing cores): the long call a token, prefill counted.
    noisy = DecodeCalls(4, long=(0.030, 0.040), short=(0.050, 0.045))
    assert not noisy.from_difference and noisy.step_seconds == pytest.approx(0.035 / 4)
    assert noisy.spread == pytest.approx(0.010 / 0.035)
    for new_tokens, long, short in ((1, (0.01,), (0.01,)), (8, (), (0.01,)), (8, (0.01,), ())):
        with pytest.raises(ValueError, match="2 or more new tokens"):
            DecodeCalls(new_tokens, long, short)


def test_the_floor_share_is_the_weights_read_at_the_copy_bandwidth_over_the_batch_1_step():
    # bench/generation.py's batch-1 run of 2026-11-26 on an H200: 988,065,536 bytes of weights at its
    # copy's 4,196.9 GB/s, a 1.2750 ms step: the step was 5.4155x its floor.
    share = floor_share(988_065_536, Repeats(4196.927022165589, None), Repeats(1 / 1.2749532862744895e-3, None))
    assert share.value == pytest.approx(1 / 5.4155171941593006) and share.spread is None
    assert floor_share(1e9, Repeats(4000.0, 0.02), Repeats(1000.0, 0.05)) == Repeats(pytest.approx(0.25),
                                                                                    pytest.approx(0.07))
    assert floor_share(1e9, Repeats(4000.0, None), Repeats(1000.0, 0.05)).spread == 0.05
    for weights, copy, rate in ((0, 1.0, 1.0), (1e9, 0.0, 1.0), (1e9, 1.0, 0.0)):
        with pytest.raises(ValueError, match="above 0"):
            floor_share(weights, Repeats(copy, None), Repeats(rate, None))


def rank_figures(rank: int, copy: float, latency: float, share: float) -> dict:
    """One rank's figures as the probe gathers them (recipes/probe.py's run_probe)."""
    return {"rank": rank, "gpu": f"GPU {rank}", "copy_gb_per_s": Repeats(copy, 0.01),
            "matmul_tflops": Repeats(700.0, 0.01), "latency_tokens_per_s": Repeats(latency, 0.01),
            "throughput_tokens_per_s": Repeats(90000.0, 0.01), "decode_batch1_floor_share": Repeats(share, 0.02),
            "decode_weight_bytes": 988_065_536, "allreduce_seconds": None, "allreduce_mib": 256, "links": {},
            "decode_note": "compiled step, CUDA graphs, fused weights; a decode step = ..."}


def test_the_summary_and_show_give_each_gpus_floor_share_and_how_decode_was_measured():
    everyone = [rank_figures(0, 4200.0, 780.0, 0.1834), rank_figures(1, 4210.0, 790.0, 0.1851)]
    summary = {"devices": ["NVIDIA H200"] * 2, **node_check_summary(everyone, SimpleNamespace(batch_size=64))}
    assert summary["decode_batch1_floor_share_rank_0"] == 0.1834
    assert summary["decode_batch1_floor_share_rank_1"] == 0.1851
    assert summary["node_check_decode"] == everyone[0]["decode_note"]
    assert summary["decode_weight_bytes"] == 988_065_536
    lines = summary_lines(summary, "probe")
    table = lines[lines.index("node check:"):]
    assert table[1].endswith("decode b=64 tokens/s  b=1 of floor")
    assert table[2].endswith("18.3%") and table[3].endswith("18.5%")
    assert table[4] == ("  decode: compiled step, CUDA graphs, fused weights; a decode step = ...; the summary's "
                        "tokens_per_s, not these columns, counts transformers' forward on every rank")
    assert table[5] == ("  b=1 of floor: the time to read the weights a decode step reads (942.3 MiB) once at the "
                        "GPU's measured memory bandwidth, over its batch-1 decode step")
    # In the table, so not in the plain list above it.
    assert not any(line.startswith(("  decode_batch1_floor_share", "  node_check_decode", "  decode_weight_bytes"))
                   for line in lines[:lines.index("node check:")])
    # Ranks that ran differently (one rank's compile failed) are each named.
    everyone[1]["decode_note"] = "uncompiled step, CUDA graphs, compiling failed: ..."
    mixed = node_check_summary(everyone, SimpleNamespace(batch_size=64))["node_check_decode"]
    assert mixed == f"GPU 0: {everyone[0]['decode_note']}; GPU 1: {everyone[1]['decode_note']}"


def test_a_gpu_whose_floor_share_is_low_is_flagged_in_percent():
    everyone = [rank_figures(rank, 4200.0, 780.0, share) for rank, share in enumerate([0.18, 0.185, 0.09, 0.18])]
    flags = node_check_summary(everyone, SimpleNamespace(batch_size=64))["node_check_flags"]
    assert flags == ["GPU 2: batch-1 decode, share of the weight-read floor 9.0% is 50% below its peers' median "
                     "18.0%"]
