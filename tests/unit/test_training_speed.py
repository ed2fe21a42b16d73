"""Training speed without changing what is learned: the micro-batch arithmetic on a table
of cases, the FLOPs of a token against a hand count, MFU's card table, and every optimisation's off
switch giving the same loss on a tiny model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gpuscale.data.cards import mfu, model_flops_shape, peak_flops, training_flops_per_token
from gpuscale.data.models import load_model, random_model_config
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.packed_attention import use_packed_attention
from gpuscale.engines.reporter import Reporter
from gpuscale.engines.training_memory import (
    MARGIN,
    TrainingShape,
    activation_bytes_per_token,
    fixed_training_bytes,
    split_rows,
)
from gpuscale.recipes.sft import SFT, Settings
from gpuscale.recipes.shared.training import train_sft_dataset
from gpuscale.recipes.shared.training_data import tokenized_dataset

GIB = 2**30
QWEN_05B = random_model_config("random-qwen2.5-0.5b")


def shape_05b(trainable=494_032_768, loaded_in_half=True, checkpointing=False):
    return TrainingShape.of(QWEN_05B, 494_032_768, trainable, loaded_in_half, checkpointing)


def test_activations_and_fixed_state_are_counted_as_documented():
    shape = shape_05b()
    # 24 layers x (30 x 896 + 4 x 4864) bytes a token: about 1.06 MiB, as measured on the GPU.
    assert activation_bytes_per_token(shape) == 24 * (30 * 896 + 4 * 4864)
    # gradients 4 + AdamW 8 bytes a trainable parameter, + 2 for the fp32 copy of a bf16-loaded model.
    assert fixed_training_bytes(shape) == 14 * 494_032_768
    assert fixed_training_bytes(shape_05b(loaded_in_half=False)) == 12 * 494_032_768
    lora = shape_05b(trainable=4_000_000)
    assert fixed_training_bytes(lora) == 12 * 4_000_000  # no master copy: the base stays frozen in bf16
    # Checkpointing keeps each layer's fp32 input and one layer's whole set.
    assert activation_bytes_per_token(shape_05b(checkpointing=True)) == 24 * 4 * 896 + 30 * 896 + 4 * 4864


@pytest.mark.parametrize("rows, tokens, free_gib, share, expected", [
    # rows a step, tokens a row, GiB free after loading, share -> micro-batch (a divisor of rows)
    (256, 128, 70, 0.9, 256),   # 32k tokens: about 34 GiB of activations, fits 70 GiB's share
    (512, 128, 70, 0.9, 256),   # 64k tokens would not: the largest divisor that does
    (64, 512, 70, 0.9, 64),
    (128, 512, 70, 0.9, 64),
    (8, 128, 70, 0.9, 8),       # the default step: all at once
    (256, 128, 20, 0.9, 64),    # a smaller card (or a shared one): smaller cuts
    (256, 128, 70, 0.25, 32),   # a quarter share
    (96, 128, 20, 0.9, 48),     # not a power of two: the largest divisor that fits (48, not 32)
    (256, 128, 6, 0.9, 1),      # the optimizer state alone does not fit: 1, and the reason says so
])
def test_rows_are_cut_into_the_largest_micro_batch_that_fits(rows, tokens, free_gib, share, expected):
    shape = shape_05b()
    split = split_rows(rows, tokens, shape, int(free_gib * GIB), share)
    assert split.micro_batch == expected
    assert split.micro_batch * split.accumulation == rows  # the effective batch is kept
    budget = free_gib * GIB * share * MARGIN - fixed_training_bytes(shape)
    if expected > 1:
        assert expected * tokens * activation_bytes_per_token(shape) <= budget
    if expected < rows:  # the next divisor up would not have fitted
        bigger = min(d for d in range(expected + 1, rows + 1) if rows % d == 0)
        assert bigger * tokens * activation_bytes_per_token(shape) > budget
    if free_gib == 6:
        assert "not even one row fits" in split.reason


def test_flops_of_a_token_against_a_hand_count():
    # A toy decoder: hidden 4, 2 heads of 2, 1 kv head, MLP 8, 3 layers, vocabulary 10.
    config = SimpleNamespace(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                             num_hidden_layers=3, vocab_size=10)
    matmul, layers, width = model_flops_shape(config)
    # q and o: 4x4 each; k and v: 4x2 each; MLP: 3 x 4x8; per layer 16+16+8+8+96 = 144; head 10x4.
    assert (matmul, layers, width) == (3 * 144 + 40, 3, 4)
    # 6 x 472 + 12 x 3 x 4 x (attending to 5 tokens on average)
    assert training_flops_per_token(matmul, layers, width, 5) == 6 * 472 + 12 * 3 * 4 * 5
    # Qwen2.5-0.5B: the embedding lookup is no product, the tied head is one (about 494M - 0.1M norms/biases).
    matmul_05b, _, _ = model_flops_shape(QWEN_05B)
    assert 490e6 < matmul_05b < 494e6


def test_mfu_needs_a_known_card():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12  # the most specific name wins
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Future GPU") is None and peak_flops(None) is None
    assert mfu(10_000, 6e9, "NVIDIA H200") == pytest.approx(10_000 * 6e9 / 989e12)
    assert mfu(10_000, 6e9, "Some Future GPU") is None


def test_packed_attention_is_the_padded_model_row_by_row():
    model, _ = load_model("tiny-math")
    torch.manual_seed(0)
    rows = [torch.randint(3, 100, (n,)) for n in (7, 12, 3)]
    padded = torch.cat([model(row[None]).logits[0] for row in rows])
    flat = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(row)) for row in rows])[None]
    with use_packed_attention(model):
        packed = model(flat, position_ids=positions).logits[0]
    assert torch.allclose(packed, padded, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the model's own again, for generation


def first_losses(tmp_path, name, device="cpu", lengths: list | None = None, **options):
    """The logged losses of 3 optimizer steps of sft on the same 24 ragged rows from the same weights
    (on CUDA: bf16 autocast over fp32 weights, as a GPU rank trains); `lengths` collects the token
    length of every forward's input."""
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, tokenizer = load_model("tiny-math", dtype=dtype, device=device)
    if lengths is not None:
        model.register_forward_pre_hook(lambda _, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                        with_kwargs=True)
    rows = [{"question": f"Ann has {n} apples and {2 * n} pears. How many fruits?" + " Think." * (n % 5),
             "completion": f"{n} + {2 * n} = {3 * n}.\n#### {3 * n}"} for n in range(24)]
    run_dir = tmp_path / name
    ctx = RankContext(0, 0, 1, torch.device(device), dtype, run_dir)
    settings = SFT().for_device(Settings(batch_size=8, max_steps=3, learning_rate=1e-3, eval_examples=0,
                                         save_model=False, checkpoint_every=0, **options),
                                on_gpu=device != "cpu", ranks=1)
    reporter = Reporter(run_dir, 0)
    trained = train_sft_dataset(tokenized_dataset(rows, tokenizer, settings.max_length), settings, ctx, reporter,
                                model, tokenizer)
    reporter.close()
    records = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r], trained


