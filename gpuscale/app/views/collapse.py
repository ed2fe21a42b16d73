"""The collapse rules: an RL run whose policy has collapsed keeps running (and burning GPU hours)
while learning nothing. Pointed out while it happens, the way `waste` points out idle GPUs:

- reward at zero while the completions sit at the length cap: the policy emits long garbage that
  never scores (a learning rate too high, or a precision problem, usually);
- entropy under a floor, in a recipe that trains on its own samples (`Recipe.explores`: grpo-mtl): the
  policy has stopped exploring, every completion of a group is the same (a supervised run's entropy is
  meant to fall: sft's reached 0.04 on CPU, and said nothing wrong);
- a figure that is no longer finite (the loss is nan): training has diverged;
- beside them, not a collapse but waste of the same kind: a training run's MFU under 10% step after
  step (`low_mfu_warnings`);
- and a cause of one: the trainer's log-probs of the sampled tokens far from the sampler's step after
  step (`policy_mismatch_warnings`): GRPO then trains on another policy's completions;
- first of all, a run that may have stopped advancing: a rank late in its step (`late_warnings`, from
  the supervisor's hang watch, control/hang_watch.py), before the run is ended as hung;
- then where the ranks' step time goes, live (data/step_phases.py's `live_advice` on each rank's last
  steps, which the supervisor keeps in the progress: `step_phase_warnings`): a straggler named with its
  GPU, a phase taking too much of a step;
- and next, not a collapse: a resumed run whose resume check failed (runs/resume_check.py: steps that do
  not add up, Adam's state not restored, a figure far from where it stood before the stop).

Names are the ranks' metric names (TRL's `completions/clipped_ratio` becomes
`completions_clipped_ratio`, see `gpuscale.engines.trl_bridge.metric_name`). `collapse_warnings` is
the pure rule on plain (step, value) lists; `run_collapse_warnings` reads them through the Store.
"""

from __future__ import annotations

from gpuscale.app.views.runs import known_recipe, resume_check_warnings
from gpuscale.app.views.text import format_number
from gpuscale.control.store import Store, planned_gpus
from gpuscale.data.cards import LOW_MFU
from gpuscale.data.figures import label
from gpuscale.data.step_phases import live_advice
from gpuscale.runs.statuses import LIVE_STATUSES

# A collapse is judged over this many logged steps, all of them: one bad step (a hard batch, a
# reward of 0 early in training) is no collapse, five in a row rarely recover on their own.
COLLAPSE_STEPS = 5
# Rewards at or below this are "zero": the rewards are shares of correct answers (0 to 1), and a
# policy that is merely bad still scores a few percent.
ZERO_REWARD = 0.01
# At least this share of completions at the length cap: a healthy policy ends most of its answers
# well before the cap; one that runs into it almost always no longer stops.
CLIPPED_SHARE = 0.9
# Where the clipped share is not logged, a mean length this close to the cap says the same.
NEAR_CAP = 0.98
# Mean token entropy (nats) under this: the sampled completions are all but deterministic, so a GRPO
# group's completions agree, their advantages are zero and nothing is learned.
ENTROPY_FLOOR = 0.05

REWARD = "reward"
CLIPPED = "completions_clipped_ratio"
MEAN_LENGTH = "completions_mean_length"
ENTROPY = "entropy"
WATCHED = (REWARD, CLIPPED, MEAN_LENGTH, ENTROPY)
# What to do about a collapse of the first kind (and of a diverged loss).
LOWER_LR = "lower learning_rate, check precision"
# Model FLOPs utilisation, and what to do when it stays low (a training step too small for the card).
MFU = "mfu"
MORE_WORK_A_STEP = ("give each step more rows (rows_per_step; grpo-mtl: prompts_per_step), the micro-batch left "
                    "auto, packing=true for short rows, or `gpuscale tune`")
