"""Is `method=reference` the users' code at its best? Times it against the public code's structure, in
one process, on the same model, prompts and settings.

    python bench/reference_parity.py --model random-qwen2.5-0.5b --device cuda --precision bf16 \
        --max-new-tokens 256 --blocks 4 --mcmc-steps 3 --problems 3

`gpuscale` is `power_sample_reference` (mcmc.py), which the recipe runs for `method=reference`.
`public structure` is written here from the paper's public code's description (Karan & Du,
reasoning-with-sampling, `mcmc_power_samp`): one `generate()` per block and per MCMC step, HF's default
sampling knobs (top_k 50), `output_scores` and `output_logits`, log q from a log_softmax of the scores
and alpha * log p from a log_softmax of the logits, cut point drawn with `random`, acceptance with
numpy; its quirks (truncated suffixes, no cut-point term) are kept, since only its speed is measured
here. The two alternate problem by problem, so drift of the machine hits both alike. Figures: seconds
per problem, decoded tokens, ms per decoded token (the fair one when EOS ends answers at different
lengths), and the ratio of the two.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpuscale.data.models import load_model
from gpuscale.data.prompts import eos_token_ids, pad_token_id, prompt_ids
from gpuscale.data.tasks import load_examples
from gpuscale.recipes.power_sampling.mcmc import PowerSamplingStats, power_sample_reference
from gpuscale.recipes.shared.models import stand_in_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402


def public_suffix(model, context: list[int], new_tokens: int, alpha: float, eos: int):
    """One generate() call as the public code makes it; (whole sequence, log q, alpha * log p)."""
    ids = torch.tensor([context], device=model.device)
    out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=True, temperature=1 / alpha,
                         eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True,
                         output_scores=True, output_logits=True)
    raw, scaled = torch.stack(out.logits, dim=0), torch.stack(out.scores, dim=0)
    tokens = out.sequences[0][len(context):]
    index = tokens.view(-1, 1, 1)
    target = (alpha * torch.log_softmax(raw, -1).gather(-1, index)).view(-1).tolist()
    proposal = torch.log_softmax(scaled, -1).gather(-1, index).view(-1).tolist()
    return out.sequences[0].tolist(), proposal, target


def public_structure(model, prompt: list[int], alpha: float, max_new_tokens: int, blocks: int, steps: int,
                     eos: int, counts: dict) -> list[int]:
    start, sequence, log_q, log_target = len(prompt), list(prompt), [], []
    block = max_new_tokens // blocks
    for _ in range(blocks):
        sequence, q, target = public_suffix(model, sequence, block, alpha, eos)
        log_q, log_target = log_q + q, log_target + target
        counts["tokens"] += len(q)
        for _ in range(steps):
            length = len(sequence)
            cut = random.randint(start, length - 1)
            proposal, q, target = public_suffix(model, sequence[:cut], length - cut, alpha, eos)
            counts["tokens"] += len(q)
            end = len(proposal)
            log_r = (sum(target) + sum(log_q[cut - start : end - start])
                     - sum(log_target[cut - start : end - start]) - sum(q))
            if np.random.rand() < np.exp(log_r):
                sequence = proposal
                log_q[cut - start :], log_target[cut - start :] = q, target
        if eos in sequence[start:]:
            return sequence[start : sequence.index(eos, start) + 1]
    return sequence[start:]


BASELINE = """Baseline: the public code's structure (`public structure` above), written here from the paper's code's
description: transformers generate() in eager mode with its default dynamic cache, HF's default sampling
knobs, output_scores and output_logits. Not put at its best beyond that structure (no StaticCache, no
torch.compile); gpuscale's `method=reference` runs the same way."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__ + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-math")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--mcmc-steps", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=4.0)
    parser.add_argument("--problems", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=None, help="default: "
                        "bench/results/power_sampling/reference-parity-<model>-<date>-<card>.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, dtype=args.precision, device=device)
    tokenizer = tokenizer or stand_in_tokenizer(args.model)
    eos = eos_token_ids(model, tokenizer)
    pad = pad_token_id(tokenizer, eos)
    prompts = [prompt_ids(tokenizer, e["question"]) for e in load_examples("tiny-math", "test", args.problems)]
    settings = (args.alpha, args.max_new_tokens, args.blocks, args.mcmc_steps)

    def gpuscale(prompt, counts, settings=settings):
        stats = PowerSamplingStats()
        power_sample_reference(model, prompt, *settings, eos, pad, stats)
        counts["tokens"] += stats.decoded_tokens

    def public(prompt, counts, settings=settings):
        public_structure(model, prompt, *settings, eos[0], counts)

    runs = {"gpuscale": gpuscale, "public structure": public}
    for run in runs.values():  # warm-up (kernels, allocator, cuBLAS): a short answer each
        run(prompts[0], {"tokens": 0}, (args.alpha, 8, 2, 1))
    figures = {name: {"seconds": [], "tokens": []} for name in runs}
    for number, prompt in enumerate(prompts):
        for name, run in runs.items():
            random.seed(number), np.random.seed(number), torch.manual_seed(number)
            counts = {"tokens": 0}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            run(prompt, counts)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            figures[name]["seconds"].append(time.perf_counter() - started)
            figures[name]["tokens"].append(counts["tokens"])
    print(f"{args.model} on {device} ({next(model.parameters()).dtype}), {len(prompts)} problems, "
          f"max_new_tokens {args.max_new_tokens}, {args.blocks} blocks, {args.mcmc_steps} steps, alpha {args.alpha}")
    for name, f in figures.items():
        f["s_per_problem"] = statistics.mean(f["seconds"])
        f["ms_per_token"] = 1000 * sum(f["seconds"]) / max(1, sum(f["tokens"]))
        print(f"  {name:<17} {f['s_per_problem']:8.3f} s/problem  {sum(f['tokens']):7d} tokens  "
              f"{f['ms_per_token']:7.2f} ms/token")
    ratio = figures["gpuscale"]["ms_per_token"] / figures["public structure"]["ms_per_token"]
    print(f"  gpuscale / public structure, per decoded token: {ratio:.3f}")
    write_result("power_sampling", f"reference-parity-{args.model}", vars(args),
                 {"device": str(device), "runs": figures, "ratio": ratio}, out=args.out,
                 card=one_card(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu")


if __name__ == "__main__":
    main()
