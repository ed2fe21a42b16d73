"""Every bad input: exit code 2, one line naming the field, the value and the reason, nothing written."""

import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest

from conftest import SLOWNESS, gpuscale, run_json
from file_modes import as_file_modes_apply, set_modes, write_history
from gpuscale.control.store import Store


@pytest.mark.parametrize("args, message", [
    (["run", "--recipe", "nope"],
     "recipe: 'nope': unknown recipe; known recipes: eggroll, grpo-mtl, power-sampling, probe, rft, sft"),
    (["run", "--recipe", "probe", "--set", "bogus=1"], "bogus: unknown setting"),
    (["run", "--recipe", "probe", "--batch-size", "0"], "batch_size: '0': Input should be greater than or equal to 1"),
    (["run", "--recipe", "probe", "--gpus", "999"], "gpus: 999: "),
    (["run", "--recipe", "probe", "--precision", "fp4"], "precision: 'fp4': "),
    (["run", "--recipe", "power-sampling", "--model", "nope"],
     "model: 'nope': unknown model; known models: tiny-math, random-tiny, random-qwen2.5-0.5b, random-qwen2.5-1.5b"),
    (["run", "--recipe", "power-sampling", "--dataset", "nope"],
     "dataset: 'nope': unknown data set; known data sets: tiny-math, tiny-math-conflict, gsm8k"),
    (["run", "--recipe", "power-sampling", "--dataset", "/no/such/file.jsonl"],
     "dataset: '/no/such/file.jsonl': no such file"),
    (["run", "--recipe", "power-sampling", "--dataset", "tiny-math:arithmetic,algebra"],
     "dataset: 'tiny-math:arithmetic,algebra': unknown domain 'algebra' of tiny-math; "
     "known domains: arithmetic, comparison, counting"),
    (["run", "--recipe", "power-sampling", "--dataset", "a.jsonl,tiny-math"],
     "dataset: 'a.jsonl,tiny-math': 'tiny-math' is not a .jsonl file"),
    (["sbatch", "--recipe", "probe", "--nodes", "2", "--gpus-per-node", "8", "--set", "batch_size=-1"],
     "batch_size: '-1'"),
    (["run", "--recipe", "grpo-mtl", "--gpus", "2", "--set", "rollout=async", "--set", "generation_gpus=2"],
     "generation_gpus: 2: the run has 2 "),  # GPUs or CPU ranks, and none left to train
    (["run", "--recipe", "grpo-mtl", "--set", "domain_weights=comparison=0"],
     "domain_weights: 'comparison=0': 'comparison=0': the weight must be a finite number above 0"),
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


@pytest.mark.parametrize("preset_text, message", [
    ("batch_size = true\n", "batch_size: True: true/false where a number is expected"),
    ("seed = 12345678901234567890123\n",
     "seed: 12345678901234567890123: Input should be less than or equal to 4294967295"),
    ("[probe]\nsteps = 0\n", "steps: 0: Input should be greater than or equal to 1"),  # the recipe's table is read
    ("[porbe]\nsteps = 3\n", "[porbe]: a table holds one recipe's settings and no recipe is called 'porbe'"),
])
def test_a_bad_preset_is_refused_before_launch(home, tmp_path, preset_text, message):
    preset = tmp_path / "p.toml"
    preset.write_text(f"gpus = 1\n{preset_text}[sft]\nepochs = true\n")  # sft's table is not probe's
    result = gpuscale("run", "--recipe", "probe", "--preset", str(preset))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
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


# ---- a home that cannot be written or read, a damaged history ------------------------------

def gpuscale_under_modes(prefix: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "gpuscale.app.cli", *args], capture_output=True, text=True,
                          timeout=120)


def one_error_line(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuscale: error: "), result.stderr  # no traceback
    return lines[0]


@pytest.mark.parametrize("another_reader", [False, True], ids=["closed cleanly", "open elsewhere"])
def test_read_only_home_reads_history_and_refuses_writes_in_one_line(home, tmp_path, another_reader):
    """Closed cleanly, runs.db has no -wal/-shm files, and a read-only folder cannot get them (SQLite's
    read-only WAL rule: the file is then read as immutable); open elsewhere, they exist and are read."""
    prefix = as_file_modes_apply(tmp_path)
    run_id = write_history(home)
    reader = sqlite3.connect(home / "runs.db") if another_reader else None
    if reader:
        reader.execute("SELECT count(*) FROM runs").fetchone()
    assert (home / "runs.db-wal").exists() == another_reader
    before = sorted(p.name for p in home.iterdir()), (home / "runs.db").read_bytes()
    set_modes(home, 0o555)
    try:
        listed = gpuscale_under_modes(prefix, "runs", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [(r["id"], r["status"]) for r in json.loads(listed.stdout)] == [(run_id, "succeeded")]
        shown = gpuscale_under_modes(prefix, "show", str(run_id), "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["summary"] == {"tokens_per_s": 5.0}
        exported = gpuscale_under_modes(prefix, "export", str(run_id))
        assert exported.returncode == 0 and json.loads(exported.stdout)["metrics"][0]["value"] == 8.0
        logs = gpuscale_under_modes(prefix, "logs", str(run_id))
        assert logs.returncode == 0 and "[rank0] rank 0/1" in logs.stdout
        for command in (["run", "--recipe", "probe", "--detach"], ["delete", str(run_id)], ["stop", str(run_id)]):
            line = one_error_line(gpuscale_under_modes(prefix, *command))
            assert line.startswith(f"gpuscale: error: {home}: not writable (")
            assert "needs a writable GPUSCALE_HOME" in line
        assert (sorted(p.name for p in home.iterdir()), (home / "runs.db").read_bytes()) == before
    finally:
        set_modes(home, 0o755)
        if reader:
            reader.close()
    assert [r["id"] for r in Store(home).list_runs()] == [run_id]  # the delete did not happen


def test_unreadable_home_is_one_line_naming_it(home, tmp_path):
    prefix = as_file_modes_apply(tmp_path)
    write_history(home)
    home.chmod(0)
    try:
        for command in (["runs"], ["show", "1"], ["run", "--recipe", "probe", "--detach"]):
            line = one_error_line(gpuscale_under_modes(prefix, *command))
            assert str(home) in line and "permission denied" in line
    finally:
        home.chmod(0o755)


def test_home_that_cannot_be_created_reads_as_an_empty_history(home, tmp_path):
    prefix = as_file_modes_apply(tmp_path)
    home.parent.chmod(0o555)  # GPUSCALE_HOME does not exist and cannot be made
    try:
        listed = gpuscale_under_modes(prefix, "runs", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout) == []
        line = one_error_line(gpuscale_under_modes(prefix, "run", "--recipe", "probe", "--detach"))
        assert line.startswith(f"gpuscale: error: {home}: not writable (permission denied)")
    finally:
        home.parent.chmod(0o755)
    assert not home.exists()


def test_damaged_history_is_one_line_and_doctor_repairs_it(home):
    run_id = write_history(home)
    with open(home / "runs.db", "r+b") as handle:  # the SQLite header overwritten
        handle.write(b"\0garbage" * 16)
    for command in (["runs"], ["show", str(run_id)], ["run", "--recipe", "probe", "--detach"], ["delete", "1"]):
        line = one_error_line(gpuscale(*command))
        assert line == (f"gpuscale: error: {home / 'runs.db'}: the run history is damaged (file is not a database); "
                        "move it aside (`gpuscale doctor --repair` does, keeping the run folders) and gpuscale "
                        "starts a new one")
    checked = gpuscale("doctor")
    assert checked.returncode == 1 and "PROBLEM  " in checked.stdout and "damaged" in checked.stdout
    repaired = gpuscale("doctor", "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert "moved to runs.db.damaged-" in repaired.stdout and "the history is healthy" in repaired.stdout
    assert run_json("runs") == [] and (home / "runs" / str(run_id) / "logs" / "rank0.log").exists()
    assert gpuscale("doctor").returncode == 0


# ---- model errors before launch -------------------------------------------------------------


def copy_of_tiny_math(tmp_path):
    from gpuscale.data.models import model_path

    directory = tmp_path / "model"
    shutil.copytree(model_path("tiny-math"), directory)
    return directory


def truncate_weights(directory):
    path = directory / "model.safetensors"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)  # a download cut off half-way
    return f"{path}: not a readable safetensors file (Error while deserializing header: incomplete metadata"


def remove_config(directory):
    (directory / "config.json").unlink()
    return f"{directory}: no config.json, so not a Hugging Face model directory"


def break_config(directory):
    (directory / "config.json").write_text('{"model_type": "llama",')
    return f"{directory / 'config.json'}: not valid JSON (line 1: "


@pytest.mark.parametrize("damage", [truncate_weights, remove_config, break_config])
def test_broken_model_directory_is_refused_before_launch(home, tmp_path, damage):
    directory = copy_of_tiny_math(tmp_path)
    expected = damage(directory)
    line = one_error_line(gpuscale("run", "--recipe", "power-sampling", "--gpus", "1", "--model", str(directory)))
    assert line.startswith(f"gpuscale: error: model: {expected}")
    assert run_json("runs") == [] and not any((home / "runs").iterdir())  # nothing recorded or started


def with_custom_code(directory, model_type: str) -> None:
    """The model's config as a model with code of its own has it: auto_map naming classes of its folder's files."""
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_mine.MineConfig",
                                                   "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "modeling_mine.py").write_text(f"open({str(directory / 'RAN')!r}, 'w')\n")


def test_a_model_with_code_of_its_own_is_refused_before_launch_naming_trust_remote_code(home, tmp_path):
    """transformers would run such a model's own code only with trust_remote_code, which gpuscale never
    passes: the rank failed after launch with transformers' prompt cut; now one line before anything starts."""
    directory = copy_of_tiny_math(tmp_path)
    with_custom_code(directory, "mine")
    line = one_error_line(gpuscale("run", "--recipe", "power-sampling", "--gpus", "1", "--model", str(directory)))
    assert line.startswith(f"gpuscale: error: model: {directory / 'config.json'}: model_type 'mine' is not one "
                           "transformers knows, and its auto_map (AutoConfig -> configuration_mine.MineConfig, "
                           "AutoModelForCausalLM -> modeling_mine.MineForCausalLM) names code of the model's own, "
                           "which transformers runs only with trust_remote_code; gpuscale runs no code")
    assert run_json("runs") == [] and not (directory / "RAN").exists()


def test_a_model_of_a_known_type_with_an_auto_map_loads_with_transformers_own_class(tmp_path):
    """A Llama checkpoint that still carries an auto_map: transformers' own class, none of the folder's code."""
    from gpuscale.data.models import check_model, load_model

    directory = copy_of_tiny_math(tmp_path)
    with_custom_code(directory, "llama")
    check_model(str(directory))
    model, _tokenizer = load_model(str(directory))
    assert type(model).__name__ == "LlamaForCausalLM" and not (directory / "RAN").exists()


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_hub_model_not_cached_fails_at_once_in_one_line(home, tmp_path, hub):
    """The hub id is not in the (empty) cache: with HF_HUB_OFFLINE nothing is asked; with the hub at an
    address that refuses connections, the check says so instead of a rank retrying for 30 s."""
    env = {"HF_HOME": str(tmp_path / "hf")}
    if hub == "unreachable":
        env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    line = one_error_line(gpuscale("run", "--recipe", "power-sampling", "--model", "someone/no-such-model", env=env))
    reason = ("not in the local Hugging Face cache" if hub == "offline"
              else "the Hugging Face hub cannot be reached (")
    assert line.startswith(f"gpuscale: error: model: 'someone/no-such-model': {reason}")
    assert "hf download someone/no-such-model" in line
    assert run_json("runs") == []


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connections are refused


@pytest.mark.parametrize("recipe", ["eggroll", "power-sampling", "probe", "sft"])
def test_every_recipe_checks_its_model_before_launch(home, tmp_path, recipe):
    """The model check is the base class's: a recipe with checks of its own still runs it (super())."""
    directory = copy_of_tiny_math(tmp_path)
    expected = remove_config(directory)
    line = one_error_line(gpuscale("run", "--recipe", recipe, "--gpus", "1", "--model", str(directory)))
    assert line == f"gpuscale: error: model: {expected}"
    assert run_json("runs") == []


# ---- too little training data for what a step takes ----------------------------------------


def jsonl_of(tmp_path, rows: int):
    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"question": f"How much is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(rows)))
    return data


@pytest.mark.parametrize("recipe, rows, settings, expected", [
    ("grpo-mtl", None, ["max_examples=4"],
     "prompts_per_step: 64: needs at least 64 training examples, the run has 4 (max_examples=4 of tiny-math); "
     "every step trains on that many distinct prompts"),
    ("grpo-mtl", 6, ["eval_examples=2", "prompts_per_step=8", "num_generations=2", "batch_size=4"],
     "prompts_per_step: 8: needs at least 8 training examples, the run has 4 (dataset={data}, after "
     "eval_examples=2 held out); "),
    ("eggroll", None, ["max_examples=8"],
     "prompts_per_step: 16: needs at least 16 training examples, the run has 8 (max_examples=8 of tiny-math); "
     "every step samples that many distinct prompts"),
    ("eggroll", 1, ["eval_examples=0"],
     "prompts_per_step: 16: needs at least 16 training examples, the run has 1 (dataset={data}); "),
    ("rft", 1, ["eval_examples=0"],
     "gpus: 2: needs at least 2 training examples, the run has 1 (dataset={data}, max_examples=4000); "
     "the 2 ranks each generate"),
    ("rft", 1, [],
     "eval_examples: 500: needs at least 1 training examples, the run has 0 (dataset={data}, max_examples=4000, after "
     "eval_examples=500 held out); it holds out every example"),
])
def test_too_few_training_examples_are_refused_before_launch(home, tmp_path, recipe, rows, settings, expected):
    """Today these start: grpo-mtl "succeeds" with 0 steps, eggroll fails a step in with
    'Sample larger than population', rft fails on the rank that got no question."""
    data = jsonl_of(tmp_path, rows) if rows else None
    args = ["run", "--recipe", recipe, "--gpus", "2" if recipe == "rft" else "1"]
    args += ["--dataset", str(data)] if data else []
    for setting in settings:
        args += ["--set", setting]
    line = one_error_line(gpuscale(*args))
    assert expected.format(data=data) in line, line
    assert run_json("runs") == [] and not any((home / "runs").iterdir())


def test_a_domain_weight_of_a_domain_the_data_lacks_is_refused_before_launch(home):
    """The data set's domains are the recipe's check's to read (a file's are its rows'): refused before any run."""
    line = one_error_line(gpuscale("run", "--recipe", "grpo-mtl", "--set", "domain_weights=comparison=2,geometry=2"))
    assert line == ("gpuscale: error: domain_weights: 'comparison=2,geometry=2': unknown domain 'geometry' of "
                    "tiny-math; known domains: arithmetic, comparison, counting")
    assert run_json("runs") == [] and not any((home / "runs").iterdir())


@pytest.mark.parametrize("recipe, settings, expected", [
    ("sft", ["rows_per_step=3"], "rows_per_step: 3: 3 rows a step do not split over 2 ranks (each takes an equal "
     "share of a step); use rows_per_step 2 or 4, or 1 or 3 ranks"),
    ("sft", ["batch_size=3"], "batch_size: 3: does not divide the 4 rows each of the 2 ranks takes a step "
     "(rows_per_step 8); use 2 or 4"),
    ("rft", ["train_batch_size=3"], "train_batch_size: 3: does not divide the 16 rows each of the 2 ranks takes a "
     "step (rows_per_step 32); use 2 or 4"),
    # Once refused only on the ranks, 10 s after launch (their accumulation_steps): now before it.
    ("grpo-mtl", ["prompts_per_step=3", "num_generations=3"], "prompts_per_step: 3: 3 prompts x 3 generations = 9 "
     "completions do not split over 2 ranks (each takes an equal share of a step); use prompts_per_step 2 or 4, "
     "or 1 or 3 ranks"),
    # It was refused, counting 1 rank.
    ("grpo-mtl", ["batch_size=3"], "batch_size: 3: does not divide the 128 completions each of the 2 ranks takes a "
     "step (64 prompts x 4 generations = 256 completions); use 2 or 4"),
    ("eggroll", ["antithetic=false", "population=5"], "population: 5: 5 members do not split over 2 ranks (each "
     "takes an equal share of a step); use population 4 or 6, or 1 or 5 ranks"),
])
def test_a_step_the_ranks_cannot_share_is_refused_before_launch(home, recipe, settings, expected):
    args = ["run", "--recipe", recipe, "--gpus", "2", *(f"--set={setting}" for setting in settings)]
    started = time.monotonic()
    line = one_error_line(gpuscale(*args))
    assert expected in line, line
    assert time.monotonic() - started < 5 * SLOWNESS  # refused before anything starts
    assert run_json("runs") == [] and not any((home / "runs").glob("*"))
