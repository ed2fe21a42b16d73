"""What `gpuscale sbatch` lets into the script it prints: every #SBATCH value checked against SLURM's
syntax (refused, exit 2, naming the option and the value), and every free-text value of the command
line (a setting, a path, the label) quoted, so that no value can run a shell command when the job runs.
The script is run by bash with srun, scontrol and gpuscale stood in for."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuscale.control import launch
from gpuscale.runs.settings import SettingsError

# Each would run `touch PWNED` in the job's folder if it reached the shell unquoted.
PAYLOADS = {
    "newline": "gpu\ntouch PWNED",
    "space": "gpu touch PWNED",
    "semicolon": "gpu;touch PWNED",
    "substitution": "$(touch PWNED)",
    "backquotes": "`touch PWNED`",
}
SLURM_OPTIONS = ("partition", "account", "qos", "time")


def sbatch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = ["sbatch", "--recipe", "probe", "--nodes", "2", "--gpus-per-node", "4"]
    return subprocess.run([sys.executable, "-m", "gpuscale.app.cli", *base, *args], capture_output=True, text=True,
                          cwd=cwd)


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("option", SLURM_OPTIONS)
def test_an_sbatch_value_slurm_would_not_take_is_refused_before_anything_is_printed(option, payload):
    result = sbatch(f"--{option}", payload)
    assert result.returncode == 2
    assert result.stdout == ""  # no script at all
    [line] = result.stderr.splitlines()
    assert line.startswith(f"gpuscale: error: {option}: {payload!r}: expected ")


@pytest.mark.parametrize("time_limit", ["30", "30:00", "04:00:00", "2-12", "2-12:30", "2-12:30:15", "UNLIMITED",
                                        "infinite", "0"])
def test_every_time_format_of_slurm_is_taken(time_limit):
    assert f"#SBATCH --time={time_limit}\n" in launch.sbatch_script("probe", 1, 1, [], {"time": time_limit})


@pytest.mark.parametrize("time_limit", ["", "4h", "1:2:3:4", "-1", "1-", "1-2:3:4:5", "\u0663\u0660", "04:00:00 "])
def test_a_time_slurm_does_not_read_is_refused(time_limit):
    with pytest.raises(SettingsError, match=r"^time: .*: expected SLURM's time formats: minutes, MM:SS"):
        launch.sbatch_script("probe", 1, 1, [], {"time": time_limit})


def test_the_options_given_are_written_and_those_not_given_left_out():
    script = launch.sbatch_script("probe", 2, 4, [], {"time": "1-00", "partition": "gpu,a100", "account": "lab-7",
                                                      "qos": None})
    lines = script.splitlines()
    assert {"#SBATCH --time=1-00", "#SBATCH --partition=gpu,a100", "#SBATCH --account=lab-7"} <= set(lines)
    assert not any(line.startswith("#SBATCH --qos") for line in lines)


def test_a_label_with_a_control_character_is_refused():
    result = sbatch("--label", PAYLOADS["newline"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"gpuscale: error: label: {PAYLOADS['newline']!r}: a control character (newline, tab, "
                             "escape...) is not allowed in a label\n")


def stand_ins(bin_dir: Path, argv_file: Path) -> None:
    """srun runs its command (as on one node, SLURM_NODEID 0), scontrol names the one node, and
    gpuscale writes the arguments it was given, NUL-separated, to `argv_file`."""
    bin_dir.mkdir()
    tools = {
        "srun": 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": "echo node7\n",
        "gpuscale": f"printf '%s\\0' \"$@\" > {argv_file}\n",
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("payload", [*PAYLOADS.values(), "it's \"odd\" $HOME"], ids=[*PAYLOADS, "quotes"])
def test_free_text_reaches_gpuscale_run_whole_and_runs_nothing(tmp_path, payload):
    """A label (on one line: see above), a setting's value, the paths of a model folder, a data file
    and a preset, each holding the payload: the script, run by bash, hands each to `gpuscale run` as
    one argument, as typed, and runs no command of them (no PWNED in the job's folder)."""
    odd = tmp_path / f"in {payload.replace('/', '_')}"
    model, data, preset = odd / "model", odd / "data.jsonl", odd / "preset.toml"
    model.mkdir(parents=True)
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    preset.write_text("seed = 1\n")
    given = [("--set", f"model={model}"), ("--set", f"dataset={data}"), ("--set", f"rdzv_id={payload}"),
             ("--preset", str(preset))]
    if "\n" not in payload:
        given.append(("--label", f"run {payload}"))
    printed = sbatch(*(arg for pair in given for arg in pair))
    assert printed.returncode == 0, printed.stderr
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.sh").write_text(printed.stdout)
    argv_file = tmp_path / "argv"
    stand_ins(tmp_path / "bin", argv_file)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "node7"}
    ran = subprocess.run(["bash", "job.sh"], cwd=job, env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    argv = argv_file.read_text().split("\0")[:-1]
    assert not (job / "PWNED").exists() and sorted(p.name for p in job.iterdir()) == ["job.sh"]
    for option, value in given:
        assert value in argv and argv[argv.index(value) - 1] == option
    assert argv[-2:] == ["--node-rank", "0"] and "rdzv_id=77" in argv
