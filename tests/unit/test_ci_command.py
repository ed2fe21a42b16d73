"""CI runs exactly the test command README.md gives: the lint, the quick part, then the end-to-end tests
only if the quick part passed."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL = 'pip install -e ".[test]"'


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("Run the tests", 1)[1].split("\n## ", 1)[0]
    (command,) = [line.strip() for line in section.splitlines() if line.startswith("    ")]
    return command


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_readme_s_test_command_as_it_is():
    command = readme_test_command()
    assert command.startswith(INSTALL + " && ")
    ci = ci_commands()
    assert any("pip install" in line and line.endswith('-e ".[test]"') for line in ci[:-1])  # installed first
    assert ci[-1] == command.removeprefix(INSTALL + " && ")


def test_the_quick_part_runs_first_and_the_end_to_end_tests_only_after_it():
    steps = [step.strip() for step in readme_test_command().split("&&")]
    assert steps[1:] == ["ruff check .", 'python -m pytest -q -n 2 -m "not e2e"', "python -m pytest -q -n 2 -m e2e"]
