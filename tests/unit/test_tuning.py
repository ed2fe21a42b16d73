"""The batch-size search against simulated throughput/memory curves, and the store of
tuned results (round trip, and an old runs.db upgraded with nothing lost)."""

from __future__ import annotations

import sqlite3

import pytest

from gpuscale.control.store import SCHEMA_VERSION, Store
from gpuscale.engines.batch_search import OUT_OF_MEMORY, Trial, search_batch_size

GB = 10**9


class Card:
    """A simulated card: throughput saturates as peak / (1 + half / batch), memory grows linearly
    from the model's `base`, and a batch above `oom_above` runs out of memory. `oom_on_retry` lists
    batches that fit on their first trial and run out of memory on every later one."""

    def __init__(self, peak=100.0, half=200, base=1 * GB, per_item=GB // 10, oom_above=10**9, oom_on_retry=()):
        self.peak, self.half, self.base, self.per_item = peak, half, base, per_item
        self.oom_above, self.oom_on_retry = oom_above, set(oom_on_retry)
        self.calls: list[int] = []

    def __call__(self, batch: int) -> Trial:
        retried = batch in self.calls
        self.calls.append(batch)
        if batch > self.oom_above or (retried and batch in self.oom_on_retry):
            return Trial(batch, failure=OUT_OF_MEMORY)
        rate = self.peak / (1 + self.half / batch)
        return Trial(batch, throughput=rate, peak_memory_bytes=self.base + batch * self.per_item,
                     step_seconds=batch / rate)


def best_of_sweep(card: Card, limit: float, max_batch: int) -> float:
    fitting = [card(b) for b in range(1, max_batch + 1)]
    return max(t.throughput for t in fitting if t.failure is None and t.peak_memory_bytes <= limit)


def test_doubling_stops_at_out_of_memory_and_refines_below_it():
    card = Card(half=10_000, oom_above=700)  # still far from flat when memory runs out
    result = search_batch_size(card, memory_limit_bytes=None, start=8)
    assert [t.batch_size for t in result.trials if t.phase == "double"] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert result.stopped == "batch 1024: out of memory"
    refined = [t.batch_size for t in result.trials if t.phase == "refine"]
    assert refined and all(512 < b < 1024 for b in refined)  # between the best and the failure
    assert 512 < result.batch_size <= 700
    assert result.chosen.throughput >= 0.9 * best_of_sweep(Card(half=10_000, oom_above=700), float("inf"), 700)


def test_five_percent_flattening_stops_doubling_long_before_memory_runs_out():
    card = Card(half=20, oom_above=100_000)
    result = search_batch_size(card, memory_limit_bytes=None, start=1)
    doubled = [t.batch_size for t in result.trials if t.phase == "double"]
    assert doubled[-1] <= 1024 and "gained less than 5%" in result.stopped
    last, before = result.trials[len(doubled) - 1], result.trials[len(doubled) - 2]
    assert last.throughput < before.throughput * 1.05
    assert before.throughput >= 0 and all(t.failure is None for t in result.trials)
    assert result.chosen.throughput >= 0.9 * card.peak  # within 10% of the plateau


def test_a_gain_just_above_the_threshold_keeps_doubling():
    """A curve whose every doubling gains 6% is followed to max_batch."""
    def gaining(batch: int) -> Trial:
        rate = 1.06 ** batch.bit_length()
        return Trial(batch, throughput=rate, peak_memory_bytes=batch, step_seconds=1.0)

    result = search_batch_size(gaining, memory_limit_bytes=None, start=1, max_batch=256)
    assert result.stopped == "the largest batch allowed" and result.batch_size == 256


def test_the_memory_cap_is_a_limit_like_out_of_memory():
    card = Card(half=10_000, base=1 * GB, per_item=GB // 10)  # batch b takes 1 + b/10 GB
    cap = 0.9 * 80 * GB  # 90% of an 80 GB card: batches up to 710 fit
    result = search_batch_size(card, memory_limit_bytes=cap, start=8)
    over = [t for t in result.trials if t.over_cap]
    assert over and over[0].batch_size == 1024 and result.stopped == "batch 1024: over the memory cap"
    assert result.chosen.peak_memory_bytes <= cap
    assert result.batch_size > 512  # refined up between 512 and the cap


def test_a_batch_that_fits_once_but_not_on_its_second_trial_is_dropped():
    """OOM at a batch that fitted on the first try: the confirming trial fails, the batch counts as
    not fitting, and the next best smaller batch is chosen (and confirmed)."""
    card = Card(half=10_000, oom_above=100_000, oom_on_retry={512})
    result = search_batch_size(card, memory_limit_bytes=None, start=64, max_batch=512)
    confirms = [(t.batch_size, t.failure) for t in result.trials if t.phase == "confirm"]
    assert confirms[0] == (512, OUT_OF_MEMORY)
    assert result.batch_size < 512 and result.chosen.failure is None
    assert confirms[-1] == (result.batch_size, None)


def scripted(figures: dict[int, list[float]]):
    """A measure that returns, for each batch, the next of its scripted throughputs."""
    queues = {batch: list(values) for batch, values in figures.items()}

    def measure(batch: int) -> Trial:
        return Trial(batch, throughput=queues[batch].pop(0), peak_memory_bytes=batch, step_seconds=1.0)

    return measure


def test_a_confirmation_slower_than_a_smaller_batch_chooses_the_smaller_one():
    """On a busy machine batch 4 first measured 240 tokens/s, then 122 on confirmation, while batch 2
    had measured 211: the faster batch measured is stored, and one line says why."""
    result = search_batch_size(scripted({1: [100.0], 2: [211.0], 4: [240.0, 122.0]}),
                               memory_limit_bytes=None, start=1, max_batch=4)
    assert [(t.batch_size, t.phase) for t in result.trials][-1] == (4, "confirm")
    assert result.batch_size == 2 and result.chosen.throughput == 211.0
    assert result.warning == ("batch 4 measured 122 on confirmation, 42% below batch 2's 211 "
                              "(a busy machine?): batch 2 chosen instead")


def test_a_confirmation_within_ten_percent_keeps_the_larger_batch():
    result = search_batch_size(scripted({1: [100.0], 2: [211.0], 4: [240.0, 195.0]}),
                               memory_limit_bytes=None, start=1, max_batch=4)
    assert result.batch_size == 4 and result.chosen.throughput == 195.0 and result.warning is None


def test_nothing_fits_gives_no_choice():
    result = search_batch_size(Card(oom_above=0), memory_limit_bytes=None, start=4)
    assert result.chosen is None and result.batch_size is None
    assert result.stopped == "batch 4: out of memory"


def test_allowed_batch_sizes_restrict_every_trial():
    """A training recipe's divisors of its global batch: only those are tried."""
    card = Card(half=10_000, oom_above=40)
    allowed = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    result = search_batch_size(card, memory_limit_bytes=None, allowed=allowed)
    assert {t.batch_size for t in result.trials} <= set(allowed)
    assert result.batch_size == 24


def test_progress_sees_every_trial_in_order():
    seen = []
    result = search_batch_size(Card(), memory_limit_bytes=None, start=2, max_batch=16, progress=seen.append)
    assert seen == result.trials


# ---- the store ----------------------------------------------------------------------------------

KEY = {"recipe": "power-sampling", "model": "tiny-math", "device": "NVIDIA H200", "precision": "bf16",
       "shape": '{"max_new_tokens": 256}'}


def test_store_round_trip_and_replace(tmp_path):
    store = Store(tmp_path)
    assert store.find_tuning(KEY) is None
    trials = [Trial(8, 2.0, 10, 0.5).as_dict(), Trial(16, failure=OUT_OF_MEMORY).as_dict()]
    store.save_tuning(KEY, batch_size=8, throughput=2.0, figure="problems_per_s", peak_memory_bytes=10,
                      memory_total_bytes=100, memory_cap=0.9, compile=False, trials=trials, stopped="x", seconds=1.5)
    row = Store(tmp_path).find_tuning(KEY)
    assert (row["batch_size"], row["throughput"], row["figure"], row["trials"]) == (8, 2.0, "problems_per_s", trials)
    assert [Trial.from_dict(t) for t in row["trials"]][1].failure == OUT_OF_MEMORY
    assert store.find_tuning({**KEY, "shape": '{"max_new_tokens": 512}'}) is None  # another shape, another key
    store.save_tuning(KEY, batch_size=16, throughput=3.0, figure="problems_per_s", trials=[])
    assert [r["batch_size"] for r in store.list_tunings("power-sampling")] == [16]  # replaced, not added


def test_an_old_history_is_upgraded_with_its_runs_kept(tmp_path):
    """A runs.db of schema version 1 (before tuning existed) gains the table; its runs stay."""
    import gpuscale.control.store as store_module

    old = Store.__new__(Store)  # build a version-1 file with version 1's migrations only
    conn = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    old.db = store_module._sqlite_utils().Database(conn)
    store_module._v1(old.db)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version VALUES (1)")
    conn.execute("INSERT INTO runs (id, recipe, status, settings, summary) VALUES (7, 'probe', 'succeeded', '{}', "
                 "'{\"tokens_per_s\": 5.0}')")
    conn.close()
    (tmp_path / "runs").mkdir()
    store = Store(tmp_path)
    assert store.get_run(7)["summary"] == {"tokens_per_s": 5.0}
    store.save_tuning(KEY, batch_size=4, throughput=1.0, figure="problems_per_s", trials=[])
    assert store.find_tuning(KEY)["batch_size"] == 4
    version = sqlite3.connect(tmp_path / "runs.db").execute("SELECT version FROM schema_version").fetchone()[0]
    assert version == SCHEMA_VERSION
    assert store.get_run(7)["label"] is None  # a later version's column, empty for an old run


def test_an_out_of_memory_error_in_a_run_names_the_batch_and_the_step(capsys):
    import torch

    from gpuscale.recipes.shared.device_trials import out_of_memory_names

    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory at step 3 of 10 with batch_size 512"):
        with out_of_memory_names(512, 3, 10):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "batch_size 512" in capsys.readouterr().out  # the rank's log says it too
    with out_of_memory_names(512, 3, 10):
        pass  # nothing raised, nothing said


def test_a_gpu_process_sets_its_device_and_keeps_attention_off_cudnn(monkeypatch):
    import torch

    from gpuscale.engines import distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        distributed.use_cuda_device(torch.device("cuda", 3))
        assert chosen == [torch.device("cuda", 3)] and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_tuner_sets_up_its_gpu_as_a_rank_does(monkeypatch):
    """Trials time the kernels the run will use: tuning on a GPU starts with the ranks' own set-up
    (stopped right there: this machine may have no GPU)."""
    from gpuscale.engines import distributed
    from gpuscale.recipes.shared.device_trials import tune_recipe
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.recipes.shared.tuning_key import Device

    class SetUp(Exception):
        pass

    def use_cuda_device(device):
        raise SetUp(str(device))

    monkeypatch.setattr(distributed, "use_cuda_device", use_cuda_device)
    recipe = get_recipe("sft")
    with pytest.raises(SetUp, match="cuda:2"):
        tune_recipe(recipe, recipe.settings_cls(), Device(2, "NVIDIA H200", (9, 0)))


def test_a_training_trial_times_a_step_it_has_run_once_on_the_rows_every_trial_takes(
        monkeypatch, tmp_path, one_torch_thread):
    """A kernel's first call at a shape can cost more than the step (a compile, a plan): the timed
    step repeats the untimed one exactly, and every batch size cuts the same rows."""
    import torch

    from gpuscale.engines.distributed import RankContext
    from gpuscale.recipes.shared import training_trial
    from gpuscale.recipes.shared.registry import get_recipe

    micro_batches = []
    real_micro_step = training_trial.micro_step

    def recorded(model, frozen, sequences, *args):
        micro_batches.append([tuple(row) for row in sequences])
        return real_micro_step(model, frozen, sequences, *args)

    monkeypatch.setattr(training_trial, "micro_step", recorded)
    recipe = get_recipe("sft")
    settings = recipe.settings_cls(batch_size=2, gradient_accumulation=2, max_length=48, max_examples=16,
                                   eval_examples=2)  # a step: 4 rows a rank
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    with recipe.trial_session(settings, ctx) as trial:
        ones = trial(1)
        by_one, micro_batches[:] = list(micro_batches), []
        trial(4)
        by_four = list(micro_batches)
    assert ones.throughput > 0 and ones.step_seconds > 0
    assert len(by_one) == 8 and by_one[:4] == by_one[4:]  # warm-up, then the same step timed
    assert len(by_four) == 2 and by_four[0] == by_four[1]
    assert [row for batch in by_one[:4] for row in batch] == by_four[0]  # the same 4 rows, cut differently
    assert len(set(by_four[0])) == 4


def test_a_training_result_is_found_only_by_runs_that_train_as_its_trials_did(tmp_path):
    """sft's key holds how its trial trained (padding-free, padded to 16, liger's layers): a run that
    trains otherwise tunes again, and so does one whose result a trial of another make stored (its key
    without these settings, as results were stored before the trials trained as runs do)."""
    import json

    from gpuscale.app.batch_choice import stored_tuning
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.recipes.shared.tuning_key import Device, tuning_key

    sft = get_recipe("sft")
    device = Device(0, "NVIDIA H200", (9, 0))
    default, padded = sft.settings_cls(), sft.settings_cls(padding_free=False)
    key = tuning_key(sft, default, device.name, "bf16").as_dict()
    assert key != tuning_key(sft, padded, device.name, "bf16").as_dict()
    store = Store(tmp_path)
    earlier = {name: value for name, value in json.loads(key["shape"]).items()
               if name not in ("padding_free", "pad_to_multiple_of", "liger_kernels")}
    store.save_tuning({**key, "shape": json.dumps(earlier, sort_keys=True)}, batch_size=1, throughput=90.8,
                      figure="tokens_per_s", trials=[])
    assert stored_tuning(store, sft, default, device) is None
    store.save_tuning(key, batch_size=8, throughput=9000.0, figure="tokens_per_s", trials=[])
    assert stored_tuning(store, sft, default, device)["batch_size"] == 8
    assert stored_tuning(store, sft, padded, device) is None


def test_a_pcgrad_trial_takes_each_domains_gradient_as_an_explicit_computation(monkeypatch, tmp_path,
                                                                               one_torch_thread):
    """With a gradient per domain (grpo-mtl's PCGrad), every micro-batch of the trial takes one loss and one
    gradient per domain, summed over the step into the domain's buffer before PCGrad's update: each buffer
    equals the gradient of that domain's rows computed row by row, unpadded, from the same weights (a
    micro-batch without rows of a domain adds nothing to its buffer)."""
    import torch

    from gpuscale.engines.distributed import RankContext
    from gpuscale.recipes.grpo_mtl.pcgrad import DomainGradients
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.recipes.shared.training_trial import TrainingRows, trainable_model, training_trial_session

    settings = get_recipe("grpo-mtl").settings_cls(mtl="pcgrad")
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    sequences = [list(range(5, 5 + length)) for length in (9, 6, 11, 8)]
    masks = [[0] * 4 + [1] * (len(row) - 4) for row in sequences]
    rows = TrainingRows(sequences, masks, domains=[0, 0, 1, 0])  # micro-batches of 2: domain 1 only in the second
    written = []
    real_write = DomainGradients.write

    def recorded(self, parameters, generator=None):
        written.append([flat.clone() for flat in self.flats])
        return real_write(self, parameters, generator)

    monkeypatch.setattr(DomainGradients, "write", recorded)
    with training_trial_session(settings, ctx, 4, lambda tokenizer: rows, domain_update=DomainGradients) as trial:
        assert trial(2).throughput > 0
    assert len(written) == 2 and all(len(step) == 2 for step in written)  # warm-up and timed step, 2 domains each
    _loaded, model = trainable_model(settings, ctx)
    parameters = [p for p in model.parameters() if p.requires_grad]
    for domain in (0, 1):
        expected = [torch.zeros_like(p) for p in parameters]
        for micro_batch in ([0, 1], [2, 3]):
            loss_tokens = sum(sum(masks[i][1:]) for i in micro_batch)
            loss = torch.zeros(())
            for i in (i for i in micro_batch if rows.domains[i] == domain):
                ids = torch.tensor(sequences[i])
                log_probs = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1)
                on_loss = torch.tensor(masks[i][1:], dtype=torch.float32)
                loss = loss - (log_probs.gather(-1, ids[1:, None]).squeeze(-1) * on_loss).sum()
            if loss.requires_grad:
                for total, grad in zip(expected, torch.autograd.grad(loss / loss_tokens / 2, parameters)):
                    total += grad
        flat = torch.cat([grad.reshape(-1) for grad in expected])
        assert flat.abs().sum() > 0
        for step in written:
            torch.testing.assert_close(step[domain], flat, rtol=1e-4, atol=1e-6)


def test_a_pcgrad_run_does_not_take_a_batch_tuned_without_it():
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.recipes.shared.tuning_key import tuning_key

    grpo = get_recipe("grpo-mtl")
    plain, pcgrad = grpo.settings_cls(), grpo.settings_cls(mtl="pcgrad")
    assert tuning_key(grpo, plain, "NVIDIA H200", "bf16").as_dict() != tuning_key(grpo, pcgrad, "NVIDIA H200",
                                                                                   "bf16").as_dict()
