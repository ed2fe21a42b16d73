"""Every measured figure README.md quotes is today's (bench/readme_figures.py).

The rule: README's measured figures live in `<!-- figures -->` ... `<!-- /figures -->` blocks, and every
number there with a unit, a sign or a decimal point belongs to a figure bench/readme_figures.py registers
with its result JSON; outside the blocks README names no date of a measurement. A registered figure fails
when its JSON is missing, its value formats to other words than README's, the defaults fingerprint of a
recipe it ran differs from today's, or (tiny-math accuracy) its test split is not today's; a ratio fails
when bench/RESULTS.md does not quote it in the same words. The tests below make each of these happen on a
copy of a real figure's JSON in tmp_path.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from bench_loader import load_bench

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RESULTS_MD = (ROOT / "bench" / "RESULTS.md").read_text()


@pytest.fixture(scope="module")
def figures():
    return load_bench("readme_figures.py")


def test_every_figure_readme_quotes_is_registered_and_today_s(figures):
    assert figures.problems(README, RESULTS_MD) == []


def copied(figures, tmp_path: Path, result: str, change) -> Path:
    """A copy of every registered figure's JSON under tmp_path, `change` applied to `result`'s data."""
    for path in {figure.result for figure in figures.registered()}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    data = json.loads((tmp_path / result).read_text())
    change(data)
    (tmp_path / result).write_text(json.dumps(data))
    return tmp_path


def check(figures, root: Path, registered=None, results_md: str = RESULTS_MD) -> list[str]:
    return figures.problems(README, results_md, registered or figures.registered(), root)


def test_a_deliberately_stale_figure_fails_naming_it(figures, tmp_path):
    hang = figures.FAULT_FIGURES[0]  # grpo-mtl's CPU run frozen: its JSON serves no other figure
    other = "0" * 16
    root = copied(figures, tmp_path, hang.result, lambda data: data["defaults_fingerprints"].update(
        {"grpo-mtl": other}))
    assert check(figures, root) == [f"README figure '{hang.name}' ({hang.result}): stale: grpo-mtl's defaults "
                                    f"fingerprint {other} is not today's "
                                    f"{figures.defaults_fingerprints()['grpo-mtl']}"]
    assert check(figures, copied(figures, tmp_path, hang.result, lambda data: None)) == []  # the copy as it was


def test_a_new_setting_left_out_of_the_neutral_additions_is_named_where_the_figures_go_stale(figures, monkeypatch):
    """What failed CI at stop 76: grpo-mtl gained `entropy_coef` (0: TRL's loss as before) without its neutral
    entry, and every grpo-mtl figure read stale. The reason now names the setting and where to declare it."""
    from gpuscale.recipes.shared import defaults_fingerprint

    hang = figures.FAULT_FIGURES[0]  # a grpo-mtl figure
    neutral = dict(defaults_fingerprint.NEUTRAL_ADDITIONS["grpo-mtl"])
    del neutral["entropy_coef"]
    monkeypatch.setitem(defaults_fingerprint.NEUTRAL_ADDITIONS, "grpo-mtl", neutral)
    found = [line for line in check(figures, ROOT) if f"'{hang.name}'" in line]
    assert found and "today's defaults less the new setting 'entropy_coef' give it" in found[0]
    assert "NEUTRAL_ADDITIONS" in found[0]


def test_only_the_recipes_a_figure_ran_are_compared(figures, tmp_path):
    hang = figures.FAULT_FIGURES[0]  # grpo-mtl's case of a JSON that holds sft's too
    root = copied(figures, tmp_path, hang.result, lambda data: data["defaults_fingerprints"].update(sft="0"))
    assert check(figures, root) == []
    as_sft = [dataclasses.replace(f, recipes=("sft",)) if f is hang else f for f in figures.registered()]
    (found,) = check(figures, root, as_sft)
    assert f"'{hang.name}'" in found and "stale: sft's defaults fingerprint 0 is not today's" in found


def test_a_missing_json_a_result_without_fingerprints_and_the_old_test_split_fail(figures, tmp_path):
    root = copied(figures, tmp_path, figures.ACCEPTANCE, lambda data: [data.pop("defaults_fingerprints"),
                                                                       data.pop("test_split")])
    found = check(figures, root)
    assert any("records no defaults fingerprint of sft" in line for line in found)
    assert any("tiny-math's test-v1, today's test split is test-v2" in line for line in found)
    (root / figures.FAULTS).unlink()
    assert f"README figure '{figures.FAULT_FIGURES[0].name}' ({figures.FAULTS}): the result JSON is missing" in check(
        figures, root)


def test_a_value_that_formats_to_other_words_fails(figures, tmp_path):
    root = copied(figures, tmp_path, figures.ACCEPTANCE,
                  lambda data: data["figures"]["targets"]["sft"]["greedy"]["points"].update(gain_greedy=22.9))
    found = check(figures, root)
    assert any("(sft greedy" in line and "greedy +22.9" in line for line in found)
    assert any("| sft | +22.9 / +13.6: met / met" in line for line in found)
    assert "'+23.9' in a figure block is no registered figure" in "\n".join(found)  # README's old words stay


def test_a_ratio_readme_quotes_must_be_results_md_s(figures):
    ratios = [dataclasses.replace(f, ratio=True) if f in figures.FAULT_FIGURES else f for f in figures.registered()]
    quoted = {f.name: f.quoted(json.loads((ROOT / f.result).read_text())) for f in ratios if f.ratio}
    assert figures.FAULT_FIGURES[0].name in quoted and len(quoted) > 1  # README's own ratios too
    found = check(figures, ROOT, ratios, results_md="")
    assert len(found) == len(quoted) and all("RESULTS.md does not quote this ratio" in p for p in found)
    everything_but_one = " ... ".join(text for name, text in quoted.items() if name != figures.FAULT_FIGURES[0].name)
    (found,) = check(figures, ROOT, ratios, results_md=everything_but_one)
    assert figures.FAULT_FIGURES[0].name in found
    assert check(figures, ROOT, ratios, results_md=" ... ".join(quoted.values())) == []


def test_an_unregistered_figure_in_a_block_or_a_date_outside_one_fails(figures):
    block = f"{figures.OPEN}4 x H200, 3 seeds, test-v2 (2026-11-29): 1.24x, 88,000 tokens/s, +0.3, 0.5b{figures.CLOSE}"
    found = figures.problems(block, "", ())
    assert [line.split("'")[1] for line in found] == ["1.24x", "88,000 tokens/s", "+0.3"]
    assert "2026-11-28 outside" in figures.problems("measured on 2026-11-28: 48 s", "", ())[0]
    assert "not closed" in figures.problems("<!-- figures --> 48 s", "", ())[0]
    assert figures.problems("a range 75.0-75.8 and 41-54%", "", ()) == []  # outside the blocks: not read
    assert figures.unregistered("41-54% and 75.0-75.8", []) == ["54%", "75.0", "75.8"]


def test_the_cpu_commands_figures_read_from_their_json_once_it_is_named(figures, monkeypatch):
    """README's CPU table waits for `python bench/cpu_commands.py` at today's defaults; its entries read the
    last one's schema (2026-11-28, older defaults: each is stale, none unreadable)."""
    assert figures.cpu_command_figures() == () or figures.CPU_COMMANDS is not None
    monkeypatch.setattr(figures, "CPU_COMMANDS", "bench/results/cpu_commands/readme-cpu-commands-2026-11-28-cpu.json")
    cpu = figures.cpu_command_figures()
    rows = {f.quoted(json.loads((ROOT / f.result).read_text())) for f in cpu}
    assert "| sft | `gpuscale run --recipe sft --gpus 2` | 107 s | 56.8 → 65.6 / 36.8 → 55.8 |" in rows
    assert "prints both accuracies (36.0% and 53.5% on this project's machine" in rows  # plain, then power
    found = figures.problems("", "", cpu)
    assert all(any(f"'{f.name}'" in line and "stale: it records no defaults fingerprint" in line for line in found)
               for f in cpu)
    assert not any("not in the JSON" in line for line in found)
