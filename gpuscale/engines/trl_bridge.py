"""The bridge between Hugging Face's trainers (TRL's SFT and GRPO, transformers' Trainer) and gpuscale.

Three pieces, so that every TRL-based recipe reports, fails and is configured the same way:

- `ReporterCallback(reporter, world_size)`: a `TrainerCallback` that turns the trainer's logs into
  Reporter records as they come (every `logging_steps` optimizer steps), and marks each step's
  phases (engines/step_phases.py) from transformers' hooks: `data` (the step's micro-batches fetched
  and collated, before `on_step_begin`), `forward_backward` (the micro-batches' passes), on a rank
  that has others `wait` (from the step's last gradient computed to `on_pre_optimizer_step`: waiting
  for the slowest rank at DDP's gradient all-reduce, the part of it the backward pass did not hide,
  the gradient clipping; see `_watch_gradients`), `optimizer` (to `on_step_end`: the step, the
  scheduler, zeroing the gradients), `log` (the loss gathered over the ranks, the record written),
  then `evaluate` and `save` where the trainer does either. A step is the time between two logs, so
  an evaluation or a checkpoint after step k's log counts in step k+1's.
- `NonFiniteGuard()`: a `TrainerCallback` that fails the run with one line (`step 168: grad_norm is
  nan (training diverged); try ...`) when a logged loss, grad_norm or reward turns NaN or Inf, and,
  attached to a GRPO trainer, when a reward function returns NaN or Inf (TRL reads a NaN reward as
  "not applicable" and leaves it out of its logs, so the logs alone would never show it).
- `trainer_args(settings, ctx, config_cls, **recipe_specific)`: one mapping from a recipe's settings
  (RunSettings and the training fields it declares, see SETTING_TO_CONFIG) to a TRL config
  (SFTConfig, GRPOConfig) or transformers' TrainingArguments.

Who reports what. transformers calls `on_log` on every process with the same, already global figures:
the loss is all-gathered and averaged, TRL's `num_tokens` is the cumulative count over all ranks (it
gathers each batch's count). The supervisor sums the `tokens` deltas of all ranks to get the run's
tokens/s and shows each rank's own, so each rank reports the tokens of its own batches: a forward
pre-hook on the model counts the non-padding tokens of every forward pass that builds a graph (the
training passes; generation and reference log-probs run without one), the count TRL gathers, so the
ranks' counts add up to the global one. (An equal share of the global delta, which every rank used
to report, showed one figure for every rank: 6,321 x 4 on a 4-GPU run.) Where the hook saw nothing
(a model called another way), the rank reports that equal share, `delta / world_size`. `samples`
are each rank's own: per-device batch x gradient accumulation per optimizer step. The other figures
(loss, learning rate, rewards...) are the same on every rank and are written by rank 0 only, so the
store holds one series of each.

This module imports transformers at the top: it is imported only inside ranks.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gpuscale.data import step_phases as phases
from gpuscale.engines import step_phases
from gpuscale.engines.reporter import NonFiniteFigure, non_finite_message
from gpuscale.engines.trl_checkpoints import checkpoint_args
from gpuscale.runs import heartbeat
from gpuscale.runs.run_dir import RunDir

# Keys of a trainer's logs that are not per-step figures.
CUMULATIVE_TOKEN_KEYS = ("num_tokens", "num_input_tokens_seen")  # TRL's first, transformers' second
# The final log of `Trainer.train()` (train_runtime, train_loss, ...): kept in `final`, not logged per step.
FINAL_PREFIX = "train_"
FINAL_KEYS = ("total_flos",)
# Logged intervals left out of the steady rate: the first step builds what later steps reuse.
WARM_UP_INTERVALS = 1
# Names the Reporter's records use for themselves.
RESERVED = ("t", "rank", "step", "total", "summary", "tokens", "samples")


def metric_name(key: str) -> str:
    """A trainer's log key as a plain identifier: `rewards/correct/mean` -> `rewards_correct_mean`."""
    name = re.sub(r"\W+", "_", key).strip("_").lower()
    if not name or name[0].isdigit():
        name = "m_" + name
    return f"trainer_{name}" if name in RESERVED else name


