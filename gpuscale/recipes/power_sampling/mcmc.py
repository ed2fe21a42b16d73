"""Power sampling: Metropolis-Hastings sampling from p(x)^alpha over whole answers (Karan & Du 2025).

Proposal: the base model at temperature 1/alpha. The answer grows block by block; after each block,
`steps` MH moves each pick a cut point uniformly among the generated tokens, resample everything after
it, and accept with

    log r = alpha * (log p(x'_suffix) - log p(x_suffix)) + (log q(x_suffix) - log q(x'_suffix))
            + log |x| - log |x'|

over the whole suffixes, in fp32. The last term is the cut point's probability (1/|x| forward,
1/|x'| back), which matters when the two answers differ in length.

Every row of the batch is an independent chain (problems x chains), all advanced in lockstep by the
batched engine: resampling reuses the prefix's KV cache, and each suffix's log-probs were stored when
it was sampled, so nothing is re-scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpuscale.data.step_phases import ACCEPT_REJECT
from gpuscale.engines.generation import Generation, GenerationEngine, Sampling
from gpuscale.engines.step_phases import phase


@dataclass
class PowerSamplingStats:
    proposals: int = 0  # MH moves proposed (rows x steps)
    accepted: int = 0
    decoded_tokens: int = 0  # every token sampled, rejected proposals included
    sampling_calls: int = 0  # batched engine calls (generate / extend / resample)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposals if self.proposals else 0.0


def block_sizes(max_new_tokens: int, blocks: int) -> list[int]:
    """The answer's length budget after each block: `blocks` blocks of equal size (the last may be
    shorter), e.g. 3072 tokens in 16 blocks of 192."""
    size = -(-max_new_tokens // blocks)
    return sorted({min(max_new_tokens, size * (i + 1)) for i in range(blocks)})


def mh_log_ratio(current: Generation, proposal: Generation, cut: torch.Tensor, alpha: float) -> torch.Tensor:
    base_new, q_new, _ = proposal.suffix_logprobs(cut)
    base_old, q_old, _ = current.suffix_logprobs(cut)
    length_term = current.lengths.float().log() - proposal.lengths.float().log()
    return alpha * (base_new - base_old) + (q_old - q_new) + length_term


def power_sample(
    engine: GenerationEngine,
    prompts,
    alpha: float,
    max_new_tokens: int,
    blocks: int,
    steps: int,
    generator: torch.Generator | None = None,
    stats: PowerSamplingStats | None = None,
    samples_per_prompt: int = 1,
    accepted_per_row: torch.Tensor | None = None,
) -> Generation:
    """`samples_per_prompt` chains per prompt (row i * k + j: chain j of prompt i; the prompt is
    prefilled once for all k); returns the chains' final states. `accepted_per_row` (a [rows] long
    tensor on the engine's device), if given, counts each chain's accepted moves."""
    stats = stats if stats is not None else PowerSamplingStats()
    proposal = Sampling(temperature=1.0 / alpha)
    current: Generation | None = None
    for target in block_sizes(max_new_tokens, blocks):
        if current is None:
            current = engine.generate(prompts, target, proposal, generator, samples_per_prompt)
            _count(stats, current, cut=None)
        else:
            before = current.lengths
            current = engine.extend(current, target, proposal, generator)
            _count(stats, current, cut=before)
        for _ in range(steps):
            current = _mh_step(engine, current, target, alpha, proposal, generator, stats, accepted_per_row)
        if bool(current.ended_with_eos.all()):
            break  # every answer is complete: further blocks would add nothing
    return current


def _mh_step(engine, current, target, alpha, proposal, generator, stats, accepted_per_row=None) -> Generation:
    lengths = current.lengths
    uniform = torch.rand(lengths.shape, generator=generator, device=lengths.device)
    cut = (uniform * lengths).long().clamp_max(lengths - 1).clamp_min(0)
    candidate = engine.resample(current, cut, target, proposal, generator)
    _count(stats, candidate, cut)
    with phase(ACCEPT_REJECT):  # a step phase of its own (engines/step_phases.py), inside the sampler's decode
        log_r = mh_log_ratio(current, candidate, cut, alpha)
        log_u = torch.rand(log_r.shape, generator=generator, device=log_r.device).log()
        accepted = log_u < log_r
        stats.proposals += accepted.numel()
        stats.accepted += int(accepted.sum())
        if accepted_per_row is not None:
            accepted_per_row += accepted
        return engine.accept(current, candidate, accepted)


def _count(stats: PowerSamplingStats, generation: Generation, cut: torch.Tensor | None) -> None:
    new = generation.lengths if cut is None else generation.lengths - cut
    stats.decoded_tokens += int(new.sum())
    stats.sampling_calls += 1


# --------------------------------------------------------------------------------------------------
# The reference structure, for measuring against: what the public code does, one problem at a time,
# one `model.generate()` call per block and per MCMC step, each re-encoding the whole prefix. The
# mathematics is the same as above (full suffixes, cut-point correction, fp32), so that only the
# execution differs when the two are timed.
# --------------------------------------------------------------------------------------------------


def _generate_suffix(model, prefix: list[int], max_new: int, alpha: float, eos_ids: list[int], pad_id: int):
    """Sample up to max_new tokens after prefix at temperature 1/alpha; tokens, log p, log q.

    As the public code does: one generate() call, and the log-probs from the logits it returns (fp32,
    one row per step). Each log-prob is the chosen logit minus a logsumexp over the vocabulary, so no
    [tokens, vocab] log_softmax is written out; tokens and log-probs come back in two host copies.
    top_k=0 / top_p=1.0 make the proposal exactly the tempered softmax that log q describes (HF's
    default top_k=50 would sample from another distribution than the one scored)."""
    ids = torch.tensor([prefix], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0 / alpha, top_k=0, top_p=1.0,
        max_new_tokens=max_new, eos_token_id=eos_ids, pad_token_id=pad_id,
        output_logits=True, return_dict_in_generate=True,
    )
    new = out.sequences[0, len(prefix):]
    logits = torch.cat(out.logits)[: len(new)].float()  # [steps, vocab]; generate() already gives fp32
    chosen = logits.gather(-1, new[:, None]).squeeze(1)
    log_p = chosen - torch.logsumexp(logits, -1)
    log_q = alpha * chosen - torch.logsumexp(logits * alpha, -1)
    log_p, log_q = torch.stack([log_p, log_q]).tolist()
    return new.tolist(), log_p, log_q


class ReferenceChain(NamedTuple):
    tokens: list[int]
    log_p: list[float]  # the base model's log-prob of each token
    accepted: int  # MH moves accepted
    proposed: int


def power_sample_reference(
    model, prompt: list[int], alpha: float, max_new_tokens: int, blocks: int, steps: int,
    eos_ids: list[int], pad_id: int, stats: PowerSamplingStats,
) -> ReferenceChain:
    """One chain for one prompt, with generate(); returns the answer's tokens and log-probs."""
    accepted_before, proposed_before = stats.accepted, stats.proposals
    tokens: list[int] = []
    log_p: list[float] = []
    log_q: list[float] = []

    def ended() -> bool:
        return bool(tokens) and tokens[-1] in eos_ids

    for target in block_sizes(max_new_tokens, blocks):
        if not ended():
            new, new_p, new_q = _generate_suffix(model, prompt + tokens, target - len(tokens), alpha, eos_ids, pad_id)
            tokens, log_p, log_q = tokens + new, log_p + new_p, log_q + new_q
            stats.decoded_tokens += len(new)
            stats.sampling_calls += 1
        for _ in range(steps):
            cut = int(torch.randint(len(tokens), ()))
            new, new_p, new_q = _generate_suffix(model, prompt + tokens[:cut], target - cut, alpha, eos_ids, pad_id)
            stats.decoded_tokens += len(new)
            stats.sampling_calls += 1
            stats.proposals += 1
            log_r = (alpha * (sum(new_p) - sum(log_p[cut:])) + (sum(log_q[cut:]) - sum(new_q))
                     + math.log(len(tokens)) - math.log(cut + len(new)))
            if math.log(float(torch.rand(()))) < log_r:
                stats.accepted += 1
                tokens, log_p, log_q = tokens[:cut] + new, log_p[:cut] + new_p, log_q[:cut] + new_q
        if ended():
            break
    return ReferenceChain(tokens, log_p, stats.accepted - accepted_before, stats.proposals - proposed_before)
