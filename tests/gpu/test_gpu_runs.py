"""On a CUDA machine only: real NVML samples of every GPU used, the run's own GPU memory and kernel time, a
real OOM."""

import pytest

from conftest import gpuscale, run_json
from gpuscale.control import telemetry
from gpuscale.control.store import Store

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_nvml_samples_of_every_gpu_and_own_memory(home):
    gpus = telemetry.list_gpus()
    count = min(2, len(gpus))
    run = run_json("run", "--recipe", "probe", "--gpus", str(count), "--set", "steps=300",
                   "--set", "telemetry_interval=0.2", "--model", "random-qwen2.5-0.5b")
    assert run["status"] == "succeeded" and run["summary"]["world_size"] == count
    samples = [s for s in Store(home).samples(run["id"]) if s["kind"] == "gpu"]
    # NVML's indices, as nvidia-smi numbers the cards: with CUDA_VISIBLE_DEVICES=1 the run's one GPU is 1.
    used = {g["index"] for g in gpus[:count]}
    assert {s["idx"] for s in samples} == used
    assert {s["name"] for s in samples} == {g["name"] for g in gpus[:count]}
    for idx in used:
        mine = [s for s in samples if s["idx"] == idx]
        assert max(s["run_mem_mb"] for s in mine) > 100  # the rank's weights and cache, attributed to the run
        assert all(0 < s["mem_used_mb"] <= s["mem_total_mb"] for s in mine)
        # The run's own share of the card (NVML's per-process utilization): the probe's decode kept it busy.
        assert max(s["run_util"] for s in mine) > 0
    busy = run["summary"]["gpu_busy_s"]
    assert busy.keys() == {f"gpu{idx}" for idx in used}
    assert all(0 < seconds <= run["summary"]["duration_s"] for seconds in busy.values())


def test_real_out_of_memory_gives_the_batch_size_hint(home):
    result = gpuscale("run", "--recipe", "probe", "--gpus", "1", "--model", "random-qwen2.5-0.5b",
                      "--batch-size", "100000", "--set", "prompt_tokens=2048", "--set", "steps=1")
    assert result.returncode == 1
    run = run_json("show", "1")
    assert run["status"] == "failed" and "OutOfMemoryError" in run["error"]
    assert "lower batch_size (now 100000" in run["hint"]


def test_a_random_model_is_made_on_the_gpu_in_its_dtype_and_every_make_draws_the_same_weights():
    from gpuscale.data.models import load_model

    first, _ = load_model("random-tiny", dtype="bf16", device="cuda")
    second, _ = load_model("random-tiny", dtype="bf16", device="cuda")
    params = list(first.parameters())
    assert {p.device.type for p in params} == {"cuda"} and {p.dtype for p in params} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(params, second.parameters(), strict=True))


def test_the_held_out_evaluation_sizes_its_batch_from_the_card_and_answers_as_at_64(tmp_path):
    """On a GPU the held-out evaluation takes as many problems a call as fill the run's share of the card
    (recipes/shared/evaluation.py's evaluation_batch_size), not the CPU's 64; greedy, the answers are
    those of 64 a call (fp32: padding more rows moves no near-tie)."""
    from gpuscale.data.models import load_model
    from gpuscale.data.tasks import load_examples
    from gpuscale.engines.distributed import RankContext
    from gpuscale.recipes.shared.evaluation import CPU_EVALUATION_BATCH, evaluation_batch_size, held_out_rows

    model, tokenizer = load_model("tiny-math", dtype=torch.float32, device=torch.device("cuda"))
    ctx = RankContext(0, 0, 1, torch.device("cuda"), torch.float32, tmp_path)
    assert evaluation_batch_size(model, ctx, 2_000, 256, memory_share=0.5) == 512
    assert evaluation_batch_size(model, ctx, 300, 256, memory_share=0.5) == 300  # no padding rows
    examples = load_examples("tiny-math", "test", 256)
    held_by_the_model = torch.cuda.memory_reserved()
    card_sized = evaluation_batch_size(model, ctx, len(examples), 64, memory_share=0.5)
    assert card_sized == len(examples) > CPU_EVALUATION_BATCH
    answers = {size: [row["completion"] for row in held_out_rows(model, tokenizer, examples, ctx, max_new_tokens=64,
                                                                 batch_size=size)]
               for size in (CPU_EVALUATION_BATCH, card_sized)}
    same = sum(a == b for a, b in zip(answers[CPU_EVALUATION_BATCH], answers[card_sized]))
    assert same >= len(examples) - 2, f"{len(examples) - same} of {len(examples)} greedy answers differ"
    # The batch's KV cache (about 1 MiB a row here) went back to the card, so that a training step after it
    # sizes its micro-batch from the card; what may stay is small: cuBLAS' workspace of each stream it ran on
    # (the default, the engines' one warm-up stream, the graphs' capture stream: 96 MiB on an H200).
    assert torch.cuda.memory_reserved() <= held_by_the_model + 128 * 2**20
