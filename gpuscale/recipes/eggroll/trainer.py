"""A rank's work in EGGROLL: its share of the population answers the step's prompts, fitnesses are
all-gathered, and every rank applies the same update.

One step, on every rank:
1. the step's prompts (the same on every rank: drawn from the run's seed and the step);
2. every perturbed matrix's noise for the whole population, regenerated from (seed, step, layer);
3. this rank's members answer the prompts, `members_per_call` members per engine call: the row
   terms' buffers are refilled in place with those members' A and B, and the members' rows are one
   contiguous block each in the batch (`method=naive`: one member at a time, weights perturbed in
   place and restored from a copy, the structure users had);
4. fitness of a member = mean correctness of its answers; all-gathered as one tensor;
5. shaped fitnesses -> one low-rank sum per matrix -> W += step (evolution.py).

Every `checkpoint_every` steps the state a step needs is saved (checkpoint.py); a run given
`resume_from` loads it and goes on with the next step.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpuscale.data.seeds import derived_seed
from gpuscale.data.step_phases import EVALUATE, OTHER, SAVE
from gpuscale.engines import preemption, step_phases
from gpuscale.recipes.eggroll import Settings, checkpoint, evolution
from gpuscale.runs import heartbeat
from gpuscale.runs.generations import GenerationLog, generation_record
from gpuscale.runs.resume_check import ResumeCheck
from gpuscale.runs.run_dir import RunDir


def population_engine(loaded, compiled: bool):
    """The engine the population decodes with. Compiled, the members' terms go inside the projections
    (`fuse_row_terms`), the faster way on an H200 (bench/RESULTS.md, eggroll: the share of plain inference)."""
    from gpuscale.engines.generation import GenerationEngine

    return GenerationEngine(loaded.model, loaded.eos, pad_token_id=loaded.pad, compile=compiled,
                            fuse_row_terms=compiled)


def run_eggroll(settings: Settings, ctx, reporter) -> None:
    from gpuscale.recipes.shared.models import load_generation_model, save_model
    from gpuscale.recipes.shared.summary import summary_opening
    from gpuscale.recipes.shared.training_data import training_and_eval_examples

    if settings.population % ctx.world_size:
        raise ValueError(f"population: {settings.population}: must divide evenly over {ctx.world_size} ranks")
    train, held_out = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    loaded.model.requires_grad_(False)  # ES needs no gradients
    engine = population_engine(loaded, settings.compile and ctx.device.type == "cuda")
    trainer = Trainer(settings, ctx, loaded, engine, train)
    evaluator = Evaluator(settings, ctx, loaded, held_out)

    done, history, check = 0, {}, None
    if settings.resume_from:  # the weights, Adam and the figures so far, from `gpuscale resume`'s checkpoint
        done, history = checkpoint.load(trainer, settings.resume_from)
        print(f"resumed from {settings.resume_from} after step {done}", flush=True)
        check = resume_check(settings, trainer, history)
    # A resumed run keeps its parent's `before` figures: they describe the model before any step.
    before = history.get("before") or evaluator.figures("before")
    summary = {"method": settings.method, "population": settings.population,
               **summary_opening(ctx, settings, train=train, held_out=held_out), "steps": settings.steps, **before}
    if ctx.is_main:
        reporter.summary({**summary, **({"resume_check": check.record()} if check else {})}, partial=True)
    reporter.total(settings.steps)
    # The rates (members/s, tokens/s) are this run's own steps'; the fitness series goes on from the parent's.
    step_seconds, fitness_means, tokens_total = [], list(history.get("fitness_means", [])), 0
    with preemption.cooperating():
        for step in range(done + 1, settings.steps + 1):
            reporter.beat(heartbeat.STEP)  # back from a checkpoint or an evaluation
            started = time.perf_counter()
            result = trainer.step(step)
            step_seconds.append(time.perf_counter() - started)
            tokens_total += result.tokens
            fitness = result.fitness
            check_finite(step, fitness)
            fitness_means.append(float(fitness.mean()))
            if check is not None:
                check.done += 1
                if check.logged(fitness_means[-1]) and ctx.is_main:  # the monitor warns while the run goes on
                    reporter.summary({"resume_check": check.record()}, partial=True)
            figures = {}
            if settings.eval_every and step % settings.eval_every == 0 and step < settings.steps:
                with step_phases.phase(EVALUATE):
                    figures = evaluator.figures(f"step{step}", log_only=True)
            reporter.log(step=step, tokens=result.tokens, samples=trainer.local_members,
                         fitness_mean=fitness_means[-1], fitness_max=float(fitness.max()),
                         fitness_std=float(fitness.std(unbiased=False)), step_time_s=step_seconds[-1],
                         **result.reward_by_domain(), **figures)
            scheduled = bool(settings.checkpoint_every and step % settings.checkpoint_every == 0)
            # SLURM's signal (engines/preemption.py): every rank stops after the same step, with its checkpoint.
            preempted = preemption.agreed(ctx.device)
            if scheduled or preempted:
                with step_phases.phase(SAVE):
                    checkpoint.save(trainer, step, {"before": before, "fitness_means": fitness_means})
            if preempted:
                raise preemption.Preempted(step, RunDir(ctx.run_dir).checkpoint(step))
    # Saved before the final evaluation: a failure there never loses the trained weights.
    model_dir = save_model(loaded.model, loaded.tokenizer, ctx) if settings.save_model else None
    checksums = ctx.gather(weights_checksum(trainer.linears + trainer.norms))
    everyone_tokens = sum(ctx.gather(tokens_total))
    # Step 1 also captures CUDA graphs and allocates the KV cache: the median leaves it out.
    # (None where a resumed run had no step left: its parent failed after its last checkpoint.)
    typical = statistics.median(step_seconds[1:] or step_seconds) if step_seconds else None
    summary.update({
        "members_per_s": settings.population / typical if typical else None,
        "tokens_per_s": everyone_tokens / sum(step_seconds) if step_seconds else None,
        "step_seconds_median": typical,
        **{f"{phase}_seconds_median": seconds for phase, seconds in trainer.clock.medians().items()},
        "fitness_mean_first": fitness_means[0], "fitness_mean_last": fitness_means[-1],
        "perturbed_matrices": len(trainer.linears), "perturbed_norms": len(trainer.norms),
        "weights_identical_across_ranks": len(set(checksums)) == 1, "weights_checksum": checksums[0],
        "model_dir": str(model_dir) if model_dir else None,
        **({"resume_check": check.record(finished=True)} if check else {}),
    })
    if ctx.is_main:
        reporter.summary(summary, partial=True)
    summary.update(evaluator.figures("after"))
    if ctx.is_main:
        reporter.summary(summary)


def resume_check(settings: Settings, trainer, history: dict) -> ResumeCheck:
    """The resume check of a run resumed from `settings.resume_from` (runs/resume_check.py): Adam's
    state as the checkpoint restored it (none to restore with optimizer=sgd), and the fitness: eggroll
    has no loss, its population's mean reward says where training stands."""
    from gpuscale.engines.resume_check import restored_optimizer
    from gpuscale.runs.resume_check import optimizer_part

    adam = trainer.updater.adam
    optimizer = restored_optimizer(adam) if adam is not None else optimizer_part(settings.optimizer, False, 0, 0, 0)
    return ResumeCheck(str(settings.resume_from), "fitness_mean", before=list(history.get("fitness_means", [])),
                       total=settings.steps, optimizer=optimizer)


