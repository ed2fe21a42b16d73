"""The generation engine against the model itself: every token and log-prob the engine reports must
equal what one teacher-forced forward pass of the same model computes over the same sequences
(left-padded, with transformers' own attention mask), and the filtered log-probs what transformers'
own warpers compute. Two architectures (Llama, Qwen2), CPU, fp32. The fast paths of the decode step
(fused projections, torch.compile, grouped attention) must give what the plain step gives.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import traceback
import warnings
from types import SimpleNamespace

import pytest
import torch
from bench_loader import load_bench
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.integrations.sdpa_attention import repeat_kv

from gpuscale.data.models import build_random_model
from gpuscale.engines.generation import (
    GenerationEngine,
    Sampling,
    StaleGenerationError,
    filter_logits,
    sample_tokens,
    triton_matvec,
)
from gpuscale.engines.generation import compiled as compiled_module
from gpuscale.engines.generation import fused as fused_module
from gpuscale.engines.generation import sampling as sampling_module

TOL = 1e-4
PAD = 0
# Prompts of different lengths, so that the batch is left-padded (one of length 1: nothing to prefill).
PROMPTS = [[5, 17, 33, 2, 91, 40, 7, 12, 150, 3, 99, 64], [8, 1, 44], [200], [31, 32, 33, 34, 35, 36, 37]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sharpen(model, factor):
    # Random weights give near-uniform next-token distributions; a larger head makes them peaked
    # (entropy about 2.5-4 nats instead of 6), so that top-k / top-p cut real mass and greedy choices
    # are not near-ties. random-tiny ties its head to the input embeddings, hence a smaller factor.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model.eval()


def _tiny_qwen2():
    config = AutoConfig.for_model(
        "qwen2", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    if request.param == "llama":
        return _sharpen(build_random_model("random-tiny", seed=0), 5)
    return _sharpen(_tiny_qwen2(), 20)


@pytest.fixture(scope="module")
def llama():
    return _sharpen(build_random_model("random-tiny", seed=0), 5)


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def teacher_forced(model, generation):
    """(logits [B, T, V], log-probs of the generated tokens [B, T]) from ONE forward over the left-padded
    batch of prompt + generated tokens, with transformers' own 2D mask and position ids (on the CPU)."""
    rows = [p[: n].tolist() + t[m].tolist() for p, n, t, m in zip(
        generation.prompt_ids, generation.prompt_lengths, generation.tokens, generation.mask)]
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        attention[i, width - len(row):] = 1
    positions = (attention.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device),
                       position_ids=positions.to(device)).logits.float().cpu()
    batch, steps = generation.tokens.shape
    out_logits = torch.zeros(batch, steps, logits.shape[-1])
    out_logprobs = torch.zeros(batch, steps)
    for i in range(len(rows)):
        n = int(generation.lengths[i])
        first = width - n  # column of the first generated token; predicted one column earlier
        out_logits[i, :n] = logits[i, first - 1: width - 1]
        out_logprobs[i, :n] = out_logits[i, :n].log_softmax(-1).gather(-1, ids[i, first:, None]).squeeze(-1)
    return out_logits, out_logprobs


def assert_padding_is_clean(generation, pad):
    """Each row: real tokens first, then padding with pad ids and zero log-probs."""
    mask = generation.mask
    assert torch.equal(mask, torch.arange(mask.shape[1])[None] < generation.lengths[:, None])
    assert bool((generation.tokens[~mask] == pad).all())
    assert bool((generation.base_logprobs[~mask] == 0).all())
    assert bool((generation.sampled_logprobs[~mask] == 0).all())


def assert_matches_teacher_forcing(model, generation, sampling=Sampling(), tol=TOL):
    generation = _on_cpu(generation)
    logits, expected = teacher_forced(model, generation)
    mask = generation.mask
    torch.testing.assert_close(generation.base_logprobs[mask], expected[mask], atol=tol, rtol=0)
    if sampling.greedy:
        assert torch.equal(generation.tokens[mask], logits.argmax(-1)[mask])
        assert bool((generation.sampled_logprobs == 0).all())
        return
    warped = TemperatureLogitsWarper(sampling.temperature)(None, logits[mask])
    if sampling.top_k:
        warped = TopKLogitsWarper(sampling.top_k)(None, warped)
    if sampling.top_p < 1:
        warped = TopPLogitsWarper(sampling.top_p)(None, warped)
    chosen = generation.tokens[mask][:, None]
    assert bool(warped.gather(-1, chosen).isfinite().all()), "a token outside top-k/top-p was sampled"
    expected_sampled = warped.log_softmax(-1).gather(-1, chosen).squeeze(-1)
    torch.testing.assert_close(generation.sampled_logprobs[mask], expected_sampled, atol=tol, rtol=0)


def _on_cpu(generation):
    fields = ("tokens", "mask", "base_logprobs", "sampled_logprobs", "prompt_ids", "prompt_lengths")
    return SimpleNamespace(lengths=generation.lengths.cpu(), **{f: getattr(generation, f).cpu() for f in fields})


# ---- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.8), Sampling(1.0, top_k=50, top_p=0.6)]
)
def test_filter_logits_equals_transformers_warpers(sampling):
    logits = torch.randn(6, 300, generator=_seeded(0)) * 4
    expected = TemperatureLogitsWarper(sampling.temperature)(None, logits)
    if sampling.top_k:
        expected = TopKLogitsWarper(sampling.top_k)(None, expected)
    if sampling.top_p < 1:
        expected = TopPLogitsWarper(sampling.top_p)(None, expected)
    ours = filter_logits(logits, sampling)
    assert torch.equal(ours.isinf(), expected.isinf())
    assert bool((ours.isinf().sum(-1) < 300).all()) and bool(ours.isinf().any())
    torch.testing.assert_close(ours[ours.isfinite()], expected[expected.isfinite()])


