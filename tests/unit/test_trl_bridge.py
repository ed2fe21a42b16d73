"""The TRL bridge: trainer logs become Reporter records (tokens as deltas, plain names, one series of
each figure), and RunSettings become a trainer config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl

from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.engines.trl_bridge import ReporterCallback, metric_name, trainer_args
from gpuscale.recipes.sft import SFT, Settings
from gpuscale.runs.heartbeat import BEAT_KEY


def lines(run_dir, rank):
    return [json.loads(line) for line in (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


def records(run_dir, rank):
    """The rank's metric records, its heartbeats left out (test_heartbeats_follow_a_real_trainer has them)."""
    return [record for record in lines(run_dir, rank) if BEAT_KEY not in record]


def fake_trainer(rank: int, batch: int = 2, accumulation: int = 3):
    args = SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation)
    state = SimpleNamespace(global_step=0, max_steps=4, is_world_process_zero=rank == 0)
    return args, state


# What TRL's trainers log (cumulative num_tokens over all ranks), then Trainer.train()'s last log.
TRL_LOGS = [
    (1, {"loss": 2.5, "grad_norm": 1.5, "learning_rate": 1e-4, "num_tokens": 300.0, "mean_token_accuracy": 0.4,
         "entropy": 1.2, "rewards/correct/mean": 0.25, "reward": 0.5, "epoch": 0.5}),
    (2, {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 5e-5, "num_tokens": 700.0, "mean_token_accuracy": 0.5,
         "entropy": 1.1, "rewards/correct/mean": 0.5, "reward": 0.75, "step_time": 0.25, "epoch": 1.0}),
    (2, {"train_runtime": 3.0, "train_samples_per_second": 8.0, "train_loss": 2.25, "total_flos": 1.0,
         "epoch": 1.0}),
]


@pytest.mark.parametrize("rank", [0, 1])
def test_trl_logs_become_records_with_token_deltas_shared_by_the_ranks(tmp_path, rank):
    reporter = Reporter(tmp_path, rank)
    callback = ReporterCallback(reporter, world_size=2)
    args, state = fake_trainer(rank)
    callback.on_train_begin(args, state, TrainerControl())
    for step, logs in TRL_LOGS:
        state.global_step = step
        callback.on_log(args, state, TrainerControl(), logs=dict(logs))
    reporter.close()

    total, first, second = records(tmp_path, rank)  # the final log is not a step record
    assert total["total"] == 4
    # Each rank reports half of the global count's growth: the ranks' sum is the global count.
    assert (first["tokens"], second["tokens"]) == (150.0, 200.0)
    assert callback.tokens_seen == 700.0
    # Its own sequences: per-device batch x gradient accumulation per optimizer step.
    assert (first["samples"], second["samples"]) == (6.0, 6.0)
    assert (first["step"], second["step"]) == (1, 2)
    if rank == 0:
        assert second["loss"] == 2.0 and second["learning_rate"] == 5e-5 and second["grad_norm"] == 1.0
        assert second["rewards_correct_mean"] == 0.5 and second["reward"] == 0.75
        assert second["mean_token_accuracy"] == 0.5 and second["entropy"] == 1.1
        assert second["step_time_ms"] == 250.0  # the trainer's own step time wins
        assert first["step_time_ms"] >= 0
        assert "num_tokens" not in second and "rewards/correct/mean" not in second
    else:  # the same global figures are written once, by rank 0
        assert "loss" not in second and "reward" not in second
    assert callback.final["train_loss"] == 2.25 and callback.final["train_runtime"] == 3.0


def test_a_rank_reports_the_tokens_of_its_own_training_passes(tmp_path):
    """With the model seen at the start of training, a rank counts the non-padding tokens of its own
    forward passes that build a graph, not an equal share of the global count (which showed one
    figure for every rank of a 4-GPU run); generation or reference passes, without grad, are not
    counted. The global count's growth still gives rank 0's MFU."""
    from gpuscale.data.models import build_random_model

    model = build_random_model("random-tiny", seed=0).train()
    reporter = Reporter(tmp_path, 1)
    callback = ReporterCallback(reporter, world_size=4)
    args, state = fake_trainer(1)
    callback.on_train_begin(args, state, TrainerControl(), model=model)
    ids = torch.ones(2, 6, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])  # 9 tokens, 3 of padding
    model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids[:1, :4], attention_mask=mask[:1, :4])  # a second micro-batch: 4 more
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # a generation or reference pass
    state.global_step = 1
    callback.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "num_tokens": 100.0})
    model(input_ids=ids, attention_mask=mask)
    state.global_step = 2
    callback.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "num_tokens": 140.0})
    callback.on_train_end(args, state, None)
    model(input_ids=ids, attention_mask=mask)  # after training: the hook is gone
    reporter.close()
    _total, first, second = records(tmp_path, 1)
    assert (first["tokens"], second["tokens"]) == (13.0, 9.0)  # not 100 / 4 and 40 / 4
    assert callback.tokens_seen == 140.0 and callback._global_delta == 40.0
    assert not model._forward_pre_hooks


