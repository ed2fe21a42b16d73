"""power-sampling end to end on CPU: 2 ranks, the embedded default model and tasks."""

import json
import shutil

import pytest

from conftest import check_step_phases, gpuscale, run_json, run_together
from gpuscale.data.models import model_path
from gpuscale.data.tasks import load_examples
from gpuscale.runs.generations import read_generations

pytestmark = pytest.mark.e2e  # every test here starts real runs


def test_two_rank_power_sampling_run_on_the_defaults(home):
    run = run_json("run", "--recipe", "power-sampling", "--gpus", "2", "--set", "max_examples=6", "--batch-size", "3")
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    assert summary["method"] == "power" and summary["problems"] == 6
    assert 0.0 <= summary["accuracy"] <= 1.0 and 0.0 < summary["acceptance_rate"] <= 1.0
    assert summary["tokens_per_s"] > 0 and summary["problems_per_s"] > 0
    assert 0 < summary["warm_up_seconds"] < summary["sampling_seconds"]  # one short problem vs six
    shown = run_json("show", str(run["id"]))["summary"]
    assert {"accuracy", "acceptance_rate", "tokens_per_s", "problems_per_s"} <= set(shown)
    exported = json.loads(gpuscale("export", str(run["id"])).stdout)
    results = exported["results"]
    assert [r["index"] for r in results] == list(range(6))  # both ranks' shares, merged in order
    for row in results:
        assert row["token_ids"] and isinstance(row["completion"], str) and row["gold"]
        assert row["prompt_token_ids"] and all(isinstance(t, int) for t in row["prompt_token_ids"])
        assert len(row["logprobs"]) == row["tokens"] and all(lp <= 0 for lp in row["logprobs"])
        assert 0.0 <= row["acceptance_rate"] <= 1.0  # the share of this chain's MH moves accepted
        assert row["correct"] == (row["extracted"] is not None and float(row["extracted"]) == float(row["gold"]))
    assert summary["accuracy"] == sum(r["correct"] for r in results) / 6
    assert_an_auditor_can_rescore(results[3])
    # What rank 0 answered (runs/generations.py): its one batch of problems 0, 2, 4, each as its result row.
    generations = read_generations(run["run_dir"])
    assert [(g["step"], g["prompt"]) for g in generations] == [(1, row["question"]) for row in results[::2]]
    for generation, row in zip(generations, results[::2]):
        assert (generation["completion"], generation["correct"], generation["domain"]) == (
            row["completion"], row["correct"], row["domain"])
        assert generation["truncated"] in (False, row["tokens"] == run["settings"]["max_new_tokens"])
    # The live figures combine both ranks (weighted by samples): they end where the summary does.
    assert run["progress"]["latest"]["accuracy"] == pytest.approx(summary["accuracy"])
    assert run["progress"]["tokens_per_s"] > 0  # a finished run's average, not an empty last window


def test_power_sampling_times_its_batches_phases(home):
    """Where a batch's time goes (data/step_phases.py): the engine's prefill, the decoding, the MH moves' accept/reject,
    the scoring and the rows written, covering 95% of the rank's steady batches. Two one-problem batches (the first is
    warm-up) of 4 blocks and 2 moves each: every phase, in a third of the time of 3 batches of 2 at the default 16
    blocks and 10 moves. One rank: a rank's batches are the same at any count (the run above shares problems)."""
    run = run_json("run", "--recipe", "power-sampling", "--gpus", "1", "--set", "max_examples=2", "--batch-size", "1",
                   "--set", "max_new_tokens=16", "--set", "blocks=4", "--set", "mcmc_steps=2")
    assert run["status"] == "succeeded", run["error"]
    check_step_phases(home, run, {"prefill", "decode", "accept_reject", "score", "log"}, ranks=1)


SEED_KNOBS = {"POWERSAMPLE_STEPS": "1", "POWERSAMPLE_MAX_NEW": "32", "POWERSAMPLE_MAX_EXAMPLES": "2",
              "POWERSAMPLE_NUM_GPUS": "1", "POWERSAMPLE_BATCH_SIZE": "2"}


