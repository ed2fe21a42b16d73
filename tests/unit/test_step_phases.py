"""Where a step's time goes: the rank's phase timer (engines/step_phases.py, its CPU path; the CUDA
path's is tests/gpu/test_step_phases_gpu.py), the Reporter that writes its figures, and the pure rules
over them (data/step_phases.py): the summary, the line `gpuscale show` writes, the advice."""

from __future__ import annotations

import json
import time

import pytest

from gpuscale.data import step_phases as rules
from gpuscale.engines import step_phases
from gpuscale.engines.reporter import Reporter
from gpuscale.runs.run_dir import RunDir


class TickClock:
    """A clock whose marks are the times it is told (`now`), completed only once `completed` says so:
    the CUDA path's rule (no step resolved before its last mark completed) without a GPU."""

    def __init__(self):
        self.now, self.completed = 0.0, True

    def mark(self):
        return self.now

    def done(self, mark) -> bool:
        return self.completed

    def seconds(self, start, end) -> float:
        return end - start

    def wait(self, mark) -> None:
        self.completed = True

    def release(self, mark) -> None:
        pass


def at(clock: TickClock, t: float, action) -> None:
    clock.now = t
    action()


def test_a_step_is_its_phases_and_other_the_time_none_names():
    clock = TickClock()
    timer = step_phases.StepPhases(clock)
    at(clock, 0.0, lambda: timer.enter("data"))
    at(clock, 1.0, timer.exit)
    at(clock, 1.5, lambda: timer.enter("forward_backward"))
    at(clock, 2.0, lambda: timer.enter("generate"))  # nested: generation's time is its own
    at(clock, 5.0, timer.exit)  # back in forward_backward
    at(clock, 6.0, timer.exit)
    at(clock, 6.25, lambda: timer.finish(1))
    [(step, seconds)] = timer.ready()
    assert step == 1
    assert seconds == {"data": 1.0, "other": 0.75, "forward_backward": 1.5, "generate": 3.0}
    assert sum(seconds.values()) == 6.25  # the step's wall time, from its first mark to its log


def test_switch_moves_the_outer_phase_and_the_next_step_starts_in_the_phase_open_at_the_log():
    clock = TickClock()
    timer = step_phases.StepPhases(clock)
    at(clock, 0.0, lambda: timer.restart("data"))
    at(clock, 1.0, lambda: timer.switch("forward_backward"))
    at(clock, 1.5, lambda: timer.enter("reward"))
    at(clock, 2.0, lambda: timer.switch("optimizer"))  # a hook inside a nested phase: the outer one changes
    at(clock, 2.5, timer.exit)  # the nested phase closes: the outer one is now optimizer
    at(clock, 4.0, lambda: timer.switch("log"))
    at(clock, 4.5, lambda: timer.finish(1))
    at(clock, 5.0, lambda: timer.switch("data"))
    at(clock, 6.0, lambda: timer.finish(2))
    (_, first), (_, second) = timer.ready()
    assert first == {"data": 1.0, "forward_backward": 0.5, "reward": 1.0, "optimizer": 1.5, "log": 0.5}
    assert second == {"log": 0.5, "data": 1.0}


def test_a_lap_names_the_time_since_the_last_mark():
    clock = TickClock()
    timer = step_phases.StepPhases(clock)
    at(clock, 0.0, lambda: timer.lap("other"))  # eggroll's step starts: nothing before it is known
    at(clock, 1.0, lambda: timer.lap("noise"))
    at(clock, 4.0, lambda: timer.lap("generate"))
    at(clock, 4.5, lambda: timer.finish(1))
    at(clock, 5.0, lambda: timer.lap("other"))  # the next step starts: the time since the log was other
    at(clock, 7.0, lambda: timer.lap("gather"))
    at(clock, 7.5, lambda: timer.enter("evaluate"))
    at(clock, 9.5, timer.exit)
    at(clock, 10.0, lambda: timer.finish(2))
    assert timer.ready() == [(1, {"noise": 1.0, "generate": 3.0, "other": 0.5}),
                             (2, {"other": 1.5, "gather": 2.0, "evaluate": 2.0})]