def test_metric_names_are_plain_identifiers():
    assert metric_name("rewards/correct/mean") == "rewards_correct_mean"
    assert metric_name("completions/mean_length") == "completions_mean_length"
    assert metric_name("clip_ratio/low_mean") == "clip_ratio_low_mean"
    assert metric_name("accuracy/arithmetic") == "accuracy_arithmetic"
    # Names the Reporter uses for itself are not overwritten by a trainer's figure.
    assert metric_name("step") == "trainer_step" and metric_name("tokens") == "trainer_tokens"


def test_settings_become_a_trainer_config(tmp_path):
    from trl import SFTConfig

    settings = Settings(batch_size=3, gradient_accumulation=4, learning_rate=3e-4, epochs=2, max_steps=None,
                        lr_scheduler="cosine", warmup_ratio=0.1, seed=7, max_length=99)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    config = trainer_args(settings, ctx, SFTConfig, packing=False)
    assert config.per_device_train_batch_size == 3 and config.gradient_accumulation_steps == 4
    assert config.learning_rate == 3e-4 and config.num_train_epochs == 2 and config.max_steps == -1
    assert config.lr_scheduler_type == "cosine" and config.warmup_steps == 0.1 and config.seed == 7
    assert config.max_length == 99
    # Checkpoints (every checkpoint_every steps, the last keep_checkpoints) go to the run folder.
    assert config.output_dir == str(tmp_path / "checkpoints") and config.report_to == []
    assert config.save_strategy == "steps" and config.save_steps == 50 and config.save_total_limit == 2
    assert config.logging_steps == 1 and config.disable_tqdm
    assert config.use_cpu and config.dataloader_num_workers == 0
    assert not config.bf16 and not config.fp16 and not config.activation_checkpointing

    half = RankContext(0, 0, 1, torch.device("cpu"), torch.bfloat16, tmp_path)
    config = trainer_args(settings.model_copy(update={"max_steps": 5}), half, SFTConfig, learning_rate=1e-3)
    assert config.bf16 and not config.fp16 and config.max_steps == 5
    assert config.learning_rate == 1e-3  # a recipe's own value wins


def test_report_to_reaches_the_config_and_names_the_run(tmp_path):
    """`report_to` (default none) becomes the config's list of integrations; the run's folder name,
    its id, names the run there (W&B, Trackio, MLflow)."""
    from trl import GRPOConfig, SFTConfig

    from gpuscale.recipes.grpo_mtl import Settings as GrpoSettings

    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path / "17")
    assert trainer_args(Settings(), ctx, SFTConfig).report_to == []
    config = trainer_args(Settings(report_to="tensorboard"), ctx, SFTConfig)
    assert config.report_to == ["tensorboard"] and config.run_name == "gpuscale-17"
    assert trainer_args(GrpoSettings(report_to="tensorboard"), ctx, GRPOConfig).report_to == ["tensorboard"]


def test_a_real_trainer_reports_every_step(tmp_path):
    """transformers' Trainer on the embedded model: one record per optimizer step, the announced
    total, and token deltas that add up to the trainer's own count."""
    from transformers import Trainer, TrainingArguments

    from gpuscale.data.models import load_model

    model, tokenizer = load_model("tiny-math")
    rows = [tokenizer(f"Ann has {n} apples.", add_special_tokens=False)["input_ids"] for n in range(8)]
    dataset = [{"input_ids": ids, "labels": ids} for ids in rows]
    settings = SFT().for_device(Settings(batch_size=2, max_steps=3, learning_rate=1e-3), on_gpu=False, ranks=1)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    callback = ReporterCallback(reporter)
    args = trainer_args(settings, ctx, TrainingArguments, include_num_input_tokens_seen="all",
                        remove_unused_columns=False)
    trainer = Trainer(model=model.train(), args=args, train_dataset=dataset, callbacks=[callback])
    trainer.train()
    reporter.close()

    written = records(tmp_path, 0)
    assert written[0]["total"] == 3
    steps = [r for r in written[1:]]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["samples"] == 2 for r in steps)
    assert sum(r["tokens"] for r in steps) == trainer.state.num_input_tokens_seen > 0
    assert "train_loss" in callback.final