def _reference_sample(logits, sampling, noise):
    """The plain recipe, every step spelled out: log-softmax of the (always) filtered scores, Gumbel
    noise added to it, argmax. The engine skips work the settings make unnecessary; same results."""
    raw = logits.log_softmax(-1)
    if sampling.greedy:
        tokens = logits.argmax(-1)
        return tokens, raw.gather(-1, tokens[:, None])[:, 0], torch.zeros(len(tokens))
    sampled = filter_logits(logits, sampling).log_softmax(-1)
    gumbel = -torch.log(-torch.log(noise))
    tokens = (sampled + gumbel).argmax(-1)
    return tokens, raw.gather(-1, tokens[:, None])[:, 0], sampled.gather(-1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("sampling", [
    Sampling(1.0), Sampling(0.7), Sampling(1.0, top_k=0, top_p=1.0), Sampling(0.8, top_k=20),
    Sampling(1.2, top_p=0.9), Sampling(0.9, top_k=50, top_p=0.8), Sampling(temperature=0),
], ids=str)
@pytest.mark.parametrize("packed_argmax", [False, True], ids=["argmax", "packed-argmax"])
def test_sample_tokens_equals_the_plain_recipe(sampling, packed_argmax, monkeypatch):
    """In particular with top_k 0 and top_p 1 (no sort, and at temperature 1 one log-softmax for both
    log-probs): the same tokens and log-probs as running the filters; also with the few-row argmax of
    packed keys (sampling.row_argmax) on for these 8 rows."""
    monkeypatch.setattr(sampling_module, "PACKED_ARGMAX_MAX_ROWS", 8 if packed_argmax else 0)
    logits = torch.randn(8, 300, generator=_seeded(3)) * 3
    noise = torch.rand(8, 300, generator=_seeded(4))
    tokens, raw, sampled = sample_tokens(logits, sampling, noise)
    expected_tokens, expected_raw, expected_sampled = _reference_sample(logits, sampling, noise)
    assert torch.equal(tokens, expected_tokens)
    # The engine normalizes by a log-sum-exp after the argmax: the same log-probs up to fp32 rounding.
    torch.testing.assert_close(raw, expected_raw, rtol=0, atol=1e-5)
    torch.testing.assert_close(sampled, expected_sampled, rtol=0, atol=1e-5)
    if not sampling.changes_distribution:
        assert torch.equal(raw, sampled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_packed_row_argmax_is_torch_argmax(compiled, monkeypatch):
    """The few-row argmax as a max of packed keys (sampling.row_argmax) picks torch's index: the first of
    equal maxima, negative rows, -inf, a vocabulary of Qwen's size; eager, and compiled as the sampling
    step is (CPU: Inductor's C++)."""
    import math

    monkeypatch.setattr(sampling_module, "PACKED_ARGMAX_MAX_ROWS", 4)
    generator = _seeded(11)
    rows = [torch.randn(3, 151_936, generator=generator) * 8,  # Qwen2.5's vocabulary
            (torch.randn(4, 500, generator=generator) * 3).round(),  # many ties
            -(torch.randn(2, 300, generator=generator).abs()) - 1]  # every value negative
    rows[0][1, [17, 90_000]] = 1e4  # equal maxima: the first wins
    rows[1][:, ::3] = -math.inf
    argmax = torch.compile(sampling_module.row_argmax, dynamic=False) if compiled else sampling_module.row_argmax
    for values in rows:
        assert torch.equal(argmax(values), values.argmax(-1))
    assert int(argmax(rows[0])[1]) == 17


@pytest.mark.parametrize("way", ["sdpa", "matmul"])
def test_grouped_query_attention_equals_repeated_kv(way, monkeypatch):
    """One query token per row: stacking the query heads of each KV head gives the attention of
    transformers' repeat_kv path, mask included; through SDPA and through the written-out matmuls
    the engine uses from MATMUL_ATTENTION_MIN_ROWS rows on."""
    monkeypatch.setattr(fused_module, "MATMUL_ATTENTION_MIN_ROWS", 1 if way == "matmul" else 10**9)
    used = []
    monkeypatch.setattr(fused_module, "_matmul_attention",
                        lambda *args, real=fused_module._matmul_attention: used.append(1) or real(*args))
    batch, heads, kv_heads, columns, dim = 3, 8, 2, 20, 16
    generator = _seeded(5)
    query = torch.randn(batch, heads, 1, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, columns, dim, generator=generator) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, columns)
    mask[0, ..., :5] = torch.finfo(torch.float32).min
    mask[2, ..., 12:] = torch.finfo(torch.float32).min
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    out, _ = fused_module._grouped_query_sdpa(module, query, key, value, mask, dropout=0.0, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 4), repeat_kv(value, 4), attn_mask=mask, scale=0.3).transpose(1, 2)
    assert out.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    assert bool(used) == (way == "matmul")


def test_decode_steps_use_grouped_attention_and_restore_the_config(llama, monkeypatch):
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        shapes.append((tuple(query.shape), tuple(key.shape)))
        return sdpa(query, key, value, **kwargs)

    engine = GenerationEngine(llama, pad_token_id=PAD, static_shapes=True)
    monkeypatch.setattr(fused_module.F, "scaled_dot_product_attention", spy)
    engine.generate(PROMPTS, 3, Sampling(1.0), generator=_seeded(0))
    kv_heads, heads = llama.config.num_key_value_heads, llama.config.num_attention_heads
    grouped = [(q, k) for q, k in shapes if q == (4, kv_heads, heads // kv_heads, 16) and k[1] == kv_heads]
    assert len(grouped) == 3 * llama.config.num_hidden_layers  # every decode step, every layer
    assert not [q for q, _ in shapes if q[2] == 1]  # no single-token query against repeated K/V
    assert llama.config._attn_implementation == "sdpa"


def test_sampling_settings_are_validated():
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)


# ---- generate ------------------------------------------------------------------------------------


@pytest.mark.parametrize("static_shapes", [False, True], ids=["dynamic", "static"])
def test_left_padded_batch_matches_teacher_forcing(model, static_shapes):
    engine = GenerationEngine(model, eos_token_ids=[], pad_token_id=PAD, static_shapes=static_shapes)
    out = engine.generate(PROMPTS, 24, Sampling(1.0), generator=_seeded(0))
    assert out.tokens.shape == (4, 24) and bool(out.mask.all())
    assert torch.equal(out.prompt_lengths, torch.tensor([len(p) for p in PROMPTS]))
    # Temperature 1 and no filtering: the sampled distribution is the model's.
    torch.testing.assert_close(out.sampled_logprobs, out.base_logprobs, atol=1e-6, rtol=0)
    assert out.base_logprobs.dtype == out.sampled_logprobs.dtype == torch.float32
    assert_matches_teacher_forcing(model, out)


@pytest.mark.parametrize(
    "sampling", [Sampling(0.7, top_k=8), Sampling(1.2, top_p=0.7), Sampling(0.9, top_k=30, top_p=0.9)]
)
def test_filtered_sampling_logprobs_match_warped_teacher_forcing(model, sampling):
    engine = GenerationEngine(model, pad_token_id=PAD)
    out = engine.generate(PROMPTS, 20, sampling, generator=_seeded(1))
    assert_matches_teacher_forcing(model, out, sampling)
    # Filtering removed mass: the sampled distribution is sharper than the model's on average.
    assert float((out.sampled_logprobs - out.base_logprobs)[out.mask].mean()) > 0.05


def test_greedy_equals_transformers_generate(model):
    engine = GenerationEngine(model, pad_token_id=PAD)
    out = engine.generate(PROMPTS, 16, Sampling(temperature=0))
    assert_matches_teacher_forcing(model, out, Sampling(temperature=0))
    for prompt, tokens in zip(PROMPTS, out.sequences()):
        reference = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                   pad_token_id=PAD, eos_token_id=None)
        assert reference[0, len(prompt):].tolist() == tokens


def test_rows_stop_at_their_own_eos(model):
    eos = list(range(3, model.config.vocab_size, 6))  # several EOS ids, so rows stop early and at different times
    engine = GenerationEngine(model, eos_token_ids=eos, pad_token_id=PAD)
    prompts = PROMPTS * 2
    out = engine.generate(prompts, 30, Sampling(1.0), generator=_seeded(3))
    lengths = out.lengths
    assert len(set(lengths.tolist())) >= 3, lengths
    assert bool(out.ended_with_eos.any()) and bool((lengths < 30).any())
    assert_padding_is_clean(out, PAD)
    is_eos = torch.isin(out.tokens, torch.tensor(eos)) & out.mask
    for row in range(len(prompts)):
        n = int(lengths[row])
        if out.ended_with_eos[row]:
            assert is_eos[row, n - 1] and not is_eos[row, : n - 1].any()  # stopped at the first EOS
        else:
            assert n == 30 and not is_eos[row].any()
    assert_matches_teacher_forcing(model, out)