class ReporterCallback(TrainerCallback):
    """Writes every log of a trainer to the rank's Reporter (see the module docstring for who reports
    what). After training, `final` holds the trainer's end-of-training figures (train_loss,
    train_runtime, ...) as plain identifiers."""

    def __init__(self, reporter, world_size: int = 1, flops_per_token: float | None = None, card: str | None = None):
        self.reporter = reporter
        self.world_size = max(1, int(world_size))
        self.flops_per_token = flops_per_token  # with `card`: MFU in every record and the summary
        self.card = card
        self.final: dict[str, float] = {}
        self._tokens_seen = 0.0  # the global cumulative count at the last log
        self._global_delta: float | None = None  # the global count's growth at the last log
        self._own_tokens = None  # this rank's tokens since the last log (a tensor, on its device), see _count_own
        self._hook = None
        self._grad_hooks: list = []  # see _watch_gradients
        self._grad_order: list | None = None
        self._waiting = False  # in the `wait` phase: the next training forward pass ends it
        self._last_step = 0
        self._last_time: float | None = None
        self.step_rates: list[float] = []  # global tokens/s of each logged interval, in order (see steady_tokens_per_s)

    @property
    def tokens_seen(self) -> float:
        """Tokens trained on so far, all ranks together (the trainer's last cumulative count)."""
        return self._tokens_seen

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.reporter.total(int(state.max_steps))
        self.reporter.beat(heartbeat.STEP, int(state.global_step))  # the first step (compiling, warming up)
        step_phases.restart(phases.DATA)  # the trainer's set-up is no step; its first batches come next
        self._last_step = int(state.global_step)
        self._last_time = time.perf_counter()
        if model is not None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._count_own, with_kwargs=True)
        if model is not None and self.world_size > 1 and not self._grad_hooks:
            self._watch_gradients(model)

    def on_step_begin(self, args, state, control, **kwargs):
        self.reporter.beat(heartbeat.STEP)  # back from a save or an evaluation (at most a line a second)
        step_phases.switch(phases.FORWARD_BACKWARD)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step_phases.switch(phases.OPTIMIZER)
        self._waiting = False
        if self._grad_order:  # the first step told which gradient comes last: watch that one alone
            last = self._grad_order[-1]
            self._remove_grad_hooks()
            self._grad_order = None
            self._grad_hooks = [last.register_post_accumulate_grad_hook(self._last_gradient)]

    def _watch_gradients(self, model) -> None:
        """Tell the wait at the gradient all-reduce apart without a sync: DDP all-reduces a bucket of
        gradients as soon as they are computed, and waits for them all once the backward pass is done,
        so the time from the step's last gradient computed to the optimizer is the wait (on a GPU: a
        mark on the stream after the last gradient's kernels, and the optimizer's, which the stream
        reaches only once the all-reduce is done). Which parameter's gradient comes last is learnt in
        the first step (every trainable parameter's hook notes the order, no mark); from then on only
        its hook marks, once a micro-batch, and the next micro-batch's forward pass switches back."""
        self._grad_order = []
        self._grad_hooks = [param.register_post_accumulate_grad_hook(self._grad_order.append)
                            for param in model.parameters() if param.requires_grad]

    def _last_gradient(self, param) -> None:
        step_phases.switch(phases.WAIT)
        self._waiting = True

    def _remove_grad_hooks(self) -> None:
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []

    def on_step_end(self, args, state, control, **kwargs):
        step_phases.switch(phases.LOG)

    def on_evaluate(self, args, state, control, **kwargs):
        self._next_in(phases.SAVE if control.should_save else phases.DATA)

    def on_save(self, args, state, control, **kwargs):
        self._next_in(phases.DATA)  # the checkpoint is written

    def on_train_end(self, args, state, control, **kwargs):
        self.reporter.beat(heartbeat.SAVE)  # what follows training: the final checkpoint, a merge, the model saved
        step_phases.restart()  # no step of the trainer's any more: what follows is the recipe's to mark
        self._remove_grad_hooks()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _count_own(self, module, args, kwargs) -> None:
        """Adds a training forward pass's non-padding tokens (its attention mask's sum, else its input
        ids') to this rank's count. Kept a tensor on the rank's device: no sync per pass, one per log."""
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return
        if self._waiting:  # the next micro-batch (DDP all-reduces only after a step's last one)
            step_phases.switch(phases.FORWARD_BACKWARD)
            self._waiting = False
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if mask is not None:
            counted = mask.sum()
        elif isinstance(ids, torch.Tensor):
            counted = ids.numel()
        else:
            return
        self._own_tokens = counted if self._own_tokens is None else self._own_tokens + counted

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if self._is_final(logs):
            self.final.update({metric_name(k): float(v) for k, v in logs.items() if _is_number(v)})
            return
        step = int(state.global_step)
        steps_done = step - self._last_step
        record = {"tokens": self._token_share(logs), "samples": self._samples(args, step)}
        step_time_ms = self._step_time_ms(logs, step)
        rate = None
        if self._global_delta is not None and step_time_ms and steps_done > 0:
            rate = self._global_delta / (step_time_ms / 1000 * steps_done)
            self.step_rates.append(rate)
        if state.is_world_process_zero:
            record.update(self._figures(logs))
            record["step_time_ms"] = step_time_ms
            if rate is not None:
                record["mfu"] = self.mfu_of(rate)
        self._last_step = step
        self.reporter.log(step=step, **record)
        # transformers logs a step before it evaluates or saves it: the phase that comes next.
        self._next_in(phases.SAVE if control.should_save else phases.EVALUATE if control.should_evaluate
                      else phases.DATA)

    def _next_in(self, phase: str) -> None:
        """The rank is now in `phase` of a step: marked, and beaten where the heartbeat names it (an
        evaluation, a save; the next step's batches are a step's to the heartbeat)."""
        self.reporter.beat(phase if phase in (heartbeat.EVALUATE, heartbeat.SAVE) else heartbeat.STEP)
        step_phases.switch(phase)

    def steady_tokens_per_s(self) -> float | None:
        """The run's steady rate: the median of the logged intervals' global tokens/s (one interval an
        optimizer step, logging_steps being 1), the first WARM_UP_INTERVALS left out (the optimizer's
        state, the allocator's first blocks, kernels compiled on first use); None where no interval
        is left. Beside the summary's whole-run `tokens_per_s`, which the warm-up weighs on in a short
        run (bench/results/sft/steady-figures-2026-11-28-h200.json: 16.8k whole-run, 22.2k steady)."""
        return steady_rate(self.step_rates)

    def mfu_of(self, tokens_per_s: float | None) -> float | None:
        """MFU a card at a global tokens/s (data/cards.py), None where the FLOPs or the card's peak are unknown."""
        from gpuscale.data.cards import mfu

        if self.flops_per_token is None or tokens_per_s is None:
            return None
        return mfu(tokens_per_s / self.world_size, self.flops_per_token, self.card)

    # ---- pieces of a record ----------------------------------------------------------------------

    @staticmethod
    def _is_final(logs: dict) -> bool:
        return any(k.startswith(FINAL_PREFIX) for k in logs) and "loss" not in logs

    def _token_share(self, logs: dict) -> float | None:
        """This rank's own tokens since the last log; where its forward passes were not seen, an
        equal share of the trainer's global count (None if that counts none either)."""
        self._global_delta = None
        for key in CUMULATIVE_TOKEN_KEYS:
            if _is_number(logs.get(key)):
                seen = float(logs[key])
                self._global_delta, self._tokens_seen = max(seen - self._tokens_seen, 0.0), seen
                break
        own, self._own_tokens = self._own_tokens, None
        if own is not None:
            return float(own)
        return None if self._global_delta is None else self._global_delta / self.world_size

    def _samples(self, args, step: int) -> float:
        """Sequences this rank trained on since the last log: its own batches, exact but for a short
        last batch of an epoch."""
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return float(per_step * max(step - self._last_step, 0))

    def _step_time_ms(self, logs: dict, step: int) -> float | None:
        """The trainer's own step time if it logs one (GRPO's `step_time`, seconds), else the wall
        time since the last log over the optimizer steps done since then."""
        now = time.perf_counter()
        measured = None
        if self._last_time is not None and step > self._last_step:
            measured = (now - self._last_time) / (step - self._last_step) * 1000
        self._last_time = now
        if _is_number(logs.get("step_time")):
            return float(logs["step_time"]) * 1000
        return measured

    @staticmethod
    def _figures(logs: dict) -> dict[str, float]:
        """Every other numeric figure of the log, under a plain name (loss, learning_rate, grad_norm,
        reward, rewards_<func>_mean, mean_token_accuracy, entropy, per-domain figures...)."""
        return {
            metric_name(key): float(value)
            for key, value in logs.items()
            if key not in CUMULATIVE_TOKEN_KEYS and key != "step_time" and _is_number(value)
        }


