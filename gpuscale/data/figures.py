"""The catalogue of figures: what a run's figures (the names ranks log with `Reporter.log` and put in
their summary) mean to people. Each known figure has a label, a unit, a direction (is a higher value
better, a lower one, or neither) and a format; the recipes promise their summary's figures from it
(`Recipe.promised_figures`, checked by the contract test) and the views read it to write a value
(`app/views/runs.py:figure_text`). A figure not in it is still shown, plainly: as a number, no unit.

One figure often comes in several names: per domain (`yield_math`), at the start and the end
(`reward_first`, `reward_last`), before and after training, per rank, a median. A catalogued figure
with `family=True` stands for every name it starts followed by `_` (`reward_first` is a `reward`),
the longest catalogued name winning (`samples_per_s_steady` is a `samples_per_s`). Held-out accuracy
has one vocabulary, `accuracy_name`'s `accuracy_<greedy|sampled>[_<domain>]_<before|after>`, which
the `accuracy` family covers.

Pure data, no torch: the ranks, the front ends and the tests share it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Direction = Literal["higher", "lower", "neither"]
HIGHER: Direction = "higher"  # higher is better: accuracy, reward, throughput
LOWER: Direction = "lower"  # lower is better: loss, time, memory
NEITHER: Direction = "neither"  # a fact of the run's shape (world_size) or a diagnostic (entropy)

# How a value is written (the views hold the formatters): `number` with thousands separators and four
# significant digits (`12,345`, `0.6931`); `percent` a share (0.282) as `28.2%`; `text` as it is (a
# dtype, a path, a split's name).
Format = Literal["number", "percent", "text"]


@dataclass(frozen=True)
class Figure:
    name: str
    label: str  # for people: `tokens/s`, `MFU`, `step time (median)`
    unit: str = ""  # written after a value (`s`, `ms`, `tokens/s`); "" for a count or a share
    direction: Direction = NEITHER
    format: Format = "number"
    family: bool = False  # also stands for `<name>_<qualifier>` (per domain, first/last, before/after)
    # What the figure counts, where its label alone leaves two figures of one kind apart (the whole
    # run's rate and the steady one): shown beside its value in `gpuscale show`, the TUI's run page and
    # an export. A recipe whose figure of a shared name counts something of its own says so in its
    # `Recipe.figure_notes`, which the views read first. A family's members share its note.
    note: str = ""


def _figures(*figures: Figure) -> dict[str, Figure]:
    """The catalogue by name; a name given twice is refused at import (a dict would keep the later)."""
    catalogue: dict[str, Figure] = {}
    for entry in figures:
        if entry.name in catalogue:
            raise ValueError(f"figure {entry.name!r}: catalogued twice ({catalogue[entry.name]} and {entry})")
        catalogue[entry.name] = entry
    return catalogue


def _rate(name: str, label: str, **kw) -> Figure:
    return Figure(name, label, unit=label, direction=HIGHER, **kw)


def _seconds(name: str, label: str, **kw) -> Figure:
    return Figure(name, label, unit="s", direction=LOWER, **kw)


def _count(name: str, label: str, **kw) -> Figure:
    return Figure(name, label, **kw)


def _text(name: str, label: str) -> Figure:
    return Figure(name, label, format="text")


ENGINE_DECODE = ("one GPU's decode steps through gpuscale's engine as it runs by default (on a GPU: the compiled "
                 "step replayed as a CUDA graph), plain sampling: a generate call of N new tokens less a call "
                 "of 1, over the N - 1 steps (bench/generation.py's measure); the summary's node_check_decode "
                 "says how each GPU ran")

FIGURES: dict[str, Figure] = _figures(
    # What a run is for: held-out accuracy (every accuracy_* name), reward, loss.
    Figure("accuracy", "accuracy", direction=HIGHER, family=True),
    # Older runs' names of the greedy and sampled held-out accuracy (app/views/runs.py's LEAD_FIGURES reads
    # them where a summary lacks accuracy_<greedy|sampled>_<before|after>).
    Figure("greedy_accuracy", "greedy accuracy", direction=HIGHER, family=True),
    Figure("sampled_accuracy", "sampled accuracy", direction=HIGHER, family=True),
    Figure("accuracy_greedy_gain_points", "greedy accuracy gain", unit="points", direction=HIGHER),
    Figure("accuracy_sampled_gain_points", "sampled accuracy gain", unit="points", direction=HIGHER),
    Figure("sample_accuracy", "generated answers correct", direction=HIGHER),
    Figure("train_accuracy", "training accuracy", direction=HIGHER, family=True),
    Figure("reward", "reward", direction=HIGHER, family=True),
    # eggroll's fitness of a member is the mean reward of its answers: its `reward` (the lead figures
    # of app/views/runs.py read fitness_mean_first/_last where reward_first/_last are missing).
    Figure("fitness_mean", "fitness (mean reward)", direction=HIGHER, family=True),
    Figure("fitness_max", "fitness (best member)", direction=HIGHER),
    Figure("fitness_std", "fitness spread"),
    Figure("yield", "questions with a correct answer", direction=HIGHER, family=True),
    Figure("loss", "loss", direction=LOWER, family=True),
    Figure("train_loss", "training loss", direction=LOWER),
    Figure("entropy", "entropy", family=True),  # in nats, which a headline need not repeat
    # TRL's completion lengths (completions/clipped_ratio, /mean_length): app/views/collapse.py watches them.
    Figure("completions_clipped_ratio", "completions at the length cap", direction=LOWER, format="percent"),
    Figure("completions_mean_length", "completion length (mean)", unit="tokens"),
    Figure("kl", "KL", family=True),
    # How far the trainer's log-probs of the sampled tokens are from the sampler's (engines/policy_mismatch.py;
    # TRL's names for vLLM's): 0 where both are the same weights at the same precision.
    Figure("sampling_sampling_logp_difference_mean", "policy mismatch (mean)", unit="nats", direction=LOWER,
           family=True),
    Figure("sampling_sampling_logp_difference_max", "policy mismatch (max)", unit="nats", direction=LOWER,
           family=True),
    Figure("sampling_sampler_kl", "policy mismatch KL", unit="nats", direction=LOWER, family=True),
    # grpo-mtl's rollout=async (engines/off_policy.py): how stale the sampling weights were, and TRL's
    # importance weights of the sampled tokens (min/mean/max) with the share its cap truncated.
    Figure("sampling_staleness", "sampling staleness", unit="steps", direction=LOWER, family=True,
           note="optimizer steps between the sampling weights and the trained ones"),
    Figure("sampling_importance_sampling_ratio", "importance weight", family=True),
    Figure("sampling_importance_sampling_clipped_share", "importance weights clipped", direction=LOWER,
           format="percent", family=True),
    Figure("grad_norm", "gradient norm"),
    Figure("learning_rate", "learning rate"),
    Figure("acceptance_rate", "MCMC acceptance"),
    # power-sampling with several chains: {"k": pass@k} (recipes/power_sampling/pass_at_k.py), per domain too.
    Figure("pass_at_k", "pass@k", direction=HIGHER, family=True),
    # Speed.
    _rate("tokens_per_s", "tokens/s", family=True),
    # A training run's steady rate beside its whole-run one (recipes/shared/training.py:training_figures).
    Figure("tokens_per_s_steady", "tokens/s (steady)", unit="tokens/s", direction=HIGHER,
           note="steady: the median optimizer step's rate, all ranks, the first step left out"),
    _rate("generated_tokens_per_s", "generated tokens/s"),
    _rate("prefill_tokens_per_s", "prefill tokens/s"),
    _rate("samples_per_s", "samples/s", family=True),
    _rate("train_samples_per_s", "training samples/s"),
    _rate("problems_per_s", "problems/s"),
    _rate("members_per_s", "members/s"),
    Figure("mfu", "MFU", direction=HIGHER, format="percent",
           note="whole run: over the trainer's whole training time, warm-up included"),
    Figure("mfu_steady", "MFU (steady)", direction=HIGHER, format="percent",
           note="steady: at the median optimizer step's rate, the first step left out"),
    # The probe's node check, one figure per rank (`copy_gb_per_s_rank_0`): data/node_check.py.
    Figure("copy_gb_per_s", "memory bandwidth", unit="GB/s", direction=HIGHER, family=True),
    Figure("matmul_tflops", "matmul", unit="TFLOP/s", direction=HIGHER, family=True),
    # Through the generation engine, one GPU: not the summary's tokens_per_s, the decode steps of
    # transformers' forward on every rank (recipes/probe.py's figure_notes). An earlier probe's (a summary
    # without node_check_decode) timed whole generate calls, the prefill with them, without torch.compile.
    Figure("latency_tokens_per_s", "decode at batch 1", unit="tokens/s", direction=HIGHER, family=True,
           note=ENGINE_DECODE),
    Figure("throughput_tokens_per_s", "decode at full batch", unit="tokens/s", direction=HIGHER, family=True,
           note=ENGINE_DECODE),
    Figure("decode_batch1_floor_share", "batch-1 decode, share of the weight-read floor", direction=HIGHER,
           format="percent", family=True,
           note="the time to read the weights a decode step reads once at the GPU's measured copy bandwidth, "
                "over its measured batch-1 decode step (100%: at the memory roofline)"),
    Figure("decode_weight_bytes", "weights read a decode step", unit="bytes"),
    Figure("allreduce_busbw_gb_per_s", "all-reduce bus bandwidth", unit="GB/s", direction=HIGHER),
    Figure("link_gb_per_s", "link bandwidth each way", unit="GB/s", direction=HIGHER, family=True),
    Figure("allreduce_algbw_gb_per_s", "all-reduce algorithm bandwidth", unit="GB/s", direction=HIGHER),
    Figure("generation_share", "share of time generating"),
    _seconds("step_seconds_median", "step time (median)"),
    Figure("step_time_ms", "step time", unit="ms", direction=LOWER, family=True),
    _seconds("step_time_s", "step time"),
    _seconds("generation_seconds", "generation time", family=True),
    _seconds("generation_wall_seconds", "generation wall time"),
    _seconds("training_seconds", "training time", family=True),
    _seconds("train_seconds", "training time"),
    _seconds("sampling_seconds", "sampling time"),
    _seconds("warm_up_seconds", "warm-up time"),
    # Where a step's time goes (data/step_phases.py): each logged step's seconds per phase, per rank
    # (`phase_seconds_forward_backward`), and the summary's mean steady step, per rank where they differ.
    _seconds("phase_seconds", "phase time", family=True),
    Figure("step_phases", "where a step goes", format="percent",
           note="each phase's share of the steady steps' time (the first step of each rank left out), all ranks"),
    _seconds("step_phase_seconds", "step phases",
             note="seconds per phase of the mean steady step (the first step of each rank left out), all ranks"),
    _seconds("step_phase_seconds_by_rank", "step phases per rank",
             note="each rank's mean steady step, where the ranks differ"),
    _seconds("gpu_busy_s", "GPU time of the run's own kernels",
             note="per GPU: the run's mean own utilization (NVML's per-process SM utilization) times its duration; "
                  "on a card other processes share, what the run cost the card"),
    # Memory.
    Figure("peak_mem_mb", "peak memory", unit="MiB", direction=LOWER, family=True),
    Figure("mem_mb", "memory", unit="MiB", direction=LOWER),
    # Energy: NVML's energy counter of the run's GPUs, read at its start and end (control/telemetry.py's
    # EnergyMeter); absent on CPU and on a GPU without the counter, `energy_unavailable` saying why.
    Figure("energy_j", "energy", unit="J", direction=LOWER),
    Figure("energy_j_by_gpu", "energy per GPU", unit="J", direction=LOWER),
    Figure("energy_j_per_1k_tokens", "energy per 1,000 tokens", unit="J", direction=LOWER),
    Figure("energy_j_per_correct_answer", "energy per correct held-out answer", unit="J", direction=LOWER),
    _text("energy_unavailable", "energy not measured"),
    # Other runs that used the run's GPUs while it lived (control/telemetry.py's shared_gpu_figures):
    # energy_j counts their work too, and the figures per token and per answer are left out.
    _text("energy_shared_with", "runs sharing the GPU"),
    _text("energy_shared", "energy counts other runs' work"),
    # The run's shape and what it worked on: facts, neither better nor worse.
    _count("world_size", "ranks"),
    _count("steps", "steps"),
    _count("batch_size", "batch size"),
    _count("throughput_batch_size", "decode batch (throughput)"),
    Figure("allreduce_mib", "all-reduce size a rank", unit="MiB"),
    _count("gradient_accumulation", "gradient accumulation"),
    _count("rows_per_step", "rows a step (all ranks)"),
    _count("population", "population"),
    _count("chains", "chains"),
    _count("problems", "problems"),
    _count("parameters", "parameters"),
    _count("train_examples", "training examples"),
    _count("train_questions", "training questions"),
    _count("train_tokens", "training tokens"),
    _count("eval_examples", "held-out examples"),
    # tiny-math's held-out problems no training or pretraining problem equals up to names and nouns
    # (data/near_duplicates.py); their accuracy is `accuracy_<greedy|sampled>_new_<before|after>`.
    _count("eval_examples_new", "held-out examples structurally new"),
    _text("structurally_new_unavailable", "structurally new subset not measured"),
    _count("generation_questions", "questions generated for"),
    _count("samples_per_question", "samples per question"),
    _count("generated_samples", "generated samples"),
    _count("kept_examples", "kept examples"),
    _count("kept_samples", "kept sampled answers"),
    _count("decoded_tokens", "decoded tokens"),
    _count("forward_passes", "forward passes"),
    _count("mean_answer_tokens", "answer length (mean)"),
    _count("prompts_too_long", "prompts too long"),
    # grpo-mtl: a domain's share of the training prompts (`train_share_<domain>`, its `domain_weights` applied).
    Figure("train_share", "share of the training prompts", format="percent", family=True),
    _count("held_out_rows_dropped", "held-out rows dropped"),
    _count("temperature", "temperature"),
    _text("dtype", "dtype"),
    _text("eval_split", "held-out split"),
    _text("test_split", "tiny-math test split"),
    _text("method", "method"),
    _text("counted_in_accuracy", "accuracy counts"),
    _text("generator", "generator"),
    _text("mtl", "multi-task method"),
    _text("rollout", "rollout"),
    Figure("max_staleness", "staleness allowed", unit="steps"),
    Figure("generation_gpus", "devices generating"),
    _text("phase", "phase"),
    _text("model_dir", "trained model"),
    _text("generated_set", "generated set"),
    _text("data_from", "generated set read"),
    _text("devices", "devices"),
    _text("node_check_gpus", "GPUs checked"),
    _text("node_check_flags", "slow GPUs"),
    _text("node_check_unjudged", "gaps within the measurement's spread"),
    _text("node_check_decode", "how the decode figures were measured"),
    _text("domains", "domains"),
    _text("batch_size_reason", "micro-batch reason"),
    _text("fitted_to_ranks", "defaults fitted to the ranks"),
    _text("liger_kernels", "Liger kernels"),
    _text("weights_identical_across_ranks", "weights identical across ranks"),
    _text("weights_checksum", "weights checksum"),
)

# A name no entry stands for, with one of these ends, is a time in seconds (eggroll's
# `<phase>_seconds_median`, one per phase of its step).
TIME_ENDS = ("_seconds", "_seconds_median", "_seconds_per_step")


def figure(name: str) -> Figure | None:
    """The catalogue's figure for `name`: its own entry, else the longest family it belongs to (its
    label then says which: `reward (first)`, `accuracy (greedy math after)`), else a time by its end;
    None for a figure the catalogue does not know."""
    if name in FIGURES:
        return FIGURES[name]
    families = [entry for entry in FIGURES.values() if entry.family and name.startswith(entry.name + "_")]
    if families:
        entry = max(families, key=lambda entry: len(entry.name))
        qualifier = name.removeprefix(entry.name + "_").replace("_", " ")
        return replace(entry, name=name, label=f"{entry.label} ({qualifier})", family=False)
    if name.endswith(TIME_ENDS):
        return _seconds(name, name.replace("_", " "))
    return None


def is_catalogued(name: str) -> bool:
    return figure(name) is not None


def label(name: str) -> str:
    """The figure's label, or its name where the catalogue does not know it."""
    known = figure(name)
    return known.label if known else name


def accuracy_name(kind: str, domain: str, when: str) -> str:
    """`accuracy_<greedy|sampled>[_<domain>]_<when>`: the one name of a held-out accuracy."""
    return "_".join(part for part in ("accuracy", kind, domain, when) if part)


def better(name: str, a: float, b: float) -> str | None:
    """Which of two values of the figure is better, "a" or "b"; None where they are equal, the
    figure has no direction, or the catalogue does not know it."""
    known = figure(name)
    if known is None or known.direction == NEITHER or a == b:
        return None
    return "b" if (b > a) == (known.direction == HIGHER) else "a"