def test_restart_drops_the_time_since_the_last_step_and_a_step_nothing_marked_is_left_out():
    clock = TickClock()
    timer = step_phases.StepPhases(clock)
    at(clock, 0.0, lambda: timer.finish(1))  # nothing marked yet: no step
    assert timer.ready() == []
    at(clock, 1.0, lambda: timer.enter("generate"))
    at(clock, 2.0, timer.exit)
    at(clock, 3.0, lambda: timer.finish(1))
    at(clock, 9.0, lambda: timer.restart("data"))  # a trainer's set-up: no step's time
    at(clock, 10.0, lambda: timer.finish(2))
    at(clock, 11.0, lambda: timer.restart())
    at(clock, 12.0, lambda: timer.finish(3))  # all other: nothing the recipe times
    assert timer.ready() == [(1, {"generate": 1.0, "other": 1.0}), (2, {"data": 1.0})]


def test_a_step_waits_for_its_marks_to_complete_and_is_never_waited_for_inside_a_run():
    clock = TickClock()
    timer = step_phases.StepPhases(clock)
    at(clock, 0.0, lambda: timer.enter("forward_backward"))
    at(clock, 2.0, lambda: timer.finish(1))
    clock.completed = False  # the GPU has not reached the step's last mark yet
    assert timer.ready() == []
    assert timer.ready(wait=True) == [(1, {"forward_backward": 2.0})]


def test_outside_a_rank_marking_does_nothing(monkeypatch):
    monkeypatch.setattr(step_phases, "_current", None)
    with step_phases.phase("generate"):
        step_phases.switch("data")
        step_phases.restart()


def test_the_cpu_clock_times_real_work(tmp_path):
    reporter = Reporter(tmp_path, 0)
    try:
        step_phases.restart("data")
        with step_phases.phase("generate"):
            time.sleep(0.05)
        reporter.log(1, loss=1.0)
    finally:
        reporter.close()
    [record] = records(tmp_path, 0)
    seconds = rules.phases_of(record)
    assert seconds["generate"] >= 0.05 and seconds["data"] < 0.05
    assert record["phase_seconds_generate"] == seconds["generate"] and record["loss"] == 1.0


def test_the_reporter_writes_a_step_s_phases_in_its_record_or_once_ready_in_a_line_of_its_own(tmp_path):
    clock = TickClock()
    reporter = Reporter(tmp_path, 1)
    reporter.phases.clock = clock
    try:
        at(clock, 0.0, lambda: step_phases.restart("data"))
        at(clock, 1.0, lambda: reporter.log(1, tokens=5))  # ready at once, as on CPU: in its record
        clock.completed = False
        at(clock, 3.0, lambda: reporter.log(2, tokens=5))  # not ready: written later
        clock.completed = True
        at(clock, 4.0, lambda: reporter.log(3, tokens=5))
        clock.completed = False
        at(clock, 6.0, lambda: reporter.log(4, tokens=5))
    finally:
        reporter.close()  # waits for step 4's marks: the rank is done
    lines = records(tmp_path, 1)
    phased = [(line["step"], line.get("phase_seconds_data")) for line in lines if "phase_seconds_data" in line]
    assert phased == [(1, 1.0), (2, 2.0), (3, 1.0), (4, 2.0)]
    assert [line["step"] for line in lines if "tokens" in line] == [1, 2, 3, 4]
    assert "phase_seconds_data" not in lines[1] and lines[2] == {**lines[2], "step": 2, "phase_seconds_data": 2.0}


