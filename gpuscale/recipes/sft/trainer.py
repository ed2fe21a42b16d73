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
    from gpuscale.data.models import load_model

    train, test = training_and_test_examples(settings)
    model, tokenizer = load_model(settings.model, dtype=ctx.dtype, device=ctx.device)
    tokenizer = tokenizer or stand_in_tokenizer(settings.model)
    before = evaluate(model, tokenizer, test, ctx, settings.max_new_tokens, seed=settings.seed)
    trained = train_sft(sft_rows(train), settings, ctx, reporter, model=model, tokenizer=tokenizer)
    after = evaluate(trained.model, tokenizer, test, ctx, settings.max_new_tokens, seed=settings.seed)
    model_dir = save_model(trained.model, tokenizer, ctx) if settings.save_model else None
    if ctx.is_main:
        summary = {"world_size": ctx.world_size, "dtype": str(ctx.dtype).removeprefix("torch."),
                   "train_examples": len(train), "eval_examples": len(test), **trained.figures}
        summary.update({name.replace("accuracy", "accuracy_before", 1): v for name, v in before.items()})
        summary.update({name.replace("accuracy", "accuracy_after", 1): v for name, v in after.items()})
        summary["model_dir"] = str(model_dir) if model_dir else None
        reporter.summary(summary)


def stand_in_tokenizer(model_name: str):
    """Random models (speed measurements at a real model's shape) have no tokenizer: they are
    trained with tiny-math's, whose ids fit every random model's vocabulary."""
    from transformers import AutoTokenizer

    from gpuscale.data.models import RANDOM_CONFIGS, model_path

    if model_name not in RANDOM_CONFIGS:
        raise ValueError(f"model: {model_name!r}: SFT needs a model with a tokenizer")
    return AutoTokenizer.from_pretrained(model_path("tiny-math"), local_files_only=True)


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
    to settings.model. Every rank calls it with the same rows (the trainer shards them); the
    trainer's logs reach `reporter` as they come.
    """
    import torch
    from trl import SFTConfig, SFTTrainer

    from gpuscale.engines.trl_bridge import ReporterCallback, trainer_args

    if model is None:
        from gpuscale.data.models import load_model

        model, tokenizer = load_model(settings.model, dtype=ctx.dtype, device=ctx.device)
        tokenizer = tokenizer or stand_in_tokenizer(settings.model)
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
    train_seconds = time.perf_counter() - started
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
    from datasets import Dataset

    from gpuscale.data.prompts import prompt_ids

    completions = tokenizer([row["completion"] for row in rows], add_special_tokens=False)["input_ids"]
    encoded = []
    for row, completion in zip(rows, completions):
        prompt = prompt_ids(tokenizer, row["question"])
        answer = list(completion) + [tokenizer.eos_token_id]
        encoded.append({"input_ids": prompt + answer, "completion_mask": [0] * len(prompt) + [1] * len(answer)})
    return Dataset.from_list(encoded)


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
    """The summary's training figures: steps, mean and first/last logged loss, global tokens/s."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens = callback.tokens_seen
    return {
        "steps": trainer.state.global_step,
        "train_loss": callback.final.get("train_loss", sum(losses) / len(losses) if losses else None),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "train_tokens": tokens,
        "tokens_per_s": tokens / train_seconds if train_seconds > 0 else None,
        "samples_per_s": callback.final.get("train_samples_per_second"),
        "train_seconds": train_seconds,
    }


# ---- evaluation and saving -----------------------------------------------------------------------


def evaluate(model, tokenizer, examples: list[dict], ctx, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, batch_size: int = 64) -> dict[str, float | None]:
    """Accuracy on `examples`, sharded over the ranks and gathered on every rank: {"accuracy": ...,
    "accuracy_<domain>": ...} (accuracy None without examples). Greedy unless a temperature is given.
    The model's train/eval mode is left as it was."""
    import torch

    from gpuscale.data.answers import is_correct
    from gpuscale.data.prompts import eos_token_ids, pad_token_id, prompt_ids
    from gpuscale.data.tasks import gold_answer
    from gpuscale.engines.generation import GenerationEngine, Sampling

    was_training = model.training
    eos = eos_token_ids(model, tokenizer)
    # No torch.compile: a few hundred answers do not repay tens of seconds of compiling.
    engine = GenerationEngine(model, eos, pad_token_id=pad_token_id(tokenizer, eos), compile=False)
    generator = torch.Generator(device=ctx.device).manual_seed(seed * 1000 + ctx.rank)
    mine, results = ctx.shard(examples), []
    for start in range(0, len(mine), batch_size):
        batch = mine[start : start + batch_size]
        prompts = [prompt_ids(tokenizer, example["question"]) for example in batch]
        generation = engine.generate(prompts, max_new_tokens, Sampling(temperature=temperature), generator)
        for example, tokens in zip(batch, generation.sequences()):
            text = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
            results.append((example.get("domain"), is_correct(text, gold_answer(example))))
    del engine
    model.train(was_training)
    return accuracy_figures([r for rank in ctx.gather(results) for r in rank])


def accuracy_figures(results: list[tuple[str | None, bool]]) -> dict[str, float | None]:
    figures: dict[str, float | None] = {"accuracy": sum(ok for _, ok in results) / len(results) if results else None}
    for domain in sorted({d for d, _ in results if d}):
        mine = [ok for d, ok in results if d == domain]
        figures[f"accuracy_{domain}"] = sum(mine) / len(mine)
    return figures


def save_model(model, tokenizer, ctx):
    """Rank 0 writes the model and its tokenizer to RUN_DIR/model (loadable with `--model` that
    path); returns the directory on every rank."""
    directory = ctx.run_dir / "model"
    if ctx.is_main:
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
    return directory
