"""Every measured figure README.md quotes, tied to the result JSON it comes from, and the check that it is
still today's (tests/unit/test_readme_figures.py runs it; `python bench/readme_figures.py` too).

README's measured figures live in marked blocks, `<!-- figures -->` ... `<!-- /figures -->`. Inside a
block every figure, i.e. every number that carries a unit (`%`, `x`, `s`, `kJ`, `GB/s`, `tokens/s`, ...),
a sign (`+22.7`, `−0.3`: a gain) or a decimal point (`0.3`), must be part of a registered figure's text;
bare whole numbers (`3 seeds`, `128 problems`) are the set-up, not figures. Outside the blocks README
holds no date of a measurement: a date there is refused unless it is in UNMEASURED_DATES (and inside,
a text with a figure's form that is no measurement, a target, is listed in UNMEASURED_TEXTS). A figure passes
when its JSON exists, each value read from it formats to README's text, the JSON's defaults fingerprint
(bench/record.py) of every recipe the figure ran is today's, and, for accuracy on tiny-math, its
`test_split` is today's edition (a result without one is test-v1's). A ratio must be quoted in the same
words by bench/RESULTS.md. A change of a recipe's defaults thus fails every figure measured with them:
measure it again (then `python bench/readme_figures.py --texts` prints the new texts) or take it out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuscale.data.splits import OLD_TEST_SPLIT, TEST_SPLIT_EDITION  # noqa: E402
from gpuscale.recipes.shared.defaults_fingerprint import defaults_fingerprints, settings_added_since  # noqa: E402

OPEN, CLOSE = "<!-- figures -->", "<!-- /figures -->"
MINUS = "\u2212"  # README writes a negative gain with the minus sign, not a hyphen
# A number, then what makes it a figure: a sign before it, a decimal point, or a unit after it (`%` and `x`
# written against the number; the others after an optional space). A letter, `@`, `=`, `/`, `:` or a
# letter's `-` just before it, or a letter just after, make it part of a name (H200, test-v2, pass@16, T=1,
# 1/alpha, 4:09, 0.5b); a range's `-` does not (75.0-75.8 is two figures).
FIGURE = re.compile(r"(?<![\w.@=/:])(?<![A-Za-z]-)(?P<sign>[+\u2212-])?"
                    r"(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?P<decimal>\.\d+)?)"
                    r"(?:(?P<unit>%|x\b|\s?(?:kJ|J|GB/s|TFLOP/s|GB|MB|MiB|GiB|ms|s|min|minutes|[a-z]+/s)\b)|(?!\.?\w))")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Dates README names outside the blocks that date no measurement (an edition of the data, a rule).
UNMEASURED_DATES = ("test-v2 since 2026-11-29",)
# Texts inside a block with a figure's form that are no measurement (a target the verdicts apply).
UNMEASURED_TEXTS = ("(floor +5",)


@dataclass(frozen=True)
class Value:
    """Where a value is in a result JSON and how README writes it. `path` is dotted keys (a list index is a
    number); `*` takes every item of a list or dict there, and `reduce` makes them one value."""

    path: str
    form: Callable[[object], str]
    reduce: Callable[[list], object] | None = None

    def read(self, data: dict) -> object:
        found = [data]
        for key in self.path.split("."):
            found = [item for node in found for item in children(node, key)]
        return self.reduce(found) if self.reduce else found[0]


def children(node: object, key: str) -> list:
    if key == "*":
        return list(node.values() if isinstance(node, dict) else node)
    return [node[int(key)] if isinstance(node, list) else node[key]]


@dataclass(frozen=True)
class Figure:
    """A figure as README writes it: `text` with a `{}` for each value, the result JSON (from the repository's
    root) they are read from, the recipes whose defaults they were measured at (only theirs are compared),
    whether it is an accuracy on tiny-math's test split, and whether it is a ratio RESULTS.md quotes too."""

    text: str
    result: str
    values: tuple[Value, ...]
    recipes: tuple[str, ...]
    tiny_math_test: bool = False
    ratio: bool = False

    @property
    def name(self) -> str:
        return self.text.replace("{}", "…")

    def quoted(self, data: dict) -> str:
        return self.text.format(*(value.form(value.read(data)) for value in self.values))


