"""The rank side of a run: what every recipe's entry point does around its own work.

`run_rank(Settings, main, settings_path)` is the body of `python -m gpuscale.recipes --recipe NAME
--settings FILE`, which torchrun (or accelerate) starts once per rank. It ties the rank's life to its
launcher, sends its output to RUN_DIR/logs/rank<R>.log, initialises torch.distributed (nccl on GPUs,
gloo on CPU), picks the device and dtype, and, if the recipe raises, writes RUN_DIR/errors/rank<R>.json
for the supervisor before exiting non-zero.

Side ranks (`RunSettings.side_ranks`: grpo-mtl's generators): the launch's last ranks stand outside the
training world. TRL and accelerate run every collective on the default process group, so a side rank
must not be in it: the training ranks' environment says the smaller world (WORLD_SIZE, and with one
training rank no distributed variables at all: a one-rank run's path) before the group is made, and a
side rank makes none; it runs the recipe's side work (`side`) instead of `main`, its own rank kept for
its log, metrics and errors. Being ranks of the same launch, they are seen, ended and named by the
launcher and the supervisor as any rank is.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError

from gpuscale.data.data_error import DataError
from gpuscale.data.models import ModelError
from gpuscale.data.precision import device_precision, torch_dtype
from gpuscale.data.seeds import derived_seed
from gpuscale.engines import preemption, step_phases
from gpuscale.engines.reporter import NonFiniteFigure, Reporter
from gpuscale.runs import heartbeat
from gpuscale.runs.process import die_with_parent
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.settings import RunSettings, SettingsError, describe_validation_error


@dataclass
class RankContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    run_dir: Path
    side_ranks: int = 0  # the launch's ranks beyond the training world (`world_size` ranks)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_side(self) -> bool:
        """A side rank: outside the training world, which it serves (no default process group)."""
        return self.rank >= self.world_size

    def shard(self, items: list) -> list:
        """This rank's share, by stride: every rank gets a similar mix of easy and hard items."""
        return items[self.rank :: self.world_size]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order (on every rank)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_memory_mb(self) -> float:
        """Peak tensor memory on the GPU, or this process's resident memory on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The rank's dtype: `precision` (auto, bf16, fp16, fp32) resolved on `device` by the one rule,
    data/precision.py's: the same answer the tuner, a stored tuning's key and the model loader get."""
    return torch_dtype(device_precision(precision, device))


def init_rank(settings: RunSettings, run_dir: Path) -> RankContext:
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = training_world(settings.side_ranks)
    use_cuda = torch.cuda.is_available() and os.environ.get("GPUSCALE_DEVICE", "cuda") == "cuda"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        use_cuda_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and rank < world_size:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    torch.manual_seed(derived_seed(settings.seed, "torch", rank))
    return RankContext(rank, local_rank, world_size, device, resolve_dtype(settings.precision, device), run_dir,
                       side_ranks=settings.side_ranks)


# What torchrun tells a rank of its world; accelerate and transformers read them again.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def training_world(side_ranks: int) -> int:
    """The size of the training world: the launch's ranks less its last `side_ranks`. A training rank's
    environment is made to say it before anything reads it (the default process group, accelerate's
    state, transformers' arguments); with one training rank the world variables go, as in a one-rank
    launch. One node only (the launch refuses side ranks over several): LOCAL_WORLD_SIZE is the world's."""
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if not side_ranks:
        return launched
    trainers = launched - side_ranks
    if trainers < 1:
        raise SettingsError(f"side ranks: {side_ranks}: the launch has {launched} ranks and at least one must train")
    if int(os.environ.get("RANK", 0)) < trainers:
        if trainers == 1:
            for name in WORLD_VARIABLES:
                os.environ.pop(name, None)
            # ... and sees one GPU, its own (local rank 0's): a process outside a distributed world that sees
            # several has transformers' Trainer wrap the model in nn.DataParallel, which TRL refuses (seen on
            # 2 x H200: generation_gpus=1 of 2). CUDA is not started yet, so torch counts the narrowed list.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0]
        else:
            os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(trainers)
    return trainers


def memory_for_auto_sizes(ctx: RankContext, share: float) -> tuple[int, str]:
    """The bytes this GPU rank sizes an `auto` batch or micro-batch from (engines.training_memory.memory_to_size_from:
    the card's memory less what this process holds, unless other processes leave less than `share` of
    it free), and where they come from, in words for the rank's log."""
    from gpuscale.engines.training_memory import memory_to_size_from

    free, total = torch.cuda.mem_get_info(ctx.device)
    memory, set_by_others = memory_to_size_from(free, total, torch.cuda.memory_reserved(ctx.device), share)
    if set_by_others:
        return memory, (f"the {memory / 2**30:.1f} GiB free now (other processes hold more than {1 - share:.0%} of "
                        "what this run's model leaves: another run's load can change this size)")
    return memory, f"the {memory / 2**30:.1f} GiB of {total / 2**30:.1f} GiB this run's model leaves"


