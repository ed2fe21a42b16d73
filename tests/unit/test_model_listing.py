"""`gpuscale models` counts parameters from the configs: the same numbers as the models built, and no
import of torch or transformers for a listing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuscale.data.models import KNOWN_MODELS, _config_of, _count_parameters, decoder_parameters, describe_models


@pytest.mark.parametrize("name", KNOWN_MODELS)
def test_parameters_from_the_shape_equal_the_built_model(name):
    config = _config_of(name)
    assert decoder_parameters(config) == _count_parameters(config)


def test_a_config_with_biases_and_an_untied_head():
    config = {**_config_of("random-tiny"), "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
              "num_key_value_heads": 1}
    assert decoder_parameters(config) == _count_parameters(config)


def test_listing_the_models_imports_neither_torch_nor_transformers():
    code = ("import sys; from gpuscale.app.cli import main; main(['models']);"
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "[]" and "tiny-math" in result.stdout and "494,032,768" in result.stdout
    assert {row["name"] for row in describe_models()} == set(KNOWN_MODELS)