# How README writes a value.
def points(value: float) -> str:
    """A gain in points as the JSON holds it: +22.7, −0.3."""
    return f"{value:+.1f}".replace("-", MINUS)


def percent(value: float) -> str:
    """A fraction as a percentage: 0.798 -> 79.8%."""
    return f"{100 * value:.1f}%"


def percent_points(value: float) -> str:
    """A percentage the JSON holds in points: 52.8 -> 52.8%."""
    return f"{value:.1f}%"


def fraction_points(value: float) -> str:
    """A gain the JSON holds as a fraction, in points: -0.0134 -> −1.3."""
    return points(100 * value)


def hundredths(value: float) -> str:
    """A fraction as points without the sign: 0.758 -> 75.8."""
    return f"{100 * value:.1f}"


def seconds(value: float) -> str:
    return f"{value:.0f} s"


def step_seconds(value: float) -> str:
    """A step's time: 0.684 -> 0.68 s."""
    return f"{value:.2f} s"


def plain(value: object) -> str:
    return str(value)


def verdict(met: bool) -> str:
    return "met" if met else "not met"


ACCEPTANCE = "bench/results/acceptance/acceptance-1gpu-3seeds-one-call-2026-12-01-h200.json"
TRAINING = ("sft", "rft", "grpo-mtl", "eggroll")  # the recipes the acceptance's verdicts are of


def target(recipe: str, *path: str) -> str:
    return ".".join(("figures", "targets", recipe, *path))


def acceptance(text: str, *values: Value) -> Figure:
    return Figure(text, ACCEPTANCE, values, CHECKED, tiny_math_test=True)


def gain(recipe: str, domain: str = "") -> Value:
    return Value(target(recipe, "greedy", "points", f"gain_greedy{'_' + domain if domain else ''}"), points)


def over_control(recipe: str) -> Value:
    return Value(target(recipe, "over_sharpening_control", "points", "over_control"), points)


def met(recipe: str, part: str) -> Value:
    return Value(target(recipe, part, "met"), verdict)


POWER = ("power-sampling",)
# README's verdict paragraph ("Under these verdicts...") and the recipe table's gains: the 1-GPU acceptance
# on test-v2. Each of its figures depends on the defaults of every recipe the check runs: the control that
# T=1 is scored over is power-sampling's, and the runs share the card (an `auto` batch is sized from it).
CHECKED = (*TRAINING, *POWER)

ACCEPTANCE_FIGURES = (
    acceptance("(sft greedy {}, T=1 {} over the sharpening control; rft {} and {})", gain("sft"), over_control("sft"),
               gain("rft"), over_control("rft")),
    acceptance("where the base already answers {} of test-v2",
               Value("figures.runs.0.domains.accuracy_greedy_comparison_before", percent)),
    acceptance("grpo-mtl gains {} (floor +5; comparison {}), PCGrad {} (comparison {}), eggroll {} (comparison {})",
               gain("grpo-mtl"), gain("grpo-mtl", "comparison"), gain("grpo-mtl pcgrad"),
               gain("grpo-mtl pcgrad", "comparison"), gain("eggroll"),
               Value("figures.seed_statistics.eggroll.gain_greedy_comparison.mean", fraction_points)),
    acceptance("at T=1 the GRPO runs ({}, {}) and eggroll ({}) fall short of the", 
               over_control("grpo-mtl"), over_control("grpo-mtl pcgrad"), over_control("eggroll")),
    acceptance("(the base sampled at T = {}: {})", Value("figures.sharpening_control.temperature", plain),
               Value("figures.sharpening_control.test_accuracy.*", percent, statistics.mean)),
    acceptance("{} against greedy {}, T = 1/alpha {}, T = 1 {}",
               *(Value(f"figures.targets.power-sampling.points.accuracy.power-sampling{rival}", percent_points)
                 for rival in ("", " greedy", " low-temperature", " temperature-1"))),
    acceptance("pass@8 {}, {} and {})",
               *(Value(f"figures.targets.power-sampling.pass_at_k.power-sampling{rival}.8", percent)
                 for rival in ("", " low-temperature", " temperature-1"))),
    # The recipe table: each recipe's greedy gain / T=1 over the control, and the verdicts of both.
    *(acceptance(f"| {row} | {{}} / {{}}: {{}} / {{}}", gain(recipe), over_control(recipe), met(recipe, "greedy"),
                 met(recipe, "over_sharpening_control"))
      for row, recipe in (("sft", "sft"), ("rft", "rft"), ("grpo-mtl", "grpo-mtl"),
                          ("grpo-mtl, PCGrad (`--set mtl=pcgrad`)", "grpo-mtl pcgrad"), ("eggroll", "eggroll"))),
    acceptance("The check ran in one call of {}", Value("figures.seconds", seconds)),
    acceptance("| power-sampling | {} vs greedy {}: {}",
               Value("figures.targets.power-sampling.points.accuracy.power-sampling", percent_points),
               Value("figures.targets.power-sampling.points.accuracy.power-sampling greedy", percent_points),
               Value("figures.targets.power-sampling.met", verdict)),
)

