"""The node check's arithmetic and table on made-up figures: all-reduce bus bandwidth as nccl-tests
computes it, the rule that flags a GPU slower than its peers, the card table's data-sheet figures
(an unknown card has none, and the table says so), and `compare` of two probes."""

from __future__ import annotations

import pytest

from gpuscale.app.views.node_check import node_check_lines, table_names
from gpuscale.app.views.runs import compare_runs
from gpuscale.data.cards import memory_bandwidth, peak_flops
from gpuscale.data.figures import figure
from gpuscale.data.node_check import (
    NODE_FIGURES,
    bus_bandwidth,
    gpu_gaps,
    link_name,
    pair_rounds,
    per_rank_name,
    repeat_spread,
    slow_gpus,
    slow_links,
    unjudged,
)

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
    # What the decode columns count, beside the summary's tokens_per_s.
    assert any(line.startswith("  decode: one GPU's generate calls through gpuscale's engine, the prompt's prefill "
                               "timed with them") for line in lines)


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
                 "throughput_tokens_per_s_rank_2", "allreduce_busbw_gb_per_s"]:
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