def test_timing_off_marks_nothing_and_logs_no_phase_figure(tmp_path, monkeypatch):
    monkeypatch.setenv(step_phases.PHASES_ENV, "0")
    reporter = Reporter(tmp_path, 0)
    try:
        step_phases.restart("data")
        with step_phases.phase("generate"):
            pass
        reporter.log(1, loss=1.0)
        reporter.log(2, loss=1.0)
    finally:
        reporter.close()
    assert [rules.phases_of(record) for record in records(tmp_path, 0)] == [{}, {}]
    assert reporter.phases.ready(wait=True) == []
    assert step_phases.timing_on({}) and step_phases.timing_on({step_phases.PHASES_ENV: "1"})


def test_alternate_times_k_steps_then_leaves_k_untimed_each_timed_stretch_starting_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv(step_phases.PHASES_ENV, "alternate:2")
    clock = TickClock()
    reporter = Reporter(tmp_path, 0)
    reporter.phases.clock = clock
    try:
        at(clock, 0.0, lambda: step_phases.restart("data"))
        for step in range(1, 8):  # each step: 1 s of data, then `train` until the log, which leaves it open
            at(clock, step - 1.0 + 0.25, lambda: step_phases.switch("train"))
            at(clock, float(step), lambda step=step: reporter.log(step, loss=1.0))
            at(clock, float(step), lambda: step_phases.switch("data"))
    finally:
        reporter.close()
    phased = {record["step"]: rules.phases_of(record) for record in records(tmp_path, 0) if rules.phases_of(record)}
    # Steps 1-2 and 5-6 timed, 3-4 and 7 not (nothing of them left in a timed step, the open `train` phase
    # at step 4's log included); step 5 starts at step 4's log, in no phase until the next mark (here none).
    assert phased == {1: {"data": 0.25, "train": 0.75}, 2: {"data": 0.25, "train": 0.75},
                      5: {"other": 0.0, "data": 0.25, "train": 0.75}, 6: {"data": 0.25, "train": 0.75}}
    assert [step_phases.timed_step(step, 2) for step in range(1, 8)] == [True, True, False, False, True, True, False]
    assert all(step_phases.timed_step(step, 0) for step in range(1, 8))
    assert step_phases.alternation({step_phases.PHASES_ENV: "alternate:3"}) == 3
    assert step_phases.alternation({}) == 0 and step_phases.alternation({step_phases.PHASES_ENV: "1"}) == 0
    with pytest.raises(ValueError, match="alternate:0"):
        step_phases.alternation({step_phases.PHASES_ENV: "alternate:0"})


def test_the_slowed_rank_sleeps_each_time_it_enters_the_phase(tmp_path, monkeypatch):
    monkeypatch.setenv(step_phases.SLOW_RANK_ENV, "1:0.05")
    slowed, other = Reporter(tmp_path, 1), Reporter(tmp_path, 0)
    try:
        for reporter in (slowed, other):
            step_phases._current = reporter.phases
            step_phases.restart("data")
            step_phases.switch("forward_backward")
            step_phases.switch("optimizer")
            reporter.log(1)
    finally:
        slowed.close(), other.close()
    assert rules.phases_of(records(tmp_path, 1)[0])["forward_backward"] >= 0.05
    assert rules.phases_of(records(tmp_path, 0)[0])["forward_backward"] < 0.05
    assert step_phases.slow_rank(0, {}) is None and step_phases.slow_rank(0, {"GPUSCALE_SLOW_RANK": "1:2"}) is None
    assert step_phases.slow_rank(2, {"GPUSCALE_SLOW_RANK": "2:1.5:generate"}) == ("generate", 1.5)
    with pytest.raises(ValueError, match="GPUSCALE_SLOW_RANK=2: expected RANK:SECONDS"):
        step_phases.slow_rank(0, {"GPUSCALE_SLOW_RANK": "2"})


