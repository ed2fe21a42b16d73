"""A rank's work in grpo-mtl: evaluate, train with TRL's GRPOTrainer over the domains (recipes/shared/training.py's
shell), save the trained model, evaluate again.

The trainer itself (TRL's GRPOTrainer with domain ids, generation timing and PCGrad) is in
multitask.py; this module builds it from the settings and turns its logs into the run's summary.
"""

from __future__ import annotations

import os
from typing import Any

from gpuscale.recipes.grpo_mtl import Settings, accumulation_steps
from gpuscale.recipes.grpo_mtl.data import domain_shares, domains_of, grpo_rows, training_and_eval_examples
from gpuscale.runs.settings import SettingsError


def run_grpo_mtl(settings: Settings, ctx, reporter) -> None:
    from gpuscale.engines.placement import generators_released

    with generators_released(ctx):  # with generation_gpus: the generators end with this work, however it ends
        train_and_evaluate(settings, ctx, reporter)


def train_and_evaluate(settings: Settings, ctx, reporter) -> None:
    from gpuscale.recipes.shared.evaluation import save_then_evaluate
    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.summary import summary_opening

    train, held_out = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    model, tokenizer = loaded.model, loaded.tokenizer
    rows, dropped = grpo_rows(train, tokenizer, settings.max_prompt_length)
    check_rows_left(len(rows), dropped, settings)
    settings = with_card_sized_batch(settings, ctx, model)
    summary = {**summary_opening(ctx, settings, train=rows, held_out=held_out), "batch_size": settings.batch_size,
               "generator": settings.generator, "mtl": settings.mtl, **rollout_summary(settings),
               "domains": domains_of(rows), **domain_shares(rows),
               "prompts_too_long": dropped, **evaluate(model, tokenizer, held_out, settings, ctx, "before")}
    if ctx.is_main:
        reporter.summary(summary, partial=True)
    trained = train_grpo(rows, settings, ctx, reporter, model, tokenizer)
    save_then_evaluate(trained, tokenizer, ctx, settings, reporter, summary,
                       lambda: evaluate(trained.model, tokenizer, held_out, settings, ctx, "after"))


def with_card_sized_batch(settings: Settings, ctx, model) -> Settings:
    """The settings with `batch_size` auto resolved on the rank: the largest divisor of the rank's
    completions per step that fits its share of the card (engines/training_memory.py, the arithmetic
    sft's micro-batch is cut by, at max_prompt_length + max_completion_length tokens a completion;
    8 on CPU), the same on every rank (`agreed_micro_batch`)."""
    if settings.batch_size is None:
        from gpuscale.recipes.grpo_mtl import rank_share
        from gpuscale.recipes.shared.card_sized_micro_batch import agreed_micro_batch, fitted_micro_batch
        from gpuscale.recipes.shared.training_settings import AUTO_STEP_ROWS

        share = rank_share(settings, ctx.world_size)
        columns = settings.max_prompt_length + settings.max_completion_length
        if ctx.device.type != "cuda":
            micro, reason = min(AUTO_STEP_ROWS, share), "the CPU default"
        else:
            micro, reason = fitted_micro_batch(settings, ctx, model, share, columns)
        micro = agreed_micro_batch(share, micro, ctx)
        print(f"batch_size auto: {micro} completions a micro-batch ({reason}); --batch-size N sets it", flush=True)
        settings = settings.model_copy(update={"batch_size": micro})
    return settings


def rollout_summary(settings: Settings) -> dict[str, Any]:
    """How the run sampled: `rollout`, and with async its `max_staleness`, `generation_gpus` and `old_logprobs`."""
    if settings.rollout != "async":
        return {"rollout": settings.rollout}
    return {"rollout": settings.rollout, "max_staleness": settings.max_staleness,
            "generation_gpus": settings.generation_gpus, "old_logprobs": settings.old_logprobs}