def check_finite(step: int, fitness: torch.Tensor) -> None:
    """Fail the run with the one line every recipe's divergence gives, as soon as a member's fitness
    is NaN or Inf (the update would carry it into every weight)."""
    from gpuscale.engines.reporter import NonFiniteFigure, non_finite_message

    bad = fitness[~torch.isfinite(fitness)]
    if bad.numel():
        raise NonFiniteFigure(non_finite_message(step, "fitness", float(bad[0]),
                                                 remedies="--precision fp32, a lower lr, or a lower sigma"))


def perturbed_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """Every linear layer of the decoder blocks (attention and MLP projections); embeddings, head and
    norms stay frozen."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in name]


def perturbed_norms(model) -> list[tuple[str, torch.nn.Module]]:
    """Every norm with a gain vector and no bias (RMSNorm-style y = weight * n(x), so a member's gain
    is a row scale of y): the decoder blocks' and the final one (perturb_norms)."""
    return [(name, module) for name, module in model.named_modules()
            if "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None
            and module.weight.dim() == 1 and getattr(module, "bias", None) is None]


def weights_checksum(modules) -> str:
    digest = hashlib.sha256()
    for _, module in modules:
        digest.update(module.weight.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class PhaseClock:
    """Seconds per phase of a step, summed within a step (a step may make several engine calls) and
    kept per step; `medians` leaves the first step out (it captures graphs). Each lap synchronises
    the device, so a phase's time is its own and not the queue's before it."""

    def __init__(self, synchronize):
        self.synchronize, self.steps = synchronize, []
        self.last = 0.0

    def start(self) -> None:
        self.synchronize()
        self.steps.append({})
        self.last = time.perf_counter()
        step_phases.lap(OTHER)  # the rank's step phases (engines/step_phases.py) name the same laps

    def lap(self, phase: str) -> None:
        self.synchronize()
        now = time.perf_counter()
        self.steps[-1][phase] = self.steps[-1].get(phase, 0.0) + now - self.last
        self.last = now
        step_phases.lap(phase)

    def medians(self) -> dict[str, float]:
        kept = self.steps[1:] or self.steps
        return {phase: statistics.median(step.get(phase, 0.0) for step in kept) for phase in kept[0]}


@dataclass
class StepResult:
    """What one step measured on this rank: the rewards of its members' answers (fitness of a
    member = the mean reward of its answers), by domain too, and the tokens decoded; `fitness`
    holds every member's, gathered from all ranks."""

    domains: list[str]  # the domain of each of a member's answers, in row order
    member_fitness: list[float] = field(default_factory=list)
    tokens: int = 0
    fitness: torch.Tensor | None = None
    _domain_rewards: dict[str, list[float]] = field(default_factory=dict)

    def add(self, rewards: list[float], tokens: int) -> None:
        per_member = len(self.domains)
        for start in range(0, len(rewards), per_member):
            answers = rewards[start : start + per_member]
            self.member_fitness.append(sum(answers) / per_member)
            for domain, reward in zip(self.domains, answers):
                self._domain_rewards.setdefault(domain, []).append(reward)
        self.tokens += tokens

    def reward_by_domain(self) -> dict[str, float]:
        """Mean reward of this rank's answers per domain, as `reward_<domain>`."""
        return {f"reward_{domain}": sum(values) / len(values) for domain, values in self._domain_rewards.items()}


class Trainer:
    def __init__(self, settings: Settings, ctx, loaded, engine, train: list[dict]):
        self.settings, self.ctx, self.loaded, self.engine, self.train = settings, ctx, loaded, engine, train
        self.linears = perturbed_linears(loaded.model)
        self.norms = perturbed_norms(loaded.model) if settings.perturb_norms else []
        self.local_members = settings.population // ctx.world_size
        self.first_member = ctx.rank * self.local_members
        self.rows_per_member = settings.prompts_per_step * settings.generations_per_prompt
        calls_width = max(1, settings.batch_size // self.rows_per_member)
        self.members_per_call = 1 if settings.method == "naive" else min(calls_width, self.local_members)
        self.draws = evolution.draws_for(settings.population, settings.antithetic)
        self.signs = evolution.member_signs(settings.population, settings.antithetic, device=ctx.device)
        # Antithetic pairs in one call share their row terms' factors (RowTerm's `mirrored`): every call's members
        # then come as whole pairs, each rank's and each call's first member even.
        self.mirrored = (settings.method == "eggroll" and settings.antithetic and self.members_per_call % 2 == 0
                         and self.local_members % 2 == 0)
        sampling_seed = derived_seed(settings.seed, "sampling", ctx.rank)
        self.generator = torch.Generator(device=ctx.device).manual_seed(sampling_seed)
        self.step_number = 0
        end = loaded.tokenizer.eos_token_id  # what ends a training answer, as sft tokenizes it
        self._answer_end = end if end is not None else loaded.eos[0]
        self.terms, self.scales = self._add_row_terms() if settings.method == "eggroll" else ([], [])
        self.noise: list[evolution.LayerNoise] = []  # the step's, per linear
        self.norm_noise: list[torch.Tensor] = []  # the step's, per norm
        self.updater = evolution.Updater([module.weight for _, module in self.linears + self.norms], settings.optimizer,
                                  settings.lr)
        self.clock = PhaseClock(ctx.synchronize)  # a step's time: noise, load, generate, score, gather, update
        # What the members answered (runs/generations.py), rank 0's first call of each step: only where
        # answers are decoded.
        self.generation_log = GenerationLog(ctx.run_dir) if ctx.is_main and settings.fitness == "correctness" else None
        self.last_answers: tuple | None = None  # _answer's (texts, rewards, cut at max_new_tokens) of its latest call

    def _add_row_terms(self):
        """A low-rank term on every perturbed linear and a row scale on every perturbed norm, one
        group of rows per member of a call, or per antithetic pair (`mirrored`); `_load_members` fills them."""
        from gpuscale.engines.generation import RowScale, RowTerm

        s, terms, scales = self.settings, [], []
        groups = self.members_per_call // 2 if self.mirrored else self.members_per_call
        for _, module in self.linears:
            buffers = [torch.zeros(groups, size, s.rank, dtype=module.weight.dtype, device=module.weight.device)
                       for size in (module.in_features, module.out_features)]
            term = RowTerm(*buffers, scale=s.sigma / math.sqrt(s.rank), mirrored=self.mirrored)
            self.engine.add_row_term(module, term)
            terms.append(term)
        for _, module in self.norms:  # fp32 factors: 1 + shift / g is too close to 1 for bf16
            scale = RowScale(torch.ones(groups, module.weight.shape[0], device=module.weight.device),
                             mirrored=self.mirrored)
            self.engine.add_row_term(module, scale)
            scales.append(scale)
        return terms, scales

    def draw_noise(self, step: int) -> None:
        """The step's noise of every perturbed linear and norm (the same on every rank)."""
        s = self.settings
        self.noise = [evolution.layer_noise(module.weight, self.draws, s.rank, s.seed, step, layer)
                      for layer, (_, module) in enumerate(self.linears)]
        self.norm_noise = [evolution.vector_noise(module.weight, self.draws, s.seed, step, len(self.linears) + index,
                                           std=s.norm_sigma / s.sigma)
                           for index, (_, module) in enumerate(self.norms)]

    def step(self, step: int) -> StepResult:
        """One ES step: this rank's members answer, every member's fitness is gathered, and the
        update is applied (the same on every rank)."""
        s, clock = self.settings, self.clock
        self.step_number = step
        clock.start()
        prompts = self._prompts(step)
        self.draw_noise(step)
        clock.lap("noise")
        mine = list(range(self.first_member, self.first_member + self.local_members))
        result = StepResult(domains=[p["domain"] for p in prompts for _ in range(s.generations_per_prompt)])
        noted = None
        for start in range(0, len(mine), self.members_per_call):
            rewards, tokens = self._evaluate(mine[start : start + self.members_per_call], prompts)
            result.add(rewards, tokens)
            noted = noted or (mine[start : start + self.members_per_call], self.last_answers)
        result.fitness = self._gather(torch.tensor(result.member_fitness, device=self.ctx.device))
        if self.generation_log is not None and noted[1] is not None:
            self.generation_log.add(step, self._answer_generations(step, prompts, *noted, result.fitness))
        clock.lap("gather")  # the rewards ended on the host: this is the gather, waiting for the others included
        shaped = evolution.shape_fitness(result.fitness, s.fitness_shaping, s.antithetic)
        coefficients = evolution.draw_coefficients(shaped, s.antithetic)
        lr = evolution.scheduled_lr(s.lr, s.lr_scheduler, step, s.steps)
        self.updater.apply(self.noise + self.norm_noise, coefficients, s.population, s.sigma, lr, s.rank)
        clock.lap("update")
        return result

    def _prompts(self, step: int) -> list[dict]:
        """The step's prompts (token ids, gold answer, domain): the same on every rank."""
        from gpuscale.data.prompts import prompt_ids

        draw = random.Random(derived_seed(self.settings.seed, "prompts", step))
        chosen = draw.sample(self.train, self.settings.prompts_per_step)
        tokenizer = self.loaded.tokenizer
        return [{"ids": prompt_ids(tokenizer, e["question"]), "answer": e["answer"], "domain": e.get("domain") or "all",
                 "question": e["question"],
                 # the training answer as SFT tokenizes it (fitness gold_logprob)
                 "gold_ids": tokenizer(e["answer"], add_special_tokens=False)["input_ids"] + [self._answer_end]}
                for e in chosen]

    def _evaluate(self, members: list[int], prompts) -> tuple[list[float], int]:
        """The reward of every answer of these members, member by member, and the tokens decoded for
        them (a short last call is padded with copies of its last member, whose answers are dropped:
        the engine's batch shape stays fixed)."""
        padded = members + [members[-1]] * (self.members_per_call - len(members))
        score = self._answer if self.settings.fitness == "correctness" else self._gold_logprobs
        if self.settings.method == "naive":
            originals = self._perturb_in_place(padded[0])
            try:
                rewards, lengths = score(padded, prompts)
            finally:
                self._restore(originals)
        else:
            self._load_members(padded)
            with self.engine.row_terms_in_forward():
                rewards, lengths = score(padded, prompts)
        real_rows = len(members) * self.rows_per_member
        return rewards[:real_rows], sum(lengths[:real_rows])

    def _load_members(self, members: list[int]) -> None:
        """Refill the row terms' buffers in place with these members' noise (graphs stay valid); mirrored, with
        each pair's first member's (its second's is the mirror image)."""
        if self.mirrored:
            members = members[0::2]
        draws = torch.tensor([evolution.member_draw(m, self.settings.antithetic) for m in members],
                             device=self.ctx.device)
        signs = self.signs[members][:, None, None]
        for term, noise in zip(self.terms, self.noise):
            term.down.copy_(noise.b[draws])
            term.up.copy_(noise.a[draws] * signs)
        for scale, noise, (_, module) in zip(self.scales, self.norm_noise, self.norms):
            # (g + shift) n(x) = g n(x) (1 + shift / g), shift = sigma x sign x noise (noise has std
            # norm_sigma / sigma); a gain of exactly 0 keeps its 0
            gain = module.weight.float()
            shift = self.settings.sigma * noise[draws] * signs[:, :, 0]
            scale.factors.copy_(torch.where(gain != 0, 1 + shift / gain, torch.ones_like(shift)))

    @torch.no_grad()
    def _perturb_in_place(self, member: int) -> list[torch.Tensor]:
        """The users' earlier EGGROLL script's structure: clone the weights, add the member's full
        perturbation to them."""
        s, draw = self.settings, evolution.member_draw(member, self.settings.antithetic)
        scale = float(self.signs[member]) * s.sigma / math.sqrt(s.rank)
        originals = [module.weight.detach().clone() for _, module in self.linears + self.norms]
        for (_, module), noise in zip(self.linears, self.noise):
            module.weight.add_((noise.a[draw] @ noise.b[draw].T * scale).to(module.weight.dtype))
        for (_, module), noise in zip(self.norms, self.norm_noise):
            module.weight.add_((noise[draw] * float(self.signs[member]) * s.sigma).to(module.weight.dtype))
        return originals

    @torch.no_grad()
    def _restore(self, originals: list[torch.Tensor]) -> None:
        for (_, module), original in zip(self.linears + self.norms, originals):
            module.weight.copy_(original)

    def _answer(self, members: list[int], prompts) -> tuple[list[float], list[int]]:
        """Every member answers every prompt: each answer's reward and length, in row order."""
        from gpuscale.data.rewards import correctness
        from gpuscale.data.scoring import decode_completions
        from gpuscale.engines.generation import Sampling

        s, loaded = self.settings, self.loaded
        rows = [prompt["ids"] for _ in members for prompt in prompts]
        self.clock.lap("load")
        generation = self.engine.generate(rows, s.max_new_tokens, Sampling(temperature=s.temperature),
                                          self._generator_for_call(), samples_per_prompt=s.generations_per_prompt,
                                          noise_period=self.rows_per_member if s.common_random_numbers else None)
        answers, lengths = generation.sequences(), generation.lengths.tolist()
        self.clock.lap("generate")
        golds = [prompt["answer"] for _ in members for prompt in prompts for _ in range(s.generations_per_prompt)]
        texts = decode_completions(answers, loaded.tokenizer, loaded.eos)
        rewards = [correctness(text, gold, s.answer_mode) for text, gold in zip(texts, golds)]
        self.clock.lap("score")
        cut = [len(tokens) >= s.max_new_tokens and tokens[-1] not in loaded.eos for tokens in answers]
        self.last_answers = (texts, rewards, cut)
        return rewards, lengths

    def _answer_generations(self, step: int, prompts, members: list[int], answers: tuple, fitness) -> list[dict]:
        """One call's answers as generation records: each with its member's fitness (gathered), row order as
        `_answer`'s (member, prompt, generation)."""
        texts, rewards, cut = answers
        generations, records = self.settings.generations_per_prompt, []
        for row in range(len(members) * self.rows_per_member):
            member, prompt = members[row // self.rows_per_member], prompts[(row % self.rows_per_member) // generations]
            records.append(generation_record(step, prompt["question"], texts[row], domain=prompt["domain"],
                                             correct=rewards[row] >= 1.0, rewards={"correctness": rewards[row]},
                                             fitness=float(fitness[member]),
                                             truncated=cut[row]))
        return records

    @torch.no_grad()
    def _gold_logprobs(self, members: list[int], prompts) -> tuple[list[float], list[int]]:
        """Every member's mean per-token log-prob of each prompt's training answer (and EOS), by
        teacher forcing: one forward of the body over all rows (the members' row terms act in it),
        the head in slices of rows so that [rows, tokens, vocab] logits never exist at once."""
        model, device, copies = self.loaded.model, self.ctx.device, len(members)
        self.clock.lap("load")  # the members' noise put in the row terms (or, naive, in the weights)
        # Every member scores the same rows: one member's block (ids, mask, scored positions) is built on
        # the host and tiled on the device, so the host's work does not grow with the members.
        block = [prompt["ids"] + prompt["gold_ids"] for prompt in prompts]
        width = max(map(len, block))
        block_ids = torch.full((len(block), width), self.loaded.pad, dtype=torch.long)
        for i, row in enumerate(block):  # right padding: a causal model's earlier positions never see it
            block_ids[i, : len(row)] = torch.tensor(row)
        lengths = torch.tensor([len(row) for row in block])
        answer_lengths = torch.tensor([len(prompt["gold_ids"]) for prompt in prompts])
        block_mask = (torch.arange(width)[None] < lengths[:, None]).long()
        # Position t predicts token t + 1: the answer's tokens are predicted from len - answer - 1 on.
        position, first = torch.arange(width - 1)[None], (lengths - answer_lengths - 1)[:, None]
        block_scored = (position >= first) & (position < (lengths - 1)[:, None])
        ids, mask, scored = (part.to(device).repeat(copies, 1) for part in (block_ids, block_mask, block_scored))
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        head, totals = model.get_output_embeddings(), []
        rows_per_slice = max(1, (1 << 26) // (width * head.out_features))
        for start in range(0, len(ids), rows_per_slice):
            part = slice(start, start + rows_per_slice)
            logits = head(hidden[part, :-1]).float()
            token_logprobs = logits.gather(-1, ids[part, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
            totals.append((token_logprobs * scored[part]).sum(1))
        scores = (torch.cat(totals).cpu() / answer_lengths.repeat(copies)).tolist()
        self.clock.lap("score")  # so that the step's `gather` phase is the all-gather alone (bench/scaling.py)
        return scores, answer_lengths.tolist() * copies

    def _generator_for_call(self) -> torch.Generator:
        """With common random numbers, every call of a step (every member, on every rank) starts from
        the step's seed; otherwise the rank's generator runs on."""
        if self.settings.common_random_numbers:
            self.generator.manual_seed(evolution.sampling_seed(self.settings.seed, self.step_number))
        return self.generator

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's fitnesses in member order, as one tensor (all ranks hold equal shares)."""
        if self.ctx.world_size == 1:
            return local
        everyone = torch.empty(self.settings.population, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(everyone, local)
        return everyone


class Evaluator:
    """Held-out accuracy, greedy and at temperature 1 (the training engine's row terms act only in
    its own calls, so these see the unperturbed model), named as every training recipe names it
    (recipes/shared/evaluation.py)."""

    def __init__(self, settings: Settings, ctx, loaded, held_out: list[dict]):
        self.settings, self.ctx, self.loaded, self.held_out = settings, ctx, loaded, held_out

    def figures(self, label: str, log_only: bool = False) -> dict:
        """`accuracy_<greedy|sampled>[_<domain>]_<label>` (label before or after); with `log_only`,
        the two overall accuracies as the figures a step logs, `accuracy_greedy` and `accuracy_sampled`."""
        from gpuscale.recipes.shared.evaluation import held_out_evaluation

        s = self.settings
        figures = held_out_evaluation(self.loaded.model, self.loaded.tokenizer, self.held_out, self.ctx, label,
                                      max_new_tokens=s.max_new_tokens, memory_share=s.gpu_memory_share, seed=s.seed,
                                      batch_size=s.batch_size)
        if log_only:
            return {f"accuracy_{kind}": figures[f"accuracy_{kind}_{label}"] for kind in ("greedy", "sampled")}
        return figures
