"""torch.compile with a way back to the uncompiled function."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

# Compiled versions of the decode step kept per process (dynamo's default, 8, is reached by a test
# session or a training loop that builds several engines or changes the model's structure a few times).
RECOMPILE_LIMIT = 64


class _CompiledOrEager:
    """`fn` under torch.compile (static shapes by default); if compiling fails, `fn` itself from then
    on, with a warning.

    Compilation happens at the first call with new shapes or settings, before any compiled code
    runs (with fullgraph=False, subgraphs before a break may have run: `fn` must be safe to run again
    after a partial run, as the decode forward is: it rewrites the same KV column). Never falls back
    while a CUDA graph is being captured: a failure there is a real error. `dynamic`: torch.compile's;
    None: dynamic only in the dimensions the caller marks (`torch._dynamo.maybe_mark_dynamic`), any
    other size that changes recompiles static. Dynamo's automatic dynamic shapes stay off: they make
    every size that changed since an earlier compile of the same function symbolic, and after a test of
    one model's prefill, another model's took Inductor's shape reasoning past 5 minutes
    (tests/unit/test_eggroll_exact.py's compiled test run after test_generation_training.py's, on CPU),
    and the row scales' compiled test, after the row terms' tests, past 10 minutes (CPU).
    test_generation_training.py checks that a prefill compiled again for another batch is still dynamic in
    the width alone.
    """

    def __init__(self, fn: Callable, name: str, mode: str, fullgraph: bool, dynamic: bool | None = False):
        self.fn, self.name = fn, name
        # Round at every explicit dtype cast as eager does (bf16 RMSNorm, rotary...): fused kernels
        # otherwise skip those roundings and bf16 log-probs drift from the eager step's.
        # torch.compile takes a mode or options, not both: the mode's options go in too.
        from torch._inductor import (
            list_mode_options,  # imported when compiling only: it is slow
        )

        options = {**list_mode_options(mode), "emulate_precision_casts": True}
        self.compiled = torch.compile(fn, dynamic=dynamic, fullgraph=fullgraph, options=options)
        self.error: BaseException | None = None

    def __call__(self, *args, **kwargs):
        if self.error is not None:
            return self.fn(*args, **kwargs)
        try:
            limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False, recompile_limit=limit,
                                            automatic_dynamic_shapes=False):
                return self.compiled(*args, **kwargs)
        except Exception as error:  # dynamo/inductor raise many types (Unsupported, InductorError, ...)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            self.error = error
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            warnings.warn(f"torch.compile of the {self.name} failed, running it uncompiled: "
                          f"{type(error).__name__}: {reason}", RuntimeWarning, stacklevel=2)
            return self.fn(*args, **kwargs)