def steady_rate(rates: list[float], warm_up: int = WARM_UP_INTERVALS) -> float | None:
    """The median of `rates` after the first `warm_up` (a median: one slow step later on, a checkpoint
    saved, does not move it); None where none is left."""
    import statistics

    steady = rates[warm_up:]
    return statistics.median(steady) if steady else None


# ---- failing fast on NaN and Inf ------------------------------------------------------------------

GUARDED = ("loss", "grad_norm")  # and every key starting with "reward"


class NonFiniteGuard(TrainerCallback):
    """Raises `NonFiniteFigure` (one line: step, figure, what to try) as soon as a logged loss,
    grad_norm or `reward*` figure is NaN or Inf. transformers logs the same global figures on every
    rank, so every rank stops at the same step. TRL logs a reward whose every value was NaN as None:
    the overall `reward` being None is read as NaN too. `attach(trainer)` adds the guard to a trainer
    and, for a trainer with reward functions (GRPO), checks every reward they return as well."""

    def attach(self, trainer) -> NonFiniteGuard:
        trainer.add_callback(self)
        functions = getattr(trainer, "reward_funcs", None)
        if functions:
            names = getattr(trainer, "reward_func_names", None) or [getattr(f, "__name__", "reward") for f in functions]
            trainer.reward_funcs = [f if _is_module(f) else FiniteReward(f, name) for f, name in zip(functions, names)]
        return self

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, value in (logs or {}).items():
            guarded = key in GUARDED or key.startswith("reward")
            if not guarded or key.startswith(FINAL_PREFIX):
                continue
            if key == "reward" and value is None:
                value = float("nan")
            if _is_number(value) and not math.isfinite(value):
                raise NonFiniteFigure(non_finite_message(int(state.global_step), metric_name(key), float(value)))