def test_a_single_eos_id_and_budgets(llama):
    engine = GenerationEngine(llama, eos_token_ids=7, pad_token_id=PAD)
    out = engine.generate(PROMPTS, 5, Sampling(1.0), generator=_seeded(0))
    assert out.tokens.shape == (4, 5)
    assert bool(((out.lengths == 5) | out.ended_with_eos).all())
    empty = engine.generate(PROMPTS, 0, Sampling(1.0))
    assert empty.tokens.shape == (4, 0)


def test_seed_determines_the_tokens(llama):
    engine = GenerationEngine(llama, pad_token_id=PAD)
    first = engine.generate(PROMPTS, 16, Sampling(1.0, top_p=0.95), generator=_seeded(11))
    again = engine.generate(PROMPTS, 16, Sampling(1.0, top_p=0.95), generator=_seeded(11))
    other = engine.generate(PROMPTS, 16, Sampling(1.0, top_p=0.95), generator=_seeded(12))
    assert torch.equal(first.tokens, again.tokens)
    assert torch.equal(first.base_logprobs, again.base_logprobs)
    assert not torch.equal(first.tokens, other.tokens)


def test_static_shapes_step_equals_dynamic_step(model):
    """The CUDA path's step (attention over the whole buffer) gives the eager path's results."""
    results = []
    for static in (False, True):
        engine = GenerationEngine(model, eos_token_ids=[9, 10, 11], pad_token_id=PAD, static_shapes=static)
        out = engine.generate(PROMPTS, 20, Sampling(0.8, top_k=40), generator=_seeded(5))
        resampled = engine.resample(out, [3, 0, 7, 1], 26, Sampling(0.8, top_k=40), generator=_seeded(6))
        results.append((out, resampled))
    for dynamic, static in zip(*results):
        assert torch.equal(dynamic.tokens, static.tokens)
        torch.testing.assert_close(dynamic.base_logprobs, static.base_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(dynamic.sampled_logprobs, static.sampled_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fuse_weights", [None, False], ids=["fused", "model-forward"])
def test_decode_step_is_capturable_in_a_cuda_graph(model, fuse_weights):
    """What CUDA graph capture needs, checked on CPU over every aten op of one static-shape step
    (the model's own code included): no host sync (item(), bool(), nonzero), no tensor built from
    host data, and only in-place updates of the engine's fixed tensors."""
    engine = GenerationEngine(model, eos_token_ids=[9], pad_token_id=PAD, static_shapes=True,
                              fuse_weights=fuse_weights)
    engine.generate(PROMPTS, 8, Sampling(0.9, top_k=20, top_p=0.9), generator=_seeded(0))
    state = engine._state
    fixed = {name: t.data_ptr() for name, t in vars(state).items() if isinstance(t, torch.Tensor)}
    write_col = int(engine._cursor.write_col)

    class OpLog(TorchDispatchMode):
        ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    with OpLog() as log:
        engine._decode_step(0, Sampling(0.9, top_k=20, top_p=0.9))
    host_syncs_or_host_data = {"_local_scalar_dense", "nonzero", "lift_fresh", "item"}
    forbidden = {op for op in log.ops if op.split(".")[1] in host_syncs_or_host_data}
    assert not forbidden, forbidden
    assert fixed == {name: t.data_ptr() for name, t in vars(state).items() if isinstance(t, torch.Tensor)}
    assert int(engine._cursor.write_col) == write_col + 1


def test_fused_decode_equals_the_models_own_forward(model):
    """q/k/v and gate/up as one matmul each (the default for these small Llama-style models) against
    the model's own forward for the decode steps: same tokens, log-probs within 1e-5 (fp32)."""
    runs = []
    for fuse in (True, False):
        engine = GenerationEngine(model, eos_token_ids=[9, 10, 11], pad_token_id=PAD, static_shapes=True,
                                  fuse_weights=fuse)
        assert (engine._fused is not None) == fuse
        runs.append(_mcmc_round_cpu(engine, Sampling(0.8, top_k=40, top_p=0.95)))
    assert GenerationEngine(model)._fused is not None  # on by default
    for fused, plain in zip(*runs):
        assert torch.equal(fused.tokens, plain.tokens)
        torch.testing.assert_close(fused.base_logprobs, plain.base_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(fused.sampled_logprobs, plain.sampled_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("weights", ["all", "small", "all-but-down-proj"])
def test_reductions_in_the_fused_forward_equal_its_matmuls(model, weights, monkeypatch):
    """The few-row way of the compiled fused forward (`_reduction_linear`, `_reduction_attention`), here
    run eagerly on every row, prefill included: the same tokens as cuBLAS's matmuls and SDPA, log-probs
    within 1e-5 (fp32), o_proj and down_proj included; with REDUCTION_LINEAR_MAX_WEIGHT_BYTES at o_proj's
    size, only o_proj of a layer's four matmuls (its smallest here) is a reduction; with
    DOWN_PROJ_AS_REDUCTION off, down_proj alone is a matmul."""
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    small_enough = o_proj.numel() * o_proj.element_size() if weights == "small" else None
    runs = []
    for reductions in (True, False):
        engine = GenerationEngine(model, eos_token_ids=[9, 10, 11], pad_token_id=PAD, static_shapes=True)
        if reductions:
            monkeypatch.setattr(fused_module, "REDUCTION_LINEAR_MAX_ROWS", 10**9)
            monkeypatch.setattr(fused_module, "REDUCTION_ATTENTION_MAX_ROWS", 10**9)
            monkeypatch.setattr(fused_module, "REDUCTION_LINEAR_MAX_WEIGHT_BYTES", small_enough)
            monkeypatch.setattr(fused_module, "DOWN_PROJ_AS_REDUCTION", weights != "all-but-down-proj")
            engine._fused.compiled = True  # the reductions are taken on compiled forwards only
        used = _count_calls(monkeypatch, fused_module, "_reduction_linear", "_reduction_attention")
        runs.append(_mcmc_round_cpu(engine, Sampling(0.8, top_k=40, top_p=0.95)))
        if reductions:  # of a layer's matmuls (q/k/v, o_proj, gate/up, down_proj): all four, o_proj alone, or three
            per_layer = {"all": 4, "small": 1, "all-but-down-proj": 3}[weights]
            assert used.count("_reduction_linear") == per_layer * used.count("_reduction_attention") > 0
        else:
            assert not used
        monkeypatch.undo()
    for reduced, plain in zip(*runs):
        assert torch.equal(reduced.tokens, plain.tokens)
        torch.testing.assert_close(reduced.base_logprobs, plain.base_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(reduced.sampled_logprobs, plain.sampled_logprobs, atol=1e-5, rtol=0)


# The fused forward with TRITON_MLP_AT_ONE_ROW (or TRITON_LAYER_AT_ONE_ROW) on, its readiness set as a compiled one-row
# step sets it, every prompt alone, in Triton's interpreter on CPU, against the same forward without it: fp32, so the
# same tokens and log-probs within 1e-5. The layer on a tiny Qwen2 (q/k/v biases, grouped KV heads). Prints the
# number of layer-steps the Triton kernels ran.
TRITON_IN_THE_INTERPRETER = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from gpuscale.data.models import build_random_model
from gpuscale.engines.generation import GenerationEngine, Sampling, triton_matvec
prompts, which, calls = eval(sys.argv[1]), sys.argv[2], []
triton_matvec._register()  # register() says no on CPU: the interpreter runs the kernels here
counted = {"mlp": "silu_gate_up", "layer": "matvec_norm"}[which]  # the layer: its tails in last programs
real = getattr(triton_matvec, counted)
setattr(triton_matvec, counted, lambda *args: calls.append(1) or real(*args))
if which == "layer":
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
else:
    model = build_random_model("random-tiny", seed=0)
runs = []
for on in (True, False):
    engine = GenerationEngine(model, eos_token_ids=[9, 10, 11], pad_token_id=0, static_shapes=True)
    engine._fused.compiled = True
    setattr(engine._fused, f"triton_{which}_ready", on)  # register() says no on CPU
    if which == "layer" and on:  # with the kernels' tails in their last programs, as on a GPU by default
        engine._fused.tail_counters = triton_matvec.tail_counters(model.config.num_attention_heads, "cpu")
    runs.append([engine.generate([p], 6, Sampling(0.8, top_k=40), generator=torch.Generator().manual_seed(i))
                 for i, p in enumerate(prompts)])
for ours, plain in zip(*runs):
    assert torch.equal(ours.tokens, plain.tokens)
    torch.testing.assert_close(ours.base_logprobs, plain.base_logprobs, atol=1e-5, rtol=0)
print(len(calls))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton: its interpreter runs the kernels")
@pytest.mark.parametrize("which", ["mlp", "layer"])
def test_the_triton_kernels_equal_the_fused_forward_in_tritons_interpreter(which):
    """triton_matvec's kernels in place of the one-row MLP's matmuls (`mlp`) or of the whole layer (`layer`),
    wired as the compiled step wires them (the GPU test test_one_row_compiled_agrees_with_the_eager_step runs
    them compiled)."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", TRITON_IN_THE_INTERPRETER, repr(PROMPTS[:2]), which],
                          capture_output=True, text=True, timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    # every layer (2 in both models) of every decode step of both prompts (one a new token: the prefill takes all
    # but the prompt's last)
    assert int(done.stdout.split()[-1]) == 2 * 6 * 2


# triton_matvec's layer kernels one by one in Triton's interpreter, fp32, against explicit computations: the norm,
# q/k/v with and without bias, rotary and the KV write at one column (the others untouched); attention over 140
# columns (three blocks, the last part padding) with masked columns, combined by its own kernel and by each head's
# last program; gate/up with SiLU; the matvec with a residual, and with the norm of its output by its last program.
LAYER_KERNELS_IN_THE_INTERPRETER = """
import torch
import torch.nn.functional as F
import sys
from gpuscale.engines.generation import triton_matvec as tm
tm.PROGRAMMATIC_DEPENDENT_LAUNCH = sys.argv[1] == "programmatic"
tm._register()
torch.manual_seed(0)
K, Hq, Hk, D, C, N, eps, exact = 64, 4, 2, 16, 150, 96, 1e-6, dict(atol=1e-5, rtol=0)
h, norm = torch.randn(1, 1, K), 1 + 0.1 * torch.randn(K)
W, bias = 0.2 * torch.randn((Hq + 2 * Hk) * D, K), 0.1 * torch.randn((Hq + 2 * Hk) * D)
angle = torch.rand(D // 2) * 3
cos, sin = (torch.cat([f(angle), f(angle)])[None, None] for f in (torch.cos, torch.sin))
keys, values = torch.randn(1, Hk, C, D), torch.randn(1, Hk, C, D)
normed = norm * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
torch.testing.assert_close(tm.rms_norm(h, norm, eps), normed, **exact)
def rotary(t):
    t = t.view(-1, D)
    return t * cos[0] + torch.cat([-t[:, D // 2:], t[:, :D // 2]], -1) * sin[0]
for b in (bias, None):
    k_cache, v_cache = keys.clone(), values.clone()
    q, k, v = F.linear(normed, W, b).split([Hq * D, Hk * D, Hk * D], -1)
    query = tm.norm_qkv_rotary(h, norm, eps, W, b, cos, sin, k_cache, v_cache, torch.tensor([6]))
    torch.testing.assert_close(query, rotary(q).reshape(-1), **exact)
    torch.testing.assert_close(k_cache[0, :, 6], rotary(k), **exact)
    torch.testing.assert_close(v_cache[0, :, 6], v.view(Hk, D), **exact)
    others = [c for c in range(C) if c != 6]
    for cache, before in ((k_cache, keys), (v_cache, values)):
        assert torch.equal(cache[:, :, others], before[:, :, others])
mask = torch.zeros(1, 1, 1, 140)
mask[..., 130:] = torch.finfo(torch.float32).min
query = torch.randn(Hq * D)
expected = torch.cat([((keys[0, i // 2, :140] @ query.view(Hq, D)[i]) * 0.25 + mask[0, 0, 0]).softmax(-1)
                      @ values[0, i // 2, :140] for i in range(Hq)])
torch.testing.assert_close(tm.decode_attention(query, keys, values, mask, 0.25), expected, **exact)
heads_counters, norm_counter = tm.tail_counters(Hq, "cpu")
torch.testing.assert_close(tm.decode_attention(query, keys, values, mask, 0.25, heads_counters), expected, **exact)
gate_up, down = 0.2 * torch.randn(2 * N, K), 0.2 * torch.randn(K, N)
gate, up = F.linear(h, gate_up).split(N, -1)
torch.testing.assert_close(tm.silu_gate_up(h, gate_up), F.silu(gate) * up, **exact)
x = torch.randn(1, 1, N)
torch.testing.assert_close(tm.matvec(x, down, h), h + F.linear(x, down), **exact)
summed, summed_normed = tm.matvec_norm(x, down, h, norm, eps, norm_counter)
torch.testing.assert_close(summed, h + F.linear(x, down), **exact)
torch.testing.assert_close(summed_normed, norm * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps),
                           **exact)
assert not heads_counters.any() and not norm_counter.any()  # left at zero for the next kernel
if tm.PROGRAMMATIC_DEPENDENT_LAUNCH:  # opaque custom ops: their fakes give the real outputs' shapes, strides, dtypes
    from torch._subclasses.fake_tensor import FakeTensorMode
    cases = [(tm.silu_gate_up, (h, gate_up)), (tm.matvec_norm, (x, down, h, norm, eps, norm_counter)),
             (tm.norm_qkv_rotary, (h, norm, eps, W, bias, cos, sin, keys.clone(), values.clone(), torch.tensor([6]))),
             (tm.decode_attention, (query, keys, values, mask, 0.25, heads_counters))]
    for function, args in cases:
        real = function(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = function(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        for r, f in zip(*(o if isinstance(o, tuple) else (o,) for o in (real, fake))):
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype), function
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton: its interpreter runs the kernels")
@pytest.mark.parametrize("launch", ["through-torch", "programmatic"])
def test_the_layer_kernels_equal_explicit_computations_in_tritons_interpreter(launch):
    """Both ways of declaring and launching the kernels (triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH): through
    torch's Triton ops, and as opaque custom ops launched by Triton (the interpreter runs them without the grid
    dependency control a GPU launch adds)."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", LAYER_KERNELS_IN_THE_INTERPRETER, launch], capture_output=True,
                          text=True, timeout=600, env=environment)
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-3000:]


# torch.compile on CPU builds C++ kernels: without a compiler it would fall back to eager (and warn).
needs_cpp_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                        reason="torch.compile on CPU needs a C++ compiler")


# The step compiled by torch.compile (Inductor's CPU code) with the layer as triton_matvec's opaque custom ops
# (PROGRAMMATIC_DEPENDENT_LAUNCH on), their kernels in Triton's interpreter, against the eager step without them.
COMPILED_OPAQUE_LAYER = """
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from gpuscale.engines.generation import GenerationEngine, Sampling, triton_matvec
triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH = True
triton_matvec._register()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
    "qwen2", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512)).eval()
calls, real = [], triton_matvec.matvec_norm
triton_matvec.matvec_norm = lambda *args: calls.append(1) or real(*args)
runs = []
for compiled in (True, False):
    engine = GenerationEngine(model, eos_token_ids=[9], pad_token_id=0, static_shapes=True, compile=compiled,
                              cuda_graphs=False)
    if compiled:  # as a compiled one-row step on a GPU sets it (register() says no on CPU)
        engine._fused.triton_layer_ready = True
        engine._fused.tail_counters = triton_matvec.tail_counters(4, "cpu")
    runs.append(engine.generate([[5, 17, 33, 2]], 6, Sampling(0.0), generator=torch.Generator().manual_seed(0)))
    assert not (compiled and engine._compile_errors()), engine._compile_errors()
assert calls, "the compiled step did not run the layer's ops"
assert torch.equal(runs[0].tokens, runs[1].tokens)
torch.testing.assert_close(runs[0].base_logprobs, runs[1].base_logprobs, atol=1e-5, rtol=0)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton: its interpreter runs the kernels")
@needs_cpp_compiler
def test_the_compiled_step_runs_the_opaque_layer_ops_as_the_eager_step_in_tritons_interpreter():
    """With PROGRAMMATIC_DEPENDENT_LAUNCH the layer's ops are opaque to torch.compile: it calls them (their fakes
    give it the outputs' shapes) and functionalizes what they write (the KV cache, the tails' counters); the
    compiled step must still decode as the eager one."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", COMPILED_OPAQUE_LAYER], capture_output=True, text=True, timeout=600,
                          env=environment)
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-3000:]


def _tracebacks(errors: dict[str, BaseException]) -> str:
    """Each compile error's whole traceback, the exceptions it chains included (its repr alone names the last)."""
    return "\n".join(f"{name}:\n" + "".join(traceback.format_exception(error)) for name, error in errors.items())


def _count_calls(monkeypatch, module, *names) -> list[str]:
    """The names of `module`'s functions `names`, in the order they are called from now on."""
    calls = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, name=name: calls.append(name) or real(*args))
    return calls


def test_fused_weights_follow_in_place_updates_of_the_model():
    """An optimizer step between calls changes the weights in place: the fused copies follow."""
    model = _sharpen(build_random_model("random-tiny", seed=0), 5)
    engine = GenerationEngine(model, pad_token_id=PAD)
    engine.generate(PROMPTS, 4, Sampling(1.0), generator=_seeded(0))
    with torch.no_grad():
        layer = model.model.layers[1]
        layer.self_attn.k_proj.weight.mul_(3.0)
        layer.mlp.up_proj.weight.add_(0.05)
    fused = engine.generate(PROMPTS, 12, Sampling(1.0), generator=_seeded(1))
    plain = GenerationEngine(model, pad_token_id=PAD, fuse_weights=False).generate(
        PROMPTS, 12, Sampling(1.0), generator=_seeded(1))
    assert torch.equal(fused.tokens, plain.tokens)
    torch.testing.assert_close(fused.base_logprobs, plain.base_logprobs, atol=1e-5, rtol=0)


def test_other_architectures_decode_through_the_models_forward():
    """Qwen3 has q/k norms: not the fused wiring. It runs the model's own forward (and refuses to fuse)."""
    config = AutoConfig.for_model(
        "qwen3", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    model = _sharpen(AutoModelForCausalLM.from_config(config), 20)
    with pytest.raises(ValueError, match="not a Llama-style decoder"):
        GenerationEngine(model, pad_token_id=PAD, fuse_weights=True)
    engine = GenerationEngine(model, pad_token_id=PAD, static_shapes=True)
    assert engine._fused is None
    assert_matches_teacher_forcing(model, engine.generate(PROMPTS, 12, Sampling(1.0), generator=_seeded(0)))


def _mcmc_round_cpu(engine, sampling):
    out = engine.generate(PROMPTS, 20, sampling, generator=_seeded(5))
    cut = (out.lengths * torch.tensor([0.5, 0.0, 1.0, 0.3])).long()
    proposal = engine.resample(out, cut, 26, sampling, generator=_seeded(6))
    merged = engine.accept(out, proposal, [True, False, True, False])
    # Prompts of one token: nothing to prefill, the first decode step allocates the KV buffers.
    short = engine.generate([p[:1] for p in PROMPTS], 10, sampling, generator=_seeded(7))
    return out, proposal, merged, short


@needs_cpp_compiler
def test_compiled_step_equals_the_eager_static_step(model):
    """torch.compile of the forward and of the sampling step (the CUDA default) on CPU, fp32: the
    same tokens, log-probs within 1e-5, through generate, resample (the other KV slot) and accept."""
    _compare_compiled_and_eager(model, fuse_weights=None)


@needs_cpp_compiler
def test_compiled_model_forward_equals_the_eager_static_step(llama):
    """The same through the model's own forward (architectures that are not Llama-style)."""
    _compare_compiled_and_eager(llama, fuse_weights=False)


def _compare_compiled_and_eager(model, fuse_weights):
    runs = []
    sampling = Sampling(0.8, top_k=40, top_p=0.95)
    for compiled in (False, True):
        engine = GenerationEngine(model, eos_token_ids=[9, 10, 11], pad_token_id=PAD, static_shapes=True,
                                  compile=compiled, fuse_weights=fuse_weights)
        runs.append(_mcmc_round_cpu(engine, sampling))
    assert not engine._compile_errors()
    for eager, compiled in zip(*runs):
        assert torch.equal(eager.tokens, compiled.tokens)
        torch.testing.assert_close(eager.base_logprobs, compiled.base_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(eager.sampled_logprobs, compiled.sampled_logprobs, atol=1e-5, rtol=0)


def test_a_failing_compile_falls_back_to_the_eager_step(llama, monkeypatch):
    def broken_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("inductor exploded\nlong traceback")
        return compiled

    expected = GenerationEngine(llama, pad_token_id=PAD, static_shapes=True).generate(
        PROMPTS, 8, Sampling(0.9), generator=_seeded(2))
    monkeypatch.setattr(compiled_module.torch, "compile", broken_compile)
    engine = GenerationEngine(llama, pad_token_id=PAD, static_shapes=True, compile=True)
    with pytest.warns(RuntimeWarning, match="running it uncompiled: RuntimeError: inductor exploded"):
        out = engine.generate(PROMPTS, 8, Sampling(0.9), generator=_seeded(2))
    assert torch.equal(out.tokens, expected.tokens)
    assert torch.equal(out.base_logprobs, expected.base_logprobs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; later steps run eagerly without a word
        engine.generate(PROMPTS, 4, Sampling(0.9), generator=_seeded(2))


def test_compile_settings_are_validated(llama):
    with pytest.raises(ValueError, match="static_shapes"):
        GenerationEngine(llama, compile=True)  # dynamic shapes on CPU
    with pytest.raises(ValueError, match="CUDA graphs of its own"):
        GenerationEngine(llama, static_shapes=True, compile=True, compile_mode="reduce-overhead")
    assert not GenerationEngine(llama).compile  # off on CPU by default


# ---- resampling suffixes -------------------------------------------------------------------------


def test_resample_with_a_different_cut_per_row(model):
    eos = [13, 14]
    engine = GenerationEngine(model, eos_token_ids=eos, pad_token_id=PAD)
    sampling = Sampling(1.0, top_k=60)
    source = engine.generate(PROMPTS, 20, sampling, generator=_seeded(7))
    lengths = source.lengths.tolist()
    cut = [lengths[0] // 2, 0, lengths[2], max(lengths[3] - 1, 0)]  # middle, all, none (extend), last token
    proposal = engine.resample(source, cut, 20, sampling, generator=_seeded(8))

    for row, c in enumerate(cut):
        for name in ("tokens", "base_logprobs", "sampled_logprobs"):
            assert torch.equal(getattr(proposal, name)[row, :c], getattr(source, name)[row, :c]), (row, name)
    suffix = proposal.mask & (torch.arange(20)[None] >= torch.tensor(cut)[:, None])
    assert bool(suffix[1].any()) and not torch.equal(proposal.tokens[1], source.tokens[1])
    assert_padding_is_clean(proposal, PAD)
    assert_matches_teacher_forcing(model, proposal, sampling)

    base, sampled, count = proposal.suffix_logprobs(cut)
    torch.testing.assert_close(base, (proposal.base_logprobs * suffix).sum(1))
    assert torch.equal(count, suffix.sum(1))


def test_resample_extends_rows_and_keeps_rows_that_ended(llama):
    eos = list(range(4, 512, 9))
    engine = GenerationEngine(llama, eos_token_ids=eos, pad_token_id=PAD)
    source = engine.generate(PROMPTS * 2, 12, Sampling(1.0), generator=_seeded(21))
    assert bool(source.ended_with_eos.any()) and not bool(source.ended_with_eos.all())
    # Block growth: keep everything and allow 40 tokens in all (the buffers grow past their first size).
    grown = engine.extend(source, 40, Sampling(1.0), generator=_seeded(22))
    assert grown.tokens.shape == (8, 40)
    ended = source.ended_with_eos
    assert torch.equal(grown.lengths[ended], source.lengths[ended])
    assert bool((grown.lengths[~ended] > source.lengths[~ended]).all())
    assert_matches_teacher_forcing(llama, grown)


def test_metropolis_hastings_loop_keeps_the_cache_consistent(model):
    """Resample, accept some rows, repeat: every state must still be the model's own sequences."""
    sampling = Sampling(0.8, top_p=0.95)
    engine = GenerationEngine(model, eos_token_ids=[21, 22], pad_token_id=PAD)
    current = engine.generate(PROMPTS, 24, sampling, generator=_seeded(30))
    choices = torch.Generator().manual_seed(31)
    for step in range(4):
        cut = (torch.rand(4, generator=choices) * current.lengths).long()
        proposal = engine.resample(current, cut, 24, sampling, generator=_seeded(40 + step))
        assert_matches_teacher_forcing(model, proposal, sampling)
        accepted = torch.tensor([True, False, step % 2 == 0, True])
        merged = engine.accept(current, proposal, accepted)
        for row in range(4):
            chosen = proposal if accepted[row] else current
            assert torch.equal(merged.tokens[row], chosen.tokens[row])
            assert torch.equal(merged.base_logprobs[row], chosen.base_logprobs[row])
        with pytest.raises(StaleGenerationError):
            engine.resample(current, cut, 24, sampling)  # its accepted rows were overwritten
        current = merged
    assert_matches_teacher_forcing(model, current, sampling)


def test_resample_rejects_bad_cuts_and_stale_generations(llama):
    engine = GenerationEngine(llama, pad_token_id=PAD)
    out = engine.generate(PROMPTS, 8, Sampling(1.0), generator=_seeded(0))
    with pytest.raises(ValueError):
        engine.resample(out, [9, 0, 0, 0], 8)  # beyond the row's length
    with pytest.raises(ValueError):
        engine.resample(out, [0, 0, 0], 8)  # one cut per row
    first = engine.resample(out, [1, 1, 1, 1], 8, generator=_seeded(1))
    engine.resample(out, [2, 2, 2, 2], 8, generator=_seeded(2))  # overwrites first's cache slot
    with pytest.raises(StaleGenerationError):
        engine.resample(first, [1, 1, 1, 1], 8)
    engine.generate(PROMPTS, 8)  # a new batch overwrites out's slot
    with pytest.raises(StaleGenerationError):
        engine.resample(out, [1, 1, 1, 1], 8)


def test_refuses_sliding_window_models():
    config = AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=16,
        max_window_layers=0,
    )
    with pytest.raises(NotImplementedError):
        GenerationEngine(AutoModelForCausalLM.from_config(config))


def test_engine_module_does_not_import_textual():
    code = "import sys, gpuscale.engines.generation; assert 'textual' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- on a GPU (python -m pytest -m gpu tests/unit/test_generation.py; skipped without CUDA) ------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mcmc_round(engine, prompts, sampling, seed, generator_per_call=False):
    """generate, resample with a different cut per row, accept every other row, resample again.

    With graphs the engine checks for finished rows every few steps only, so once every row has ended it
    may draw noise for a few more (no-op) steps than eager decoding: a generator shared with the next
    call would then hand it different numbers. The last call always has a fresh one; with
    `generator_per_call` (one row, which ends early) every call does."""
    generators = (torch.Generator(device="cuda").manual_seed(seed + i) for i in range(5))
    shared = next(generators)
    generator = (lambda: next(generators)) if generator_per_call else (lambda: shared)
    out = engine.generate(prompts, 40, sampling, shared)
    cut = (out.lengths * torch.linspace(0, 1, len(prompts), device="cuda")).long()
    proposal = engine.resample(out, cut, 48, sampling, generator())
    merged = engine.accept(out, proposal, torch.arange(len(prompts), device="cuda") % 2 == 0)
    again = engine.resample(merged, cut.flip(0).clamp_max(merged.lengths), 48, sampling, generator())
    fresh = torch.Generator(device="cuda").manual_seed(seed + 10)
    short = engine.generate([p[:1] for p in prompts], 16, sampling, fresh)  # nothing to prefill
    return out, proposal, merged, again, short


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sampling", [Sampling(0.9, top_k=40, top_p=0.95), Sampling(temperature=0)])
def test_cuda_graphs_replay_the_eager_static_step(sampling):
    cpu_model = _sharpen(build_random_model("random-tiny", seed=0), 5)
    model = _sharpen(build_random_model("random-tiny", seed=0), 5).to("cuda")
    runs = []
    for graphs in (True, False):
        engine = GenerationEngine(model, eos_token_ids=list(range(3, 512, 6)), pad_token_id=PAD,
                                  cuda_graphs=graphs, static_shapes=True, compile=False)
        runs.append(_mcmc_round(engine, PROMPTS * 4, sampling, seed=0))
        assert bool(engine._graphs) == graphs
    for with_graphs, eager in zip(*runs):
        assert torch.equal(with_graphs.tokens, eager.tokens)
        torch.testing.assert_close(with_graphs.base_logprobs, eager.base_logprobs, atol=1e-5, rtol=0)
    for generation in runs[0]:
        assert_matches_teacher_forcing(cpu_model, generation, sampling, tol=1e-3)


def _common_prefix(first, second):
    """[B, T] True up to each row's first differing token (both rows being the same so far)."""
    differs = (first.tokens != second.tokens).cpu()
    return differs.long().cumsum(1) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, fuse_weights",
                         [(torch.float32, None), (torch.bfloat16, None), (torch.float32, False)],
                         ids=["fp32", "bf16", "fp32-model-forward"])
@pytest.mark.parametrize("sampling", [Sampling(0.9, top_k=40, top_p=0.95), Sampling(temperature=0)], ids=str)
def test_compiled_graphs_equal_the_uncompiled_eager_static_step(dtype, fuse_weights, sampling):
    """compile + CUDA graphs (the CUDA default) against the uncompiled eager static step, over an MCMC
    round. fp32: same tokens, log-probs within 1e-5. bf16: fused kernels may round a hidden value
    differently now and then even with emulated casts (reduction order), which moves a log-prob by up
    to ~1e-2 and can flip a near-tie: rows must agree up to rare divergences, log-probs within 1e-3
    on average and 3e-2 at worst over the common prefix."""
    model = _sharpen(build_random_model("random-tiny", seed=0), 5).to("cuda", dtype)
    runs = []
    for compiled in (True, False):
        engine = GenerationEngine(model, eos_token_ids=list(range(3, 512, 6)), pad_token_id=PAD,
                                  cuda_graphs=compiled, static_shapes=True, compile=compiled,
                                  fuse_weights=fuse_weights)
        runs.append(_mcmc_round(engine, PROMPTS * 4, sampling, seed=0))
        if compiled:
            assert engine._graphs and not engine._compile_errors()
    _assert_fast_agrees_with_eager(*runs, dtype)


def _assert_fast_agrees_with_eager(fast_runs, eager_runs, dtype):
    for fast, eager in zip(fast_runs, eager_runs):
        if dtype == torch.float32:
            assert torch.equal(fast.tokens, eager.tokens)
            torch.testing.assert_close(fast.base_logprobs, eager.base_logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(fast.sampled_logprobs, eager.sampled_logprobs, atol=1e-5, rtol=0)
            continue
        same = _common_prefix(fast, eager) & eager.mask.cpu()
        assert float(same.sum()) >= 0.9 * float(eager.mask.sum()), "compiled and eager rows diverge often"
        for name in ("base_logprobs", "sampled_logprobs"):
            difference = (getattr(fast, name) - getattr(eager, name)).abs().cpu()[same]
            assert float(difference.mean()) < 1e-3 and float(difference.max()) < 3e-2, (name, difference.max())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sampling", [Sampling(0.9, top_k=40, top_p=0.95), Sampling(temperature=0)], ids=str)
@pytest.mark.parametrize("way", ["reductions", "cublas-sdpa", "triton-mlp", "triton-layer"])
def test_one_row_compiled_agrees_with_the_eager_step(dtype, sampling, way, monkeypatch):
    """One row, compiled with CUDA graphs, the fused forward's matmuls and attention as Inductor's
    reductions (REDUCTION_*_MAX_ROWS at 1), with the MLP as triton_matvec's kernels beside them
    (TRITON_MLP_AT_ONE_ROW), each whole layer as its kernels (TRITON_LAYER_AT_ONE_ROW, their tails in last
    programs), or through cuBLAS and SDPA, against the uncompiled eager static step, with the tolerances of
    test_compiled_graphs_equal_the_uncompiled_eager_static_step. Not the layer with TAILS_IN_LAST_PROGRAM off:
    a process that compiled that step and then the default one failed the second compile on an H200
    (triton_matvec.TAILS_IN_LAST_PROGRAM says so); the seven kernels are checked in Triton's interpreter."""
    model = _sharpen(build_random_model("random-tiny", seed=0), 5).to("cuda", dtype)
    runs, traced = [], []
    for compiled in (True, False):
        for name in ("REDUCTION_LINEAR_MAX_ROWS", "REDUCTION_ATTENTION_MAX_ROWS"):
            monkeypatch.setattr(fused_module, name, 0 if way == "cublas-sdpa" else 1)
        # before the engine is built: it registers the Triton ops where the switch is on
        monkeypatch.setattr(fused_module, "TRITON_MLP_AT_ONE_ROW", way == "triton-mlp")
        monkeypatch.setattr(fused_module, "TRITON_LAYER_AT_ONE_ROW", way == "triton-layer")
        engine = GenerationEngine(model, eos_token_ids=list(range(3, 512, 6)), pad_token_id=PAD,
                                  cuda_graphs=compiled, static_shapes=True, compile=compiled)
        fused_calls = _count_calls(monkeypatch, fused_module, "_reduction_linear", "_reduction_attention")
        triton_calls = _count_calls(monkeypatch, triton_matvec, *LAYER_KERNELS)
        runs.append(_mcmc_round(engine, PROMPTS[:1], sampling, seed=0, generator_per_call=True))
        traced.append(set(fused_calls + triton_calls))  # compiled: called while dynamo traced the step
        monkeypatch.undo()
        if compiled:
            assert engine._graphs and not engine._compile_errors()
    expected = {"reductions": {"_reduction_linear", "_reduction_attention"}, "cublas-sdpa": set(),
                "triton-mlp": {"_reduction_linear", "_reduction_attention", "silu_gate_up", "matvec"},
                "triton-layer": set(LAYER_KERNELS) - {"rms_norm"}}[way]
    assert traced == [expected, set()]
    _assert_fast_agrees_with_eager(*runs, dtype)


LAYER_KERNELS = ("norm_qkv_rotary", "decode_attention", "rms_norm", "matvec_norm", "silu_gate_up", "matvec")


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_on_the_qwen_shape_in_bf16():
    model = build_random_model("random-qwen2.5-0.5b", seed=0).to("cuda", torch.bfloat16)
    engine = GenerationEngine(model, pad_token_id=PAD)
    assert engine.cuda_graphs and engine._head_out_dtype, "expected CUDA graphs and fp32 logits from the head"
    assert engine.compile, "expected torch.compile by default on CUDA"
    prompts = torch.randint(0, 151936, (8, 32), generator=_seeded(0)).tolist()
    for generation in _mcmc_round(engine, prompts, Sampling(1.0), seed=1):
        assert engine._graphs and not engine._compile_errors()
        _, expected = teacher_forced(model, _on_cpu(generation))
        mask = generation.mask.cpu()
        # bf16 forwards of different shapes (batched prefill vs one-token decode) differ by about 1e-2.
        assert float((generation.base_logprobs.cpu() - expected)[mask].abs().max()) < 0.1


def test_the_agreement_measure_finds_an_fp32_step_exact():
    """decode_ways.py's `agreement` (what the bf16 test below holds the layer kernels to): an fp32 step scored against
    the same model's fp32 forward has no error and picks its argmax; a slip of one column would show."""
    agreement = load_bench("decode_ways.py").agreement
    engine = GenerationEngine(build_random_model("random-tiny", seed=0), pad_token_id=PAD, static_shapes=True)
    measured = agreement(engine, prompts=2, new_tokens=6)
    assert measured["max_abs_logprob_error"] < 1e-5 and measured["fp32_argmax_share"] == 1.0
    assert [len(tokens) for tokens in measured["tokens"]] == [6, 6]


@pytest.mark.gpu
@needs_cuda
def test_the_triton_layer_in_bf16_stays_as_close_to_fp32_as_the_uncompiled_step():
    """The default batch-1 step (each layer as triton_matvec's kernels) at Qwen2.5-0.5B's shape in bf16, against
    the uncompiled step, both scored against an fp32 forward (bench/decode_ways.py's `agreement`). Not their
    tokens: two bf16 steps part wherever the fp32 top-two margin is under bf16's error, which a random model's
    greedy decode meets within tens of tokens (on an H200 the uncompiled step and the step with only the MLP's
    kernels parted at steps 1-20 of all six prompts: decode-ways-b1-agreement-2026-12-01-h200.json), so the kernels
    are held to the uncompiled step's closeness instead."""
    agreement = load_bench("decode_ways.py").agreement
    model = build_random_model("random-qwen2.5-0.5b", seed=0).to("cuda", torch.bfloat16)
    uncompiled = agreement(GenerationEngine(model, pad_token_id=PAD, compile=False, cuda_graphs=False,
                                            static_shapes=True))
    engine = GenerationEngine(model, pad_token_id=PAD)
    assert engine._fused.triton_layer_ready, "expected the whole-layer kernels on by default on CUDA"
    ours = agreement(engine)
    assert not engine._compile_errors(), _tracebacks(engine._compile_errors())
    assert ours["mean_abs_logprob_error"] <= 1.25 * uncompiled["mean_abs_logprob_error"] + 1e-3, (ours, uncompiled)
    assert ours["fp32_argmax_share"] >= uncompiled["fp32_argmax_share"] - 0.03, (ours, uncompiled)


# The default batch-1 step at Qwen2.5-0.5B's shape in bf16, greedy, in a fresh process (the Triton ops are
# registered once a process, as the switch then says): its tokens and log-probs, saved to argv[2].
LAUNCHED_STEP = """
import sys, torch
from gpuscale.data.models import build_random_model
from gpuscale.engines.generation import GenerationEngine, Sampling, triton_matvec
triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH = sys.argv[1] == "programmatic"
model = build_random_model("random-qwen2.5-0.5b", seed=0).to("cuda", torch.bfloat16)
engine = GenerationEngine(model, pad_token_id=0)
prompt = torch.randint(0, 151936, (24,), generator=torch.Generator().manual_seed(0)).tolist()
out = engine.generate([prompt], 48, Sampling(temperature=0.0), generator=torch.Generator("cuda").manual_seed(0))
assert engine._fused.triton_layer_ready and not engine._compile_errors(), engine._compile_errors()
torch.save({"tokens": out.tokens.cpu(), "logprobs": out.base_logprobs.cpu()}, sys.argv[2])
"""


@pytest.mark.gpu
@needs_cuda
def test_programmatic_dependent_launch_gives_the_same_tokens_and_log_probs(tmp_path):
    """triton_matvec.PROGRAMMATIC_DEPENDENT_LAUNCH changes when each layer kernel starts, not what it computes: the
    same greedy tokens and bitwise the same log-probs as the kernels launched through torch.compile."""
    results = {}
    for launch in ("through-torch", "programmatic"):
        path = tmp_path / f"{launch}.pt"
        done = subprocess.run([sys.executable, "-c", LAUNCHED_STEP, launch, str(path)], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[launch] = torch.load(path)
    assert torch.equal(results["programmatic"]["tokens"], results["through-torch"]["tokens"])
    assert torch.equal(results["programmatic"]["logprobs"], results["through-torch"]["logprobs"])


@pytest.mark.gpu
@needs_cuda
def test_matmul_attention_agrees_with_sdpa_in_bf16_on_the_gpu():
    """The large-batch way (scores written in fp32 by the bf16 matmul) against SDPA's kernels, at a
    batch above MATMUL_ATTENTION_MIN_ROWS: within bf16's rounding of the output."""
    rows, kv_heads, groups, columns, dim = fused_module.MATMUL_ATTENTION_MIN_ROWS + 16, 2, 7, 96, 64
    generator = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(rows, kv_heads, groups, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    key, value = (torch.randn(rows, kv_heads, columns, dim, device="cuda", dtype=torch.bfloat16,
                              generator=generator) * 3 for _ in range(2))
    mask = torch.zeros(rows, 1, 1, columns, device="cuda", dtype=torch.bfloat16)
    mask[::3, ..., :40] = torch.finfo(torch.bfloat16).min
    ours = fused_module._matmul_attention(query, key, value, mask, dim ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                                attn_mask=mask.float(), scale=dim ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=dim ** -0.5)
    ours_error = float((ours.float() - expected).abs().max())
    sdpa_error = float((sdpa.float() - expected).abs().max())
    assert ours_error <= 2 * sdpa_error + 1e-3, (ours_error, sdpa_error)


class _SwiGLUWithoutActFn(torch.nn.Module):
    """An MLP that fuses its activation into its forward and keeps no `act_fn`, as liger-kernel's
    SwiGLU (which the training recipes put on the policy on CUDA) does."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_an_mlp_without_act_fn_decodes_fused_with_the_configs_activation():
    model = _sharpen(_tiny_qwen2(), 20)
    for layer in model.model.layers:
        layer.mlp = _SwiGLUWithoutActFn(layer.mlp)
    assert not hasattr(model.model.layers[0].mlp, "act_fn")
    engine = GenerationEngine(model, pad_token_id=PAD, static_shapes=True, fuse_weights=True)
    assert engine._fused is not None
    assert_matches_teacher_forcing(model, engine.generate(PROMPTS, 12, Sampling(1.0), generator=_seeded(0)))
