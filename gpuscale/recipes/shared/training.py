"""The one training shell of the TRL recipes (sft, rft's training phase, grpo-mtl) and what they share.

- Settings: `TrainingSettings` (learning rate and schedule, clipping, LoRA, the held-out evaluation,
  saving), and `SupervisedSettings` on it (epochs or max_steps, accumulation, sequence length...) for
  the recipes that fine-tune on (question, completion) rows. Each recipe keeps its own defaults by
  redeclaring a field.
- Data: `training_and_eval_examples` (the held-out split, `eval_split` choosing test or validation
  problems: data/tasks.py's `held_out_split`, the one rule every recipe goes through), `sft_rows` and
  `tokenized_dataset` (rows as TRL's SFTTrainer takes them), `lora_config`.
- The shell: `train_model(build, settings, ctx, model)` takes a factory of a TRL trainer and does
  what every training recipe does around it: fp32 master weights for a full fine-tune, the NaN guard
  (engines/trl_bridge.py), train, free the optimizer, merge LoRA, cast to the rank's dtype, eval
  mode; it returns one `TrainedModel`. `train_sft` is the SFT phase built on it.
- The end of a run: `held_out_evaluation` (greedy and temperature 1, per domain and on tiny-math's
  structurally new subset, one strict answer rule, figures named
  `accuracy_<greedy|sampled>[_<domain>|_new]_<before|after>` by data/figures.py's `accuracy_name`) and
  `save_then_evaluate` (the trained model is saved before the final evaluation, so that a failure
  there never loses it).

No torch at import: the front ends read the settings classes, and eggroll uses the evaluation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator

from gpuscale.data.figures import accuracy_name
from gpuscale.runs.settings import RunSettings, SettingsError

MOST_ACCUMULATION = 1024  # the largest gradient_accumulation allowed
# batch_size auto with gradient_accumulation given (TRL's count): a unit of accumulation is this many
# rows a rank (as batch_size 8 was), and on CPU a micro-batch takes at most this many rows.
AUTO_STEP_ROWS = 8


def checked_lora_targets(value: str) -> str:
    """`lora_targets` as peft takes it: all-linear, or module names like q_proj,v_proj."""
    value = value.strip()
    if value != "all-linear" and not re.fullmatch(r"\w+(\s*,\s*\w+)*", value):
        raise ValueError("expected all-linear or module names like q_proj,v_proj")
    return value


# ---- settings ------------------------------------------------------------------------------------

EVAL_SPLIT_HELP = ("which problems the held-out evaluation scores: test = the data set's test split, the same "
                   "for every seed (a JSONL file: its first eval_examples rows); validation = problems for "
                   "choosing settings without scoring the test problems, never trained on: tiny-math's own "
                   "validation split (the same for every seed, none a pretraining problem of the embedded model), "
                   "else the first eval_examples problems of the training data, taken out of training (a JSONL "
                   "file: the eval_examples rows after its test rows, which stay out of training too)")


def eval_split_field():
    """The `eval_split` setting of every recipe that scores held-out problems (one description)."""
    return Field("test", description=EVAL_SPLIT_HELP)



class TrainingSettings(RunSettings):
    """What every TRL training recipe is set with, besides RunSettings."""

    KEY_ALIASES = {"lr": "learning_rate"}

    learning_rate: float = Field(2e-5, gt=0.0, le=1.0, description="peak learning rate")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="learning-rate schedule after the warm-up")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0,
                                description="share of the steps spent warming up the learning rate")
    max_grad_norm: float = Field(1.0, ge=0.0, le=1e6, description="gradient clipping (0 = none)")
    lora_rank: int = Field(0, ge=0, le=1024, description="0 = full fine-tune; otherwise LoRA adapters of this rank")
    lora_alpha: float = Field(32.0, gt=0.0, le=4096.0,
                              description="LoRA scaling numerator (alpha / rank scales the update)")
    lora_targets: str = Field("all-linear", description="modules LoRA adapts: all-linear, or names like q_proj,v_proj")
    eval_examples: int = Field(100, ge=0, le=100_000, description="held-out problems (of eval_split) scored "
                               "greedily and at temperature 1 before and after training (0 = no evaluation)")
    eval_split: Literal["test", "validation"] = eval_split_field()
    save_model: bool = Field(True, description="save the trained model (merged if LoRA) to RUN_DIR/model, "
                             "before the final evaluation")
    liger_kernels: bool = Field(True, description="liger-kernel's fused RMSNorm, SwiGLU and RoPE on CUDA (pip install "
                                "liger-kernel; without it the run says so and goes on without)")

    @field_validator("lora_targets")
    @classmethod
    def _check_targets(cls, value: str) -> str:
        return checked_lora_targets(value)


class SupervisedSettings(TrainingSettings):
    """The settings of a fine-tune on (question, completion) rows with TRL's SFTTrainer (sft, rft)."""

    KEY_ALIASES = {**TrainingSettings.KEY_ALIASES, "grad_accum": "gradient_accumulation"}

    epochs: float = Field(1.0, gt=0.0, le=1000.0, description="passes over the training examples")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (overrides epochs)")
    # Over all ranks, as grpo-mtl's prompts_per_step and eggroll's population: the number of GPUs
    # changes how fast a run trains, not what it learns (a per-rank count gave a 4-GPU run 4x the rows
    # a step, a quarter of the steps, and less learned at the same learning rate: bench/RESULTS.md).
    rows_per_step: int = Field(8, ge=1, le=1 << 20, description="training sequences per optimizer step over "
                               "all ranks (the effective batch, a learning setting: a run learns the same on "
                               "any number of GPUs, only faster); each rank takes rows_per_step / ranks of them "
                               "a step, in micro-batches of batch_size")
    gradient_accumulation: int | None = Field(
        None, ge=1, le=MOST_ACCUMULATION, description="TRL's count instead of rows_per_step: micro-batches of "
        "batch_size per optimizer step on each rank, so a step takes batch_size x gradient_accumulation x ranks "
        "rows (batch_size auto counting as 8); empty = it follows from rows_per_step")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    max_length: int = Field(512, ge=8, le=131_072,
                            description="longest prompt + completion, in tokens (longer are cut)")
    activation_checkpointing: bool = Field(False, description="recompute activations in the backward pass "
                                           "(less memory, about a third more compute)")
    max_new_tokens: int = Field(256, ge=1, le=65_536, description="answer length budget in the evaluation")
    # Speed (ARCHITECTURE.md, engines/packed_attention.py): each can be turned off, each gives the same loss
    # (tests/unit/test_training_speed.py).
    padding_free: bool = Field(True, description="a micro-batch's rows concatenated into one sequence, attention "
                               "row by row (flash varlen on CUDA): no compute on padding tokens")
    packing: bool = Field(False, description="pack rows into sequences of max_length tokens (TRL's bfd packing): a "
                          "micro-batch counts packed sequences, so an optimizer step takes more rows")
    pad_to_multiple_of: int = Field(16, ge=0, le=1024, description="a micro-batch's sequence padded to a multiple of "
                                    "this many tokens (0 = not padded): one compiled variant of liger's kernels "
                                    "for every length")

    @field_validator("max_steps", mode="before")
    @classmethod
    def _no_limit_words(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() in ("", "none", "all") else value

    def rank_rows(self, ranks: int) -> int:
        """Sequences per optimizer step on each of `ranks` ranks: rows_per_step / ranks, or with
        gradient_accumulation given, batch_size (auto: AUTO_STEP_ROWS) x gradient_accumulation. What
        tuning and the card-sized split keep. SettingsError (naming the field) where the ranks do not
        share the step evenly: DDP pairs every rank's micro-batches."""
        if self.gradient_accumulation is not None:
            return (self.batch_size or AUTO_STEP_ROWS) * self.gradient_accumulation
        if self.rows_per_step % ranks:
            raise SettingsError(f"rows_per_step: {self.rows_per_step}: does not split evenly over the run's {ranks} "
                                f"ranks (each takes an equal share of a step); give a multiple of {ranks}")
        return self.rows_per_step // ranks

    @property
    def step_asked(self) -> dict[str, int]:
        """How the step's rows were asked for, part of a tuning result's key: rows_per_step over all
        ranks, or TRL's per-rank count."""
        if self.gradient_accumulation is not None:
            return {"rows_a_rank": self.rank_rows(1)}
        return {"rows_per_step": self.rows_per_step}

    def check_micro_batch(self, ranks: int, micro_batch: int | None, field: str = "batch_size") -> int:
        """The rank's rows of a step (`rank_rows`), checked to split into micro-batches of
        `micro_batch` rows (None: sized later, any split); SettingsError naming `field` otherwise."""
        rows = self.rank_rows(ranks)
        if micro_batch is not None and rows % micro_batch:
            raise SettingsError(f"{field}: {micro_batch}: does not divide the {rows} rows each of the {ranks} ranks "
                                f"takes a step (rows_per_step {rows * ranks}); give a divisor of {rows}")
        return rows


def with_micro_batch(settings: SupervisedSettings, wanted: int) -> SupervisedSettings:
    """The settings with a tuned micro-batch: the largest allowed up to `wanted` for the rank's rows of
    a step on the ranks this run starts (a batch tuned for another share need not divide this one);
    gradient_accumulation, where given (TRL's count), rescaled so that the step keeps its rows."""
    from gpuscale.recipes.shared.rank_batches import micro_batch_within, run_ranks

    rows = settings.rank_rows(run_ranks(settings))
    micro = micro_batch_within(rows, wanted, MOST_ACCUMULATION)
    accumulation = None if settings.gradient_accumulation is None else rows // micro
    return settings.model_copy(update={"batch_size": micro, "gradient_accumulation": accumulation})


# ---- data ----------------------------------------------------------------------------------------


def training_and_eval_examples(settings) -> tuple[list[dict], list[dict]]:
    """(training examples, held-out evaluation examples) of the run: `dataset`, `eval_split`,
    `eval_examples`, `max_examples` and `seed` of its settings through data/tasks.py's
    `held_out_split`, the rule every recipe holds out by. With eval_split=test the evaluation is the
    test split (a JSONL file, one split by itself: its first `eval_examples` rows); with validation,
    a generated task's validation split, else the first `eval_examples` problems of the training
    data. The seed never changes the problems scored. A question scored is never trained on,
    whatever the data set. A question longer than the model's context is refused or left out before
    any of this (`too_long`, data/question_length.py)."""
    from gpuscale.data.question_length import question_limit
    from gpuscale.data.tasks import held_out_split

    return held_out_split(settings.dataset, getattr(settings, "eval_split", "test"), settings.eval_examples,
                          settings.max_examples, seed=settings.seed, question_limit=question_limit(settings))


def sft_rows(examples: list[dict]) -> list[dict]:
    """Examples as the prompt-completion rows `train_sft` takes: the question and the gold answer."""
    return [{"question": example["question"], "completion": example["answer"]} for example in examples]


def tokenized_dataset(rows: list[dict], tokenizer, max_length: int | None = None):
    """A `datasets.Dataset` of input_ids and completion_mask, tokenized here so that the prompt is
    exactly the generation side's (TRL would re-tokenize text prompts its own way), each row cut to
    `max_length` tokens (TRL's padding-free collator cuts nothing)."""
    import datasets

    from gpuscale.data.prompts import prompt_ids

    datasets.disable_progress_bars()  # TRL's preparation passes would draw bars in the rank's log
    completions = tokenizer([row["completion"] for row in rows], add_special_tokens=False)["input_ids"]
    encoded = []
    for row, completion in zip(rows, completions):
        prompt = prompt_ids(tokenizer, row["question"])
        answer = list(completion) + [tokenizer.eos_token_id]
        ids, mask = prompt + answer, [0] * len(prompt) + [1] * len(answer)
        encoded.append({"input_ids": ids[:max_length], "completion_mask": mask[:max_length]})
    return datasets.Dataset.from_list(encoded)


def lora_config(settings):
    """peft's LoraConfig for lora_rank > 0, None for a full fine-tune."""
    if settings.lora_rank == 0:
        return None
    from peft import LoraConfig

    targets = settings.lora_targets
    if targets != "all-linear":
        targets = [name.strip() for name in targets.split(",")]
    return LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules=targets,
                      lora_dropout=0.0, task_type="CAUSAL_LM")