def check_rows_left(kept: int, dropped: int, settings: Settings) -> None:
    """Every optimizer step takes prompts_per_step distinct prompts: with fewer rows left once the
    prompts longer than max_prompt_length are left out, TRL's data loader yields no whole step and the
    run would end at once with 0 steps as if it had succeeded. The prompts' lengths are known only
    once the tokenizer is loaded, so this is the rank's refusal, one line, before anything is trained
    or evaluated (recipe.check refuses too few examples before launch, counted before this cut)."""
    if kept >= settings.prompts_per_step:
        return
    needed = settings.prompts_per_step
    if not dropped:
        raise SettingsError(f"prompts_per_step: {needed}: needs at least {needed} training examples, the run has "
                            f"{kept}; lower prompts_per_step or give more examples")
    raise SettingsError(
        f"max_prompt_length: {settings.max_prompt_length}: {dropped} of {kept + dropped} training prompts are "
        f"longer, leaving {kept}, fewer than prompts_per_step ({settings.prompts_per_step}); raise "
        "max_prompt_length or lower prompts_per_step")


def evaluate(model, tokenizer, examples: list[dict], settings: Settings, ctx, when: str) -> dict[str, float | None]:
    """Held-out accuracy, overall and per domain, greedy and sampled at temperature 1, strict answers:
    `accuracy_greedy[_<domain>]_<when>`, `accuracy_sampled[_<domain>]_<when>`."""
    from gpuscale.recipes.shared.evaluation import held_out_evaluation

    return held_out_evaluation(model, tokenizer, examples, ctx, when, max_new_tokens=settings.max_completion_length,
                               memory_share=settings.gpu_memory_share, seed=settings.seed)


# ---- training ------------------------------------------------------------------------------------


def train_grpo(rows: list[dict], settings: Settings, ctx, reporter, model, tokenizer):
    """GRPO on `rows` ({"prompt", "answer", "domain"}, the same on every rank: the trainer shards them),
    in the training shell; a `TrainedModel`."""
    from gpuscale.recipes.grpo_mtl.multitask import StepClock
    from gpuscale.recipes.shared.training import train_model

    clock = None

    def build(model):
        nonlocal clock
        trainer, callback = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
        clock = StepClock(trainer)
        trainer.add_callback(clock)
        return trainer, callback

    def more_figures(trainer, callback, seconds: float) -> dict[str, Any]:
        return {**grpo_figures(trainer, callback, seconds, ctx), **per_step_figures(clock)}

    # GRPO's loss hovers near 0 whatever the policy (the advantages are centred): where training stands
    # is its reward, which a resumed run's first steps are checked against (runs/resume_check.py).
    return train_model(build, settings, ctx, model, more_figures, resume_figure="reward")


def build_trainer(rows: list[dict], settings: Settings, ctx, reporter, model, tokenizer):
    """(MultiTaskGRPOTrainer, its ReporterCallback) for the run's settings."""
    import datasets
    from trl import GRPOConfig

    from gpuscale.data.prompts import eos_token_ids
    from gpuscale.data.rewards import RewardRouter, parse_reward_weights
    from gpuscale.engines.reporter import injected_fault
    from gpuscale.engines.trl_bridge import ReporterCallback, trainer_args
    from gpuscale.recipes.grpo_mtl.generations import GenerationKeeper, GenerationNotes
    from gpuscale.recipes.grpo_mtl.multitask import MultiTaskGRPOTrainer
    from gpuscale.recipes.shared.training import apply_liger_kernels, card_name, lora_config

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" warning
    datasets.disable_progress_bars()
    domains = domains_of(rows)
    weights, per_domain = parse_reward_weights(settings.reward_weights)
    router = RewardRouter(weights, per_domain)
    args = trainer_args(
        settings, ctx, GRPOConfig,
        num_generations=settings.num_generations,
        gradient_accumulation_steps=accumulation_steps(settings, ctx.world_size),
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        beta=settings.beta,
        entropy_coef=settings.entropy_coef,
        loss_type=settings.loss_type,
        reward_weights=router.reward_weights(domains),
        use_transformers_continuous_batching=settings.generator == "continuous",
        # rollout=async: TRL's correction of the sampler's policy, token by token, truncated at its cap
        # (engines/off_policy.py); read only once the trainer turns it on.
        vllm_importance_sampling_mode="token_truncate",
        transformers_continuous_batching_config=continuous_cache_on_cpu(settings, ctx),
        # PCGrad differentiates each domain's loss separately; checkpointing would recompute per domain.
        activation_checkpointing=False,
        torch_compile=False,  # `compile` is the engine's (its decode step), not the training forward's
        remove_unused_columns=False,
        log_completions=False,
    )
    print(f"speed: liger kernels {apply_liger_kernels(model, ctx, settings.liger_kernels)}", flush=True)
    is_async = settings.rollout == "async"
    rollout = trainer_rollout(settings, ctx, tokenizer) if settings.generator == "engine" else None
    callback = ReporterCallback(reporter, ctx.world_size, flops_per_token=grpo_flops_per_token(model, settings),
                                card=card_name(ctx))
    reward_funcs = router.reward_funcs(domains)
    nan_from = injected_fault("nan_reward", ctx.rank)
    if nan_from is not None:
        reward_funcs = [NanFrom(function, nan_from) for function in reward_funcs]
    # The generations' domain and truncation (a completion at the cap that did not end with EOS).
    reward_funcs[0] = GenerationNotes(reward_funcs[0], settings.max_completion_length, eos_token_ids(model, tokenizer))
    trainer = MultiTaskGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=lora_config(settings),
        callbacks=[callback],
        rollout_func=rollout,
        domains=domains,
        mtl=settings.mtl,
        mtl_seed=settings.seed,
        off_policy=is_async,
        old_logprobs=settings.old_logprobs if is_async else "loss",  # read only by rollout=async
    )
    trainer.add_callback(GenerationKeeper(trainer, ctx.run_dir))  # RUN_DIR/generations.jsonl, rank 0
    if is_async:
        trainer.add_callback(rollout)  # its thread ends with the training
    return trainer, callback