FAULTS = "bench/results/faults/faults-sigstop-2026-11-29-cpu.json"
GPU_STOP_FAULTS = "bench/results/faults/faults-stop-2026-11-29-h200x2.json"
GPU_KILL_FAULTS = "bench/results/faults/faults-kill-2026-11-29-h200x2.json"


def case_figure(case: str, key: str) -> Value:
    """`key` of bench/faults.py's case named `case`."""
    return Value("figures.cases.*", seconds, lambda cases: next(found[key] for found in cases if found["case"] == case))


def tenths(value: float) -> str:
    return f"{value:.1f} s"


FAULT_FIGURES = (
    Figure("a 2-rank CPU run of grpo-mtl whose rank 1 got SIGSTOP ended {} later", FAULTS,
           (case_figure("grpo-stop", "stop_to_end_s"),), ("grpo-mtl",)),
    Figure("on 2 x H200 at random-qwen2.5-0.5b with `hang_timeout=30`, sft's and grpo-mtl's runs ended {} and {} "
           "after the SIGSTOP", GPU_STOP_FAULTS,
           (case_figure("sft-stop", "stop_to_end_s"), case_figure("grpo-stop", "stop_to_end_s")), ("sft", "grpo-mtl")),
    Figure("a killed rank's peer was gone {} after the SIGKILL", GPU_KILL_FAULTS,
           (Value("figures.cases.*", tenths, lambda cases: max(case["others_gone_s"] for case in cases)),),
           ("sft", "grpo-mtl")),
)

# sft's step against stock SFTTrainer at its best (TRL's own liger switch at its best batch; bench/train_speed.py),
# three alternating repeats of each side in one call.
SFT_SPEED = "bench/results/sft/train-speed-stock-best-0.5b-2026-11-30-h200x2.json"


def times(value: float) -> str:
    """A ratio: 4.125 -> 4.12x."""
    return f"{value:.2f}x"


def tokens_per_s(value: float) -> str:
    """A rate: 110530.7 -> 110,531 tokens/s."""
    return f"{value:,.0f} tokens/s"


SFT_SPEED_FIGURES = (
    Figure("an sft step at its defaults ran {} as fast as stock `SFTTrainer` at its best ({} against {}, stock's "
           "three timings within {})", SFT_SPEED,
           (Value("figures.ratio_over_stock_best", times), Value("figures.gpuscale_tokens_per_s", tokens_per_s),
            Value("figures.stock_tokens_per_s", tokens_per_s), Value("figures.stock_spread", percent)),
           ("sft",), ratio=True),
)

# grpo-mtl's step against stock GRPOTrainer at its best, both sides in one call (bench/train_speed.py), at
# grpo-mtl's default step; two calls, since stock's own step time moves from call to call.
GRPO_SPEED = ("bench/results/grpo_mtl/train-speed-grpo-64x4-stock-2026-11-29-h200.json",
              "bench/results/grpo_mtl/train-speed-grpo-64x4-stock-repeat-2026-11-29-h200.json")


def grpo_speed(text: str, result: str, *values: Value) -> Figure:
    return Figure(text, result, values, ("grpo-mtl",), ratio=True)


GRPO_SPEED_FIGURES = (
    grpo_speed("a grpo-mtl step at its defaults ran {} as fast as stock `GRPOTrainer` at its best ({} against "
               "{} a step", GRPO_SPEED[0], Value("figures.grpo.step_stock_over_gpuscale", times),
               Value("figures.grpo.gpuscale.step_seconds_median", step_seconds),
               Value("figures.grpo.stock_best.step_seconds_median", step_seconds)),
    grpo_speed("and {} in a second call", GRPO_SPEED[1], Value("figures.grpo.step_stock_over_gpuscale", times)),
)

