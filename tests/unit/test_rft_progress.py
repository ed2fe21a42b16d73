"""rft's one step count over its phases: the total is announced once, at the start, generation and
training counted, and the trainer's own steps are scaled into the training phase's share of it, so
the progress never goes back (it went from 252 of 252 back to 252 of 1,044 when training started)."""

from __future__ import annotations

from gpuscale.control.hang_watch import PHASE_ALLOWANCE_S, HangWatch
from gpuscale.control.metrics_tail import MetricsTailer
from gpuscale.engines.reporter import Reporter
from gpuscale.recipes.rft import Settings, training_settings
from gpuscale.recipes.rft.trainer import (
    BASE_EVALUATION,
    FINAL_EVALUATION,
    GENERATE,
    TRAIN,
    PhasedReporter,
    most_kept_rows,
    most_training_steps,
)
from gpuscale.runs.heartbeat import STEP


class Recorder:
    def __init__(self):
        self.totals, self.steps = [], []

    def total(self, steps: int) -> None:
        self.totals.append(steps)

    def log(self, step: int, **figures) -> None:
        self.steps.append((step, figures["phase"]))

    def beat(self, phase: str, step: int | None = None) -> None:
        pass


def test_the_total_is_announced_once_and_the_trainers_steps_fill_their_span():
    reporter = Recorder()
    phases = PhasedReporter(reporter, {BASE_EVALUATION: 1, GENERATE: 3, TRAIN: 12, FINAL_EVALUATION: 1})
    phases.start(BASE_EVALUATION).log(1)
    phases.start(GENERATE)
    for call in (1, 2, 3):
        phases.log(call)
    phases.start(TRAIN)
    phases.total(4)  # the trainer, when it starts: fewer steps than the most the kept set could take
    for step in (1, 2, 3, 4):
        phases.log(step, loss=1.0)
    phases.start(FINAL_EVALUATION).log(1)
    assert reporter.totals == [17]
    steps = [step for step, _ in reporter.steps]
    assert steps == sorted(steps) and steps[-1] == 17
    assert [step for step, phase in reporter.steps if phase == TRAIN] == [4, 7, 10, 13, 16]  # its start, then 4 x 3
    assert [phase for _, phase in reporter.steps] == sorted(phase for _, phase in reporter.steps)


def test_the_training_span_is_the_most_steps_the_kept_set_can_take():
    settings = Settings(max_examples=100, samples_per_question=16, keep_per_question=4, include_gold=True,
                        train_batch_size=8, gradient_accumulation=2, epochs=3.0)
    assert most_kept_rows(settings, 100) == 500  # 4 answers and the gold one a question
    # 2 ranks: 250 rows each, 32 micro-batches of 8, 16 steps an epoch, 3 epochs.
    assert most_training_steps(settings, 500, 2) == 48
    assert most_training_steps(settings.model_copy(update={"max_steps": 5}), 500, 2) == 5
    # The same step over all ranks: 32 rows, 16 a rank, two micro-batches of 8.
    over_ranks = settings.model_copy(update={"gradient_accumulation": None, "rows_per_step": 32})
    assert most_training_steps(over_ranks, 500, 2) == 48
    assert most_training_steps(over_ranks, 500, 1) == 45  # 500 rows on 1 rank: 63 micro-batches, 15 steps
    assert most_kept_rows(settings.model_copy(update={"keep_per_question": 0, "include_gold": False}), 10) == 160


def test_the_training_phases_set_up_and_first_step_get_the_hang_watchs_loading_allowance(tmp_path):
    """Between generation's last call and the SFT trainer's second step the rank builds the trainer and
    its data, then compiles and warms up its first step, with nothing to log: the watch must give both a
    phase's allowance, not the step allowance generation's quick calls set (an rft run at 0.5B was ended
    as hung there, after 225 s)."""
    reporter = Reporter(tmp_path, 0)
    phases = PhasedReporter(reporter, {BASE_EVALUATION: 1, GENERATE: 3, TRAIN: 12, FINAL_EVALUATION: 1})
    phases.start(GENERATE)
    for call in (1, 2, 3):
        phases.log(call)
    phases.start(TRAIN)
    phases.beat(STEP, 0)  # the trainer built, in its first step (the TRL bridge's on_train_begin)
    reporter.close()
    tailer = MetricsTailer(tmp_path / "metrics", 1)
    tailer.read_new()
    beats = tailer.take_beats()
    # Generation's calls as if each took 10 s: their p95 sets a step allowance of AUTO_FLOOR_S (120 s).
    begin = beats[0].t
    spaced = [type(beat)(beat.rank, begin + 10 * number, beat.step, beat.phase) for number, beat in enumerate(beats)]
    watch = HangWatch(None, started_at=begin, ranks=range(1))
    watch.saw(spaced[:-1])
    building_the_trainer = spaced[-2].t + 300
    assert watch.stands(building_the_trainer)[0].allowance_s == PHASE_ALLOWANCE_S
    assert watch.hung(building_the_trainer) is None
    watch.saw(spaced[-1:])
    compiling_its_first_step = spaced[-1].t + 300
    assert watch.stands(compiling_its_first_step)[0].allowance_s == PHASE_ALLOWANCE_S
    assert watch.hung(compiling_its_first_step) is None
    assert watch.step_time_p95() == 10.0  # the set-up is no step time


def test_the_training_phase_trains_uncompiled_at_its_own_micro_batch_whatever_compile_says():
    """`compile` is the generation engine's: the trainer's torch_compile recompiles at each new padding-free
    length (a 1-step training phase sat over 400 s in it on an H200)."""
    settings = Settings(compile=True, batch_size=128, train_batch_size=4)
    trained_with = training_settings(settings)
    assert (trained_with.compile, trained_with.batch_size) == (False, 4)
    assert (settings.compile, settings.batch_size) == (True, 128)  # the generation phase keeps its own
