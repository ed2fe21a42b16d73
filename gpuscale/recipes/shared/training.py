"""The one training shell of the TRL recipes (sft, rft's training phase, grpo-mtl).

- `train_model(build, settings, ctx, model)` takes a factory of a TRL trainer and does what every
  training recipe does around it: fp32 master weights for a full fine-tune, the NaN guard
  (engines/trl_bridge.py), train, free the optimizer, merge LoRA, cast to the rank's dtype, eval
  mode; it returns one `TrainedModel` with the summary's `training_figures`.
- `train_sft` (and `train_sft_dataset`, on rows already tokenized) is the SFT phase built on it.
- What the trainers are built with: `lora_config`, `sft_speed_config` (padding-free batches, packing),
  `apply_liger_kernels`, and the MFU's `flops_per_token` and `card_name`.

Settings are training_settings.py's, the examples training_data.py's, the micro-batch on the card
card_sized_micro_batch.py's, the held-out evaluation and the end of a run evaluation.py's.

No torch at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuscale.recipes.shared.card_sized_micro_batch import card_sized_split
from gpuscale.recipes.shared.training_data import tokenized_dataset
from gpuscale.recipes.shared.training_settings import SupervisedSettings, TrainingSettings


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


@dataclass
class TrainedModel:
    """The trained model (LoRA merged into it, in the rank's dtype, on its device, in eval mode) and
    the training's figures for the run summary."""

    model: Any
    figures: dict[str, Any] = field(default_factory=dict)


def train_model(build: Callable, settings: TrainingSettings, ctx, model,
                more_figures: Callable | None = None, packed_attention: bool = False,
                resume_figure: str = "loss") -> TrainedModel:
    """Train `model` with the TRL trainer `build(model) -> (trainer, ReporterCallback)` makes.

    Around the trainer: fp32 master weights for a full fine-tune (the forward runs under bf16/fp16
    autocast), the NaN guard, attention row by row over padding-free batches where asked
    (engines/packed_attention.py, for the training only: generation needs the model's own), then after
    training the optimizer's state freed, a LoRA adapter merged, the model cast back to the rank's
    dtype and put in eval mode. The figures are `training_figures` and, where given,
    `more_figures(trainer, callback, seconds)`; a run resumed from a checkpoint adds its
    `resume_check` (engines/resume_check.py), comparing the trainer's logged `resume_figure`."""
    import gc
    import time

    import torch

    from gpuscale.engines import preemption
    from gpuscale.engines.packed_attention import use_packed_attention
    from gpuscale.engines.resume_check import ResumeCheckCallback
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
    resumed = resume_checkpoint(settings)
    checking = ResumeCheckCallback(callback.reporter, resumed, resume_figure) if resumed else None
    if checking is not None:
        trainer.add_callback(checking)
    started = time.perf_counter()
    with use_packed_attention(model, packed_attention), preemption.cooperating():
        trainer.train(resume_from_checkpoint=resumed)
        if on_preemption.stopped_at is not None:
            step = on_preemption.stopped_at
            raise preemption.Preempted(step, RunDir(ctx.run_dir).checkpoint(step))
    # The trainer's own training time (its loop, without its set-up), or the wall time if it reports none.
    seconds = callback.final.get("train_runtime") or time.perf_counter() - started
    figures = training_figures(trainer, callback, seconds, ctx)
    if checking is not None:
        figures["resume_check"] = checking.check.record(finished=True)
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
    over the trainer's training time, warm-up included (`tokens_per_s`, `mfu`) and at its steady
    steps (`tokens_per_s_steady`, `mfu_steady`: the median step, the first left out,
    `ReporterCallback.steady_tokens_per_s`); MFU a card where the callback knows the FLOPs of a token
    and the card's peak (data/cards.py)."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens_per_s = callback.tokens_seen / seconds if seconds > 0 else None
    steady = callback.steady_tokens_per_s()
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
        "tokens_per_s_steady": steady,
        "mfu_steady": callback.mfu_of(steady),
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
        from gpuscale.recipes.shared.models import load_generation_model

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