# grpo-mtl's rollout=async and placement against its synchronous rollout, in one call (`bench/grpo_async.py`).
GRPO_ASYNC = "bench/results/grpo_mtl/async-2gpu-2026-11-30-h200x2.json"
GRPO_ASYNC_FIGURES = (
    grpo_speed("on 2 GPUs its steady step ran {} as fast as the synchronous one, and a whole 20-step run {}",
               GRPO_ASYNC, Value("figures.ratios.async_over_sync_steady_2gpu", times),
               Value("figures.ratios.async_over_sync_2gpu", times)),
    grpo_speed("its step ran at {} the synchronous step's speed", GRPO_ASYNC,
               Value("figures.ratios.placed_over_sync_steady_2gpu", times)),
)

# grpo-mtl's learning under rollout=async beside the synchronous rollout: 3 seeds each, 1 GPU a run, all of
# test-v2, the two sets of runs at the same time on two GPUs (bench/acceptance.py --only grpo-mtl).
GRPO_ASYNC_LEARNING = {
    rollout: f"bench/results/grpo_mtl/async-learning-3seeds-{rollout}-card-sized-eval-2026-11-30-h200x2.json"
    for rollout in ("async", "sync")}
GRPO_GAIN = Value("figures.seed_statistics.grpo-mtl.gain_greedy.mean", fraction_points)
GRPO_ASYNC_LEARNING_FIGURES = (
    Figure("over 3 seeds on tiny-math's test split it gained {} greedy", GRPO_ASYNC_LEARNING["async"],
           (GRPO_GAIN,), ("grpo-mtl",), tiny_math_test=True),
    Figure("against {} for the synchronous rollout run beside it", GRPO_ASYNC_LEARNING["sync"],
           (GRPO_GAIN,), ("grpo-mtl",), tiny_math_test=True),
)

# The node check's decode beside bench/generation.py's at the same shape (`bench/node_check.py --decode-agreement`).
NODE_CHECK_DECODE = "bench/results/probe/node_check_decode-default-256-tokens-tails-2026-12-01-h200.json"


def thousandths(value: float) -> str:
    return f"{value:.3f}"


NODE_CHECK_FIGURES = (
    Figure("the check's batch-1 decode ran at {} of bench/generation.py's speed and its batch-1024 decode at {}, "
           "batch 1 at {} of its floor", NODE_CHECK_DECODE,
           (Value("figures.rows.0.ratio", thousandths), Value("figures.rows.1.ratio", thousandths),
            Value("figures.rows.0.probe_floor_share", percent)), ("probe",)),
)

# The engine's one-row decode step, each layer as five Triton kernels, beside transformers at its best
# (`bench/decode_ways.py --ways today --with-transformers`).
DECODE_WAYS = "bench/results/generation/decode-ways-b1-five-kernels-transformers-2026-12-01-h200.json"


def milliseconds(value: float) -> str:
    return f"{value:.2f} ms"


DECODE_FIGURES = (
    Figure("a one-row step took {} with each layer as five Triton kernels, {} of its floor, {} as fast as "
           "transformers at its best", DECODE_WAYS,
           (Value("figures.ways.0.ms_per_step", milliseconds),
            Value("figures.ways.0", percent, lambda rows: rows[0]["floor_ms"] / rows[0]["ms_per_step"]),
            Value("figures.ways.0.speedup_vs_transformers", times)), (), ratio=True),
)

# Where a step's time goes (`bench/step_phases.py`): grpo-mtl's split over the profiled steps, at its defaults.
STEP_PHASES_GRPO = "bench/results/phases/step-phases-grpo-mtl-2026-11-29-h200x2.json"


def phase_share(recipe: str, phase: str) -> Value:
    """`phase`'s share of rank 0's profiled window, as the recipe's run timed it."""
    return Value(f"figures.recipes.{recipe}.profiler.by_rank.0", percent,
                 lambda ranks: ranks[0]["ours"][phase] / ranks[0]["window_s"])


