"""End to end on CPU: grpo-mtl with generation_gpus=1 (engines/placement.py) through the real CLI, under the real
`accelerate launch` with 2 CPU ranks: rank 1 generates, rank 0 trains alone (a one-rank trainer, TRL's
GRPOTrainer) and sends it the weights over gloo each step, a real supervisor and runs.db.

Both a full fine-tune and LoRA (whose trainer sends the adapters alone, which the generator merges):
- The run learns: its losses and gradients move and the saved model is not the one it started from, while the
  generator answered every step, one step behind from the second on; rank 0 sent what training changes.
- The generator samples from the trainer's weights: the digest of the weights it sampled each job from
  (GPUSCALE_WEIGHTS_DIGEST) is that of the embedded model at step 0 and of the trainer's checkpoint of the step
  it names after (LoRA: its adapter merged by peft), never more than max_staleness steps before the step trained.
- A generator killed (SIGKILL) ends every rank within 10 s and the run `failed`, naming it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from conftest import gpuscale, leftover_processes, rank_processes, run_json, slow, wait_until
from gpuscale.control.store import Store
from gpuscale.data.models import load_model
from gpuscale.data.step_phases import GENERATE, WEIGHT_SYNC
from gpuscale.engines.placement import DIGEST_ENV, weights_digest
from gpuscale.runs.statuses import LIVE_STATUSES

pytestmark = pytest.mark.e2e  # every test here starts real runs

PLACED = ["--recipe", "grpo-mtl", "--gpus", "2", "--set", "rollout=async", "--set", "generation_gpus=1",
          "--set", "rollout.n=4", "--set", "data.train_batch_size=4", "--set", "ppo_micro_batch_size_per_gpu=4",
          "--set", "max_response_length=16", "--set", "eval_examples=0", "--set", "max_examples=16"]
STEPS = 4
JOB_LINE = re.compile(r"^job for step (\d+): weights of step (\d+), digest ([0-9a-f]{64})$", re.MULTILINE)


@pytest.fixture(scope="module", params=["full", "lora"])
def placed_run(module_home, request) -> dict:
    """4 steps (one epoch of 16 prompts, 4 a step), a checkpoint at every step, the generator's digests logged; a
    full fine-tune, and LoRA (whose trainer sends only its adapters)."""
    lora = ["--set", "lora_rank=4"] if request.param == "lora" else []
    return run_json("run", *PLACED, *lora, "--set", f"max_steps={STEPS}", "--set", "checkpoint_every=1",
                    "--set", f"keep_checkpoints={STEPS}", "--set", "save_model=true", env={DIGEST_ENV: "1"})


def test_one_generator_and_one_trainer_learn(module_home, placed_run):
    run = placed_run
    assert run["status"] == "succeeded", run["error"]
    summary = run["summary"]
    assert (summary["world_size"], summary["generation_gpus"], summary["steps"]) == (1, 1, STEPS)
    store = Store(module_home)

    def series(name: str) -> list[float]:
        rows = [(m["step"], m["value"]) for m in store.metrics(run["id"], name) if m["rank"] >= 0]
        assert [step for step, _ in rows] == list(range(1, STEPS + 1)), name
        return [value for _, value in rows]

    assert series("sampling_staleness") == [0.0, 1.0, 1.0, 1.0]  # the first step had nothing generated ahead
    assert len(set(series("loss"))) > 1 and any(norm > 0 for norm in series("grad_norm"))
    assert {m["rank"] for m in store.metrics(run["id"]) if m["rank"] >= 0} == {0}  # the generator logs no steps
    phases = summary["step_phases"]
    assert GENERATE in phases and WEIGHT_SYNC in phases, phases  # rank 0 sends the weights in its steps
    trained, _ = load_model(summary["model_dir"])
    original = load_model("tiny-math")[0].state_dict()
    assert any(not torch.equal(weight, original[name]) for name, weight in trained.state_dict().items())
    log = (Path(run["run_dir"]) / "logs" / "rank1.log").read_text()
    assert f"generation: served {STEPS} jobs for training ranks 0" in log
    lora = run["settings"]["lora_rank"] > 0
    sent = re.search(r"^placement: (\d+) tensors \(.* of float32(, the LoRA adapters)?\) go to the generators",
                     (Path(run["run_dir"]) / "logs" / "rank0.log").read_text(), re.MULTILINE)
    assert sent and bool(sent.group(2)) == lora
    adapted = 2 * 7 * 4  # lora_A and lora_B of tiny-math's 7 linears in each of its 4 layers
    assert int(sent.group(1)) == (adapted if lora else len(list(trained.parameters())))
    assert not leftover_processes(run["run_dir"])


def test_the_generator_samples_from_the_trainer_s_weights_at_most_max_staleness_old(placed_run):
    run_dir = Path(placed_run["run_dir"])
    jobs = [(int(step), int(weights), digest)
            for step, weights, digest in JOB_LINE.findall((run_dir / "logs" / "rank1.log").read_text())]
    assert [(step, weights) for step, weights, _ in jobs] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    max_staleness = placed_run["summary"]["max_staleness"]
    assert all(0 <= step - weights <= max_staleness for step, weights, _ in jobs)

    def trainer_weights(step: int) -> str:
        """The digest of the trainer's weights after `step` optimizer steps: the embedded model's, or a checkpoint's
        (a LoRA checkpoint's adapter merged by peft into the embedded model)."""
        checkpoint = run_dir / "checkpoints" / f"checkpoint-{step}"
        adapter = step > 0 and (checkpoint / "adapter_config.json").exists()
        model = load_model("tiny-math" if step == 0 or adapter else str(checkpoint))[0]
        if adapter:
            model = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
        return weights_digest(model.named_parameters())

    assert all(digest == trainer_weights(weights) for _, weights, digest in jobs)
    assert len({digest for _, _, digest in jobs}) == 3  # the weights of steps 0, 1 and 2 all differ


def test_a_killed_generator_ends_the_run_naming_it_within_ten_seconds(home):
    run_id = int(gpuscale("run", *PLACED, "--set", "max_steps=500", "--detach").stdout)
    store = Store(home)
    wait_until(lambda: any(m["rank"] == 0 for m in store.metrics(run_id, "loss")), 120,
               message="the trainer's first step")
    run_dir = store.get_run(run_id)["run_dir"]
    os.kill(rank_processes(run_dir)[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not rank_processes(run_dir), 10, interval=0.1, message="every rank to end")
    took = time.monotonic() - killed
    run = wait_until(lambda: (r := run_json("show", str(run_id)))["status"] not in LIVE_STATUSES and r, 60)
    assert took < slow(10)
    assert run["status"] == "failed" and run["error"] == "rank 1: killed by SIGKILL with no error of its own"
    assert not leftover_processes(run_dir)
