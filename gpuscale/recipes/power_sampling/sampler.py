"""A rank's work in power sampling: its share of the problems, in batches, sampled and scored."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpuscale.data import step_phases as phases
from gpuscale.engines import step_phases
from gpuscale.engines.step_phases import phase
from gpuscale.recipes.power_sampling import Settings
from gpuscale.runs.generations import GenerationLog, generation_record
from gpuscale.runs.run_dir import merge_results

if TYPE_CHECKING:  # torch is imported only inside a rank
    from gpuscale.recipes.power_sampling.mcmc import PowerSamplingStats


def run_power_sampling(settings: Settings, ctx, reporter) -> None:
    from gpuscale.data.question_length import question_limit
    from gpuscale.data.tasks import evaluation_examples
    from gpuscale.recipes.shared.device_trials import out_of_memory_names
    from gpuscale.recipes.shared.generation_batches import batched
    from gpuscale.recipes.shared.models import load_generation_model
    from gpuscale.recipes.shared.results import RankResults
    from gpuscale.recipes.shared.summary import summary_opening

    examples = evaluation_examples(settings.dataset, settings.split, settings.max_examples, seed=settings.seed,
                                   question_limit=question_limit(settings), domain=settings.domain)
    mine = ctx.shard(list(enumerate(examples)))
    loaded = load_generation_model(settings.model, ctx)
    settings = with_batch_size(settings, loaded.model, len(mine), ctx)
    sampler = BatchSampler(settings, loaded.model, loaded.tokenizer, loaded.eos, loaded.pad, ctx)
    batches = batched(mine, settings.batch_size)
    warm_up_seconds = sampler.warm_up(batches[0]) if batches else 0.0
    reporter.total(len(batches))
    results, started = RankResults(ctx.run_dir, ctx.rank), time.perf_counter()
    generation_log = GenerationLog(ctx.run_dir) if ctx.is_main else None  # rank 0's own answers, a batch a step
    for number, batch in enumerate(batches, start=1):
        # A batch is a step (engines/step_phases.py): decoded (inside it the engine's prefill, the MCMC
        # moves' accept/reject, the answers scored), then its rows written and logged.
        step_phases.switch(phases.DECODE)
        before = sampler.stats_snapshot()
        with out_of_memory_names(settings.batch_size, number, len(batches)):
            rows = sampler.run(batch)
        step_phases.switch(phases.LOG)
        results.add(rows)
        if generation_log is not None:
            generation_log.add(number, [answer_generation(number, row, settings.max_new_tokens, loaded.eos)
                                        for row in rows])
        done = sampler.stats_snapshot()
        reporter.log(
            step=number, samples=len(batch), tokens=done["decoded_tokens"] - before["decoded_tokens"],
            accuracy=sum(r["correct"] for r in results.rows) / len(results.rows),
            acceptance_rate=sampler.stats.acceptance_rate, forward_passes=done["sampling_calls"],
        )
    step_phases.restart()  # the batches are done: no step follows
    elapsed = time.perf_counter() - started
    everyone = ctx.gather({"results": results.rows, "elapsed": elapsed, "warm_up": warm_up_seconds,
                           **sampler.stats_snapshot()})
    if ctx.is_main:
        merge_results(ctx.run_dir, [row for rank in everyone for row in rank["results"]])
        reporter.summary({**summary_opening(ctx), **summarise(settings, everyone)})


def with_batch_size(settings: Settings, model, problems: int, ctx) -> Settings:
    """The settings with batch_size resolved where the user gave none: 8 problems on CPU ranks; on a
    GPU as many as fill gpu_memory_share (half by default) of the card's memory left once the model
    is loaded (engines.training_memory.auto_batch_size, at most 512 and at most this rank's problems). The rank's
    log says what was chosen and why."""
    if settings.batch_size is not None:
        return settings
    from gpuscale.engines.distributed import card_sized_batch

    per_problem = bytes_per_problem(model.config, model.dtype.itemsize, settings.max_new_tokens, settings.chains)
    size = card_sized_batch(ctx, per_problem, problems, "problem", settings.gpu_memory_share)
    return settings.model_copy(update={"batch_size": size})


def bytes_per_problem(config, dtype_bytes: int, max_new_tokens: int, chains: int) -> int:
    """GPU memory one problem takes in the batched sampler, per its chains: the KV cache of the
    engine's two slots (current answers and candidates), each of the columns the engine is built with
    below, and a few fp32 vocabulary-sized rows per decode step (logits, noise, probabilities)."""
    from gpuscale.engines.generation import bytes_per_row

    # Two slots (current answers and candidates), each of the columns the engine is built with.
    return chains * bytes_per_row(config, dtype_bytes, columns=2 * (2 * max_new_tokens + 512))


# Tokens per answer in the warm-up: enough decode steps for every CUDA graph to be captured (two
# eager steps, then the capture), few enough to cost well under a second.
WARM_UP_TOKENS = 8


class BatchSampler:
    """Samples answers for a batch of (index, example) pairs with the chosen method."""

    def __init__(self, settings: Settings, model, tokenizer, eos: list[int], pad: int, ctx):
        import torch

        from gpuscale.data.seeds import derived_seed
        from gpuscale.engines.generation import GenerationEngine
        from gpuscale.recipes.power_sampling.mcmc import PowerSamplingStats

        self.settings, self.model, self.tokenizer, self.eos, self.pad = settings, model, tokenizer, eos, pad
        self.stats = PowerSamplingStats()
        sampling_seed = derived_seed(settings.seed, "sampling", ctx.rank)
        self.generator = torch.Generator(device=ctx.device).manual_seed(sampling_seed)
        torch.manual_seed(sampling_seed)  # the reference method draws from the global RNG
        self.engine = None
        if settings.method != "reference":
            # Two answers' worth of columns: a resample keeps up to one answer and writes up to another.
            self.engine = GenerationEngine(model, eos, pad_token_id=pad, max_columns=2 * settings.max_new_tokens + 512,
                                           compile=settings.compile and ctx.device.type == "cuda")
            self.engine.marks_prefill = True  # a step phase of its own: a batch's step is its sampling

    def warm_up(self, batch: list[tuple[int, dict]]) -> float:
        """Run the method once on the batch's first problem with a few tokens, before the clock
        starts, and return the seconds it took. A process's first batch pays one-time costs (CUDA
        graph capture for both KV slots, cuBLAS set-up, allocating the KV cache: about 1 s on an
        H200) that would otherwise be counted as sampling. With CUDA graphs the one problem is
        padded to the batch's full shape (`padded`), so everything is set up for that shape. It
        draws from its own generator and leaves the stats alone, so the run's samples are the same
        with or without it."""
        import torch

        from gpuscale.recipes.power_sampling.mcmc import PowerSamplingStats

        started = time.perf_counter()
        # Two blocks and a step: generate, extend and resample, on both KV slots.
        short = self.settings.model_copy(update={"max_new_tokens": min(WARM_UP_TOKENS, self.settings.max_new_tokens),
                                                 "blocks": 2, "mcmc_steps": 1})
        device = self.generator.device
        scratch = torch.Generator(device=device).manual_seed(0)
        # The reference method draws from the global RNGs: they are restored afterwards.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.run(batch[:1], short, scratch, PowerSamplingStats())
        return time.perf_counter() - started

    def stats_snapshot(self) -> dict:
        return {"decoded_tokens": self.stats.decoded_tokens, "sampling_calls": self.stats.sampling_calls,
                "proposals": self.stats.proposals, "accepted": self.stats.accepted}

    def run(self, batch: list[tuple[int, dict]], settings: Settings | None = None,
            generator=None, stats: PowerSamplingStats | None = None) -> list[dict]:
        """Sample and score the batch (with the sampler's own settings, generator and stats unless given)."""
        from gpuscale.data.prompts import prompt_ids

        s = self.settings if settings is None else settings
        generator = self.generator if generator is None else generator
        stats = self.stats if stats is None else stats
        prompts = [prompt_ids(self.tokenizer, example["question"]) for _, example in batch]
        answers = self.sample(self.padded(prompts), s, generator, stats)
        with phase(phases.SCORE):
            return self._scored(batch, prompts, answers, s)

    def _scored(self, batch, prompts: list[list[int]], answers: list[dict], s: Settings) -> list[dict]:
        """The results rows of the batch's answers, each scored against its problem's answer."""
        from gpuscale.data.scoring import score_completion

        chains = s.chains
        rows = []
        for row, chain in enumerate(answers[: len(prompts) * chains]):
            index, example = batch[row // chains]
            scored = score_completion(index, row % chains, example, chain["token_ids"], self.tokenizer, self.eos,
                                      s.answer_mode)
            # What an auditor needs to check the row: the prompt's ids and each token's log-prob.
            rows.append({**scored, "prompt_token_ids": prompts[row // chains], "logprobs": chain["logprobs"],
                         "acceptance_rate": chain["acceptance_rate"]})
        return rows

    def padded(self, prompts: list[list[int]]) -> list[list[int]]:
        """A short last batch keeps the full batch shape under CUDA graphs (generation_batches.padded_to)."""
        from gpuscale.recipes.shared.generation_batches import padded_to

        if self.engine is None or not self.engine.cuda_graphs:
            return prompts
        return padded_to(prompts, self.settings.batch_size)

    def sample(self, prompts: list[list[int]], s: Settings, generator, stats: PowerSamplingStats) -> list[dict]:
        """`s.chains` answers per prompt, chain j of prompt i in row i * chains + j (the engine
        prefills each prompt once for all its chains). Each answer: its token ids, the base model's
        log-prob of each, and, for MCMC, the share of the chain's moves that were accepted."""
        import torch

        from gpuscale.engines.generation import Sampling
        from gpuscale.recipes.power_sampling.mcmc import power_sample, power_sample_reference

        if s.method == "reference":
            chains = [power_sample_reference(self.model, p, s.alpha, s.max_new_tokens, s.blocks, s.mcmc_steps,
                                             self.eos, self.pad, stats) for p in prompts for _ in range(s.chains)]
            return [answer(c.tokens, c.log_p, c.accepted, c.proposed) for c in chains]
        if s.method == "power":
            accepted = torch.zeros(len(prompts) * s.chains, dtype=torch.long, device=self.generator.device)
            proposals_before = stats.proposals
            generation = power_sample(self.engine, prompts, s.alpha, s.max_new_tokens, s.blocks, s.mcmc_steps,
                                      generator, stats, samples_per_prompt=s.chains, accepted_per_row=accepted)
            moves = (stats.proposals - proposals_before) // len(accepted)  # every chain moves at every step
            accepted = accepted.tolist()
        else:
            sampling = Sampling(temperature=0.0 if s.method == "greedy" else s.temperature)
            generation = self.engine.generate(prompts, s.max_new_tokens, sampling, generator,
                                              samples_per_prompt=s.chains)
            stats.decoded_tokens += int(generation.lengths.sum())
            stats.sampling_calls += 1
            moves, accepted = 0, [0] * generation.batch_size
        logprobs = generation.base_logprobs.cpu().tolist()
        return [answer(tokens, logprobs[row][: len(tokens)], accepted[row], moves)
                for row, tokens in enumerate(generation.sequences())]


def answer_generation(step: int, row: dict, max_new_tokens: int, eos: list[int]) -> dict:
    """A results row as a generation record (runs/generations.py): cut where it ran to max_new_tokens unended."""
    cut = row["tokens"] >= max_new_tokens and row["token_ids"][-1] not in eos
    return generation_record(step, row["question"], row["completion"], domain=row["domain"],
                             correct=bool(row["correct"]), truncated=cut)


def answer(tokens: list[int], logprobs: list[float], accepted: int, proposed: int) -> dict:
    """One chain's answer as a results row gets it (acceptance None where nothing was proposed)."""
    return {"token_ids": tokens, "logprobs": [round(value, 6) for value in logprobs],
            "acceptance_rate": accepted / proposed if proposed else None}


def summarise(settings: Settings, everyone: list[dict]) -> dict:
    from gpuscale.data.scoring import accuracy_by_domain
    from gpuscale.data.tasks import test_split_scored
    from gpuscale.recipes.power_sampling.pass_at_k import pass_at_k_figures

    rows = [r for rank in everyone for r in rank["results"]]
    problems = len({r["index"] for r in rows})
    wall = max(rank["elapsed"] for rank in everyone) or 1e-9
    proposals = sum(rank["proposals"] for rank in everyone)
    decoded = sum(rank["decoded_tokens"] for rank in everyone)
    summary = {
        "method": settings.method,
        "eval_split": settings.split,
        **test_split_scored(settings.dataset, settings.split),
        "problems": problems,
        "batch_size": settings.batch_size,  # as resolved on rank 0 when the settings said auto
        "chains": settings.chains,
        **accuracy_by_domain(rows),  # accuracy, and accuracy_<domain> for each domain
        "acceptance_rate": sum(rank["accepted"] for rank in everyone) / proposals if proposals else None,
        "problems_per_s": problems / wall,
        "tokens_per_s": decoded / wall,
        "decoded_tokens": decoded,
        "forward_passes": sum(rank["sampling_calls"] for rank in everyone),
        "mean_answer_tokens": sum(r["tokens"] for r in rows) / max(1, len(rows)),
        "sampling_seconds": wall,
        "warm_up_seconds": max(rank["warm_up"] for rank in everyone),
    }
    if settings.chains > 1:  # independent answers per problem: the diversity figures too
        summary["counted_in_accuracy"] = ACCURACY_OVER_CHAINS
        summary.update(pass_at_k_figures(rows))  # pass_at_k, pass_at_k_<domain>
    return summary


# What `accuracy` is with several chains: every chain's answer counts once (not the first chain, not a
# majority vote), so it is the mean per-answer accuracy, the same figure as pass@1.
ACCURACY_OVER_CHAINS = "every chain's answer, each counted once: the share correct over problems x chains (= pass@1)"