# ---- the shell -----------------------------------------------------------------------------------


@dataclass
class TrainedModel:
    """The trained model (LoRA merged into it, in the rank's dtype, on its device, in eval mode) and
    the training's figures for the run summary."""

    model: Any
    figures: dict[str, Any] = field(default_factory=dict)


def train_model(build: Callable, settings: TrainingSettings, ctx, model,
                more_figures: Callable | None = None, packed_attention: bool = False) -> TrainedModel:
    """Train `model` with the TRL trainer `build(model) -> (trainer, ReporterCallback)` makes.

    Around the trainer: fp32 master weights for a full fine-tune (the forward runs under bf16/fp16
    autocast), the NaN guard, attention row by row over padding-free batches where asked
    (engines/packed_attention.py, for the training only: generation needs the model's own), then after
    training the optimizer's state freed, a LoRA adapter merged, the model cast back to the rank's
    dtype and put in eval mode. The figures are `training_figures` and, where given,
    `more_figures(trainer, callback, seconds)`."""
    import gc
    import time

    import torch

    from gpuscale.engines import preemption
    from gpuscale.engines.packed_attention import use_packed_attention
    from gpuscale.engines.trl_bridge import NonFiniteGuard
    from gpuscale.engines.trl_checkpoints import resume_checkpoint
    from gpuscale.runs.run_dir import RunDir

    if settings.lora_rank == 0 and ctx.dtype != torch.float32:
        model = model.float()
    trainer, callback = build(model)
    NonFiniteGuard().attach(trainer)
    # SLURM's signal (engines/preemption.py): the trainer saves the step it ends and stops.
    on_preemption = preemption.preemption_callback(ctx.device)
    trainer.add_callback(on_preemption)
    started = time.perf_counter()
    with use_packed_attention(model, packed_attention), preemption.cooperating():
        trainer.train(resume_from_checkpoint=resume_checkpoint(settings))
        if on_preemption.stopped_at is not None:
            step = on_preemption.stopped_at
            raise preemption.Preempted(step, RunDir(ctx.run_dir).checkpoint(step))
    # The trainer's own training time (its loop, without its set-up), or the wall time if it reports none.
    seconds = callback.final.get("train_runtime") or time.perf_counter() - started
    figures = training_figures(trainer, callback, seconds, ctx)
    if more_figures is not None:
        figures.update(more_figures(trainer, callback, seconds))
    model = trainer.model
    del trainer  # the optimizer's state goes with it
    gc.collect()
    if settings.lora_rank:
        model = model.merge_and_unload()
    return TrainedModel(model.to(ctx.dtype).eval(), figures)


