"""A rank's share of a run's batch, before anything runs: how many ranks a run of these settings starts
here (`run_ranks`) and which micro-batches a training recipe may run for a rank's rows per optimizer
step (`micro_batches`, `micro_batch_within`). No torch (the device plan is runs/devices.py's): the
recipes' tuning hooks call it in the front end's process, the trials and the ranks in theirs."""

from __future__ import annotations

from gpuscale.runs.settings import RunSettings, SettingsError


def run_ranks(settings: RunSettings) -> int:
    """How many ranks of a run of these settings share its work on this machine (1 where its `gpus`
    cannot be planned here): a rank's share of the work, and of a training recipe's global batch,
    depends on it. The ranks the launch starts less its side ranks (`RunSettings.side_ranks`: grpo-mtl's
    generators), which take no share."""
    return run_ranks_on(settings)[0]


def run_ranks_on(settings: RunSettings) -> tuple[int, bool]:
    """`run_ranks`, and whether they are GPUs (False: CPU ranks, or `gpus` not planned here). Side
    ranks that would leave none to share the work are refused (SettingsError naming their field)."""
    from gpuscale.runs.devices import plan_devices

    try:
        plan = plan_devices(settings.gpus)
    except SettingsError:
        return 1, False
    launched = plan.nproc * settings.nnodes
    side = settings.side_ranks
    if side >= launched:
        devices = "GPUs" if plan.on_gpu else "CPU ranks"
        gpus = ",".join(map(str, settings.gpus)) if isinstance(settings.gpus, list) else settings.gpus
        nodes = f", nnodes={settings.nnodes}" if settings.nnodes > 1 else ""
        field = settings.SIDE_RANKS_FIELD
        raise SettingsError(f"{field}: {side}: the run has {launched} {devices} (gpus={gpus}{nodes}) and at least "
                            f"one must train; give more gpus or fewer {field}")
    return launched - side, plan.on_gpu


def micro_batches(rank_batch: int, most_accumulation: int | None = None) -> list[int]:
    """The micro-batches a training recipe may run for `rank_batch` rows per optimizer step on a rank:
    the divisors of it (gradient accumulation = rank_batch // micro-batch keeps the step's batch), with
    at most `most_accumulation` micro-batches per step."""
    return [d for d in range(1, rank_batch + 1)
            if rank_batch % d == 0 and (most_accumulation is None or rank_batch // d <= most_accumulation)]


def micro_batch_within(rank_batch: int, wanted: int, most_accumulation: int | None = None) -> int:
    """The largest allowed micro-batch up to `wanted` (a tuned batch found for another share of the
    global batch need not divide this one), else the smallest allowed."""
    allowed = micro_batches(rank_batch, most_accumulation) or [rank_batch]
    return max((d for d in allowed if d <= wanted), default=allowed[0])