def card_sized_batch(ctx: RankContext, bytes_per_item: int, items: int, unit: str, share: float,
                     name: str = "batch_size", how_to_set: str = "; --batch-size N sets it") -> int:
    """A recipe's `auto` batch on this rank: 8 items on a CPU rank; on a GPU as many as fill `share`
    (the run's gpu_memory_share) of the card's memory left once the model is loaded
    (`memory_for_auto_sizes`; engines.training_memory.auto_batch_size: at most 512, at most the rank's `items`).
    The rank's log says what was chosen for `name` and why, then `how_to_set`, how a user sets it instead."""
    from gpuscale.engines.training_memory import CPU_BATCH_SIZE, auto_batch_size

    if ctx.device.type != "cuda":
        size, why = CPU_BATCH_SIZE, "the CPU default"
    else:
        memory, source = memory_for_auto_sizes(ctx, share)
        size = auto_batch_size(memory, bytes_per_item, items=items, share=share)
        why = (f"{share:.0%} of {source}, at about {bytes_per_item / 2**20:.1f} MiB per {unit}, at most 512 and at "
               f"most this rank's {items}")
    print(f"{name} auto: {size} {unit}s per batch ({why}){how_to_set}", flush=True)
    return size


def use_cuda_device(device: torch.device) -> None:
    """What a gpuscale process sets before it computes on a GPU: the device, and attention off cuDNN
    (`avoid_cudnn_attention`). The ranks and the tuner's trials (recipes/shared/device_trials.py) both
    start here, so that a trial times the kernels its run will use (trials that left attention on cuDNN
    read sft's batch 2 three times slower than batch 1 on an H200 and chose batch 1: bench/RESULTS.md)."""
    torch.cuda.set_device(device)
    avoid_cudnn_attention()
    quiet_unused_liger_backends()


def avoid_cudnn_attention() -> None:
    """Keep torch's scaled_dot_product_attention off its cuDNN kernels on this rank.

    On Hopper, for bf16 inputs with a padding mask (every left-padded GRPO or SFT batch), torch picks
    cuDNN attention, whose backward returned non-finite query gradients on a real micro-batch of the
    embedded model while its forward, and the memory-efficient and math kernels' backward on the same
    batch and weights, were finite (bench/bf16_diagnosis.py --replay; bench/RESULTS.md). One such
    value spreads to every gradient through clipping, and the run's weights turn NaN. The
    memory-efficient kernel takes its place (flash attention still serves batches without a mask)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


# liger-kernel's dispatcher imports every backend it knows for an op on the op's first call, and logs a
# warning through this logger for each that does not import: `Backend impl
# 'liger_kernel.ops.backends._cutedsl.rms_norm' for op 'rms_norm' could not be imported:
# ModuleNotFoundError: ...`, for CuTe DSL, Ascend NPU and cuTile, a dozen lines in every training run's
# log. gpuscale uses its Triton kernels (recipes/shared/training.py:apply_liger_kernels), so only a
# Triton backend that fails says something; the others' missing packages are expected.
LIGER_DISPATCH_LOGGER = "liger_kernel.backends.registry"
LIGER_USED_BACKEND = "._triton."
NOT_INSTALLED = ("ImportError", "ModuleNotFoundError")


class UnusedLigerBackends(logging.Filter):
    """Drops liger's warning that a backend gpuscale does not use could not be imported; every other
    record of its logger (a Triton backend that fails, any other warning) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        unused_import = (str(record.msg).startswith("Backend impl ") and len(args) == 4
                         and LIGER_USED_BACKEND not in str(args[0]) and args[2] in NOT_INSTALLED)
        return not unused_import


def quiet_unused_liger_backends() -> None:
    """Keep liger's lines about backends that are not installed out of the rank's log (once a process)."""
    logger = logging.getLogger(LIGER_DISPATCH_LOGGER)
    if not any(isinstance(f, UnusedLigerBackends) for f in logger.filters):
        logger.addFilter(UnusedLigerBackends())


def _redirect_output(run_dir: Path, rank: int) -> None:
    """Send this rank's stdout and stderr (Python's and C++'s) to its own log file."""
    log_path = RunDir(run_dir).log(rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log_fd, 1), os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


# Errors whose message is already one line for the user: shown as they are, without the class's path.
USER_ERRORS = (NonFiniteFigure, SettingsError, DataError, ModelError)


