"""Power sampling is exact: on a toy model whose answers can all be enumerated, the chains' final
states follow the normalised p(x)^alpha, while plain sampling at temperature 1/alpha does not."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpuscale.engines.generation import GenerationEngine, Sampling
from gpuscale.recipes.power_sampling.mcmc import (
    PowerSamplingStats,
    _generate_suffix,
    block_sizes,
    power_sample,
    power_sample_reference,
)

EOS, VOCAB, MAX_NEW, ALPHA = 3, 4, 3, 4.0
PROMPT = [0, 1]


@pytest.fixture(scope="module")
def toy_model():
    torch.manual_seed(3)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper next-token distributions, so that p^alpha and p^(1/T) differ clearly
        model.lm_head.weight.mul_(10.0)
    return model


def all_answers() -> list[tuple[int, ...]]:
    """Every answer of at most MAX_NEW tokens: ended by EOS, or cut by the budget."""
    words = [w for w in range(VOCAB) if w != EOS]
    answers = []
    for length in range(MAX_NEW):
        answers += [(*body, EOS) for body in itertools.product(words, repeat=length)]
    answers += list(itertools.product(words, repeat=MAX_NEW))
    return answers


def answer_logprob(model, answer: tuple[int, ...]) -> float:
    ids = torch.tensor([PROMPT + list(answer)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0, len(PROMPT) - 1 : -1]
    return float(torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPT):, None]).sum())


def normalised(logweights: dict) -> dict:
    top = max(logweights.values())
    total = sum(math.exp(v - top) for v in logweights.values())
    return {k: math.exp(v - top) / total for k, v in logweights.items()}


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def empirical(generation) -> dict:
    counts = Counter(tuple(seq) for seq in generation.sequences())
    return {k: v / generation.batch_size for k, v in counts.items()}


def test_block_sizes():
    assert block_sizes(3072, 16) == list(range(192, 3073, 192))
    assert block_sizes(10, 3) == [4, 8, 10]
    assert block_sizes(2, 16) == [1, 2]


def test_chains_follow_p_to_the_alpha(toy_model):
    log_p = {a: answer_logprob(toy_model, a) for a in all_answers()}
    target = normalised({a: ALPHA * lp for a, lp in log_p.items()})
    rows = 4000
    engine = GenerationEngine(toy_model, eos_token_ids=EOS)
    generator = torch.Generator().manual_seed(0)
    stats = PowerSamplingStats()
    chains = power_sample(engine, [PROMPT] * rows, ALPHA, MAX_NEW, blocks=1, steps=300,
                          generator=generator, stats=stats)
    power_tv = total_variation(empirical(chains), target)
    plain = engine.generate([PROMPT] * rows, MAX_NEW, Sampling(temperature=1 / ALPHA), generator)
    plain_tv = total_variation(empirical(plain), target)
    # What sampling noise alone gives: the expected TV of `rows` exact draws (normal approximation).
    noise_tv = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * rows)) for p in target.values())
    print(f"TV power {power_tv:.4f}  plain@1/alpha {plain_tv:.4f}  expected from noise {noise_tv:.4f}  "
          f"acceptance {stats.acceptance_rate:.3f}")
    assert 0.05 < stats.acceptance_rate < 1.0
    # Within what the sample size allows (MH chains are correlated only through their start) ...
    assert power_tv < 2 * noise_tv
    # ... while per-token temperature is a different distribution altogether.
    assert plain_tv > 0.3


def test_reference_suffix_logprobs_are_the_models(toy_model):
    """The reference's per-token log p and log q (from generate()'s logits) equal the model's own
    teacher-forced log-probs at temperature 1 and at 1/alpha."""
    torch.manual_seed(1)
    prefix = PROMPT + [2]
    tokens, log_p, log_q = _generate_suffix(toy_model, prefix, MAX_NEW, ALPHA, [EOS], pad_id=0)
    ids = torch.tensor([prefix + tokens])
    with torch.no_grad():
        logits = toy_model(input_ids=ids).logits.float()[0, len(prefix) - 1 : -1]
    chosen = ids[0, len(prefix):, None]
    assert log_p == pytest.approx(torch.log_softmax(logits, -1).gather(-1, chosen).squeeze(1).tolist(), abs=1e-5)
    assert log_q == pytest.approx(torch.log_softmax(ALPHA * logits, -1).gather(-1, chosen).squeeze(1).tolist(),
                                  abs=1e-5)


def test_reference_chains_are_distributed_as_the_batched_samplers(toy_model):
    """`method=reference` (one generate() per block and per step, log-probs from generate()'s logits)
    runs the same Markov chain as the batched sampler: after the same number of MH steps, their
    chains' states follow one distribution (within sampling noise), which has moved well away from
    where both started (plain sampling at 1/alpha) towards p(x)^alpha."""
    # Answers of at most 2 tokens mix in a few steps: after 10, a chain without the proposal's terms
    # in log r is about 5x the noise away (checked by breaking it).
    max_new, steps, chains, rows = 2, 10, 300, 4000
    stats = PowerSamplingStats()
    torch.manual_seed(0)  # the reference draws from the global RNG, as the public code does
    reference = Counter(
        tuple(power_sample_reference(toy_model, PROMPT, ALPHA, max_new, 1, steps, [EOS], 0, stats).tokens)
        for _ in range(chains)
    )
    reference = {k: v / chains for k, v in reference.items()}
    engine = GenerationEngine(toy_model, eos_token_ids=EOS)
    batched = empirical(power_sample(engine, [PROMPT] * rows, ALPHA, max_new, blocks=1, steps=steps,
                                     generator=torch.Generator().manual_seed(0)))
    start = empirical(engine.generate([PROMPT] * rows, max_new, Sampling(temperature=1 / ALPHA),
                                      torch.Generator().manual_seed(1)))
    # The expected TV between two samples of one distribution (sizes chains and rows).
    noise_tv = 0.5 * sum(math.sqrt(2 * p * (1 - p) * (1 / chains + 1 / rows) / math.pi) for p in batched.values())
    apart, moved = total_variation(reference, batched), total_variation(start, batched)
    print(f"TV reference-batched {apart:.4f}  start-batched {moved:.4f}  noise {noise_tv:.4f}  "
          f"acceptance {stats.acceptance_rate:.3f}")
    assert stats.sampling_calls == chains * (1 + steps)  # one generate() for the block, one per MH step
    assert apart < 2 * noise_tv
    assert moved > 4 * noise_tv


def test_reference_has_the_public_codes_structure_and_no_full_vocabulary_log_softmax(toy_model, monkeypatch):
    """The reference was slower than the code it stands for: like the public code,
    one generate() per block and per MCMC step and nothing else that runs the model; and its log-probs
    come from a logsumexp per token, not from [steps, vocab] log_softmax tensors (the cost that made it
    2.2x slower). Its speed against a rewrite of the public code is in bench/RESULTS.md."""
    blocks, steps = 2, 3
    calls = {"generate": 0, "forward": 0, "log_softmax": 0}
    inside_generate = False
    generate, forward, log_softmax = type(toy_model).generate, type(toy_model).forward, torch.log_softmax

    def counted_generate(self, *args, **kwargs):
        nonlocal inside_generate
        calls["generate"] += 1
        inside_generate = True
        try:
            return generate(self, *args, **kwargs)
        finally:
            inside_generate = False

    def counted_forward(self, *args, **kwargs):
        calls["forward"] += not inside_generate  # a model call of its own, outside generate()
        return forward(self, *args, **kwargs)

    def counted_log_softmax(*args, **kwargs):
        calls["log_softmax"] += 1
        return log_softmax(*args, **kwargs)

    monkeypatch.setattr(type(toy_model), "generate", counted_generate)
    monkeypatch.setattr(type(toy_model), "forward", counted_forward)
    monkeypatch.setattr(torch, "log_softmax", counted_log_softmax)
    torch.manual_seed(0)
    # No EOS id the toy model can draw: every block runs, as with a random model.
    power_sample_reference(toy_model, PROMPT, ALPHA, 4, blocks, steps, [VOCAB + 7], 0, PowerSamplingStats())
    assert calls == {"generate": blocks * (1 + steps), "forward": 0, "log_softmax": 0}
