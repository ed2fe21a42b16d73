"""rft's generation call: the host work around the engine, timed alone at the GPU bench's shape.

    python bench/rft_call_host.py [--questions 128] [--samples 30] [--new-tokens 128] [--repeats 5]

bench/rft.py's GPU run (128 questions x 30 samples = 3,840 rows a call, 128 new tokens, the random
Qwen2.5-0.5B-shaped model prompted with tiny-math's tokenizer) spends part of each call on the host:
encoding the prompts, turning the call's token rows into lists, decoding them into texts. That work is
the same on the GPU machine's CPU as here (per row, not per FLOP), so it is timed here on token rows of
the call's shape, two kinds:
- `random model`: ids drawn over Qwen2.5's 151,936, as the bench's random model samples them: almost
  none is in the stand-in tokenizer's 512, so the texts are nearly empty and the filtering is the work;
- `in vocabulary`: ids under 512, every one decoded, as a trained model's answers would be.
Each piece is the best of --repeats; the rows are host tensors (the device-to-host copy is left out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import write_result  # noqa: E402

QWEN_VOCABULARY = 151_936

BASELINE = """Baseline: the same call's host work as it was done before (tree f7dc78b): each prompt encoded
alone (`prompt_ids`), each row's tokens taken by its own mask (`Generation.sequences`, row by row), its EOS
and unknown ids dropped in a Python loop over every id, the texts through `tokenizer.batch_decode`
(transformers decodes row by row in Python). Against it, the host work now: the prompts encoded as one
batch, the rows filtered as tensors, one selection and one `tolist` for the call, the texts in one
call of the Rust tokenizer."""


def best_seconds(work, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def before(tokens, mask, tokenizer, eos, questions):
    """The call's host work as it was (tree f7dc78b)."""
    from gpuscale.data.prompts import prompt_ids

    def tokenize():
        return [prompt_ids(tokenizer, question) for question in questions]

    def texts():
        rows = [row[keep].tolist() for row, keep in zip(tokens, mask)]
        known, ends = len(tokenizer), set(eos)
        return tokenizer.batch_decode([[t for t in row if t not in ends and t < known] for row in rows],
                                      skip_special_tokens=True)

    return tokenize, texts


def after(tokens, mask, tokenizer, eos, questions):
    """The call's host work now (recipes/rft/generate.py)."""
    from gpuscale.data.prompts import prompts_ids
    from gpuscale.recipes.rft.generate import SampledCall

    sampled = SampledCall(tokens, mask)
    return (lambda: prompts_ids(tokenizer, questions)), (lambda: sampled.texts(tokenizer, eos))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=128, help="questions a call")
    parser.add_argument("--samples", type=int, default=30, help="samples a question")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens a row (every row runs to the budget)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: bench/results/rft/call-host-<date>-cpu.json")
    args = parser.parse_args()

    import torch

    from gpuscale.data.tasks import load_examples
    from gpuscale.recipes.shared.models import load_generation_model

    torch.set_num_threads(1)  # the rank's host work is one thread's
    loaded = load_generation_model("tiny-math", SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))
    questions = [example["question"] for example in load_examples("tiny-math", "train", args.questions)]
    shape = (args.questions * args.samples, args.new_tokens)
    generator = torch.Generator().manual_seed(args.seed)
    figures = {}
    for kind, vocabulary in (("random_model", QWEN_VOCABULARY), ("in_vocabulary", len(loaded.tokenizer))):
        tokens = torch.randint(2, vocabulary, shape, generator=generator)  # 0 and 1: tiny-math's pad and EOS
        mask = torch.ones(shape, dtype=torch.bool)
        for version, pieces in (("before", before), ("after", after)):
            tokenize, texts = pieces(tokens, mask, loaded.tokenizer, loaded.eos, questions)
            seconds = {"tokenize": best_seconds(tokenize, args.repeats), "texts": best_seconds(texts, args.repeats)}
            figures[f"{kind}_{version}"] = seconds
            print(f"{kind:13} {version:6}: " + " · ".join(f"{piece} {1e3 * s:.1f} ms" for piece, s in seconds.items())
                  + f" · total {1e3 * sum(seconds.values()):.1f} ms", flush=True)
        old, new = (pieces(tokens, mask, loaded.tokenizer, loaded.eos, questions) for pieces in (before, after))
        figures[f"{kind}_same_results"] = all(o() == n() for o, n in zip(old, new))
    write_result("rft", "call-host", vars(args), figures, out=args.out, card="cpu")


if __name__ == "__main__":
    main()
