"""The models gpuscale knows by name, and loading any model by name, hub id or local path.

Random models are built from a config with no download: they exercise the machinery (memory, speed)
at a real model's shape. Import of torch/transformers happens inside the functions so that listing
models stays cheap.
"""

from __future__ import annotations

from typing import Any

# Shapes copied from the public configs, so speed and memory match the real models.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "random-tiny": dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True,
    ),
    "random-qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def random_model_config(name: str):
    from transformers import AutoConfig

    spec = dict(RANDOM_CONFIGS[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def build_random_model(name: str, seed: int = 0):
    """A model of a known shape with random weights (fp32, on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(random_model_config(name))