class FiniteReward:
    """A TRL reward function that raises `NonFiniteFigure` when it returns NaN or Inf for a row (None,
    "not this row's reward", passes)."""

    def __init__(self, function, name: str):
        self.function, self.__name__ = function, name

    def __call__(self, *args, **kwargs):
        values = self.function(*args, **kwargs)
        for value in values:
            if value is not None and not math.isfinite(value):
                state = kwargs.get("trainer_state")
                step = int(state.global_step) + 1 if state is not None else 0  # the step being generated
                raise NonFiniteFigure(non_finite_message(
                    step, f"reward {self.__name__}", float(value), cause="the reward function returned it",
                    remedies="checking the reward function on this step's completions"))
        return values


def _is_module(function) -> bool:
    import torch

    return isinstance(function, torch.nn.Module)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- settings -> trainer configuration -----------------------------------------------------------

# A recipe's setting -> the trainer config's field. Applied only where the recipe's settings have the
# field (RunSettings has batch_size and seed; training recipes add the rest).
SETTING_TO_CONFIG = {
    "batch_size": "per_device_train_batch_size",
    "seed": "seed",
    "learning_rate": "learning_rate",
    "epochs": "num_train_epochs",
    "max_steps": "max_steps",
    "gradient_accumulation": "gradient_accumulation_steps",
    "lr_scheduler": "lr_scheduler_type",
    # transformers 5 reads a warmup_steps below 1 as a fraction of the training steps.
    "warmup_ratio": "warmup_steps",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "max_length": "max_length",
    "activation_checkpointing": "activation_checkpointing",
    "compile": "torch_compile",
}