def engine_rollout(settings: Settings, tokenizer, own_weights: bool = False):
    """The engine's rollout at the run's settings (a generator's decodes with the same)."""
    from gpuscale.engines.rollout import EngineRollout

    return EngineRollout(tokenizer, settings.max_completion_length, settings.temperature, seed=settings.seed,
                         max_columns=settings.max_prompt_length + settings.max_completion_length,
                         compile=settings.compile, own_weights=own_weights)


def trainer_rollout(settings: Settings, ctx, tokenizer):
    """The trainer's `rollout_func` on gpuscale's engine: the engine itself (rollout=sync), or the async
    rollout on the rank's own engine, or with generation_gpus on the generators (engines/placement.py)."""
    from gpuscale.engines.async_rollout import AsyncEngineRollout, LocalSampler
    from gpuscale.engines.placement import Link, RemoteSampler

    if settings.rollout != "async":
        return engine_rollout(settings, tokenizer)
    if settings.generation_gpus:
        sampler = RemoteSampler(engine_rollout(settings, tokenizer), Link(ctx))
    else:
        sampler = LocalSampler(engine_rollout(settings, tokenizer, own_weights=True))
    return AsyncEngineRollout(sampler, settings.max_staleness)


def generate_for_trainers(settings: Settings, ctx, reporter) -> None:
    """A generator rank's work (generation_gpus; engines/placement.py): the model loaded, then the
    training ranks' prompts decoded from the weights they send, until their training ends."""
    from gpuscale.engines import preemption
    from gpuscale.engines.placement import Link, serve
    from gpuscale.recipes.shared.models import load_generation_model

    # Ended by the trainers alone: SLURM's signal leaves it serving until they end (engines/placement.py).
    with preemption.cooperating():
        loaded = load_generation_model(settings.model, ctx)
        jobs = serve(Link(ctx), engine_rollout(settings, loaded.tokenizer), loaded.model, reporter)
    print(f"generation: served {jobs} jobs for training ranks "
          f"{', '.join(map(str, range(ctx.rank - ctx.world_size, ctx.world_size, ctx.side_ranks)))}", flush=True)


class NanFrom:
    """A reward function that returns NaN for its rows from optimizer step `step` on: the fault
    GPUSCALE_INJECT_FAULT=RANK:nan_reward:STEP injects, to test that a NaN reward fails the run."""

    def __init__(self, function, step: int):
        self.function, self.step, self.__name__ = function, step, function.__name__

    def __call__(self, *args, trainer_state=None, **kwargs):
        values = self.function(*args, trainer_state=trainer_state, **kwargs)
        if trainer_state is not None and trainer_state.global_step + 1 >= self.step:
            return [None if value is None else float("nan") for value in values]
        return values


