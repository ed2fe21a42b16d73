"""Issue 11, item 12: do the reference's generate() arguments cost time against the public code's?

    python3 bench/generate_kwargs.py     # one GPU; the Qwen2.5-0.5B shape in bf16, 96 new tokens a call

Six variants of one generate() call: the arguments `power_sample_reference` passes, those of the public
code's structure (bench/reference_parity.py), and the reference's with one difference each. The
variants take turns, 4 calls each, the first left out; the figure is ms per generated token.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from gpuscale.data.models import build_random_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, CALLS = 120, 96, 4


def variants(attention_mask: torch.Tensor) -> dict[str, dict]:
    common = dict(do_sample=True, temperature=0.25, output_logits=True, return_dict_in_generate=True)
    reference = dict(common, attention_mask=attention_mask, top_k=0, top_p=1.0, eos_token_id=[1, 2], pad_token_id=0)
    return {
        "reference": reference,
        "public": dict(common, eos_token_id=1, pad_token_id=1, output_scores=True),
        "ref, no mask": {k: v for k, v in reference.items() if k != "attention_mask"},
        "ref, top_k 50": {k: v for k, v in reference.items() if k not in ("top_k", "top_p")},
        "ref, one eos": dict(reference, eos_token_id=1, pad_token_id=1),
        "ref, no top_p": {k: v for k, v in reference.items() if k != "top_p"},
    }


BASELINE = """Baseline: the `public` variant, the generate() arguments of the public code's structure
(bench/reference_parity.py); every variant is transformers' model.generate() in eager mode with its
default dynamic cache (no StaticCache, no torch.compile), batch 1, on the same model and prompt.
Needs one CUDA GPU."""


def main() -> None:
    argparse.ArgumentParser(description=__doc__ + "\n" + BASELINE,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    model = build_random_model("random-qwen2.5-0.5b").to("cuda", torch.bfloat16).eval()
    ids = torch.randint(100, 1000, (1, PROMPT_TOKENS), device="cuda")
    calls = variants(torch.ones_like(ids))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(CALLS):
        for name, kwargs in calls.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / (out.sequences.shape[1] - PROMPT_TOKENS))
    figures = {}
    for name, seconds in times.items():
        every = [round(1000 * s, 2) for s in seconds]
        figures[name] = {"ms_per_token_median": 1000 * statistics.median(seconds[1:]), "ms_per_token_calls": every}
        print(f"  {name:<14} {figures[name]['ms_per_token_median']:6.2f} ms/token  {every}")
    write_result("power_sampling", "generate-kwargs", {"model": "random-qwen2.5-0.5b", "dtype": "bfloat16",
                                                       "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                                                       "calls": CALLS, "variants": list(calls)},
                 figures, card=one_card(torch.cuda.get_device_name(0)))


if __name__ == "__main__":
    main()