def test_a_blocking_collective_is_the_rank_s_wait_and_an_async_one_is_left_alone(tmp_path):
    class Dist:
        """torch.distributed's shape: a blocking collective returns once every rank joined in."""
        calls = []

        @staticmethod
        def all_reduce(tensor, async_op=False):
            Dist.calls.append((tensor, async_op))
            time.sleep(0.05)

    step_phases.time_collectives(Dist)
    step_phases.time_collectives(Dist)  # timed once, however often asked
    reporter = Reporter(tmp_path, 0)
    try:
        Dist.all_reduce("before")  # outside every phase: no step's, no wait
        step_phases.restart("forward_backward")
        Dist.all_reduce("grads")
        Dist.all_reduce("more", async_op=True)
        reporter.log(1)
    finally:
        reporter.close()
    seconds = rules.phases_of(records(tmp_path, 0)[0])
    assert 0.05 <= seconds["wait"] < 0.1 and seconds["forward_backward"] >= 0.05  # the async call's sleep
    assert Dist.calls == [("before", False), ("grads", False), ("more", True)]
    assert Dist.all_reduce.__name__ == "all_reduce"


def records(run_dir, rank: int) -> list[dict]:
    lines = [json.loads(line) for line in RunDir(run_dir).metrics(rank).read_text().splitlines()]
    return [line for line in lines if "beat" not in line]


# ---- the rules: summary, the show line, advice ---------------------------------------------------


def test_the_summary_is_the_mean_steady_step_and_its_shares_add_up():
    warm_up = {"data": 5.0, "forward_backward": 5.0}
    steps = [warm_up, {"data": 0.1, "forward_backward": 0.7, "other": 0.1},
             {"data": 0.3, "forward_backward": 0.9}, {"data": 0.2, "forward_backward": 0.8, "other": 0.2}]
    figures = rules.summarise({0: steps, 1: steps})
    assert figures["step_phase_seconds"] == pytest.approx({"data": 0.2, "forward_backward": 0.8, "other": 0.1})
    assert figures["step_phases"] == pytest.approx({"data": 0.2 / 1.1, "forward_backward": 0.8 / 1.1,
                                                    "other": 0.1 / 1.1}, abs=1e-4)
    assert sum(figures["step_phases"].values()) == pytest.approx(1.0, abs=1e-3)


def test_steps_of_different_kinds_share_the_time_they_took():
    # rft: its generation calls, then its optimizer steps; a median step would hold no generation.
    steps = [{"generate": 9.0}] + [{"generate": 3.0, "filter": 1.0}] * 2 + [{"forward_backward": 0.5}] * 4
    figures = rules.summarise({0: steps})
    assert figures["step_phases"] == pytest.approx({"generate": 6 / 10, "filter": 2 / 10, "forward_backward": 2 / 10})
    assert "step_phase_seconds_by_rank" not in figures  # the ranks are alike


def test_ranks_that_differ_keep_their_own_figures_and_a_run_without_steady_steps_has_none():
    fast = [{"forward_backward": 1.0}] * 3
    slow = [{"forward_backward": 1.0}] + [{"forward_backward": 1.3}] * 2
    figures = rules.summarise({0: fast, 1: slow})
    assert figures["step_phase_seconds_by_rank"] == {"0": {"forward_backward": 1.0}, "1": {"forward_backward": 1.3}}
    assert rules.summarise({0: fast[:1], 1: slow[:1]}) == {}
    assert rules.summarise({}) == {}


def test_the_show_line_is_largest_first_with_other_last():
    line = rules.where_a_step_goes({"other": 0.02, "data": 0.03, "forward_backward": 0.71, "optimizer": 0.12,
                                    "log": 0.12, "save": 0.001})
    assert line == "forward+backward 71% · optimizer 12% · log 12% · data 3% · other 2%"


BALANCED = {"0": {"forward_backward": 1.0, "data": 0.05}, "1": {"forward_backward": 1.02, "data": 0.05}}


