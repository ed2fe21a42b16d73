"""Every GPU count runs or is refused before launch (recipes/shared/rank_split.py): a count a step shares
out over the ranks that does not split is refused where the user gave it, naming the nearest values and
rank counts that split, and moved to the nearest value that splits where it is a default."""

import pytest

from gpuscale.recipes.grpo_mtl import accumulation_steps
from gpuscale.recipes.shared.rank_batches import micro_batch_within
from gpuscale.recipes.shared.rank_split import Split, closest, fit_splits, nearest_divisors, nearest_fit
from gpuscale.recipes.shared.registry import BUILTIN, get_recipe
from gpuscale.runs.settings import SettingsError

RANK_COUNTS = range(1, 9)  # 1 to 8 GPUs, and 1 to 4 CPU ranks and more


def test_the_nearest_values_that_split_and_the_closest_of_them():
    assert nearest_fit(16, 3) == [15, 18]
    assert nearest_fit(2048, 6) == [2046, 2052]
    assert nearest_fit(2, 3) == [3]  # nothing below the step itself
    assert nearest_fit(12, 4) == [12]
    assert closest(16, [15, 18]) == 15 and closest(64, [60, 66]) == 66
    assert closest(5, [4, 6]) == 4  # a tie takes the lower: a step no larger than asked
    assert nearest_divisors(128, 3) == [2, 4] and nearest_divisors(9, 1) == [3] and nearest_divisors(7, 9) == [7]


def grpo(**given):
    return get_recipe("grpo-mtl").settings_cls.model_validate(given)


def test_a_given_count_that_does_not_split_is_refused_naming_the_values_and_the_rank_counts_that_would():
    settings = grpo(prompts_per_step=16, num_generations=16)
    splits = get_recipe("grpo-mtl").rank_splits(settings)
    with pytest.raises(SettingsError) as refused:
        fit_splits(settings, splits, ranks=3, on_gpu=True)
    assert str(refused.value) == ("prompts_per_step: 16: 16 prompts x 16 generations = 256 completions do not split "
                                  "over 3 GPUs (each takes an equal share of a step); use prompts_per_step 15 or 18, "
                                  "or 2 or 4 GPUs")
    eggroll = get_recipe("eggroll").settings_cls.model_validate({"population": 64})
    with pytest.raises(SettingsError, match=r"^population: 64: 64 members in antithetic pairs do not split over 3 "
                                            r"ranks \(each takes an equal share of a step\); use population 60 or 66, "
                                            r"or 2 or 4 ranks$"):
        fit_splits(eggroll, get_recipe("eggroll").rank_splits(eggroll), ranks=3, on_gpu=False)


def test_a_default_moves_to_the_nearest_value_that_splits_and_says_so():
    settings = grpo(num_generations=8)  # prompts_per_step is the default: it moves, num_generations stays
    fitted, lines = fit_splits(settings, get_recipe("grpo-mtl").rank_splits(settings), ranks=3, on_gpu=True)
    assert (fitted.prompts_per_step, fitted.num_generations) == (63, 8)
    assert lines == ["prompts_per_step 64 -> 63: the default's 64 prompts x 8 generations = 512 completions do not "
                     "split over 3 GPUs; --set prompts_per_step=N chooses"]
    same, said = fit_splits(settings, get_recipe("grpo-mtl").rank_splits(settings), ranks=4, on_gpu=True)
    assert same is settings and said == []
    with pytest.raises(SettingsError, match="^prompts_per_step: 64: "):  # a run's check moves nothing
        fit_splits(settings, get_recipe("grpo-mtl").rank_splits(settings), ranks=3, on_gpu=True, adapt=False)


def test_a_split_of_several_items_a_value_steps_by_what_the_value_lacks():
    split = Split("prompts_per_step", str, per_value=16)
    assert split.step(3) == 3 and split.step(6) == 3 and split.step(8) == 1 and split.step(32) == 2


def rank_side_holds(name: str, settings, ranks: int) -> None:
    """What each rank needs of its share, by the arithmetic the ranks do (not the split rule itself)."""
    if name in ("sft", "rft"):
        assert settings.rows_per_step % ranks == 0
        rows = settings.rank_rows(ranks)
        micro = micro_batch_within(rows, settings.batch_size or 8)
        settings.check_micro_batch(ranks, micro)  # the micro-batch the rank sizes divides its share
    elif name == "grpo-mtl":
        assert settings.completions_per_step % ranks == 0
        share = settings.completions_per_step // ranks
        sized = settings.model_copy(update={"batch_size": micro_batch_within(share, 8)})  # the CPU's auto
        assert accumulation_steps(sized, ranks) * sized.batch_size * ranks == settings.completions_per_step
    elif name == "eggroll":
        assert settings.population % ranks == 0 and settings.population % 2 == 0
        members = settings.population // ranks
        assert settings.batch_size == min(settings.prompts_per_step * members, 8192)


@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_recipe_s_defaults_run_on_1_to_8_ranks(name, on_gpu):
    """The GPU-count matrix: a run asked for with nothing but its rank count is fitted before launch
    (rank_split.fit_splits) and by its rank (Recipe.for_device: device defaults, eggroll's population),
    and then every rank's share is whole: nothing left to fail after launch."""
    recipe = get_recipe(name)
    for ranks in RANK_COUNTS:
        asked = recipe.settings_cls()
        fitted, _ = fit_splits(asked, recipe.rank_splits(asked), ranks, on_gpu)
        on_rank = recipe.for_device(recipe.settings_cls.model_validate_json(fitted.model_dump_json()), on_gpu, ranks)
        rank_side_holds(name, on_rank, ranks)
        fit_splits(on_rank, recipe.rank_splits(on_rank), ranks, on_gpu, adapt=False)  # the check passes too


def test_the_fitted_defaults_are_the_nearest_that_split():
    cases = {("grpo-mtl", 3): ("prompts_per_step", 63), ("grpo-mtl", 5): ("prompts_per_step", 65),
             ("grpo-mtl", 6): ("prompts_per_step", 63), ("grpo-mtl", 7): ("prompts_per_step", 63),
             ("sft", 3): ("rows_per_step", 9), ("sft", 5): ("rows_per_step", 10), ("sft", 7): ("rows_per_step", 7),
             ("rft", 3): ("rows_per_step", 33), ("rft", 5): ("rows_per_step", 30), ("rft", 7): ("rows_per_step", 35)}
    for (name, ranks), (field, value) in cases.items():
        recipe = get_recipe(name)
        fitted, lines = fit_splits(recipe.settings_cls(), recipe.rank_splits(recipe.settings_cls()), ranks, True)
        assert getattr(fitted, field) == value and len(lines) == 1, (name, ranks)
    eggroll = get_recipe("eggroll")
    auto = eggroll.settings_cls()
    assert [eggroll.for_device(auto, True, ranks).population for ranks in (1, 2, 3, 4, 5, 6, 7, 8)] == [
        2048, 2048, 2046, 2048, 2050, 2046, 2044, 2048]
    settled, lines = eggroll.device_values_fitted(auto, on_gpu=False, ranks=3)
    assert settled.population == 66 and lines == [
        "population 64 -> 66: the default's 64 members in antithetic pairs do not split over 3 ranks; "
        "--set population=N chooses"]