# The policy mismatch (engines/policy_mismatch.py): the mean over the sampled tokens of |log p_trainer -
# log p_sampler|, in nats. The same weights at the same precision give ~0 (under 1e-5 in fp32 on CPU);
# a bf16 forward against an fp32 one should stay near 0.01 (bf16 keeps 8 bits of mantissa: logits of
# magnitude 10 are off by a few hundredths, and most of it cancels in the softmax). At 0.05 the average
# token's importance ratio is off by 5%, a quarter of GRPO's clip range (epsilon 0.2): the clipping and
# the advantages then act on the sampler's noise as much as on the update (the training-inference
# mismatch that makes RL runs collapse; TRL corrects it for vLLM with `vllm_importance_sampling_correction`).
MISMATCH = "sampling_sampling_logp_difference_mean"
MISMATCH_BOUND = 0.05
# Judged over fewer steps than a collapse: a mismatch of precision or kernels is there from the first
# step on, every step; three in a row are no unlucky batch.
MISMATCH_STEPS = 3
# What to do about it: on a GPU the engine decodes the fp32 master weights while the loss's forward runs
# under bf16 autocast; fp32 on both sides tells a precision mismatch from a bug.
ALIGN_PRECISION = "the loss trains on another policy's completions; compare a run with --precision fp32"
# With rollout=async the sampler's weights are up to max_staleness optimizer steps old: the gap holds the
# policy's drift over those steps too, which precision does not explain.
NARROW_STALENESS = ("with rollout=async it holds the policy's drift over max_staleness steps too (TRL's "
                    "importance sampling weights it, capped): a lower learning_rate or max_staleness=0 narrows it")


def collapse_warnings(history: dict[str, list[tuple[int, float]]], settings: dict | None = None,
                      nonfinite: dict[str, dict] | None = None, steps: int = COLLAPSE_STEPS,
                      explores: bool = True) -> list[str]:
    """Collapse worth pointing out now, one line each.

    `history`: per metric name, its (step, value) of the last logged steps, oldest first (more than
    `steps` are cut to the last `steps`); `settings`: the run's (for `max_completion_length`);
    `nonfinite`: per figure no longer finite, `{"step": first such step, "value": "nan"}`; `explores`:
    whether the run trains on its own samples, where alone a low entropy is a collapse."""
    recent = {name: [value for _, value in rows[-steps:]] for name, rows in history.items()
              if len(rows) >= steps}
    warnings = [f"{name} is {info.get('value', 'nan')} since step {info.get('step', '?')} — {LOWER_LR}"
                for name, info in sorted((nonfinite or {}).items())]
    cap = (settings or {}).get("max_completion_length")
    rewards, at_cap = recent.get(REWARD), _share_at_cap(recent, cap)
    if rewards and at_cap is not None and max(rewards) <= ZERO_REWARD and min(at_cap) >= CLIPPED_SHARE:
        where = f"the {cap}-token cap" if cap else "the length cap"
        warnings.append(f"collapse: reward {_mean(rewards):.2f} and {100 * _mean(at_cap):.0f}% of completions at "
                        f"{where} over the last {steps} steps — {LOWER_LR}")
    entropy = recent.get(ENTROPY) if explores else None
    if entropy and max(entropy) < ENTROPY_FLOOR:
        warnings.append(f"collapse: entropy {entropy[-1]:.2f} under {format_number(ENTROPY_FLOOR)} — "
                        "the policy stopped exploring")
    return warnings


def _share_at_cap(recent: dict[str, list[float]], cap) -> list[float] | None:
    """Per step, the share of completions at the cap: the clipped ratio where logged, else 1 or 0 as
    the mean length is at the cap or not."""
    if CLIPPED in recent:
        return recent[CLIPPED]
    if MEAN_LENGTH in recent and isinstance(cap, (int, float)) and cap > 0:
        return [1.0 if length >= NEAR_CAP * cap else 0.0 for length in recent[MEAN_LENGTH]]
    return None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def low_mfu_warnings(history: dict[str, list[tuple[int, float]]], steps: int = COLLAPSE_STEPS) -> list[str]:
    """A GPU training run whose MFU (the ranks log it where the card's peak is known, data/cards.py)
    stayed under LOW_MFU over its last `steps` logged steps: the card mostly waits, on the CPU's
    kernel launches, small matrices or generation."""
    recent = [value for _, value in history.get(MFU, [])[-steps:]]
    if len(recent) < steps or max(recent) >= LOW_MFU:
        return []
    # Whole percents, not figure_text's tenths: the warning compares with a round threshold.
    return [f"{label(MFU)} {100 * _mean(recent):.0f}% (under {100 * LOW_MFU:.0f}%) over the last {steps} steps — "
            f"{MORE_WORK_A_STEP}"]


