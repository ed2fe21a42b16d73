"""Every bad input: exit code 2, one line naming the field, the value and the reason, nothing written."""

import json

import psutil
import pytest

from conftest import gpuscale


@pytest.mark.parametrize("args, message", [
    (["run", "--recipe", "nope"], "recipe: 'nope': unknown recipe; known recipes: eggroll, power-sampling, probe, sft"),
    (["run", "--recipe", "probe", "--set", "bogus=1"], "bogus: unknown setting"),
    (["run", "--recipe", "probe", "--batch-size", "0"], "batch_size: '0': Input should be greater than or equal to 1"),
    (["run", "--recipe", "probe", "--gpus", "999"], "gpus: 999: "),
    (["run", "--recipe", "probe", "--precision", "fp4"], "precision: 'fp4': "),
    (["run", "--recipe", "power-sampling", "--model", "nope"],
     "model: 'nope': unknown model; known models: tiny-math, random-tiny, random-qwen2.5-0.5b"),
    (["run", "--recipe", "power-sampling", "--dataset", "nope"],
     "dataset: 'nope': unknown data set; known data sets: tiny-math, gsm8k"),
    (["run", "--recipe", "power-sampling", "--dataset", "/no/such/file.jsonl"],
     "dataset: '/no/such/file.jsonl': no such file"),
    (["run", "--recipe", "power-sampling", "--dataset", "tiny-math:arithmetic,algebra"],
     "dataset: 'tiny-math:arithmetic,algebra': unknown domain 'algebra' of tiny-math; "
     "known domains: arithmetic, comparison, counting"),
    (["run", "--recipe", "power-sampling", "--dataset", "a.jsonl,tiny-math"],
     "dataset: 'a.jsonl,tiny-math': 'tiny-math' is not a .jsonl file"),
    (["sbatch", "--recipe", "probe", "--nodes", "2", "--gpus-per-node", "8", "--set", "batch_size=-1"],
     "batch_size: '-1'"),
])
def test_bad_run_input_starts_and_writes_nothing(home, args, message):
    result = gpuscale(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"gpuscale: error: {result.stderr.split('error: ', 1)[1].strip()}"]
    assert message in result.stderr
    assert not home.exists()  # no runs.db, no run folder


def test_malformed_preset(home, tmp_path):
    preset = tmp_path / "bad.toml"
    preset.write_text("[broken\n")
    result = gpuscale("run", "--recipe", "probe", "--preset", str(preset))
    assert result.returncode == 2 and f"preset: {preset}: not valid TOML" in result.stderr
    assert not home.exists()


@pytest.mark.parametrize("command", [["show", "77"], ["logs", "77"], ["stop", "77"], ["export", "x1"],
                                     ["compare", "1", "2"]])
def test_unknown_run_id(home, command):
    result = gpuscale(*command)
    assert result.returncode == 2
    assert "no such run" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# Data that parses only when read: refused by the recipe's check before anything is recorded or started.
GOOD_LINE = json.dumps({"question": "How much is 2 + 2?", "answer": "2 + 2 = 4.\n#### 4"})


@pytest.mark.parametrize("lines, where, reason", [
    ([GOOD_LINE, GOOD_LINE, '{"question": "cut off'], "line 3", "not valid JSON"),
    ([GOOD_LINE, json.dumps({"question": "no answer"})], "line 2", "missing field 'answer'"),
    ([], "", "no examples"),
])
def test_bad_data_is_refused_before_launch(home, tmp_path, lines, where, reason):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    result = gpuscale("run", "--recipe", "power-sampling", "--gpus", "1", "--dataset", str(data))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line
    assert f"gpuscale: error: dataset: {data}{', ' + where if where else ''}: {reason}" in result.stderr
    runs = gpuscale("runs", "--json")
    assert runs.returncode == 0 and json.loads(runs.stdout) == []
    assert not any((home / "runs").iterdir())  # no run folder
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(home) in " ".join(p.info["cmdline"] or [])]
