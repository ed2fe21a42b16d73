"""One seed rule (data/seeds.py): every seed a run derives is a hash of its keys, and no module of
gpuscale derives one by arithmetic (`seed + rank`, `seed * 1000 + rank`), under which run seed 1
rank 0 draws what run seed 0 rank 1 draws."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpuscale
from gpuscale.data.seeds import derived_seed

PACKAGE = Path(gpuscale.__file__).parent
THE_RULE = PACKAGE / "data" / "seeds.py"
PINNED = 2654191283464432734  # derived_seed(0, "noise", 1, 2) since the rule began (FORMAT 2)
SEEDING_CALLS = {"manual_seed", "manual_seed_all", "seed", "Random", "default_rng", "RandomState", "Generator"}


def test_keys_that_a_sum_confuses_give_different_seeds():
    assert derived_seed(1, 0) != derived_seed(0, 1)
    assert derived_seed(1, "sampling", 0) != derived_seed(0, "sampling", 1)
    assert derived_seed(0, "noise", 3, 2) != derived_seed(0, "sampling", 3, 2)  # streams named apart
    assert derived_seed(0, 1) != derived_seed(0, 1, 0)  # a key more is another stream


def test_the_rule_is_pinned_and_fits_every_generator():
    # Resumed runs regenerate their draws from these seeds: if this value changes, bump the format of
    # every checkpoint that relies on it (recipes/eggroll/checkpoint.py's FORMAT).
    assert derived_seed(0, "noise", 1, 2) == derived_seed(0, "noise", 1, 2) == PINNED
    assert all(0 <= derived_seed(seed, rank) < 2**63 for seed in range(20) for rank in range(8))


@pytest.mark.parametrize("bad", [1.0, True, None])
def test_a_key_that_is_not_an_int_or_a_str_is_refused_by_name(bad):
    with pytest.raises(TypeError, match=f"key {bad!r}: expected an int or a str"):
        derived_seed(0, bad)


def seed_arithmetic(source: str) -> list[int]:
    """Lines where `source` computes with a name that says seed (`seed * 1000 + rank`), or hands a
    seeding call (manual_seed, random.Random, ...) a computed value (`manual_seed(base + rank)`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and any(says_seed(part) for part in ast.walk(node)):
            found.add(node.lineno)
        if isinstance(node, ast.Call) and called_name(node) in SEEDING_CALLS:
            arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
            if any(isinstance(part, ast.BinOp) for argument in arguments for part in ast.walk(argument)):
                found.add(node.lineno)
    return sorted(found)


def says_seed(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "seed" in name.lower() and name != "derived_seed"


def called_name(call: ast.Call) -> str:
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def test_the_scan_sees_each_kind_of_seed_arithmetic():
    assert seed_arithmetic("g.manual_seed(settings.seed + ctx.rank)") == [1]
    assert seed_arithmetic("x = 1\nr = random.Random(seed * 1_000_003 + step)") == [2]
    assert seed_arithmetic("torch.manual_seed(base * 1000 + rank)") == [1]
    assert seed_arithmetic("g.manual_seed(derived_seed(settings.seed, 'sampling', rank))") == []
    assert seed_arithmetic("offset = rank * size + local_rank") == []


def test_no_module_but_the_rule_derives_a_seed_by_arithmetic():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != THE_RULE
                 for line in seed_arithmetic(path.read_text())]
    assert offenders == [], f"derive these seeds with data/seeds.derived_seed: {offenders}"


def test_an_eggroll_checkpoint_from_before_the_rule_is_refused_saying_why(tmp_path):
    # Its steps' noise and prompts were drawn by arithmetic: resumed now, the run would go on with others.
    import json
    from types import SimpleNamespace

    from gpuscale.recipes.eggroll import checkpoint

    (tmp_path / checkpoint.META_FILE).write_text(json.dumps({"format": 1, "recipe": "eggroll", "step": 2}))
    trainer = SimpleNamespace(ctx=None, settings=None)
    with pytest.raises(ValueError, match=f"{tmp_path}: checkpoint format 1, expected 2: .*earlier seed rule"):
        checkpoint.load(trainer, tmp_path)