@pytest.fixture(scope="module")
def one_rank_runs(module_home, tmp_path_factory) -> dict:
    """The two 1-rank runs of the tests below, started together (each keeps one core busy): one set by
    the POWERSAMPLE_ knobs of the users' earlier power-sampling script alone, one on a saved model
    directory and a local GSM8K-format file (and the examples written to it), 3 chains a problem."""
    folder = tmp_path_factory.mktemp("local")
    model_dir = folder / "my-model"
    shutil.copytree(model_path("tiny-math"), model_dir)
    data = folder / "gsm8k-style.jsonl"
    examples = load_examples("tiny-math", "test", max_examples=3)
    data.write_text("".join(json.dumps({"question": e["question"], "answer": e["answer"]}) + "\n" for e in examples))
    knobs, local = run_together(["--recipe", "power-sampling"],
                                ["--recipe", "power-sampling", "--gpus", "1", "--model", str(model_dir),
                                 "--dataset", str(data), "--set", "max_new_tokens=64", "--set", "blocks=2",
                                 "--set", "mcmc_steps=2", "--set", "chains=3", "--set", "domain=gsm8k"],
                                envs=[SEED_KNOBS, {}])
    return {"knobs": knobs, "local": local, "examples": examples}


def test_seed_knobs_work_as_aliases(one_rank_runs):
    result = one_rank_runs["knobs"]
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded"
    s = run["settings"]
    assert (s["mcmc_steps"], s["max_new_tokens"], s["max_examples"], s["gpus"], s["batch_size"]) == (1, 32, 2, 1, 2)
    assert run["summary"]["problems"] == 2


def test_local_model_directory_and_gsm8k_format_jsonl(one_rank_runs):
    """The real-model path: a saved model directory and a local GSM8K-format file."""
    result, examples = one_rank_runs["local"], one_rank_runs["examples"]
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded", run["error"]
    results = json.loads(gpuscale("export", str(run["id"])).stdout)["results"]
    assert [r["gold"] for r in results] == [e["answer"].rsplit("#### ", 1)[1] for e in examples for _ in range(3)]
    # The rows name no domain: `--set domain=gsm8k` names it, not the file's name (gsm8k-style).
    assert {r["domain"] for r in results} == {"gsm8k"}
    assert "accuracy_gsm8k" in run["summary"] and "accuracy_gsm8k-style" not in run["summary"]
    assert "takes its file's name as its domain" not in result.stderr


def test_several_chains_give_pass_at_k(one_rank_runs):
    """3 chains a problem: 3 result rows each, and the summary's pass@k for k = 1..3 as the rows give it."""
    from gpuscale.recipes.power_sampling.pass_at_k import pass_at_k

    run = json.loads(one_rank_runs["local"].stdout)
    summary = run["summary"]
    results = json.loads(gpuscale("export", str(run["id"])).stdout)["results"]
    assert [(r["index"], r["chain"]) for r in results] == [(i, c) for i in range(3) for c in range(3)]
    correct = [sum(r["correct"] for r in results if r["index"] == i) for i in range(3)]
    assert summary["chains"] == 3 and list(summary["pass_at_k"]) == ["1", "2", "3"]
    for k in (1, 2, 3):
        assert summary["pass_at_k"][str(k)] == pytest.approx(sum(pass_at_k(3, c, k) for c in correct) / 3)
    assert summary["accuracy"] == pytest.approx(summary["pass_at_k"]["1"]) == pytest.approx(sum(correct) / 9)
    assert "pass_at_k" not in json.loads(one_rank_runs["knobs"].stdout)["summary"]  # one chain: no pass@k


def assert_an_auditor_can_rescore(row: dict) -> None:
    """A results row holds what it takes to check it: the model's log-prob of every answer token,
    given the prompt's ids, is the one the row records."""
    import torch

    from gpuscale.data.models import load_model

    model, _tokenizer = load_model("tiny-math", dtype=torch.float32)
    prompt, answer = row["prompt_token_ids"], row["token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(answer)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(row["logprobs"]), expected, rtol=0, atol=1e-4)