STEP_PHASE_FIGURES = (
    Figure("a grpo-mtl step at its defaults went {} to forward+backward, {} to generating and {} to rewards",
           STEP_PHASES_GRPO, tuple(phase_share("grpo-mtl", phase) for phase in ("forward_backward", "generate",
                                                                                  "reward")), ("grpo-mtl",)),
)

# The CPU commands (`python bench/cpu_commands.py`, 2 CPU ranks on 2 cores): the demo's figures and the
# table of each recipe's default CPU run. None until it is measured at today's defaults; then the file it
# wrote, and README holds the texts `python bench/readme_figures.py --texts` prints for them.
CPU_COMMANDS: str | None = "bench/results/cpu_commands/readme-cpu-commands-2026-11-30-cpu.json"


def cpu_run(command: str, field: str, form: Callable[[object], str] = hundredths, nth: int = 0) -> Value:
    """A figure of the command's `nth` run by run id (the demo's: 0 plain sampling, 1 power sampling)."""
    return Value(f"figures.{command}.runs.*", form, lambda runs: sorted(runs, key=lambda run: run["id"])[nth][field])


def cpu_row(recipe: str) -> Figure:
    """A recipe's row of README's CPU table: its command's time, greedy and T=1 accuracy before -> after."""
    accuracy = [cpu_run(recipe, f"accuracy_{kind}_{when}") for kind in ("greedy", "sampled")
                for when in ("before", "after")]
    return Figure(f"| {recipe} | `gpuscale run --recipe {recipe} --gpus 2` | {{}} | {{}} → {{}} / {{}} → {{}} |",
                  CPU_COMMANDS, (Value(f"figures.{recipe}.wall_s", seconds), *accuracy), (recipe,),
                  tiny_math_test=True)


def cpu_command_figures() -> tuple[Figure, ...]:
    if CPU_COMMANDS is None:
        return ()
    sample = "power-sampling-method-sample"
    return (
        Figure("prints both accuracies ({} and {} on this project's machine", CPU_COMMANDS,
               (cpu_run("demo", "accuracy", percent), cpu_run("demo", "accuracy", percent, nth=1)), POWER,
               tiny_math_test=True),
        Figure("It took {} on a quiet 2-core machine", CPU_COMMANDS, (Value("figures.demo.wall_s", seconds),), POWER),
        Figure("| probe | `gpuscale run --recipe probe --gpus 2` | {} | — |", CPU_COMMANDS,
               (Value("figures.probe.wall_s", seconds),), ("probe",)),
        Figure("| power-sampling | `gpuscale run --recipe power-sampling --gpus 2`, then `--set method=sample` | "
               "{} + {} | {} vs {} |", CPU_COMMANDS,
               (Value("figures.power-sampling.wall_s", seconds), Value(f"figures.{sample}.wall_s", seconds),
                cpu_run("power-sampling", "accuracy", percent), cpu_run(sample, "accuracy", percent)), POWER,
               tiny_math_test=True),
        *(cpu_row(recipe) for recipe in TRAINING),
    )


def registered() -> tuple[Figure, ...]:
    return (*ACCEPTANCE_FIGURES, *FAULT_FIGURES, *SFT_SPEED_FIGURES, *GRPO_SPEED_FIGURES, *GRPO_ASYNC_FIGURES,
            *GRPO_ASYNC_LEARNING_FIGURES, *NODE_CHECK_FIGURES,
            *DECODE_FIGURES, *STEP_PHASE_FIGURES, *cpu_command_figures())


def blocks(text: str) -> tuple[list[str], str]:
    """README's figure blocks, and the text outside them. Raises ValueError on a block not closed."""
    inside, outside, rest = [], [], text
    while OPEN in rest:
        before, _, after = rest.partition(OPEN)
        block, closed, rest = after.partition(CLOSE)
        if not closed or OPEN in block:
            raise ValueError(f"README: a `{OPEN}` block is not closed by `{CLOSE}` before the next one")
        outside.append(before)
        inside.append(block)
    if CLOSE in rest:
        raise ValueError(f"README: `{CLOSE}` without its `{OPEN}`")
    return inside, "".join([*outside, rest])


