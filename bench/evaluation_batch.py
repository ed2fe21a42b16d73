"""The held-out evaluation on a GPU: 64 problems a call (every recipe's evaluation until 2026-11-30)
against the batch sized from the card (recipes/shared/evaluation.py's evaluation_batch_size).

    python3 bench/evaluation_batch.py     # one GPU; the embedded model and the Qwen2.5-0.5B shape, bf16

For each model, tiny-math's test problems (MODELS: how many) are answered greedily at each batch
size with the evaluation's own code (`held_out_rows`: gpuscale's engine, uncompiled, as the recipes
call it), the two sizes taking turns, REPEATS times each after one warm-up at each; the figures are
the medians' seconds and their ratio. Greedy, both should give the same answers: how many differ is
counted (bf16 kernels may round a near-tie otherwise in a larger batch).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402

from gpuscale.data.models import load_model  # noqa: E402
from gpuscale.data.tasks import load_examples  # noqa: E402
from gpuscale.engines.distributed import RankContext, use_cuda_device  # noqa: E402
from gpuscale.recipes.shared.evaluation import CPU_EVALUATION_BATCH, evaluation_batch_size, held_out_rows  # noqa: E402
from gpuscale.runs.settings import AUTO_MEMORY_SHARE  # noqa: E402

# tiny-math: the acceptance's 2,000 test problems; the 0.5B shape: the recipes' default 500 (eval_examples).
MODELS = {"tiny-math": 2_000, "random-qwen2.5-0.5b": 500}
NEW_TOKENS, REPEATS = 256, 3

BASELINE = f"""Baseline: the evaluation as it was, {CPU_EVALUATION_BATCH} problems a call, the same code, model, dtype
(bf16), problems and answer budget; only the rows a call differ. Needs one CUDA GPU."""


def timed(model, tokenizer, examples: list[dict], ctx, batch_size: int) -> tuple[float, list[str]]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    rows = held_out_rows(model, tokenizer, examples, ctx, max_new_tokens=NEW_TOKENS, batch_size=batch_size)
    torch.cuda.synchronize()
    return time.perf_counter() - started, [row["completion"] for row in rows]


def measure(name: str, problems: int, ctx) -> dict:
    model, tokenizer = load_model(name, dtype=torch.bfloat16, device=ctx.device)
    if tokenizer is None:  # a random model: the embedded model's tokenizer shapes its prompts
        _, tokenizer = load_model("tiny-math", dtype=torch.bfloat16, device="cpu")
    examples = load_examples("tiny-math", "test", problems)
    sizes = {"batch 64": CPU_EVALUATION_BATCH,
             "card-sized": evaluation_batch_size(model, ctx, len(examples), NEW_TOKENS, AUTO_MEMORY_SHARE)}
    seconds: dict[str, list[float]] = {label: [] for label in sizes}
    answers: dict[str, list[str]] = {}
    for repeat in range(REPEATS + 1):
        for label, size in sizes.items():
            took, answers[label] = timed(model, tokenizer, examples, ctx, size)
            if repeat:  # the first of each is the warm-up
                seconds[label].append(took)
    medians = {label: statistics.median(values) for label, values in seconds.items()}
    differ = sum(a != b for a, b in zip(answers["batch 64"], answers["card-sized"]))
    figures = {"batch_sizes": sizes, "seconds": seconds, "median_seconds": medians,
               "speedup": medians["batch 64"] / medians["card-sized"], "answers_differing": differ}
    print(f"{name}: {sizes}: {medians['batch 64']:.1f} s -> {medians['card-sized']:.1f} s "
          f"({figures['speedup']:.2f}x); {differ} of {len(examples)} greedy answers differ", flush=True)
    del model
    torch.cuda.empty_cache()
    return figures


def main() -> None:
    argparse.ArgumentParser(description=__doc__ + "\n" + BASELINE,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    device = torch.device("cuda", 0)
    use_cuda_device(device)
    ctx = RankContext(0, 0, 1, device, torch.bfloat16, Path("/tmp/evaluation-batch"))
    figures = {name: measure(name, problems, ctx) for name, problems in MODELS.items()}
    write_result("generation", "evaluation-batch", {"models": MODELS, "dtype": "bfloat16",
                                                    "max_new_tokens": NEW_TOKENS, "repeats": REPEATS,
                                                    "memory_share": AUTO_MEMORY_SHARE},
                 figures, card=one_card(torch.cuda.get_device_name(0)))


if __name__ == "__main__":
    main()