def continuous_cache_on_cpu(settings: Settings, ctx) -> dict | None:
    """generator=continuous on CPU: a paged cache of what a step's sequences can fill (each prompt's
    completions at their longest, in pages of transformers' 256 tokens). transformers sizes it otherwise
    by the device's free memory, which on CPU is the machine's RAM: TRL's half of it, allocated at every
    generation call (~4.5 s a call on a 23 GB machine, for a few tiny sequences). GPUs keep TRL's rule."""
    if settings.generator != "continuous" or ctx.device.type != "cpu":
        return None
    pages_per_sequence = -(-(settings.max_prompt_length + settings.max_completion_length) // 256)
    return {"num_blocks": settings.prompts_per_step * settings.num_generations * pages_per_sequence}


def grpo_figures(trainer, callback, seconds: float, ctx) -> dict[str, Any]:
    """GRPO's figures beside the shell's: the generation/training split of the time, MFU over the
    whole training time (generation included: the share of the card the update's FLOPs use) where
    the card's peak is known, the policy mismatch at the start and the end, and each domain's
    training reward at the start and the end."""
    from gpuscale.engines.off_policy import CLIPPED_SHARE, STALENESS
    from gpuscale.engines.policy_mismatch import MISMATCH_FIGURES

    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    tokens = callback.tokens_seen
    generation = trainer.generation_seconds
    figures = {
        "generation_seconds": generation,
        "training_seconds": max(seconds - generation, 0.0),
        "generation_share": generation / seconds if seconds > 0 else None,
        "mfu": callback.mfu_of(tokens / seconds if seconds > 0 else None),
    }
    for key in ("reward", "completions/mean_length", "entropy", "kl", "pcgrad/conflict_share", *MISMATCH_FIGURES,
                STALENESS, CLIPPED_SHARE):
        figures.update(first_and_last(history, key))
    for domain in trainer.domains:
        figures.update(first_and_last(history, f"rewards/correctness_{domain}/mean", f"train_accuracy_{domain}"))
    return figures


def per_step_figures(clock) -> dict[str, float | None]:
    """Medians over the optimizer steps, the first left out when there are more (it builds the
    optimizer's state and the engine's buffers, captures graphs): the step's wall time, its
    generation part and the rest (scoring, the loss's forward and backward, the optimizer step)."""
    import statistics

    steps = list(zip(clock.step_seconds, clock.generation_seconds))
    typical = steps[1:] or steps
    if not typical:
        return {"step_seconds_median": None, "generation_seconds_per_step": None, "training_seconds_per_step": None}
    return {"step_seconds_median": statistics.median(step for step, _ in typical),
            "generation_seconds_per_step": statistics.median(generation for _, generation in typical),
            "training_seconds_per_step": statistics.median(step - generation for step, generation in typical)}


def first_and_last(history: list[dict], key: str, name: str | None = None, window: int = 10) -> dict[str, float]:
    """The mean of a logged figure over the first and the last `window` logs holding it (fewer if
    the run logged it fewer than 2 x window times): {name_first, name_last}; {} if never logged."""
    import math

    values = [entry[key] for entry in history
              if isinstance(entry.get(key), (int, float)) and not math.isnan(entry[key])]
    if not values:
        return {}
    width = max(1, min(window, len(values) // 2))
    name = name or key.replace("/", "_")
    return {f"{name}_first": sum(values[:width]) / width, f"{name}_last": sum(values[-width:]) / width}


def grpo_flops_per_token(model, settings: Settings) -> float:
    """Training FLOPs of a token of the update (data/cards.py), a token attending on average to half
    of a full-length prompt and completion."""
    from gpuscale.data.cards import model_flops_shape, training_flops_per_token

    matmul, layers, width = model_flops_shape(model.config)
    return training_flops_per_token(matmul, layers, width,
                                    (settings.max_prompt_length + settings.max_completion_length) / 2)