def training_figures(trainer, callback, seconds: float, ctx=None) -> dict[str, Any]:
    """The summary's training figures: steps, mean and first/last logged loss, and the global rates
    over the trainer's training time; MFU a card where the callback knows the FLOPs of a token and
    the card's peak (data/cards.py)."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens_per_s = callback.tokens_seen / seconds if seconds > 0 else None
    return {
        "steps": trainer.state.global_step,
        "train_loss": callback.final.get("train_loss", sum(losses) / len(losses) if losses else None),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "train_tokens": callback.tokens_seen,
        "tokens_per_s": tokens_per_s,
        "samples_per_s": callback.final.get("train_samples_per_second"),
        "train_seconds": seconds,
        "mfu": callback.mfu_of(tokens_per_s),
    }


def train_sft(rows: list[dict], settings: SupervisedSettings, ctx, reporter, model=None,
              tokenizer=None) -> TrainedModel:
    """Fine-tune on `rows`, each {"question": ..., "completion": ...} (other keys are ignored), with
    TRL's SFTTrainer: the loss is on the completion and EOS only, the prompt being the question as
    `prompt_ids` builds it. `model` and `tokenizer` default to settings.model; a model passed in is
    trained in place (a LoRA adapter is merged into it). Every rank calls it with the same rows (the
    trainer shards them); the trainer's logs reach `reporter` as they come.

    Speed, each setting on by default where it applies and each one off with a setting: padding-free
    micro-batches with attention row by row (`padding_free`), rows packed into max_length sequences
    (`packing`, off by default: it changes what a step holds), liger-kernel's fused layers on CUDA
    (`liger_kernels`), and with batch_size auto the micro-batch cut to the card (`card_sized_split`)."""
    if model is None:
        from gpuscale.recipes.shared.common import load_generation_model

        loaded = load_generation_model(settings.model, ctx)
        model, tokenizer = loaded.model, loaded.tokenizer
    return train_sft_dataset(tokenized_dataset(rows, tokenizer, settings.max_length), settings, ctx, reporter,
                             model, tokenizer)


def train_sft_dataset(dataset, settings: SupervisedSettings, ctx, reporter, model, tokenizer,
                      callbacks: tuple = ()) -> TrainedModel:
    """`train_sft` on rows already tokenized (`tokenized_dataset`'s columns); `callbacks` are more
    TrainerCallbacks (bench/train_speed.py's step timer)."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    settings, split = card_sized_split(settings, ctx, model, lengths)
    kernels = apply_liger_kernels(model, ctx, settings.liger_kernels)
    print(f"speed: padding_free {settings.padding_free}, packing {settings.packing}, liger kernels {kernels}",
          flush=True)

    def build(model):
        from trl import SFTConfig, SFTTrainer

        from gpuscale.engines.trl_bridge import ReporterCallback, trainer_args

        callback = ReporterCallback(reporter, ctx.world_size, flops_per_token=flops_per_token(model, lengths, settings),
                                    card=card_name(ctx))
        trainer = SFTTrainer(
            model=model,
            args=trainer_args(settings, ctx, SFTConfig, completion_only_loss=True, **sft_speed_config(settings)),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(settings),
            callbacks=[callback, *callbacks],
        )
        return trainer, callback

    trained = train_model(build, settings, ctx, model, packed_attention=settings.padding_free or settings.packing)
    trained.figures.update(batch_size=settings.batch_size, gradient_accumulation=settings.gradient_accumulation,
                           rows_per_step=settings.rank_rows(ctx.world_size) * ctx.world_size,
                           batch_size_reason=split, liger_kernels=kernels)
    return trained


# ---- speed ----------------------------------------------------------------------------------------


def sft_speed_config(settings: SupervisedSettings) -> dict[str, Any]:
    """SFTConfig's fields for padding-free batches, packing and padding. Rows come cut to max_length
    (`tokenized_dataset`); TRL's padding-free collator takes no max_length unless it packs.

    Why pad: Triton compiles a kernel once for each divisibility of its integer arguments (by 16, or
    equal to 1), and liger's RoPE and RMSNorm take the micro-batch's token count as one. A
    padding-free length that varies step to step compiles a new variant whenever it first meets the
    other divisibility: 148-168 ms each on one H200, three kernels at once, mid-run, on one rank while
    every other rank waits at the gradient all-reduce (bench/RESULTS.md). Padded to a multiple of 16,
    every length is the same variant. The padding tokens carry no loss (TRL's labels are -100 there);
    TRL's token count includes them (fewer than pad_to_multiple_of a micro-batch)."""
    packing = settings.packing
    return {"padding_free": settings.padding_free or packing, "packing": packing, "packing_strategy": "bfd",
            "max_length": settings.max_length if packing else None,
            "pad_to_multiple_of": settings.pad_to_multiple_of or None}


def card_sized_split(settings: SupervisedSettings, ctx, model, lengths: list[int]) -> tuple[SupervisedSettings, str]:
    """The rank's rows of a step (`rank_rows`) in micro-batches: batch_size's if given, else the
    largest that fits its share of the card (on CPU: at most AUTO_STEP_ROWS), the same on every rank
    (`agreed_micro_batch`); gradient accumulation makes up the step. Returns the settings with
    batch_size and gradient_accumulation set (TRL's two counts), and the reason in one line, also
    printed to the rank's log."""
    rows = settings.check_micro_batch(ctx.world_size, settings.batch_size)
    if settings.batch_size is not None:
        return settings.model_copy(update={"gradient_accumulation": rows // settings.batch_size}), "given"
    from gpuscale.engines.training_memory import tokens_per_row

    tokens = tokens_per_row(lengths, padded=not (settings.padding_free or settings.packing),
                            packed_length=settings.max_length if settings.packing else None)
    if ctx.device.type != "cuda":
        micro, reason = AUTO_STEP_ROWS, "the CPU default"
    else:
        micro, reason = fitted_micro_batch(settings, ctx, model, rows, tokens)
    micro = agreed_micro_batch(rows, micro, ctx)
    line = f"batch_size auto: {micro} rows a micro-batch x {rows // micro} accumulated ({reason})"
    print(line, flush=True)
    return settings.model_copy(update={"batch_size": micro, "gradient_accumulation": rows // micro}), line


def fitted_micro_batch(settings: TrainingSettings, ctx, model, rows: int, tokens: int) -> tuple[int, str]:
    """The largest divisor of `rows` whose micro-batch of `tokens`-token rows fits the rank's share of
    its card (engines/training_memory.py's arithmetic, on the memory `memory_for_auto_sizes` gives), and why."""
    import torch

    from gpuscale.engines.distributed import memory_for_auto_sizes
    from gpuscale.engines.training_memory import TrainingShape, split_rows

    memory, source = memory_for_auto_sizes(ctx, settings.gpu_memory_share)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = parameters if settings.lora_rank == 0 else lora_parameters_estimate(model, settings)
    shape = TrainingShape.of(model.config, parameters, trainable, model.dtype != torch.float32,
                             getattr(settings, "activation_checkpointing", False))
    split = split_rows(rows, tokens, shape, memory, settings.gpu_memory_share, source)
    return split.micro_batch, split.reason


def lora_parameters_estimate(model, settings) -> int:
    """LoRA's trainable parameters, about: rank x (in + out) of every linear layer it adapts."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(settings.lora_rank * (m.in_features + m.out_features) for m in linears)


def agreed_micro_batch(rows: int, micro: int, ctx) -> int:
    """The smallest micro-batch any rank found, cut to a divisor of the step's `rows`: DDP and the
    loss's collectives pair the ranks' micro-batches, so every rank must take as many a step."""
    from gpuscale.engines.training_memory import largest_divisor

    if ctx.world_size > 1:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(micro, device=ctx.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        micro = int(tensor)
    return largest_divisor(rows, micro)


def apply_liger_kernels(model, ctx, wanted: bool) -> str:
    """liger-kernel's fused RMSNorm, SwiGLU and RoPE on the model (CUDA only: they are Triton kernels).
    The output head stays TRL's, which computes the loss in tiles. Returns what was done, for the log."""
    if not wanted:
        return "off"
    if ctx.device.type != "cuda":
        return "off (CPU)"
    try:  # the entry point transformers' own Trainer calls for `use_liger_kernel`
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        return "not installed (pip install liger-kernel)"
    _apply_liger_kernel_to_instance(model=model, rms_norm=True, swiglu=True, rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return "on"


def flops_per_token(model, lengths: list[int], settings) -> float:
    """Training FLOPs of a token of these rows (data/cards.py): a token attends on average to half its
    row (packed rows too: each attends only to itself)."""
    from gpuscale.data.cards import model_flops_shape, training_flops_per_token

    matmul, layers, width = model_flops_shape(model.config)
    mean_row = sum(lengths) / len(lengths) if lengths else 1
    return training_flops_per_token(matmul, layers, width, mean_row / 2)


def card_name(ctx) -> str | None:
    import torch

    return torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None


# ---- the end of a run: save, then evaluate --------------------------------------------------------


def held_out_evaluation(model, tokenizer, examples: list[dict], ctx, when: str, *, max_new_tokens: int,
                        seed: int = 0, batch_size: int = 64) -> dict[str, float | None]:
    """Held-out accuracy, greedy and at temperature 1, overall and per domain, every recipe's answers
    extracted by one strict `#### N` rule (data/scoring.py's HELD_OUT_ANSWER_MODE says why):
    {"accuracy_greedy_<when>": ..., "accuracy_greedy_<domain>_<when>": ..., "accuracy_sampled_<when>": ...};
    the overall ones are None without examples. On tiny-math also the structurally new subset
    (data/near_duplicates.py): `accuracy_<greedy|sampled>_new_<when>` and its size `eval_examples_new`;
    other data has `eval_examples_new` None and `structurally_new_unavailable` saying why. `when` is
    "before" or "after" (training); the final evaluation is where GPUSCALE_INJECT_FAULT's `final_eval` fires."""
    from gpuscale.data.scoring import new_subset_size
    from gpuscale.engines.reporter import fail_if_injected

    if when == "after":
        fail_if_injected("final_eval", ctx.rank)
    figures: dict[str, float | None] = dict(new_subset_size(examples))
    for label, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        if not examples:
            figures[accuracy_name(label, "", when)] = None
            continue
        from gpuscale.recipes.shared.common import held_out_accuracy

        found = held_out_accuracy(model, tokenizer, examples, ctx, max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed, batch_size=batch_size)
        figures.update({accuracy_name(label, name.removeprefix("accuracy").lstrip("_"), when): value
                        for name, value in found.items()})
    return figures


def save_then_evaluate(trained: TrainedModel, tokenizer, ctx, settings, reporter, summary: dict,
                       evaluate: Callable[[], dict]) -> dict:
    """The end of a training run: save the trained model to RUN_DIR/model (where `save_model`), report
    the summary so far as a partial one, then run the final evaluation `evaluate()` and report the
    whole summary. A failure in the evaluation leaves the saved model and the figures measured
    before it. Returns the whole summary (rank 0's matters)."""
    from gpuscale.recipes.shared.common import save_model

    model_dir = save_model(trained.model, tokenizer, ctx) if settings.save_model else None
    summary = {**summary, **trained.figures, "model_dir": str(model_dir) if model_dir else None}
    if ctx.is_main:
        reporter.summary(summary, partial=True)
    summary.update(evaluate())
    if ctx.is_main:
        reporter.summary(summary)
    return summary
