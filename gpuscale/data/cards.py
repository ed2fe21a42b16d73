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

# Device memory bandwidth, bytes/s, from the vendors' data sheets (decimal GB/s x 1e9). Matched like
# PEAK_DENSE_BF16; an A100's memory differs by its size and form, so those keys say it.
MEMORY_BANDWIDTH = {
    "H100 PCIe": 2000e9,
    "H100 NVL": 3900e9,
    "H100": 3350e9,  # SXM (NVIDIA H100 80GB HBM3)
    "H200": 4800e9,
    "H20": 4000e9,
    "GH200": 4000e9,
    "B200": 8000e9,
    "A100-SXM4-40GB": 1555e9,
    "A100-PCIE-40GB": 1555e9,
    "A100 80GB PCIe": 1935e9,
    "A100": 2039e9,  # SXM4 80GB
    "A800": 2039e9,
    "L40S": 864e9,
    "L40": 864e9,
    "L4": 300e9,
    "A10G": 600e9,
    "A10": 600e9,
    "RTX 4090": 1008e9,
    "RTX 6000 Ada": 960e9,
}

LOW_MFU = 0.10  # a GPU training run below this for a while gets a live warning


def peak_flops(card_name: str | None) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None for a card not in the table (or no card)."""
    return _by_card(PEAK_DENSE_BF16, card_name)


def memory_bandwidth(card_name: str | None) -> float | None:
    """The card's data-sheet memory bandwidth in bytes/s, or None for a card not in the table."""
    return _by_card(MEMORY_BANDWIDTH, card_name)


def unknown_card_note(card_name: str | None) -> str:
    """What a table of measured figures says beside a card without data-sheet figures."""
    return f"no data-sheet figures for {card_name or 'this device'} (not in gpuscale/data/cards.py)"


def _by_card(table: dict[str, float], card_name: str | None) -> float | None:
    """The entry of `table` whose key the card's name contains, the most specific (longest) key first."""
    if not card_name:
        return None
    for key in sorted(table, key=len, reverse=True):
        if key in card_name:
            return table[key]
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
