"""The recipe's warm-up (run before its clock starts) changes no sample: it draws from its own
generator and gives the global RNGs back as they were, for the batched and the reference method."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuscale.data.models import load_model
from gpuscale.data.prompts import eos_token_ids, pad_token_id
from gpuscale.data.tasks import load_examples
from gpuscale.engines.distributed import RankContext
from gpuscale.recipes.power_sampling import Settings
from gpuscale.recipes.power_sampling.sampler import BatchSampler


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tokenizer = load_model("tiny-math", dtype=torch.float32, device=torch.device("cpu"))
    return model, tokenizer


def sampler(tiny, method: str) -> BatchSampler:
    model, tokenizer = tiny
    settings = Settings(method=method, max_new_tokens=24, blocks=2, mcmc_steps=2, batch_size=3, seed=5)
    ctx = RankContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                      run_dir=Path("."))
    eos = eos_token_ids(model, tokenizer)
    return BatchSampler(settings, model, tokenizer, eos, pad_token_id(tokenizer, eos), ctx)


@pytest.mark.parametrize("method", ["power", "reference"])
def test_warm_up_changes_no_sample_and_no_count(tiny, method):
    batch = list(enumerate(load_examples("tiny-math", "test", 3)))
    cold = sampler(tiny, method)
    expected = cold.run(batch)

    warm = sampler(tiny, method)
    seconds = warm.warm_up(batch)
    assert seconds > 0
    assert warm.stats_snapshot() == {"decoded_tokens": 0, "sampling_calls": 0, "proposals": 0, "accepted": 0}
    got = warm.run(batch)

    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected]
    assert warm.stats_snapshot() == cold.stats_snapshot()
