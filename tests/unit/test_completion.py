"""`gpuscale completion bash|zsh`: the script, loaded by the real shell, completes the commands, their
options, the recipes' names and the other values a shell can offer, from the parser itself."""

import shutil
import subprocess
import sys

import pytest

from gpuscale.app.cli import COMMANDS
from gpuscale.recipes.shared.registry import all_recipes


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory):
    printed = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "completion", "bash"], capture_output=True,
                             text=True)
    assert printed.returncode == 0, printed.stderr
    path = tmp_path_factory.mktemp("completion") / "gpuscale.bash"
    path.write_text(printed.stdout)
    return path


def completions(script, *words: str) -> list[str]:
    """What bash offers after `words` (the last one being typed), through the completion function the
    script registers for gpuscale (`complete -p` names it), as bash calls it on TAB."""
    quoted = " ".join(f"'{word}'" for word in words)
    program = f"""
source {script}
function=$(complete -p gpuscale | sed -E 's/.* -F ([^ ]+) .*/\\1/')
COMP_WORDS=({quoted}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))
COMP_LINE="${{COMP_WORDS[*]}}"; COMP_POINT=${{#COMP_LINE}}
"$function" gpuscale "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    ran = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return sorted(line for line in ran.stdout.splitlines() if line)


def test_bash_completes_every_command(bash_script):
    assert set(COMMANDS) <= set(completions(bash_script, "gpuscale", ""))
    assert completions(bash_script, "gpuscale", "re") == ["recipes", "resume"]


def test_bash_completes_the_recipes_names_after_recipe(bash_script):
    for command in ("run", "tune", "sbatch"):
        assert completions(bash_script, "gpuscale", command, "--recipe", "") == sorted(all_recipes())
    assert completions(bash_script, "gpuscale", "run", "--recipe", "gr") == ["grpo-mtl"]


def test_bash_completes_options_statuses_and_paths(bash_script, tmp_path):
    assert completions(bash_script, "gpuscale", "sbatch", "--la") == ["--label"]
    assert completions(bash_script, "gpuscale", "runs", "--") == ["--help", "--json", "--label", "--limit",
                                                                   "--recipe", "--status"]
    assert completions(bash_script, "gpuscale", "runs", "--status", "s") == ["stopped", "succeeded"]
    preset = tmp_path / "sweep.toml"
    preset.write_text("")
    assert completions(bash_script, "gpuscale", "run", "--preset", str(tmp_path / "sw")) == [str(preset)]


def test_the_parser_that_reads_a_command_keeps_its_own_message_for_an_unknown_recipe():
    """The recipe names are choices in the completion's copy of the parser only."""
    refused = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "sbatch", "--recipe", "nope", "--nodes", "1",
                              "--gpus-per-node", "1"], capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr == ("gpuscale: error: recipe: 'nope': unknown recipe; known recipes: "
                              f"{', '.join(sorted(all_recipes()))}\n")


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_registers_the_completion_through_eval(tmp_path):
    printed = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "completion", "zsh"], capture_output=True,
                             text=True)
    assert printed.returncode == 0, printed.stderr
    script = tmp_path / "_gpuscale"
    script.write_text(printed.stdout)
    registered = subprocess.run(["zsh", "-fc", f'autoload -U compinit; compinit -u -D; eval "$(<{script})"; '
                                 "print -r -- $_comps[gpuscale]"], capture_output=True, text=True, timeout=60)
    assert registered.returncode == 0, registered.stderr
    assert registered.stdout.strip() == "_shtab_gpuscale"
    for name in all_recipes():
        assert name in printed.stdout
