"""engines/generation/speed.py, the measure bench/generation.py and the probe's node check share: the
calls it times (N new tokens, then 1), the engine's path in words, and the bytes of weights a decode
step reads (the floor's numerator). CPU, tiny models."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gpuscale.data.models import build_random_model
from gpuscale.engines.generation import GenerationEngine
from gpuscale.engines.generation.speed import (
    decode_calls,
    engine_path,
    generate_call,
    path_text,
    weight_bytes_read_a_step,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_step_reads_every_weight_once_and_of_an_untied_input_embedding_one_row():
    tied = build_random_model("random-tiny")
    # Tied: the head is the embedding, read whole by every step; model.parameters() lists it once.
    fp32 = parameter_bytes(tied)
    assert weight_bytes_read_a_step(tied) == fp32
    assert weight_bytes_read_a_step(tied.to(torch.bfloat16)) == fp32 // 2  # bytes, not parameters
    config = AutoConfig.for_model("qwen2", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    untied = AutoModelForCausalLM.from_config(config)
    embedding = untied.get_input_embeddings().weight
    assert weight_bytes_read_a_step(untied) == parameter_bytes(untied) - embedding.numel() * 4


def test_the_calls_are_the_long_ones_then_the_short_ones_each_synchronized():
    made, synchronized = [], []
    calls = decode_calls(made.append, 8, 3, lambda: synchronized.append(len(made)))
    assert made == [8, 8, 8, 1, 1, 1]
    assert synchronized == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]  # before and after each call
    assert calls.new_tokens == 8 and len(calls.long) == len(calls.short) == 3


def test_a_cpu_engine_at_its_defaults_runs_uncompiled_and_every_row_decodes_every_token():
    model = build_random_model("random-tiny").eval()
    engine = GenerationEngine(model, ())
    path = engine_path(engine)
    assert path == {"cuda_graphs": False, "compiled": False, "compile_error": None, "fused_weights": True}
    assert path_text(path) == "uncompiled step, fused weights"
    assert path_text({**path, "cuda_graphs": True, "compiled": True}) == "compiled step, CUDA graphs, fused weights"
    failed = {**path, "cuda_graphs": True, "compile_error": "BackendCompilerFailed: ..."}
    assert path_text(failed) == ("uncompiled step, CUDA graphs, fused weights, compiling failed: "
                                 "BackendCompilerFailed: ...")
    prompts = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    run = generate_call(engine, prompts, torch.Generator().manual_seed(1))
    calls = decode_calls(run, 4, 2, lambda: None)
    assert all(seconds > 0 for seconds in calls.long + calls.short)


def test_decode_ways_cut_by_its_calls_time_bound_writes_the_ways_it_measured(tmp_path, monkeypatch):
    """bench/decode_ways.py under `timeout -s INT`: the interrupt that ends the second way's child leaves the first
    way's real measurement in the result file, marked cut (two GPU calls of 2026-12-01 lost every row that way)."""
    import json

    from bench_loader import load_bench

    decode_ways = load_bench("decode_ways.py")
    measured = decode_ways.run_child

    def second_interrupted(way, args):
        if way == "no-tails":
            raise KeyboardInterrupt
        return measured(way, args)

    monkeypatch.setattr(decode_ways, "run_child", second_interrupted)
    out = tmp_path / "ways.json"
    decode_ways.main(["--ways", "today,no-tails,uncompiled", "--device", "cpu", "--model", "random-tiny",
                      "--new-tokens", "4", "--repeats", "1", "--out", str(out)])
    figures = json.loads(out.read_text())["figures"]
    assert figures["cut"] is True and [row["way"] for row in figures["ways"]] == ["today"]
    assert figures["ways"][0]["ms_per_step"] > 0
