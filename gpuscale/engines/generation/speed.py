"""How fast the engine decodes: one measure for bench/generation.py and the probe's node check.

A decode step's seconds come from generate calls of N new tokens and of 1 after the same prompts, each
timed with the device synchronized before and after (wall clock: the host's launches count, as they do
for users), the medians' difference over the N - 1 steps between them (data/node_check.py's
`DecodeCalls`): the prefill and each call's own overheads cancel. Plain sampling (temperature 1, no
top-k/top-p) and no EOS, so every row decodes every step. The floor of a step is the bytes of weights it
reads (`weight_bytes_read_a_step`) at the device's copy bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gpuscale.data.node_check import DecodeCalls

from .sampling import Sampling

PLAIN_SAMPLING = Sampling(temperature=1.0)


def call_seconds(call: Callable[[], object], synchronize: Callable[[], None]) -> float:
    """Wall seconds of `call`, the device synchronized before and after."""
    synchronize()
    started = time.perf_counter()
    call()
    synchronize()
    return time.perf_counter() - started


def generate_call(engine, prompts: torch.Tensor, generator: torch.Generator | None) -> Callable[[int], None]:
    """`run(n)`: the engine's plain sampling of exactly `n` new tokens after each of `prompts` [B, P]."""

    def run(new_tokens: int) -> None:
        out = engine.generate(prompts, new_tokens, PLAIN_SAMPLING, generator=generator)
        if out.tokens.shape != (prompts.shape[0], new_tokens) or not bool(out.mask.all()):
            raise RuntimeError(f"the engine decoded {tuple(out.tokens.shape)} tokens, not {new_tokens} a row of "
                               f"{prompts.shape[0]}: a timing of decode steps needs every row to decode them all")

    return run


def decode_calls(run: Callable[[int], None], new_tokens: int, repeats: int,
                 synchronize: Callable[[], None]) -> DecodeCalls:
    """`repeats` calls of `run(new_tokens)`, then `repeats` of `run(1)`, each timed (after a warm-up the
    caller made: a first call allocates, compiles and captures)."""
    long = [call_seconds(lambda: run(new_tokens), synchronize) for _ in range(repeats)]
    short = [call_seconds(lambda: run(1), synchronize) for _ in range(repeats)]
    return DecodeCalls(new_tokens, tuple(long), tuple(short))


def engine_path(engine) -> dict:
    """How the engine's decode steps ran: CUDA graphs, a compiled step (False where compiling failed and
    the step ran uncompiled: `compile_error` says why), fused q/k/v and gate/up weights."""
    error = next(iter(engine._compile_errors().values()), None)
    return {"cuda_graphs": engine.cuda_graphs, "compiled": engine.compile and error is None,
            "compile_error": None if error is None else f"{type(error).__name__}: {error}"[:500],
            "fused_weights": engine._fused is not None}


def path_text(path: dict) -> str:
    """`compiled step, CUDA graphs, fused weights` (the engine's default on a GPU), `uncompiled step, fused
    weights` (on a CPU): `engine_path` in words, a failed compile's error after them."""
    parts = ["compiled step" if path["compiled"] else "uncompiled step"]
    parts += [name for key, name in (("cuda_graphs", "CUDA graphs"), ("fused_weights", "fused weights")) if path[key]]
    if path["compile_error"]:
        parts.append(f"compiling failed: {path['compile_error'][:200]}")
    return ", ".join(parts)


def weight_bytes_read_a_step(model) -> int:
    """Bytes of the weights one decode step reads: every parameter once (tied ones count once), but for an
    input embedding that is not also the output head (a step reads one row of it a token)."""
    unique = {p.data_ptr(): p for p in model.parameters()}
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is not None and (head is None or head.weight.data_ptr() != embeddings.weight.data_ptr()):
        unique.pop(embeddings.weight.data_ptr(), None)
    return sum(p.numel() * p.element_size() for p in unique.values())