def added_since_hint(recipe: str, recorded: str) -> str:
    """What a stale fingerprint would be but for one setting added since (defaults_fingerprint's
    settings_added_since): the setting to name in NEUTRAL_ADDITIONS if its default keeps the behaviour before it."""
    added = settings_added_since(recipe, recorded)
    return (f" (today's defaults less the new setting {added[0]!r} give it: if that setting's default keeps what "
            "the recipe did before it, name it in NEUTRAL_ADDITIONS, gpuscale/recipes/shared/defaults_fingerprint.py; "
            "else measure the figure again)") if added else ""


def stale_reasons(figure: Figure, data: dict, fingerprints: dict[str, str], edition: str) -> list[str]:
    """Why the JSON no longer stands for today's tool: a recipe's defaults changed, another test split."""
    recorded = data.get("defaults_fingerprints") or {}
    reasons = [f"{recipe}'s defaults fingerprint {recorded[recipe]} is not today's {fingerprints[recipe]}"
               f"{added_since_hint(recipe, recorded[recipe])}"
               if recipe in recorded else f"it records no defaults fingerprint of {recipe}"
               for recipe in figure.recipes if recorded.get(recipe) != fingerprints[recipe]]
    split = data.get("test_split") or OLD_TEST_SPLIT
    if figure.tiny_math_test and split != edition:
        reasons.append(f"it was scored on tiny-math's {split}, today's test split is {edition}")
    return reasons


def figure_problems(figure: Figure, in_blocks: str, results_md: str, root: Path, fingerprints: dict[str, str],
                    edition: str) -> tuple[list[str], str | None]:
    """What is wrong with one figure, and its text as the JSON gives it (None where it cannot be read)."""
    where = f"README figure '{figure.name}' ({figure.result})"
    path = root / figure.result
    if not path.is_file():
        return [f"{where}: the result JSON is missing"], None
    data = json.loads(path.read_text())
    problems = [f"{where}: stale: {reason}" for reason in stale_reasons(figure, data, fingerprints, edition)]
    try:
        quoted = figure.quoted(data)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        return [*problems, f"{where}: a value is not in the JSON ({error!r})"], None
    if quoted not in in_blocks:
        problems.append(f"{where}: README's figure blocks do not hold {quoted!r}, what the JSON gives")
    if figure.ratio and quoted not in results_md:
        problems.append(f"{where}: bench/RESULTS.md does not quote this ratio as README does: {quoted!r}")
    return problems, quoted


def unregistered(block: str, quoted: list[str]) -> list[str]:
    """The figures of a block that no registered figure's text holds."""
    for text in sorted([*quoted, *UNMEASURED_TEXTS], key=len, reverse=True):
        block = block.replace(text, " ")
    return [match.group(0).strip() for match in FIGURE.finditer(DATE.sub(" ", block))
            if match.group("sign") or match.group("decimal") or match.group("unit")]


def problems(readme: str, results_md: str, figures: tuple[Figure, ...] | None = None,
             root: Path = ROOT) -> list[str]:
    """Everything that keeps README's figures from being today's; empty when all are."""
    try:
        inside, outside = blocks(readme)
    except ValueError as error:
        return [str(error)]
    fingerprints, edition = defaults_fingerprints(), TEST_SPLIT_EDITION
    inside = [" ".join(block.split()) for block in inside]  # README's line breaks are no part of a figure
    in_blocks = " | ".join(inside)
    found, quoted = [], []
    for figure in registered() if figures is None else figures:
        wrong, text = figure_problems(figure, in_blocks, results_md, root, fingerprints, edition)
        found += wrong
        quoted += [text] if text else []
    for block in inside:
        found += [f"README: {figure!r} in a figure block is no registered figure (bench/readme_figures.py)"
                  for figure in unregistered(block, quoted)]
    for text in UNMEASURED_DATES:
        outside = outside.replace(text, " ")
    found += [f"README: the date {date} outside the figure blocks: a measured figure goes in a block"
              for date in DATE.findall(outside)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", action="store_true",
                        help="print each registered figure's text as its JSON gives it (to update README)")
    args = parser.parse_args(argv)
    if args.texts:
        for figure in registered():
            print(figure.quoted(json.loads((ROOT / figure.result).read_text())), end="\n\n")
        return 0
    found = problems((ROOT / "README.md").read_text(), (ROOT / "bench" / "RESULTS.md").read_text())
    print("\n".join(found) or f"README's {len(registered())} registered figures are today's")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
