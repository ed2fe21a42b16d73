"""Before launch: are there enough training examples for what the run does with them? (no torch: the
front end's check runs this.)

A run with too few examples does not fail at once: GRPO's data loader then yields no whole step and
the run "succeeds" with nothing trained, ES sampling raises after the model is loaded, a rank with no
question of its own breaks the collectives. Counted here the way each recipe loads them, without
the network and without generating a named task's problems.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuscale.runs.settings import SettingsError


def training_count(settings, training_examples: Callable[[object], list[dict]]) -> tuple[int | None, str]:
    """How many training examples the run will have, and where that number comes from (for the
    refusal's message). `training_examples(settings)` is the recipe's own loader, used for JSONL
    files only: they are read whole by the data check anyway, and the loader (data/tasks.py's
    `held_out_split`) leaves out the rows the run scores: a file's first eval_examples rows, and with
    eval_split=validation the eval_examples rows after them too. A named task's training split holds
    thousands of problems (its test split is separate, and gsm8k's validation problems are loaded on
    top of max_examples; tiny-math's are a split of their own), so there the count is `max_examples`,
    or None where it is unset (the whole split: plenty); only where gsm8k's validation problems would
    leave fewer than that in its split of known size (data/tasks.py's `training_split_size`) is the
    count what is left. The message says what was held out."""
    from gpuscale.data.tasks import GENERATED_TASKS, parse_dataset, training_split_size

    held_out = getattr(settings, "eval_examples", 0)
    validation = held_out and getattr(settings, "eval_split", "test") == "validation"
    if parse_dataset(settings.dataset).paths:
        count = len(training_examples(settings))
        source = f"dataset={settings.dataset}"
        if settings.max_examples is not None:
            source += f", max_examples={settings.max_examples}"
        if validation:
            source += f", after eval_examples={held_out} held out for test and {held_out} for validation"
        elif held_out:
            source += f", after eval_examples={held_out} held out"
        return count, source
    # A generated task's validation split is its own (data/tiny_math.py): it leaves the training split whole.
    takes_from_training = validation and parse_dataset(settings.dataset).task not in GENERATED_TASKS
    size = training_split_size(settings.dataset) if takes_from_training else None
    if size is not None and (settings.max_examples is None or settings.max_examples > size - held_out):
        return max(0, size - held_out), (f"the {size} training problems of {settings.dataset}, after "
                                         f"eval_examples={held_out} held out for validation")
    if settings.max_examples is None:
        return None, f"dataset={settings.dataset}"
    return settings.max_examples, f"max_examples={settings.max_examples} of {settings.dataset}"


def require_training_examples(count: int | None, source: str, needed: int, field: str, value: int,
                              reason: str) -> None:
    """SettingsError with one line naming `field`, its value, the count and its source, if `count`
    is known and below `needed`."""
    if count is None or count >= needed:
        return
    raise SettingsError(f"{field}: {value}: needs at least {needed} training examples, the run has {count} "
                        f"({source}); {reason}")