def _write_error(run_dir: Path, rank: int, exc: BaseException) -> None:
    lines = traceback.format_exception_only(type(exc), exc)
    record = {
        "t": time.time(),
        "rank": rank,
        "type": type(exc).__name__,
        # A diverged run's message is already the line to show (step, figure, what to try), and so is a
        # setting the rank refuses (`field: value: why`, as the front ends refuse one before launch) and
        # data or a model it cannot load (file, line, reason).
        "message": str(exc) if isinstance(exc, USER_ERRORS) else lines[-1].strip(),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    path = RunDir(run_dir).error(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def read_settings(settings_cls: type[RunSettings], settings_path: Path) -> RunSettings:
    """The run's settings as the front end wrote them, validated again here: a value the rank
    refuses (a file gone since the launch) is one SettingsError line, `field: value: why`, the error
    the run records, not pydantic's report of several lines."""
    try:
        return settings_cls.model_validate_json(settings_path.read_text())
    except ValidationError as exc:
        raise SettingsError(f"{settings_path}: {describe_validation_error(exc)}") from None


RankWork = Callable[[RunSettings, RankContext, Reporter], None]


def run_rank(settings_cls: type[RunSettings], main: RankWork, settings_path: str | Path,
             side: RankWork | None = None, imports: tuple[str, ...] = ()) -> None:
    """The body of one rank: `main(settings, ctx, reporter)` with everything around it; on a side rank
    (outside the training world: `RankContext.on_side`), `side(settings, ctx, reporter)` instead.
    `imports`: modules the work imports, made before it starts (`freeze_imports`)."""
    # If torchrun (or the supervisor, for a run without a launcher) dies without cleaning up (SIGKILL),
    # the kernel kills this rank too.
    die_with_parent(signal.SIGKILL)
    settings_path = Path(settings_path)
    run_dir = settings_path.parent
    rank = int(os.environ.get("RANK", 0))
    _redirect_output(run_dir, rank)
    quiet_unused_liger_backends()
    reporter = Reporter(run_dir, rank)
    status = 0
    preemption.install()  # SIGUSR1: write a checkpoint where the recipe can, and end (engines/preemption.py)
    answer_stack_requests(run_dir, rank)
    try:
        settings = read_settings(settings_cls, settings_path)
        ctx = init_rank(settings, run_dir)
        freeze_imports(imports)
        if ctx.device.type == "cuda":
            reporter.phases.use_cuda(ctx.device)  # the step phases' marks: CUDA events, no sync in a step
        if dist.is_initialized():
            step_phases.time_collectives(dist)  # the wait for the other ranks, a phase of its own
        role = f" (a side rank beside {ctx.world_size} training)" if ctx.on_side else f"/{ctx.world_size}"
        print(f"rank {rank}{role} on {ctx.device} ({ctx.dtype}), pid {os.getpid()}", flush=True)
        if ctx.on_side and side is None:
            raise SettingsError(f"rank {rank}: a side rank, and the recipe has no side work")
        (side if ctx.on_side else main)(settings, ctx, reporter)
        if dist.is_initialized():
            dist.barrier()  # leave together: no rank tears its group down under a peer's collective
    except preemption.Preempted as ended:
        # Not an error: the run ends as asked. No barrier: outside a loop that checkpoints, a peer
        # may already be gone.
        print(f"rank {rank}: {ended}", flush=True)
        if rank == 0:
            RunDir(run_dir).preempted.write_text(json.dumps({"step": ended.step, "checkpoint": ended.checkpoint}))
    except BaseException as exc:
        _write_error(run_dir, rank, exc)
        traceback.print_exc()
        status = 1
    finally:
        reporter.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_without_finalization(status)


def freeze_imports(modules: tuple[str, ...]) -> None:
    """Import `modules`, then keep every object made so far out of the cyclic collector's sight
    (gc.freeze: never scanned again, still freed by reference counting) and turn the collector on.

    A rank's imports (torch, transformers, TRL, what they load) make hundreds of thousands of objects that
    live as long as it does. The collector went over all of them at each full collection: several while
    they were being made, and then at every gc.collect() a recipe or a library calls (a held-out
    evaluation's before and after, accelerate's as training starts). Frozen, a small run costs 10-12%
    fewer CPU-seconds (bench/RESULTS.md, "CPU commands of README"). recipes/__main__.py
    starts a rank with the collector off; this runs once the rank's world is set up (init_rank: nothing
    imports transformers before training_world has settled the environment), before its work: besides
    modules, only the settings, the context, the reporter and the process group exist, which live as long
    as the rank, so nothing the work makes and drops is frozen. The garbage the imports left (some 10,000
    objects, 7 MB) is collected first, so none of it is kept."""
    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.enable()


def answer_stack_requests(run_dir: Path, rank: int) -> None:
    """On STACKS_SIGNAL, write every thread's Python stack to RunDir.stacks(rank): the supervisor of a
    run that stopped advancing asks for them before it ends the run (control/hang_watch.py).
    faulthandler writes from the signal handler itself, so a rank blocked in a collective answers too."""
    path = RunDir(run_dir).stacks(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Kept open for the rank's life (faulthandler holds it); empty unless asked, and then removed.
    faulthandler.register(heartbeat.STACKS_SIGNAL, file=open(path, "w"), all_threads=True)  # noqa: SIM115


def _exit_without_finalization(status: int) -> None:
    """End the rank now, its files flushed, skipping the interpreter's finalization. Gloo's worker
    threads can still hold tensors when Python tears itself down; freeing them then takes the GIL of
    a dying interpreter and the rank aborts ("terminate called without an active exception", SIGABRT)
    after its work, summary and barrier were done, and the run counted as failed (seen in CI and once
    in a full local test run; never reproduced alone, so the cause is the one pytorch/pytorch#179291
    describes, not one measured here). The two-node test has failed once since, its cause not
    recorded: this exit is not shown to be the whole story. Everything a rank leaves is already
    written and closed by here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
