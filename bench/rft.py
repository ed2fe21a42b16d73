"""RFT: generated samples/s of gpuscale's generation against the seed's structure, and SFT tokens/s
on 1 and on N GPUs, from real `gpuscale run --recipe rft` runs.

    python bench/rft.py [--gpus 2] [--model random-qwen2.5-0.5b] [--questions 64]

1. Generation: two runs at the same settings (30 samples per question at temperature 0.7, 8
   questions per call, the same questions and length budget, one GPU): `generator=gpuscale` (the
   generation engine: one prefill per question shared by its samples, CUDA graphs) and
   `generator=transformers` (`model.generate` with `num_return_sequences`, the seed's datagen.py).
   The figures are the run summaries' `samples_per_s` (all calls) and `samples_per_s_steady`
   (without each rank's first call, which captures graphs / compiles), and where a call's seconds
   go (`call_split`, mean seconds of the calls after the first, `first_call_split` of the first):
   tokenize (the prompts), prefill and decode (gpuscale only: the device's time between CUDA events
   around them, no sync added), results (the rest of the sampler's call: the engine's host
   preparation, the prefill's KV copied to the samples' rows, the rows assembled and copied to the
   host; for transformers `generate`, its whole generate() call), texts (the answers decoded) and
   filter (scoring, keeping, writing; outside samples/s). A GPU card's host work per row is the
   CPU's: bench/rft_call_host.py times it alone.
2. Training: the gpuscale run's kept set is reused (`data_from`) for a fixed number of SFT steps on
   1 GPU and on --gpus GPUs, same per-device batch; tokens/s is the summary's (the trainer's own
   count over its training time) and MFU = 6 x parameters x tokens/s / (GPUs x peak), the card's
   dense bf16 peak from gpuscale/data/cards.py, attention's share of the FLOPs left out (short
   sequences).

A random model (`random-qwen2.5-0.5b`, the shape of Qwen2.5-0.5B) answers noise, so no sample is
correct: the runs set include_gold=true so that there is a set to train on; its speed is what counts.
On CPU (the script's own test) pass `--model tiny-math --gpus 2` and small sizes; the ranks are
then CPU processes and there is no MFU (none either on a card cards.py does not know).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from benchruns import RunFailed, gpuscale_run  # noqa: E402
from record import card, write_result  # noqa: E402

from gpuscale.data.cards import mfu as card_mfu  # noqa: E402  (no torch)


def rft_run(args, gpus: int, *settings: str) -> dict:
    """One `gpuscale run --recipe rft` to its end (benchruns.py's); a run that did not succeed ends the
    script with its status and error, its rank's log printed (a hung run's stacks are in its folder)."""
    arguments = ["--recipe", "rft", "--gpus", str(gpus), "--model", args.model, "--dataset", args.dataset,
                 "--set", f"seed={args.seed}", "--set", "eval_examples=0", "--set", "save_model=false",
                 "--set", "include_gold=true", "--set", f"max_new_tokens={args.max_new_tokens}",
                 "--set", f"max_length={args.max_length}", "--set", f"precision={args.precision}"]
    for setting in settings:
        arguments += ["--set", setting]
    try:
        return gpuscale_run(arguments)
    except RunFailed as error:
        raise SystemExit(str(error)) from None


def generation(args, generator: str, batch_size: int) -> dict:
    run = rft_run(args, 1, f"generator={generator}", f"max_examples={args.questions}",
                       f"samples_per_question={args.samples}", f"batch_size={batch_size}",
                       f"temperature={args.temperature}", f"compile={str(args.compile and generator == 'gpuscale')}",
                       "max_steps=1", "train_batch_size=1")
    s = run["summary"]
    print(f"  -> {generator}: {s['samples_per_s']:.1f} samples/s ({s['samples_per_s_steady'] or 0:.1f} without the "
          f"first call), {s['generated_tokens_per_s']:.0f} tokens/s, {s['generation_seconds']:.1f} s", flush=True)
    steady, first = call_split(s, "generation_call"), call_split(s, "generation_first_call")
    print("     a call after the first: " + (" · ".join(f"{piece} {seconds:.3f} s" for piece, seconds in steady.items())
                                             or "none (one call)"), flush=True)
    return {"run": run["id"], **{key: s.get(key) for key in (
        "samples_per_s", "samples_per_s_steady", "generated_tokens_per_s", "generation_seconds", "generated_samples",
        "sample_accuracy", "kept_examples")}, "call_split": steady, "first_call_split": first}


def call_split(summary: dict, prefix: str) -> dict:
    """piece -> seconds of the summary's `<prefix>_<piece>_seconds` (rft's trainer.py: call_split_figures)."""
    return {key.removeprefix(prefix + "_").removesuffix("_seconds"): value for key, value in summary.items()
            if key.startswith(prefix + "_") and key.endswith("_seconds")}


def training(args, gpus: int, data_from: int, parameters: int, card_name: str | None) -> dict:
    run = rft_run(args, gpus, f"data_from={data_from}", f"max_steps={args.train_steps}",
                       f"train_batch_size={args.train_batch_size}", f"learning_rate={args.learning_rate}",
                       f"lora_rank={args.lora_rank}")
    s = run["summary"]
    mfu = card_mfu(s["tokens_per_s"] and s["tokens_per_s"] / gpus, 6 * parameters, card_name)
    mfu_text = f"MFU {100 * mfu:.2f}%" if mfu is not None else "no MFU (no card peak)"
    print(f"  -> {gpus} GPU(s): {s['tokens_per_s']:.0f} tokens/s, {mfu_text}, "
          f"{s['steps']} steps in {s['train_seconds']:.1f} s", flush=True)
    return {"run": run["id"], "gpus": gpus, "tokens_per_s": s["tokens_per_s"], "mfu": mfu,
            "train_seconds": s["train_seconds"], "steps": s["steps"], "train_tokens": s["train_tokens"]}


def model_parameters(name: str) -> int:
    from gpuscale.data.models import describe_models

    known = {row["name"]: row["parameters"] for row in describe_models()}
    if name in known and known[name]:
        return known[name]
    from gpuscale.data.models import load_model

    model, _ = load_model(name)
    return sum(p.numel() for p in model.parameters())


BASELINE = """Baseline: `generator=transformers`, the structure of the users' earlier RFT script (transformers
model.generate with num_return_sequences: eager, its default dynamic cache), a real run at the same
questions per call (--batch-size) as gpuscale's. At its best at large calls: at 3,840 rows generate()
decodes a step in half the time with its dynamic cache that it takes with a StaticCache and its own
torch.compile (bench/generation.py, results/generation/engine-vs-generate-b3840-before-*); not swept
over batch sizes (--engine-batch-size gives gpuscale, not the baseline, its own). The SFT part has no
baseline of other code: N GPUs against 1."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--dataset", default="tiny-math")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the multi-GPU training run")
    parser.add_argument("--questions", type=int, default=64, help="training questions generated for")
    parser.add_argument("--samples", type=int, default=30, help="samples per question")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--batch-size", type=int, default=8, help="questions per call (both generators)")
    parser.add_argument("--engine-batch-size", type=int, default=None,
                        help="also time gpuscale at this many questions per call (its own best)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine's decode step")
    parser.add_argument("--skip-training", action="store_true", help="time the generators only")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--train-batch-size", type=int, default=8, help="per device")
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/rft/<what>-<date>-<card>.json")
    args = parser.parse_args()
    os.environ["GPUSCALE_HOME"] = args.home or tempfile.mkdtemp(prefix="gpuscale-bench-rft-")

    results = {"generation": {}, "training": []}
    results["generation"]["gpuscale"] = engine = generation(args, "gpuscale", args.batch_size)
    results["generation"]["transformers"] = baseline = generation(args, "transformers", args.batch_size)
    if args.engine_batch_size:
        results["generation"]["gpuscale_own_batch"] = generation(args, "gpuscale", args.engine_batch_size)
    results["generation"]["speedup"] = engine["samples_per_s"] / baseline["samples_per_s"]
    results["generation"]["speedup_steady"] = (engine["samples_per_s_steady"] or 0) / (
        baseline["samples_per_s_steady"] or float("inf"))
    print(f"generation: gpuscale {results['generation']['speedup']:.1f}x transformers "
          f"({results['generation']['speedup_steady']:.1f}x without first calls)", flush=True)
    if not args.skip_training:
        parameters = model_parameters(args.model)
        results["parameters"] = parameters
        found = card()  # the visible CUDA devices the runs use
        card_name = found["names"][0] if isinstance(found, dict) else None
        for gpus in sorted({1, args.gpus}):
            results["training"].append(training(args, gpus, engine["run"], parameters, card_name))
        one, most = results["training"][0], results["training"][-1]
        results["training_scaling"] = most["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else None
        print(f"training: {args.gpus} GPUs {results['training_scaling']:.2f}x one", flush=True)
    write_result("rft", "generation-speed" if args.skip_training else "speed", vars(args), results, out=args.out)


if __name__ == "__main__":
    main()
