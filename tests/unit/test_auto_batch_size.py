"""GPU runs of power sampling no longer default to a batch that fills 1% of the
card. The rule is a pure function of the card's free memory, the model's shape and the settings, so it
is tested here without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuscale.data.models import random_model_config
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.training_memory import CPU_BATCH_SIZE, auto_batch_size, memory_to_size_from
from gpuscale.recipes.power_sampling import Settings
from gpuscale.recipes.power_sampling.sampler import bytes_per_problem, with_batch_size
from gpuscale.runs.settings import AUTO_MEMORY_SHARE, resolve_settings

GiB = 2**30
H200_FREE = 140 * GiB  # what an H200 has free once a 0.5B model is loaded


def qwen_problem_bytes(max_new_tokens: int, chains: int = 1) -> int:
    return bytes_per_problem(random_model_config("random-qwen2.5-0.5b"), 2, max_new_tokens, chains)


def test_the_default_batch_size_is_auto_and_the_user_can_say_so():
    assert Settings().batch_size is None
    assert resolve_settings(Settings, overrides={"batch_size": "auto"}).batch_size is None
    assert resolve_settings(Settings, overrides={"batch_size": "64"}).batch_size == 64


def test_qwen_shape_on_an_h200_fills_a_real_share_of_the_card():
    """A run reported as too small for its card: Qwen2.5-0.5B shape, bf16, 256 new tokens; batch 8
    used 1.2% of the card."""
    per_problem = qwen_problem_bytes(256)
    size = auto_batch_size(H200_FREE, per_problem, AUTO_MEMORY_SHARE, items=10_000)
    assert size == 512  # the cap: half the card would hold more
    assert 8 * per_problem / H200_FREE < 0.01  # what the old default used of it, by the same count
    assert size * per_problem / H200_FREE > 0.05


@pytest.mark.parametrize("max_new_tokens, chains", [(3072, 1), (3072, 4), (8192, 1)])
def test_long_answers_and_chains_fill_half_the_free_memory(max_new_tokens, chains):
    per_problem = qwen_problem_bytes(max_new_tokens, chains)
    size = auto_batch_size(H200_FREE, per_problem, AUTO_MEMORY_SHARE)
    assert size < 512
    assert 0.45 < size * per_problem / H200_FREE <= 0.5  # half, to the nearest problem
    assert auto_batch_size(H200_FREE // 4, per_problem, AUTO_MEMORY_SHARE) < size  # a smaller card, a smaller batch


def test_never_more_than_the_ranks_problems_nor_less_than_one():
    assert auto_batch_size(H200_FREE, 10**6, AUTO_MEMORY_SHARE, items=37) == 37  # a larger batch would only be padding
    assert auto_batch_size(1 * GiB, 100 * GiB, AUTO_MEMORY_SHARE, items=37) == 1


def test_bytes_per_problem_counts_both_kv_slots_and_the_chains():
    config = random_model_config("random-qwen2.5-0.5b")
    one = bytes_per_problem(config, 2, 256, 1)
    kv_per_token = 24 * 2 * 2 * 64 * 2  # layers, K and V, kv heads, head dim, bf16 bytes
    assert one == 2 * (2 * 256 + 512) * kv_per_token + 4 * 151936 * 4
    assert bytes_per_problem(config, 2, 256, 4) == 4 * one
    assert bytes_per_problem(config, 4, 256, 1) > one  # fp32 caches take twice the room


def test_cpu_ranks_keep_the_old_default_and_an_explicit_size_is_kept():
    ctx = RankContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                      run_dir=Path("."))
    model = type("Model", (), {"config": random_model_config("random-tiny"), "dtype": torch.float32})()
    assert with_batch_size(Settings(), model, 100, ctx).batch_size == CPU_BATCH_SIZE == 8
    assert with_batch_size(Settings(batch_size=3), model, 100, ctx).batch_size == 3


def test_runs_sharing_a_card_size_their_batch_from_their_share():
    """A run's gpu_memory_share scales the auto batch: runs started together on one card, each at a quarter,
    together ask for no more than the card's free memory."""
    per_problem = 256 * 2**20  # under the 512 cap at either share
    whole = auto_batch_size(H200_FREE, per_problem, share=resolve_settings(Settings).gpu_memory_share)
    eighth = resolve_settings(Settings, overrides={"gpu_memory_share": "0.125"}).gpu_memory_share
    quarter = auto_batch_size(H200_FREE, per_problem, share=eighth)
    assert quarter * 4 * per_problem <= H200_FREE * 0.5 and quarter == whole // 4


def test_a_seed_gets_the_same_batch_whatever_other_runs_hold_on_the_card_while_its_share_is_free():
    """rft's generation batch once followed the memory free when the run started, which other runs on
    the card set: a seed split its questions otherwise from one call to the next and drew other samples.
    The memory sized from is the card's less what this run holds, unless others leave less than its
    share of that free."""
    total, own, share = 80 * GiB, 2 * GiB, 0.5
    idle = memory_to_size_from(total - own - GiB // 2, total, own, share)  # only a CUDA context besides
    shared = memory_to_size_from(50 * GiB, total, own, share)  # other runs hold 27.5 GiB
    assert idle == shared == (total - own, False)
    per_question = 40 * 2**20
    assert auto_batch_size(idle[0], per_question, share=share) == auto_batch_size(shared[0], per_question, share=share)
    # Others leave less than half of what the model leaves: sized from what is free, and said so.
    assert memory_to_size_from(30 * GiB, total, own, share) == (30 * GiB, True)
    assert memory_to_size_from(30 * GiB, total, own, 0.25) == (total - own, False)  # a smaller share still fits

