"""What a card can do and what a trained token costs: the one model FLOPs utilisation (MFU) rule.

MFU = trained tokens/s on a card x FLOPs a token / the card's dense bf16 peak (no sparsity).
FLOPs a token of training (forward and backward, PaLM's appendix B): 6 x the parameters that take
part in matrix products (the embedding lookup is no product; a tied or untied output head is) plus
the attention's 12 x layers x attention width x the attended length (6 for the forward's two
products, twice that for the backward). A card absent from the table has no MFU: the figure is left
out and the run says so, rather than guess a peak.

Pure arithmetic, no torch: the ranks, the monitor and the tests share it.
"""

from __future__ import annotations

# Dense bf16 tensor-core peak, FLOP/s, from the vendors' data sheets (the "with sparsity" figures
# halved). Matched against the card's name as CUDA or NVML reports it, the most specific key first.
PEAK_DENSE_BF16 = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM (NVIDIA H100 80GB HBM3)
    "H200": 989e12,
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 6000 Ada": 364e12,
}

LOW_MFU = 0.10  # a GPU training run below this for a while gets a live warning


def peak_flops(card_name: str | None) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None for a card not in the table (or no card)."""
    if not card_name:
        return None
    for key in sorted(PEAK_DENSE_BF16, key=len, reverse=True):
        if key in card_name:
            return PEAK_DENSE_BF16[key]
    return None


def training_flops_per_token(matmul_parameters: int, layers: int, attention_width: int,
                             attended_tokens: float) -> float:
    """FLOPs of one trained token, forward and backward: 6 x `matmul_parameters` + 12 x `layers` x
    `attention_width` (heads x head size) x `attended_tokens` (the mean length of context a token
    attends to: half the sequence, under a causal mask)."""
    return 6.0 * matmul_parameters + 12.0 * layers * attention_width * attended_tokens


def mfu(tokens_per_s_per_card: float | None, flops_per_token: float, card_name: str | None) -> float | None:
    """Model FLOPs utilisation of one card, or None where the card's peak is unknown or nothing ran."""
    peak = peak_flops(card_name)
    if peak is None or not tokens_per_s_per_card:
        return None
    return tokens_per_s_per_card * flops_per_token / peak


def model_flops_shape(config) -> tuple[int, int, int]:
    """(matmul parameters, layers, attention width) of a Llama- or Qwen2-shaped decoder config (an
    object with hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size...):
    every projection of every layer and the output head, the embedding lookup left out."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * intermediate
    head = config.vocab_size * hidden
    return config.num_hidden_layers * layer + head, config.num_hidden_layers, heads * head_dim