def policy_mismatch_warnings(history: dict[str, list[tuple[int, float]]], steps: int = MISMATCH_STEPS,
                             settings: dict | None = None) -> list[str]:
    """The trainer's log-probs of the sampled tokens more than MISMATCH_BOUND nats from the sampler's, on
    average over the tokens, at each of the last `steps` logged steps; what to do about it depends on
    whether the sampler's weights may be older than the trainer's (`settings`' rollout)."""
    recent = [value for _, value in history.get(MISMATCH, [])[-steps:]]
    if len(recent) < steps or min(recent) <= MISMATCH_BOUND:
        return []
    settings = settings or {}
    stale = settings.get("rollout") == "async" and settings.get("max_staleness", 1) > 0
    return [f"policy mismatch: the trainer's log-probs of the sampled tokens are {recent[-1]:.3f} nats from the "
            f"sampler's (over {format_number(MISMATCH_BOUND)}) over the last {steps} steps — "
            f"{NARROW_STALENESS if stale else ALIGN_PRECISION}"]


def late_warnings(progress: dict) -> list[str]:
    """The ranks the supervisor found late in a step (progress `late`: silent for 3x their p95 step time),
    one line: `rank 1 late: no progress for 45 s at step 138 (3x its p95 step time, 1.2 s); the run ends
    as hung after 120 s without progress (hang_timeout)`."""
    late = progress.get("late")
    if not late:
        return []
    ranks = [entry["rank"] for entry in late]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    silent, step = max(entry["silent_s"] for entry in late), min(entry["step"] for entry in late)
    pace = max(entry["p95_s"] for entry in late)
    timeout = progress.get("hang_timeout_s")
    end = (f"the run ends as hung after {timeout:.0f} s without progress (hang_timeout)" if timeout
           else "hang_timeout is off: nothing ends it")
    return [f"{who} late: no progress for {silent:.0f} s at step {step} (over 3x the p95 step time, "
            f"{format_number(pace)} s); {end}"]


def step_phase_warnings(progress: dict, gpu_indices: list[int] = ()) -> list[str]:
    """What to change read from the ranks' last steps (progress `step_phases`: rank -> its mean recent
    step), `gpu_indices` the run's GPUs in rank order: `rank 1 (GPU 1) is a straggler: ...`."""
    cards = {str(rank): f"GPU {gpu}" for rank, gpu in enumerate(gpu_indices)}
    return live_advice(progress.get("step_phases"), cards)


def run_collapse_warnings(store: Store, run: dict, steps: int = COLLAPSE_STEPS) -> list[str]:
    """`late_warnings` of a run of the store, then `step_phase_warnings`, then a resumed run's failed
    resume check (views/runs.py's `resume_check_warnings`), then `collapse_warnings`: its last `steps` logged steps
    of the watched figures, and the figures its supervisor saw turn non-finite (in the run's progress);
    then `low_mfu_warnings` and `policy_mismatch_warnings`."""
    history = store.recent_steps(run["id"], (*WATCHED, MFU, MISMATCH), max(steps, MISMATCH_STEPS))
    progress = run.get("progress") or {}
    recipe = known_recipe(run.get("recipe"))
    explores = recipe is not None and recipe.explores
    # The ranks' last steps speak while the run is live; once it has ended, its summary's `advice:`
    # lines (views/runs.py) say it over the whole run, and the last live lines would repeat them.
    live = run.get("status") in LIVE_STATUSES and progress.get("step_phases")
    phases = step_phase_warnings(progress, planned_gpus(run.get("run_dir"))) if live else []
    return (late_warnings(progress) + phases + resume_check_warnings(run)
            + collapse_warnings(history, run.get("settings"), progress.get("nonfinite"), steps, explores)
            + low_mfu_warnings(history, steps) + policy_mismatch_warnings(history, settings=run.get("settings")))
