"""A rank's work in SFT: evaluate, train with TRL's SFTTrainer, evaluate again, save.

`train_sft(rows, settings, ctx, reporter)` is the training phase by itself, for any recipe that has
(question, completion) rows to fine-tune on (RFT trains on its kept samples with it).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

from gpuscale.recipes.sft import Settings
from gpuscale.recipes.sft.data import sft_rows, training_and_test_examples


def run_sft(settings: Settings, ctx, reporter) -> None:
    from gpuscale.recipes.common import held_out_accuracy, load_generation_model, save_model

    train, test = training_and_test_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    model, tokenizer = loaded.model, loaded.tokenizer
    before = held_out_accuracy(model, tokenizer, test, ctx, max_new_tokens=settings.max_new_tokens, seed=settings.seed)
    trained = train_sft(sft_rows(train), settings, ctx, reporter, model=model, tokenizer=tokenizer)
    after = held_out_accuracy(trained.model, tokenizer, test, ctx, max_new_tokens=settings.max_new_tokens,
                              seed=settings.seed)
    model_dir = save_model(trained.model, tokenizer, ctx) if settings.save_model else None
    if ctx.is_main:
        summary = {"world_size": ctx.world_size, "dtype": str(ctx.dtype).removeprefix("torch."),
                   "train_examples": len(train), "eval_examples": len(test), **trained.figures}
        summary.update({name.replace("accuracy", "accuracy_before", 1): v for name, v in before.items()})
        summary.update({name.replace("accuracy", "accuracy_after", 1): v for name, v in after.items()})
        summary["model_dir"] = str(model_dir) if model_dir else None
        reporter.summary(summary)


# ---- training ------------------------------------------------------------------------------------


@dataclass
class TrainedModel:
    """What `train_sft` gives back: the trained model (LoRA merged into it, in the rank's dtype, on
    its device) and the training's figures for the run summary."""

    model: Any
    figures: dict[str, Any] = field(default_factory=dict)


def train_sft(rows: list[dict], settings, ctx, reporter, model=None, tokenizer=None) -> TrainedModel:
    """Fine-tune on `rows`, each {"question": ..., "completion": ...} (other keys are ignored): the
    loss is on the completion and EOS only, the prompt being the question as `prompt_ids` builds it.

    `settings` needs the training fields of sft's Settings (learning_rate, epochs, max_steps,
    gradient_accumulation, lr_scheduler, warmup_ratio, weight_decay, max_length,
    activation_checkpointing, lora_rank, lora_alpha, lora_targets). `model` and `tokenizer` default
    to settings.model; a model passed in is trained in place (a LoRA adapter is merged into it).
    Every rank calls it with the same rows (the trainer shards them); the
    trainer's logs reach `reporter` as they come.
    """
    import torch
    from trl import SFTConfig, SFTTrainer

    from gpuscale.engines.trl_bridge import ReporterCallback, trainer_args

    if model is None:
        from gpuscale.recipes.common import load_generation_model

        loaded = load_generation_model(settings.model, ctx)
        model, tokenizer = loaded.model, loaded.tokenizer
    if settings.lora_rank == 0 and ctx.dtype != torch.float32:
        # A full fine-tune keeps fp32 master weights; the forward runs in bf16/fp16 under autocast.
        model = model.float()
    callback = ReporterCallback(reporter, ctx.world_size)
    trainer = SFTTrainer(
        model=model,
        args=trainer_args(settings, ctx, SFTConfig, completion_only_loss=True, packing=False),
        train_dataset=tokenized_dataset(rows, tokenizer),
        processing_class=tokenizer,
        peft_config=lora_config(settings),
        callbacks=[callback],
    )
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started  # used only if the trainer reports no runtime
    figures = training_figures(trainer, callback, train_seconds)
    model = trainer.model
    del trainer  # the optimizer's state goes with it
    gc.collect()
    if settings.lora_rank:
        model = model.merge_and_unload()
    return TrainedModel(model.to(ctx.dtype).eval(), figures)


def tokenized_dataset(rows: list[dict], tokenizer):
    """A `datasets.Dataset` of input_ids and completion_mask, tokenized here so that the prompt is
    exactly the generation side's (TRL would re-tokenize text prompts its own way)."""
    import datasets

    from gpuscale.data.prompts import prompt_ids

    datasets.disable_progress_bars()  # TRL's preparation passes would draw bars in the rank's log
    completions = tokenizer([row["completion"] for row in rows], add_special_tokens=False)["input_ids"]
    encoded = []
    for row, completion in zip(rows, completions):
        prompt = prompt_ids(tokenizer, row["question"])
        answer = list(completion) + [tokenizer.eos_token_id]
        encoded.append({"input_ids": prompt + answer, "completion_mask": [0] * len(prompt) + [1] * len(answer)})
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


def training_figures(trainer, callback, train_seconds: float) -> dict[str, Any]:
    """The summary's training figures: steps, mean and first/last logged loss, and the global rates
    over the trainer's own training time (its loop, without its set-up)."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    seconds = callback.final.get("train_runtime") or train_seconds
    return {
        "steps": trainer.state.global_step,
        "train_loss": callback.final.get("train_loss", sum(losses) / len(losses) if losses else None),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "train_tokens": callback.tokens_seen,
        "tokens_per_s": callback.tokens_seen / seconds if seconds > 0 else None,
        "samples_per_s": callback.final.get("train_samples_per_second"),
        "train_seconds": seconds,
    }