def test_heartbeats_follow_a_real_trainer_through_its_steps_and_checkpoints(tmp_path):
    """transformers' Trainer with a checkpoint at step 2: the rank's lines say it loads, steps, saves
    (written after the step's log, before the checkpoint), steps again, and saves after training; the
    supervisor's tailer reads them as heartbeats (control/metrics_tail.py), one per line."""
    from transformers import Trainer, TrainingArguments

    from gpuscale.control.metrics_tail import MetricsTailer
    from gpuscale.data.models import load_model

    model, tokenizer = load_model("tiny-math")
    rows = [tokenizer(f"Ann has {n} apples.", add_special_tokens=False)["input_ids"] for n in range(8)]
    settings = SFT().for_device(Settings(batch_size=2, max_steps=3, learning_rate=1e-3, checkpoint_every=2),
                                on_gpu=False, ranks=1)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    args = trainer_args(settings, ctx, TrainingArguments, remove_unused_columns=False)
    trainer = Trainer(model=model.train(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                      callbacks=[ReporterCallback(reporter)])
    trainer.train()
    reporter.close()

    written = lines(tmp_path, 0)
    phases = [(record.get(BEAT_KEY, "log"), record["step"]) for record in written if "total" not in record]
    assert phases[:2] == [("loading", 0), ("step", 0)]
    assert phases[phases.index(("log", 2)) + 1] == ("save", 2)  # announced before the checkpoint is written
    assert ("step", 2) in phases[phases.index(("save", 2)):]  # on_save: back to stepping
    assert phases[-1] == ("save", 3)  # after training: the final save and what follows it
    beats = MetricsTailer(tmp_path / "metrics", 1)
    beats.read_new()
    assert [(b.phase, b.step) for b in beats.take_beats() if b.phase is not None] == [
        (phase if phase != "log" else "step", step) for phase, step in phases]


def test_a_config_with_the_older_checkpointing_name_gets_it(tmp_path):
    """transformers 5.17 (the GPU image's floor) calls it gradient_checkpointing: a setting or a
    recipe's activation_checkpointing must reach it under that name, not fail or vanish."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)} - {"activation_checkpointing"}
    OlderArguments = dataclasses.make_dataclass(  # noqa: N806 (a class)
        "OlderArguments", [(name, object, dataclasses.field(default=None)) for name in sorted(names)])
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    assert trainer_args(Settings(activation_checkpointing=True), ctx, OlderArguments).gradient_checkpointing is True
    assert trainer_args(Settings(), ctx, OlderArguments, activation_checkpointing=False).gradient_checkpointing is False


@pytest.mark.parametrize("logs, line", [
    ({"loss": 2.0, "grad_norm": float("nan")},
     "step 168: grad_norm is nan (training diverged); try --precision fp32, a lower learning_rate, or max_grad_norm"),
    ({"loss": float("inf")}, "step 168: loss is inf (training diverged)"),
    ({"rewards/correctness_counting/mean": float("-inf")}, "step 168: rewards_correctness_counting_mean is -inf"),
    ({"reward": None}, "step 168: reward is nan"),  # TRL logs an all-NaN reward as None
])
def test_the_nan_guard_fails_on_a_non_finite_figure_with_one_line(logs, line):
    from gpuscale.engines.reporter import NonFiniteFigure
    from gpuscale.engines.trl_bridge import NonFiniteGuard

    state = SimpleNamespace(global_step=168)
    with pytest.raises(NonFiniteFigure) as failure:
        NonFiniteGuard().on_log(None, state, None, logs=logs)
    assert str(failure.value).startswith(line) and "\n" not in str(failure.value)


def test_the_nan_guard_lets_finite_and_absent_figures_pass():
    from gpuscale.engines.trl_bridge import NonFiniteGuard

    state = SimpleNamespace(global_step=3)
    # A domain's reward is None when the step drew none of its rows; the final log is not guarded.
    NonFiniteGuard().on_log(None, state, None, logs={"loss": 1.0, "grad_norm": 0.5, "reward": 0.25,
                                                     "rewards/correctness_counting/mean": None,
                                                     "train_loss": float("nan"), "learning_rate": 1e-4})


def test_the_nan_guard_checks_a_grpo_trainer_s_reward_values():
    from gpuscale.engines.reporter import NonFiniteFigure
    from gpuscale.engines.trl_bridge import NonFiniteGuard

    def correctness_counting(prompts, completions, **columns):
        return [None, 1.0, float("nan")]

    callbacks = []
    trainer = SimpleNamespace(reward_funcs=[correctness_counting], reward_func_names=["correctness_counting"],
                              add_callback=callbacks.append)
    guard = NonFiniteGuard().attach(trainer)
    assert callbacks == [guard]
    with pytest.raises(NonFiniteFigure, match=r"^step 5: reward correctness_counting is nan \(the reward function"):
        trainer.reward_funcs[0](["p"] * 3, ["c"] * 3, trainer_state=SimpleNamespace(global_step=4))
