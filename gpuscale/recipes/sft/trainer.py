"""A rank's work in SFT: evaluate, train with TRL's SFTTrainer (recipes/shared/training.py's shell), save the
trained model, evaluate again."""

from __future__ import annotations

from gpuscale.recipes.sft import Settings


def run_sft(settings: Settings, ctx, reporter) -> None:
    from gpuscale.recipes.shared.evaluation import held_out_evaluation, save_then_evaluate
    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.summary import summary_opening
    from gpuscale.recipes.shared.training import train_sft
    from gpuscale.recipes.shared.training_data import sft_rows, training_and_eval_examples

    train, held_out = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    model, tokenizer = loaded.model, loaded.tokenizer

    def evaluate(model, when: str) -> dict:
        return held_out_evaluation(model, tokenizer, held_out, ctx, when, max_new_tokens=settings.max_new_tokens,
                                   memory_share=settings.gpu_memory_share, seed=settings.seed)

    summary = {**summary_opening(ctx, settings, train=train, held_out=held_out), **evaluate(model, "before")}
    if ctx.is_main:
        reporter.summary(summary, partial=True)
    trained = train_sft(sft_rows(train), settings, ctx, reporter, model=model, tokenizer=tokenizer)
    save_then_evaluate(trained, tokenizer, ctx, settings, reporter, summary, lambda: evaluate(trained.model, "after"))