# Config fields renamed between the transformers versions gpuscale supports: the newer name, and the
# older one used where the config class lacks it (transformers 5.17 has only gradient_checkpointing).
RENAMED_FIELDS = {"activation_checkpointing": "gradient_checkpointing"}


def report_to(settings) -> list[str]:
    """The training recipes' `report_to` (checked in recipes/shared/report_backends.py) as a config
    takes it: ["none"], ["all"] or the integrations; ["none"] for settings without it (eggroll's)."""
    return getattr(settings, "report_to", "none").split(",")


def trainer_args(settings, ctx, config_cls, **recipe_specific):
    """A `config_cls` (SFTConfig, GRPOConfig, TrainingArguments...) for this rank.

    From the settings: per-device batch, gradient accumulation, seed, learning rate, epochs or
    max_steps, scheduler, warm-up... (SETTING_TO_CONFIG). From the rank: bf16/fp16 autocast when
    the rank's dtype is half precision; on CPU `use_cpu`, and gloo between several ranks; the
    integrations of `report_to` (`report_to`), named after the run. Fixed: output inside the run
    folder (RUN_DIR/trainer; TensorBoard's event files go to RUN_DIR/tensorboard, the
    TENSORBOARD_LOGGING_DIR control/supervisor.py gives the ranks), checkpoints
    only every `checkpoint_every` steps, a log at every step, no progress bars (ranks write to log
    files), no dataloader worker processes. `recipe_specific` overrides any of these.
    """
    import torch

    fields = {f.name for f in dataclasses.fields(config_cls)}
    values: dict[str, Any] = {}
    for setting, field in SETTING_TO_CONFIG.items():
        if (field in fields or RENAMED_FIELDS.get(field) in fields) and setting in type(settings).model_fields:
            # A setting left empty keeps the config's default (max_steps -1: train for num_train_epochs).
            if getattr(settings, setting) is not None:
                values[field] = getattr(settings, setting)
    on_cpu = ctx.device.type != "cuda"
    values.update(
        output_dir=str(RunDir(ctx.run_dir).trainer),
        report_to=report_to(settings),
        run_name=f"gpuscale-{Path(ctx.run_dir).name}",  # the run's id: its name in W&B, Trackio, MLflow...
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        # The one autocast switch of a TRL run (accelerate is launched with --mixed_precision no):
        # the rank's dtype, data/precision.py's rule resolved on this rank's device.
        bf16=ctx.dtype == torch.bfloat16,
        fp16=ctx.dtype == torch.float16,
        use_cpu=on_cpu,
        # Every parameter of our models takes part in the loss: DDP need not search for unused ones.
        ddp_find_unused_parameters=False,
        # Nor broadcast rank 0's buffers before every forward pass: a causal LM's (the rotary frequencies)
        # are computed alike on every rank and never trained, and the broadcast is a collective a pass,
        # where the faster ranks waited for a straggler inside `forward_backward` (DDP's C++ broadcasts them,
        # out of the step phases' sight: they tell the wait apart at Python's collectives and at the
        # gradient all-reduce, ReporterCallback._watch_gradients).
        ddp_broadcast_buffers=False,
    )
    # Checkpoints every `checkpoint_every` steps into the run folder (model, optimizer, scheduler, RNG,
    # data position), the last `keep_checkpoints` kept: what `gpuscale resume` continues from.
    values.update(checkpoint_args(settings, ctx.run_dir))
    if on_cpu and ctx.world_size > 1:
        values["ddp_backend"] = "gloo"  # the group the rank started (accelerate would try MPI first)
    values.update(recipe_specific)
    for newer, older in RENAMED_FIELDS.items():
        if newer in values and newer not in fields and older in fields:
            values[older] = values.pop(newer)
    return config_cls(**values)
