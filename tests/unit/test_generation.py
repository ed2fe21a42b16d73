"""The generation engine against the model itself: every token and log-prob the engine reports must
equal what one teacher-forced forward pass of the same model computes over the same sequences
(left-padded, with transformers' own attention mask), and the filtered log-probs what transformers'
own warpers compute. Two architectures (Llama, Qwen2), CPU, fp32.
"""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from gpuscale.data.models import build_random_model
from gpuscale.engines.generation import (
    GenerationEngine,
    Sampling,
    StaleGenerationError,
    filter_logits,
)

TOL = 1e-4
PAD = 0
# Prompts of different lengths, so that the batch is left-padded (one of length 1: nothing to prefill).
PROMPTS = [[5, 17, 33, 2, 91, 40, 7, 12, 150, 3, 99, 64], [8, 1, 44], [200], [31, 32, 33, 34, 35, 36, 37]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: one thread is fastest, and several threads spinning on a busy machine made a
    # 4x64 matmul take 15 ms instead of 10 us.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    for i, row in enumerate(rows):
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


def test_decode_step_is_capturable_in_a_cuda_graph(model):
    """What CUDA graph capture needs, checked on CPU over every aten op of one static-shape step
    (the model's own code included): no host sync (item(), bool(), nonzero), no tensor built from
    host data, and only in-place updates of the engine's fixed tensors."""
    engine = GenerationEngine(model, eos_token_ids=[9], pad_token_id=PAD, static_shapes=True)
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


def _mcmc_round(engine, prompts, sampling, seed):
    """generate, resample with a different cut per row, accept every other row, resample again."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    out = engine.generate(prompts, 40, sampling, generator)
    cut = (out.lengths * torch.linspace(0, 1, len(prompts), device="cuda")).long()
    proposal = engine.resample(out, cut, 48, sampling, generator)
    merged = engine.accept(out, proposal, torch.arange(len(prompts), device="cuda") % 2 == 0)
    again = engine.resample(merged, cut.flip(0).clamp_max(merged.lengths), 48, sampling, generator)
    return out, proposal, merged, again


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sampling", [Sampling(0.9, top_k=40, top_p=0.95), Sampling(temperature=0)])
def test_cuda_graphs_replay_the_eager_static_step(sampling):
    cpu_model = _sharpen(build_random_model("random-tiny", seed=0), 5)
    model = _sharpen(build_random_model("random-tiny", seed=0), 5).to("cuda")
    runs = []
    for graphs in (True, False):
        engine = GenerationEngine(model, eos_token_ids=list(range(3, 512, 6)), pad_token_id=PAD,
                                  cuda_graphs=graphs, static_shapes=True)
        runs.append(_mcmc_round(engine, PROMPTS * 4, sampling, seed=0))
        assert bool(engine._graphs) == graphs
    for with_graphs, eager in zip(*runs):
        assert torch.equal(with_graphs.tokens, eager.tokens)
        torch.testing.assert_close(with_graphs.base_logprobs, eager.base_logprobs, atol=1e-5, rtol=0)
    for generation in runs[0]:
        assert_matches_teacher_forcing(cpu_model, generation, sampling, tol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_on_the_qwen_shape_in_bf16():
    model = build_random_model("random-qwen2.5-0.5b", seed=0).to("cuda", torch.bfloat16)
    engine = GenerationEngine(model, pad_token_id=PAD)
    assert engine.cuda_graphs and engine._head_out_dtype, "expected CUDA graphs and fp32 logits from the head"
    prompts = torch.randint(0, 151936, (8, 32), generator=_seeded(0)).tolist()
    for generation in _mcmc_round(engine, prompts, Sampling(1.0), seed=1):
        assert engine._graphs
        _, expected = teacher_forced(model, _on_cpu(generation))
        mask = generation.mask.cpu()
        # bf16 forwards of different shapes (batched prefill vs one-token decode) differ by about 1e-2.
        assert float((generation.base_logprobs.cpu() - expected)[mask].abs().max()) < 0.1