@pytest.mark.parametrize("case, kwargs, expected", [
    ("nothing wrong", dict(step_phases={"forward_backward": 0.9, "data": 0.05, "other": 0.05},
                           seconds_by_rank=BALANCED, memory_mb={"GPU 0": (60_000, 81_559)}), []),
    ("no figures at all", {}, []),
    ("a straggler, named with its card",
     dict(seconds_by_rank={"0": {"forward_backward": 1.0}, "1": {"forward_backward": 1.0},
                           "2": {"forward_backward": 1.0}, "3": {"forward_backward": 1.2}},
          gpu_of_rank={"3": "GPU 3"}),
     ["rank 3 (GPU 3) is a straggler: it works 1.2 s a step, 20% over the ranks' median 1 s"]),
    ("a straggler among ranks that meet at the all-reduce: the others' steps are as long, spent waiting",
     dict(seconds_by_rank={"0": {"forward_backward": 1.0, "wait": 0.5}, "1": {"forward_backward": 1.0, "wait": 0.5},
                           "2": {"forward_backward": 1.5, "wait": 0.0}}),
     ["rank 2 is a straggler: it works 1.5 s a step, 50% over the ranks' median 1 s"]),
    ("a rank just under the straggler's margin", dict(seconds_by_rank={"0": {"x": 1.0}, "1": {"x": 1.14}}), []),
    ("generation over half a step", dict(step_phases={"generate": 0.62, "forward_backward": 0.38}),
     ["generation takes 62% of a step: raise the generation batch"]),
    ("data loading over 10%", dict(step_phases={"data": 0.14, "forward_backward": 0.86}),
     ["data loading takes 14% of a step"]),
    ("waiting at the all-reduce over 20%", dict(step_phases={"wait": 0.25, "forward_backward": 0.75}),
     ["waiting for the other ranks at the all-reduce takes 25% of a step"]),
    ("a card under a third full", dict(memory_mb={"GPU 1": (20_480, 81_920), "GPU 0": (60_000, 81_920)}),
     ["GPU 1 uses 20.0 of its 80 GiB (25%): raise batch_size"]),
    ("two things at once", dict(step_phases={"generate": 0.55, "data": 0.11, "other": 0.34}),
     ["generation takes 55%", "data loading takes 11%"]),
])
def test_advice(case, kwargs, expected):
    lines = rules.advice(**kwargs)
    assert len(lines) == len(expected), (case, lines)
    for line, start in zip(lines, expected):
        assert line.startswith(start), (case, line)


def test_the_live_advice_reads_each_rank_s_last_steady_steps():
    steady = {"forward_backward": 1.0, "wait": 0.6}
    slowed = {"forward_backward": 1.0, "log": 0.6}
    steps = {0: [{"data": 9.0}, steady, steady, steady, steady],  # its warm-up step left out
             1: [{"data": 9.0}, {"forward_backward": 1.0}, slowed, slowed, slowed],  # slowed from step 3 on
             2: [{"data": 9.0}]}  # no steady step yet
    recent = rules.recent_by_rank(steps)
    assert recent == {"0": steady, "1": slowed}
    [line] = rules.live_advice(recent, {"1": "GPU 7"})
    assert line.startswith("rank 1 (GPU 7) is a straggler: it works 1.6 s a step, 23% over")
    assert rules.recent_by_rank({0: [{"data": 9.0}, {"data": 1.0}, {"data": 2.0}]}, steps=1) == {"0": {"data": 2.0}}
    balanced = {"forward_backward": 1.0, "wait": 0.05}
    assert rules.live_advice({}) == [] and rules.live_advice({"0": balanced, "1": balanced}) == []


