"""Models: the embedded tiny-math model loads offline and answers in GSM8K's format; names resolve."""

import json
import subprocess
import sys

import pytest

from conftest import python_offline
from gpuscale.data.answers import extract_answer, is_correct
from gpuscale.data.models import (
    KNOWN_MODELS,
    ModelError,
    build_random_model,
    describe_models,
    load_model,
    model_path,
    random_model_config,
)
from gpuscale.data.tasks import gold_answer, load_examples

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_math():
    return load_model("tiny-math")


def _greedy_completions(model, tokenizer, questions: list[str]) -> list[str]:
    """Greedy answers for a batch of questions, prompted by the model's own chat template."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")  # the tokenizer pads on the left
    with torch.no_grad():
        output = model.generate(**batch, do_sample=False)  # EOS, pad, max length: generation_config.json
    return tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def test_embedded_files_are_small_and_safetensors():
    files = {path.name: path.stat().st_size for path in model_path().iterdir()}
    assert "model.safetensors" in files and "tokenizer.json" in files and "generation_config.json" in files
    assert sum(files.values()) < 20 * 1024 * 1024


def test_tiny_math_loads_with_its_prompt_format_and_stop_ids(tiny_math):
    model, tokenizer = tiny_math
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert tokenizer.is_fast
    generation = json.loads((model_path() / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert generation["pad_token_id"] == tokenizer.pad_token_id
    messages = [{"role": "user", "content": "Q?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|user|>Q?") and prompt.endswith("<|assistant|>")


def test_tiny_math_answers_in_gsm8k_format(tiny_math):
    model, tokenizer = tiny_math
    examples = load_examples("tiny-math", "test", max_examples=40)
    completions = _greedy_completions(model, tokenizer, [e["question"] for e in examples])
    for completion in completions:
        assert completion.rstrip().splitlines()[-1].startswith("#### "), completion
        assert extract_answer(completion, mode="strict") is not None, completion
    # The model is right on about half of the test problems (bench/RESULTS.md); a broken checkpoint,
    # tokenizer or prompt format gets next to none.
    assert sum(is_correct(c, gold_answer(e)) for c, e in zip(completions, examples)) >= 10


def test_tiny_math_loads_with_the_network_off(tmp_path):
    """In a fresh process with HF_HUB_OFFLINE=1 and an empty cache: no download is attempted."""
    code = (
        "from gpuscale.data.models import load_model\n"
        "model, tokenizer = load_model('tiny-math')\n"
        "print(type(model).__name__, len(tokenizer))\n"
    )
    result = python_offline(code, tmp_path / "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "LlamaForCausalLM"


def test_load_from_a_local_directory_and_in_another_dtype():
    model, tokenizer = load_model(str(model_path()), dtype="bf16")
    assert model.dtype == torch.bfloat16 and tokenizer is not None


def test_a_directory_of_weights_only_loads_without_a_tokenizer(tmp_path):
    build_random_model("random-tiny").save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert tokenizer is None and model.config.hidden_size == random_model_config("random-tiny").hidden_size


def test_random_models_still_build_and_load_without_a_tokenizer():
    model, tokenizer = load_model("random-tiny")
    assert tokenizer is None
    assert model.config.hidden_size == random_model_config("random-tiny").hidden_size
    reference = build_random_model("random-tiny", seed=0)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)  # seed 0 by default


def test_unknown_name_lists_the_known_models():
    with pytest.raises(ModelError) as error:
        load_model("tiny-maths")
    message = str(error.value)
    assert "\n" not in message and "'tiny-maths'" in message
    assert all(name in message for name in KNOWN_MODELS)


def test_missing_local_path_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(ModelError, match="not a local directory"):
        load_model(str(tmp_path / "no-such-model"))


def test_unreachable_hub_id_is_one_clear_line(tmp_path):
    code = (
        "from gpuscale.data.models import load_model, ModelError\n"
        "try:\n    load_model('no-such-org/no-such-model')\n"
        "except ModelError as error:\n    print('ModelError:', error)\n"
    )
    result = python_offline(code, tmp_path / "hf")
    lines = [line for line in result.stdout.splitlines() if line.startswith("ModelError:")]
    assert len(lines) == 1, result.stdout + result.stderr[-2000:]
    assert "hub" in lines[0] and "local directory" in lines[0]


def test_unknown_dtype_is_refused():
    with pytest.raises(ModelError, match="unknown dtype"):
        load_model("random-tiny", dtype="fp8")


def test_describe_models_counts_parameters_without_building_them():
    rows = {row["name"]: row for row in describe_models()}
    assert set(rows) == set(KNOWN_MODELS)
    random_tiny = build_random_model("random-tiny")
    assert rows["random-tiny"]["parameters"] == sum(p.numel() for p in random_tiny.parameters())
    assert 490e6 < rows["random-qwen2.5-0.5b"]["parameters"] < 500e6  # Qwen2.5-0.5B has 494M
    assert rows["random-qwen2.5-0.5b"]["architecture"] == "Qwen2ForCausalLM"
    model, _ = load_model("tiny-math")
    assert rows["tiny-math"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert rows["tiny-math"]["architecture"] == "LlamaForCausalLM"
    assert rows["tiny-math"]["path"] == str(model_path())


def test_listing_names_does_not_import_torch():
    code = (
        "import sys\nimport gpuscale.data.models, gpuscale.data.tasks, gpuscale.data.answers\n"
        "print(gpuscale.data.models.KNOWN_MODELS, gpuscale.data.tasks.KNOWN_TASKS)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules, 'textual' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[-1] == "False False False", result.stderr[-2000:]
