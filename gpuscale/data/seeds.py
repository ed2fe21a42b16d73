"""The one rule for deriving a random seed: `derived_seed(*keys)`.

Every generator a run seeds (a rank's global RNG, a sampling stream, a step's noise, a step's prompt
draw) takes its seed from here, keyed by the run's `seed` and whatever else tells its stream apart
(a word naming the stream, the rank, the step, the layer). Arithmetic such as `seed + rank` or
`seed * 1000 + rank` makes different keys collide: run seed 1 rank 0 would draw exactly what run
seed 0 rank 1 draws, and (seed, step, layer) what (seed, step, rank) draws. A hash of the keys gives
unrelated seeds to any two different key tuples, the same seed for the same keys in any process.
tests/unit/test_seeds.py checks that no other module of gpuscale derives a seed by arithmetic.
"""

from __future__ import annotations

import hashlib

__all__ = ["derived_seed"]


def derived_seed(*keys: int | str) -> int:
    """A 63-bit seed (fits torch.manual_seed, random.Random, numpy) from keys such as
    (seed, "noise", step, layer): the same keys give the same seed in any process and Python
    version; keys that differ anywhere, in value, order or count, give unrelated seeds."""
    if not keys:
        raise ValueError("derived_seed: no keys: expected the run's seed and what tells the stream apart")
    digest = hashlib.blake2b(repr(tuple(_key(key) for key in keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _key(key) -> int | str:
    # Integers (numpy's and torch's too) by value; a bool or a float would pass as an int by accident.
    if isinstance(key, str):
        return key
    if isinstance(key, (bool, float)) or not hasattr(key, "__index__"):
        raise TypeError(f"derived_seed: key {key!r}: expected an int or a str, got {type(key).__name__}")
    return int(key.__index__())