def test_show_writes_where_a_step_goes_and_the_advice_read_from_it():
    from gpuscale.app.views.runs import step_lines

    summary = {"step_phases": {"forward_backward": 0.6, "data": 0.3, "other": 0.1},
               "step_phase_seconds_by_rank": {"0": {"forward_backward": 1.0}, "1": {"forward_backward": 1.5}}}
    peaks = [{"kind": "gpu", "idx": 4, "peak_run_mem_mb": None, "peak_mem_used_mb": 80_000.0, "mem_total_mb": 81_920},
             {"kind": "gpu", "idx": 5, "peak_run_mem_mb": 10_000.0, "peak_mem_used_mb": 80_000.0,
              "mem_total_mb": 81_920}]
    lines = step_lines(summary, peaks, gpu_indices=[4, 5])
    assert lines[0] == "step: forward+backward 60% · data 30% · other 10%"
    assert [line.split(":")[0] for line in lines[1:]] == ["advice"] * 3
    assert lines[1].startswith("advice: rank 1 (GPU 5) is a straggler")
    assert lines[2].startswith("advice: data loading takes 30%")
    assert lines[3].startswith("advice: GPU 5 uses 9.8 of its 80 GiB")  # the run's own memory, not the card's
    assert step_lines({"tokens_per_s": 5.0}, peaks) == []  # a run that timed no phases


def test_compare_shows_the_change_per_phase_and_export_holds_the_phase_figures(tmp_path, monkeypatch, capsys):
    from gpuscale.app import cli
    from gpuscale.app.views.export import export_text
    from gpuscale.control.store import Store

    monkeypatch.setenv("GPUSCALE_HOME", str(tmp_path))
    store = Store(tmp_path)
    steps = {"a": {"forward_backward": 0.3, "data": 0.1}, "b": {"forward_backward": 0.3, "data": 0.02, "wait": 0.05}}
    ids = {}
    for side, seconds in steps.items():
        ids[side] = store.create_run("sft", {"batch_size": 8}, ["accelerate"], "host")
        store.finish_run(ids[side], "succeeded", summary={"step_phase_seconds": seconds,
                                                          "step_phases": rules.shares(seconds)})
        store.add_rows([{"run_id": ids[side], "rank": 0, "t": 1.0, "step": 2, "name": rules.figure_name(name),
                         "value": value} for name, value in seconds.items()], [])
    assert cli.main(["compare", str(ids["a"]), str(ids["b"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("where a step goes:")
    assert lines[at + 1:] == ["  step: 0.4 s -> 0.37 s, -0.03 (-7.5%)",
                              "  forward+backward: 0.3 s (75%) -> 0.3 s (81%), +0 (+0.0%)",
                              "  data: 0.1 s (25%) -> 0.02 s (5%), -0.08 (-80.0%)",
                              "  waiting for other ranks: - -> 0.05 s (14%), +0.05"]
    assert cli.main(["compare", str(ids["a"]), str(ids["a"])]) == 0  # the same run: nothing changed
    assert "  data: 0.1 s (25%) -> 0.1 s (25%), +0 (+0.0%)" in capsys.readouterr().out
    exported = json.loads(export_text(store, ids["b"], "json"))
    assert exported["run"]["summary"]["step_phase_seconds"] == steps["b"]
    assert {m["name"] for m in exported["metrics"]} == {"phase_seconds_forward_backward", "phase_seconds_data",
                                                         "phase_seconds_wait"}
    assert "phase_seconds_wait" in export_text(store, ids["b"], "csv", "metrics")
    assert '"wait": 0.05' in export_text(store, ids["b"], "csv", "summary").replace('""', '"')


def test_gpuscale_run_prints_a_live_warning_once_whatever_its_figures_do_next():
    from gpuscale.app.commands.launching import warning_subject

    def advice(slowed: float) -> list[str]:
        return rules.live_advice({"0": {"forward_backward": 1.0}, "1": {"forward_backward": slowed}}, {"1": "GPU 3"})

    first, later = advice(1.5), advice(1.7)
    assert first != later and [warning_subject(w) for w in first] == [warning_subject(w) for w in later]
    assert warning_subject(first[0]) == "rank # (GPU #) is a straggler"
    assert warning_subject("waiting for the other ranks at the all-reduce takes 25% of a step: x") != \
        warning_subject("data loading takes 25% of a step: x")