def test_padding_free_gives_the_padded_losses(tmp_path, one_torch_thread):
    on, trained = first_losses(tmp_path, "on")
    off, _ = first_losses(tmp_path, "off", padding_free=False)
    assert len(on) == 3
    # Same rows, same weights, same updates: equal to float32 rounding (the sums run in another order).
    assert on == pytest.approx(off, rel=1e-4)
    assert trained.figures["liger_kernels"] == "off (CPU)"
    assert trained.figures["batch_size"] == 8 and trained.figures["batch_size_reason"] == "given"


def test_padding_to_a_multiple_of_16_gives_the_same_losses(tmp_path, one_torch_thread):
    padded_lengths, ragged_lengths = [], []
    padded, _ = first_losses(tmp_path, "padded", lengths=padded_lengths)  # the default: 16
    ragged, _ = first_losses(tmp_path, "ragged", lengths=ragged_lengths, pad_to_multiple_of=0)
    assert padded == pytest.approx(ragged, rel=1e-4)  # the padding tokens carry no loss
    assert len(padded_lengths) == len(ragged_lengths) == 3
    assert all(length % 16 == 0 for length in padded_lengths)
    assert any(length % 16 for length in ragged_lengths)  # else the test would show nothing


def test_packing_trains_on_the_same_tokens(tmp_path, one_torch_thread):
    """Packed sequences hold several rows each, so a step holds more rows and the losses differ; the
    first step's loss is over the same model, so it is within the rows' spread, and the run learns."""
    packed, trained = first_losses(tmp_path, "packed", packing=True, max_length=128)
    assert len(packed) == 3 and packed[-1] < packed[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_every_switch_gives_the_same_losses(tmp_path):
    """torch's varlen flash kernel and liger-kernel's layers against padded sdpa and plain layers, in
    bf16 autocast: equal to bf16's rounding (a relative 2%)."""
    everything, trained = first_losses(tmp_path, "all", device="cuda")
    plain, _ = first_losses(tmp_path, "plain", device="cuda", padding_free=False, liger_kernels=False)
    no_liger, _ = first_losses(tmp_path, "no-liger", device="cuda", liger_kernels=False)
    assert trained.figures["liger_kernels"] == "on"
    assert everything == pytest.approx(plain, rel=2e-2)
    assert no_liger == pytest.approx(plain, rel=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_varlen_kernel_takes_autocast_s_mixed_dtypes():
    """Under bf16 autocast over fp32 weights the rotary embedding hands attention fp32 queries and keys
    beside bf16 values (a default sft run without liger-kernel failed on it: "FlashAttention only
    support fp16 and bf16"); the kernel runs in autocast's dtype and equals sdpa row by row."""
    from gpuscale.engines.packed_attention import _rows_by_sdpa, packed_attention_forward

    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim = 22, 4, 2, 64
    query, key = (torch.randn(1, n, tokens, head_dim, device="cuda") for n in (heads, kv_heads))
    value = torch.randn(1, kv_heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in (7, 12, 3)])[None].cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = packed_attention_forward(None, query, key, value, None, scaling=head_dim ** -0.5,
                                          position_ids=positions)
    q, k, v = (t[0].transpose(0, 1).to(torch.bfloat16) for t in (query, key, value))
    cumulative = torch.tensor([0, 7, 19, 22], dtype=torch.int32, device="cuda")
    expected = _rows_by_sdpa(q, k, v, cumulative, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out[0].float(), expected.float(), atol=2e-2)


def test_a_row_is_budgeted_at_its_packed_padded_or_padding_free_length():
    from gpuscale.engines.training_memory import tokens_per_row

    lengths = [64, 100, 192, 156]  # mean 128
    assert tokens_per_row(lengths, padded=True) == 192  # a padded batch pads to its longest
    assert tokens_per_row(lengths, padded=False) == 161  # 1.25 x the mean, + 1
    assert tokens_per_row([10, 10, 11], padded=False) == 11  # never above the longest
    assert tokens_per_row(lengths, padded=False, packed_length=512) == 512


def test_the_training_bench_names_its_baseline_and_how_it_is_put_at_its_best():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "train_speed.py"
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "stock TRL SFTTrainer" in shown.stdout and "best batch, found by a sweep" in shown.stdout
    assert "--grpo-stock-micro" in shown.stdout


def test_a_tuning_trial_s_padding_free_micro_batch_gives_the_padded_gradients(tmp_path, one_torch_thread):
    """sft's tuning trial trains as its run does, padding-free (rows in one sequence, padded to 16):
    the same gradients as the padded micro-batch, and the tokens counted as TRL counts them."""
    from gpuscale.recipes.shared.training_trial import micro_step

    model, _ = load_model("tiny-math")
    torch.manual_seed(0)
    rows = [torch.randint(3, 100, (n,)).tolist() for n in (7, 12, 3)]
    masks = [[0] * 2 + [1] * (len(row) - 2) for row in rows]  # a two-token prompt, then the completion
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)

    def gradients(**packing):
        model.zero_grad(set_to_none=True)
        tokens = micro_step(model, None, rows, masks, 0, ctx, 1.0, **packing)
        return tokens, [p.grad.clone() for p in model.parameters()]

    padded_tokens, padded = gradients()
    with use_packed_attention(model):
        packed_tokens, packed = gradients(packed_to=16)
    assert padded_tokens == 22 and packed_tokens == 32  # 22 tokens, the sequence padded to 32
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(padded, packed))
    assert any(g.abs().sum() > 0 for g in packed)
