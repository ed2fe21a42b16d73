"""Starting and stopping runs: device planning, launcher argv, the detached supervisor, SLURM scripts.

Every command is an argv list, never a shell string. A run is started by writing its settings and
row, then spawning its supervisor in a new session, so the run outlives the terminal that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from gpuscale.control import disk_space, run_queue
from gpuscale.control.store import DiskFull, Store, UnknownRun
from gpuscale.control.supervisor import DIRECT_RANK_ENV, summary_from_files
from gpuscale.runs.checkpoints import is_complete, latest_checkpoint
from gpuscale.runs.devices import DevicePlan, plan_devices
from gpuscale.runs.process import kill_run_processes, private_files, process_alive, wait_for
from gpuscale.runs.run_dir import RunDir, merge_results
from gpuscale.runs.settings import RunSettings, SettingsError, describe_validation_error
from gpuscale.runs.statuses import LIVE_STATUSES

# What a run's supervisor runs: `python -m SUPERVISOR_MODULE RUN_ID --home HOME` (doctor finds it by it).
SUPERVISOR_MODULE = "gpuscale.control.supervisor"

# ---- launcher argv --------------------------------------------------------------------------------


def torchrun_argv(settings: RunSettings, plan: DevicePlan, entry: list[str], settings_path: Path) -> list[str]:
    """torchrun's argv; `entry` is the rank's `-m module args...` (the recipe's rank_entry)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.nproc)]
    if settings.nnodes == 1 and not settings.rdzv_endpoint:
        argv += ["--standalone"]  # a free port per run: concurrent runs never collide
    else:
        argv += [
            "--nnodes", str(settings.nnodes), "--node-rank", str(settings.node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", settings.rdzv_endpoint or "localhost:29500",
            "--rdzv-id", settings.rdzv_id,
        ]
    return argv + ["--max-restarts", "0", *entry, "--settings", str(settings_path)]


def accelerate_argv(settings: RunSettings, plan: DevicePlan, entry: list[str], settings_path: Path) -> list[str]:
    """`accelerate launch`, for recipes built on TRL.

    Several processes go through `--multi_gpu`, on CPU ranks too: that launcher only hands the
    processes to torch.distributed.run (accelerate's `--cpu` with several processes wants mpirun,
    and the two flags exclude each other). A CPU rank knows it is one from the environment the
    supervisor gives it (GPUSCALE_DEVICE=cpu, no visible GPU); the TRL bridge then sets the trainer's
    `use_cpu`, and accelerate joins the gloo group the rank already started. `--main_process_port 0`
    picks a free port on one node, so concurrent runs never collide.

    `--mixed_precision no`, whatever the run's precision: the rank alone decides it. The flag only
    sets ACCELERATE_MIXED_PRECISION for the ranks, and transformers' TrainingArguments reads that
    only where neither its bf16 nor its fp16 is set. Each rank resolves `precision` on its own device
    (data/precision.py, the one rule) and sets the trainer's bf16/fp16 from it (engines/trl_bridge:
    trainer_args), so the trainer's Accelerator applies the one autocast, over the fp32 master
    weights of a full fine-tune (recipes/shared/training.py: train_model). With `no` here, a rank that
    resolved fp32 trains in fp32: never under an autocast the launcher chose without seeing the card.
    """
    processes = plan.nproc * settings.nnodes
    argv = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--num_processes", str(processes),
        "--num_machines", str(settings.nnodes), "--machine_rank", str(settings.node_rank),
        "--mixed_precision", "no",  # the rank's trainer sets bf16/fp16 itself: see above
        "--dynamo_backend", "no",
    ]
    if settings.nnodes > 1:
        host, _, port = (settings.rdzv_endpoint or "127.0.0.1:29500").rpartition(":")
        argv += ["--main_process_ip", host, "--main_process_port", port, "--rdzv_backend", "c10d"]
    if processes > 1:
        argv += ["--multi_gpu"]
        if settings.nnodes == 1:
            argv += ["--main_process_port", "0"]
    elif not plan.on_gpu:
        argv += ["--cpu"]
    return argv + [*entry, "--settings", str(settings_path)]


LAUNCHERS = {"torchrun": torchrun_argv, "accelerate": accelerate_argv}


def one_process(settings: RunSettings, plan: DevicePlan) -> bool:
    """Whether the run is one process in all: one rank, one node. Such a run starts its rank without a
    launcher (`launcher_argv`); every other keeps its launcher."""
    return plan.nproc == 1 and settings.nnodes == 1


def launcher_argv(recipe, settings: RunSettings, plan: DevicePlan, settings_path: Path) -> list[str]:
    """The run's command: the recipe's launcher, which starts the ranks, or for a run of one process in
    all (`one_process`) the rank itself, `python -m gpuscale.recipes ...`, which the supervisor starts with
    the environment the launcher would have given it (`direct_rank_environment`). A launcher of one
    process costs 2.4-3.6 s of wall and CPU time for nothing else (bench/RESULTS.md, "The test suite's
    time"). The one place that chooses between the two."""
    if one_process(settings, plan):
        return [sys.executable, *recipe.rank_entry, "--settings", str(settings_path)]
    return LAUNCHERS[recipe.launcher](settings, plan, recipe.rank_entry, settings_path)


def direct_rank_environment(recipe, settings: RunSettings, plan: DevicePlan) -> dict[str, str] | None:
    """The variables the recipe's launcher puts in the environment of its one process, for a rank
    started without it (`launcher_argv`); None for a run that keeps its launcher. The supervisor adds
    them to what it gives every run (supervisor.py:rank_environment), so that the rank's code is the
    same either way. Read off the launchers themselves (torch 2.13, accelerate 1.15): a script that
    writes its environment, under each launcher's own argv for one process (`torchrun_argv`,
    `accelerate_argv`; tests/unit/test_launch.py compares them). OMP_NUM_THREADS stays the supervisor's
    in both (torchrun sets it only for several ranks; accelerate passes on what it was given)."""
    if not one_process(settings, plan):
        return None
    return ONE_PROCESS_ENVIRONMENTS[recipe.launcher](plan)


def torchrun_one_rank_environment(plan: DevicePlan) -> dict[str, str]:
    """torchrun's: rank 0 of a world of 1, and where the rendezvous is. A world of one makes no process
    group (engines/distributed.py:init_rank), so nothing binds MASTER_PORT; it is a free port all the
    same, as --standalone picks (free at the launch: a queued run's may be taken by its start). Its
    TORCHELASTIC_* variables are left out: no gpuscale code reads them, and TORCHELASTIC_USE_AGENT_STORE
    would send a process group to its agent's store, which is not there."""
    return {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
            "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
            "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()), "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def accelerate_one_process_environment(plan: DevicePlan) -> dict[str, str]:
    """`accelerate launch`'s for one process (its simple launcher: accelerate/utils/launch.py,
    prepare_simple_launcher_cmd_env): no world variables at all, the ACCELERATE_* that accelerate_argv's
    flags say, and with --cpu two Intel OpenMP settings. On a GPU that launcher would also read a user's
    `accelerate config` file; the rank started directly does not (gpuscale gives every flag it needs)."""
    environment = {
        "ACCELERATE_USE_CPU": str(not plan.on_gpu),  # --cpu
        "ACCELERATE_MIXED_PRECISION": "no",  # --mixed_precision no
        "ACCELERATE_DYNAMO_BACKEND": "NO",  # --dynamo_backend no; the other dynamo flags' defaults below
        "ACCELERATE_DYNAMO_MODE": "default",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
        "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
    }
    if not plan.on_gpu:
        environment.update(KMP_AFFINITY="granularity=fine,compact,1,0", KMP_BLOCKTIME="1")
    return environment


ONE_PROCESS_ENVIRONMENTS = {"torchrun": torchrun_one_rank_environment, "accelerate": accelerate_one_process_environment}


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# How display_command writes a launcher's module: as its own command.
LAUNCHER_COMMANDS = {"torch.distributed.run": ["torchrun"], "accelerate.commands.launch": ["accelerate", "launch"]}


def display_command(argv: list[str]) -> str:
    """The argv as a user would type it: torchrun instead of `python -m torch.distributed.run`, and
    `python` for the interpreter of a rank started without a launcher (`python -m gpuscale.recipes ...`)."""
    shown = list(argv)
    if shown[1:2] == ["-m"] and len(shown) > 2:
        shown = [*LAUNCHER_COMMANDS.get(shown[2], ["python", "-m", shown[2]]), *shown[3:]]
    return shlex.join(shown)


# ---- start, stop, reconcile -----------------------------------------------------------------------


def start_run(store: Store, recipe, settings: RunSettings, plan: DevicePlan | None = None,
              notes: dict | None = None, label: str | None = None, parent_id: int | None = None,
              queue: bool = False) -> int:
    """Check that GPUSCALE_HOME has room for a run (`refuse_without_room`) and the run's input
    (`recipe.check`: data that does not parse, an empty data set...), then record the run and start
    its supervisor in a new session; returns the run id. Nothing is recorded or started for input the
    recipe refuses, and a run that cannot be started (a disk that fills meanwhile) leaves no row.
    `notes` are recorded with the settings in the history (e.g. `batch_size_source`, where
    `--batch-size auto` found its batch), not given to ranks; `parent_id`: the run this one continues
    (`resume_run`); `queue`: the run waits, `queued`, until its devices are free and the runs queued
    before it on them have started (control/run_queue.py)."""
    refuse_without_room(store.home)
    plan = plan or plan_devices(settings.gpus)
    if queue:
        run_queue.check_queueable(run_queue.Demand.of_plan(plan_record(plan)), settings.nnodes)
    for_ranks = run_ids_as_folders(store, settings)
    recipe.check(for_ranks)
    notes = {**(notes or {}), **questions_left_out(recipe, for_ranks), **({"queue": True} if queue else {})}
    # The history keeps the settings as the user gave them (data_from=3); the ranks read run folders.
    run_id = store.create_run(recipe.name, {**settings.model_dump(), **(notes or {})}, [], socket.gethostname(),
                              parent_id=parent_id)
    try:
        # A private run's folder and files are its user's alone, and so is what its processes write.
        with private_files(settings.private):
            supervisor = prepare_and_spawn(store, run_id, recipe, for_ranks, plan, notes, label, parent_id)
    except BaseException as error:
        forget_unstarted_run(store, run_id)
        if disk_space.is_disk_full(error):
            raise DiskFull(disk_space.disk_full_line(store.home)) from None
        raise
    _children.append(supervisor)
    return run_id


def refuse_without_room(home: Path) -> None:
    """Refuse a run (DiskFull, one line naming the file system and the room left) where GPUSCALE_HOME's
    file system holds less than a run needs to start (control/disk_space.py)."""
    if disk_space.short_of_room(home):
        raise DiskFull(disk_space.disk_full_line(home))


def prepare_and_spawn(store: Store, run_id: int, recipe, for_ranks: RunSettings, plan: DevicePlan, notes: dict,
                      label: str | None, parent_id: int | None) -> subprocess.Popen:
    """The recorded run's folder and command, then its supervisor, started in a session of its own."""
    folder = RunDir(store.get_run(run_id)["run_dir"]).make()
    settings_path = folder.settings
    settings_path.write_text(for_ranks.model_dump_json(indent=2))
    folder.plan.write_text(json.dumps(plan_record(plan, direct_rank_environment(recipe, for_ranks, plan))))
    argv = launcher_argv(recipe, for_ranks, plan, settings_path)
    store.update_run(run_id, command=argv, label=label)
    # The row's own fields, kept beside the settings: `gpuscale doctor --repair` rebuilds a lost
    # history from the run folders, and the recipe's name is nowhere else in them.
    folder.update_info(recipe=recipe.name, command=argv, host=socket.gethostname(), label=label, notes=notes or {},
                       parent_id=parent_id, created_at=store.get_run(run_id)["created_at"])
    with open(folder.supervisor_log, "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, str(run_id), "--home", str(store.home)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, preexec_fn=ignore_preemption_signal,
        )
    try:
        store.update_run(run_id, supervisor_pid=supervisor.pid)
    except BaseException:  # a supervisor the history does not know of would run unseen: it goes too
        supervisor.kill()
        supervisor.wait()
        raise
    return supervisor


def forget_unstarted_run(store: Store, run_id: int) -> None:
    """A run whose supervisor never started: its row and its folder go, as if it had been refused
    (a row left would be reconciled `lost`, started `-`). Best effort: the history or the disk that
    failed the start may fail this too, and the error that says why must reach the user."""
    with contextlib.suppress(Exception):
        store.delete_run(run_id)
    with contextlib.suppress(Exception):
        shutil.rmtree(store.home / "runs" / str(run_id), ignore_errors=True)


def plan_record(plan: DevicePlan, direct_rank_env: dict[str, str] | None = None) -> dict:
    """The device plan as plan.json holds it (what the supervisor and the queue read); for a rank
    started without a launcher, the variables the supervisor gives it (`direct_rank_environment`)."""
    record = {"nproc": plan.nproc, "gpu_indices": list(plan.gpu_indices)}
    return record if direct_rank_env is None else {**record, DIRECT_RANK_ENV: direct_rank_env}


def ignore_preemption_signal() -> None:
    """In the supervisor before exec: SIGUSR1 ignored until it takes the signal itself (SLURM may
    send it to every process of the job step, and by default it ends a process)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def run_ids_as_folders(store: Store, settings: RunSettings) -> RunSettings:
    """The settings as the ranks get them: each of `RUN_ID_FIELDS` (rft's data_from) that holds a run
    id of the history replaced by that run's folder, so that no rank opens the history. Refused
    (SettingsError naming the field) for an id the history does not hold."""
    folders = {}
    for name in settings.RUN_ID_FIELDS:
        text = str(getattr(settings, name) or "").strip()
        if not text.isdigit():
            continue  # empty, or a path already
        try:
            run = store.get_run(int(text))
        except UnknownRun:
            raise SettingsError(f"{name}: {text!r}: no run {text} in the history") from None
        if not run.get("run_dir"):
            raise SettingsError(f"{name}: {text!r}: run {text} has no run folder")
        folders[name] = str(run["run_dir"])
    return settings.model_copy(update=folders) if folders else settings


def questions_left_out(recipe, settings: RunSettings) -> dict:
    """With too_long=skip, how many of the data set's questions are left out as too long for the
    model's context (data/question_length.py) and where the first is, recorded with the run; the
    supervisor puts the count in its summary. {} when none is, or the recipe reads no questions."""
    if not getattr(recipe, "reads_questions", True) or settings.too_long != "skip":
        return {}
    from gpuscale.data.question_length import question_limit, questions_too_long

    skipped = questions_too_long(settings.dataset, question_limit(settings))
    return {"questions_too_long": len(skipped), "questions_too_long_first": skipped[0]} if skipped else {}


class ResumeRefused(SettingsError):
    """A run that cannot be resumed: one line saying why (the CLI exits 2 on it, the TUI shows it)."""


class AlreadyResumed(ResumeRefused):
    """A run that was resumed before: resuming it again would continue the same checkpoint a second
    time, so it needs `force` (the CLI's --force, the TUI's confirmation). `children`: the runs that
    continued it, oldest first."""

    def __init__(self, run_id: int, children: list[dict]):
        self.children = children
        names = ", ".join(f"run {child['id']} ({child['status']})" for child in children)
        newest = children[-1]
        # Resuming the newest child goes on from further, where that child can itself be resumed.
        further = (f"`gpuscale resume {newest['id']}` goes on from where that got, "
                   if newest["status"] in RESUMABLE_STATUSES else "")
        super().__init__(f"run {run_id} was already resumed by {names}; {further}"
                         f"`gpuscale resume {run_id} --force` resumes run {run_id} again")


RESUMABLE_STATUSES = ("stopped", "failed", "lost", "preempted")


def refuse_unless_ended(run: dict) -> None:
    """Only a stopped, failed or lost run can be resumed."""
    run_id, status = run["id"], run["status"]
    if status in LIVE_STATUSES:
        raise ResumeRefused(f"run {run_id} is {status}: only a stopped, failed or lost run can be resumed")
    if status == "succeeded":
        raise ResumeRefused(f"run {run_id} succeeded: there is nothing left to resume")


def checkpoint_of(run: dict) -> Path | None:
    """The run's newest complete checkpoint, else (a resumed run stopped before its own first
    checkpoint) the one it was itself resumed from; None if neither."""
    found = latest_checkpoint(run["run_dir"]) if run.get("run_dir") else None
    inherited = (run.get("settings") or {}).get("resume_from")
    if found is None and inherited and is_complete(inherited):
        found = Path(inherited)
    return found


def no_checkpoint(run: dict) -> ResumeRefused:
    every = (run.get("settings") or {}).get("checkpoint_every")
    if not every:
        reason = "it saved none: checkpoint_every was 0" if every == 0 else "it saved none"
    else:
        reason = f"it saved none: it stopped before step {every}, or its recipe writes no checkpoints"
    return ResumeRefused(f"run {run['id']} has no checkpoint to resume from ({reason})")


def resume_point(run: dict) -> Path:
    """The checkpoint a resume of `run` starts from (`checkpoint_of`). Refuses, with the reason, a
    run that is live, succeeded, or has no checkpoint."""
    refuse_unless_ended(run)
    found = checkpoint_of(run)
    if found is None:
        raise no_checkpoint(run)
    return found


def resume_settings(recipe, run: dict, overrides: dict | None = None) -> RunSettings:
    """The settings of a run continuing `run`: its own (as its ranks read them), then what its
    recipe continues it from besides a checkpoint (`recipe.resume_overrides`: rft's kept answers),
    `overrides` on top (`gpus` may change: the checkpoints hold nothing tied to the number of ranks),
    and `resume_from` its last checkpoint. Refused where there is neither a checkpoint nor such work."""
    refuse_unless_ended(run)
    checkpoint = checkpoint_of(run)
    kept_work = recipe.resume_overrides(run)
    if checkpoint is None and not kept_work:
        raise no_checkpoint(run)
    folder = RunDir(run["run_dir"])
    try:
        merged = json.loads(folder.settings.read_text())
    except (OSError, ValueError) as exc:
        raise ResumeRefused(f"run {run['id']}: its settings ({folder.settings}) cannot be read ({exc})") from None
    merged.update(kept_work)
    for key, value in (overrides or {}).items():
        merged[recipe.settings_cls.field_for_key(key)] = value
    merged["resume_from"] = str(checkpoint) if checkpoint else None
    try:
        return recipe.settings_cls.model_validate(merged)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from None


_PARENTS_LABEL = object()  # resume_run's default: the child carries its parent's label


def resume_run(store: Store, recipe, run: dict, overrides: dict | None = None,
               plan: DevicePlan | None = None, force: bool = False, label: str | None | object = _PARENTS_LABEL,
               notes: dict | None = None, queue: bool = False) -> int:
    """Continue a stopped, failed or lost run as a new run that names it as its parent, from its
    last checkpoint (`resume_settings`), with its label unless `label` is given; returns the new
    run's id. A run resumed before is refused (`AlreadyResumed`, naming the runs that continued it)
    unless `force`. The one way both front ends resume a run."""
    settings = resume_settings(recipe, run, overrides)
    children = store.children(run["id"])
    if children and not force:
        raise AlreadyResumed(run["id"], children)
    label = run.get("label") if label is _PARENTS_LABEL else label
    return start_run(store, recipe, settings, plan, notes=notes, label=label, parent_id=run["id"], queue=queue)


def earlier_attempt(store: Store, job_id: str, node_rank: int) -> dict | None:
    """The newest run of SLURM job `job_id` on node `node_rank` (`gpuscale run --slurm-requeue`
    records the job in the run's notes), after marking runs whose supervisor died lost; None if none."""
    reconcile(store)
    for run in store.list_runs():  # newest first
        settings = run.get("settings") or {}
        if str(settings.get("slurm_job_id")) == str(job_id) and settings.get("node_rank", 0) == node_rank:
            return run
    return None


# Supervisors this front end started; polled so that finished ones do not linger as zombies.
_children: list[subprocess.Popen] = []


def reap_children() -> None:
    _children[:] = [child for child in _children if child.poll() is None]


def wait_for_own_supervisor(run: dict, seconds: float) -> None:
    """Sleep `seconds`, or only until the run's supervisor exits where this front end started it (the
    run's end is recorded by then): `gpuscale run` returns as its run ends, not up to `seconds` later."""
    child = next((c for c in _children if c.pid == run.get("supervisor_pid") and c.poll() is None), None)
    if child is None:
        time.sleep(seconds)
        return
    try:
        child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def stop_run(store: Store, run_id: int, timeout: float = 15.0) -> dict:
    """SIGTERM the run's supervisor, which stops the ranks; returns the run once it has ended."""
    run = store.get_run(run_id)
    if run["status"] not in LIVE_STATUSES:
        return run
    if process_alive(run["supervisor_pid"], run["supervisor_started"]):
        os.kill(run["supervisor_pid"], signal.SIGTERM)
        wait_for(lambda: _ended(store, run_id), timeout)
    if not _ended(store, run_id):
        reconcile(store)
    return store.get_run(run_id)


def _ended(store: Store, run_id: int) -> bool:
    reap_children()
    return store.get_run(run_id)["status"] not in LIVE_STATUSES


QUEUED_GRACE_S = 60.0


def reconcile(store: Store) -> list[int]:
    """Mark runs whose supervisor died as `lost` (`failed` on a full disk: `dead_supervisor_end`) and
    kill whatever is left of them; the rows their ranks finished are merged into results.jsonl and
    their summary gives the figures so far (marked partial), as the supervisor would have done.

    Every front end calls this before it shows runs; a read-only history is left as it is. Returns
    the ids it marked lost.
    """
    reap_children()
    if store.read_only:
        return []
    lost = []
    for run in store.live_runs():
        if process_alive(run["supervisor_pid"], run["supervisor_started"]):
            continue
        if run["supervisor_pid"] is None and time.time() - run["created_at"] < QUEUED_GRACE_S:
            continue  # its front end is still starting the supervisor
        if run["supervisor_started"] is None and process_alive(run["supervisor_pid"], None):
            continue  # started but not yet registered itself
        if run["run_dir"] and (ended := RunDir(run["run_dir"]).read_info().get("ended")):
            # Its supervisor recorded the end in the folder but not here: the history was replaced
            # meanwhile (`doctor --repair`), or it died between the two writes.
            store.finish_run(run["id"], **recorded_end(ended))
            continue
        end = dead_supervisor_end(store, run)
        if run["run_dir"]:
            kill_run_processes(run["run_dir"])  # first: no rank may still be writing
            disk_space.free_room(RunDir(run["run_dir"]).room_reserve)  # the supervisor's, to record the end in
            with contextlib.suppress(OSError):  # a full disk: what was finished stays in the ranks' files
                merge_results(run["run_dir"])
            end["summary"] = {**end["summary"], **summary_from_files(run["run_dir"], run["id"])}
            RunDir(run["run_dir"]).try_record_end(**end)  # on a full disk, the history alone holds the end
        if store.finish_run(run["id"], **end):
            lost.append(run["id"])
    return lost


def dead_supervisor_end(store: Store, run: dict) -> dict:
    """How a run whose supervisor died ended: `lost`; `failed` where GPUSCALE_HOME's file system is
    full (the supervisor died of it, or could not record the run's end), saying so in one line."""
    died = f"supervisor (pid {run['supervisor_pid']}) died; the run's processes were killed"
    if run_queue.waits_in_queue(run):
        died = f"supervisor (pid {run['supervisor_pid']}) died while the run was queued; it never started"
    end = {"status": "lost", "error": died, "summary": run["summary"] or {}}
    if disk_space.short_of_room(run["run_dir"] or store.home):
        end.update(status="failed", error=disk_space.disk_full_line(store.home),
                   hint=f"the disk filled during the run: its {died}")
    return end


def recorded_end(ended: dict) -> dict:
    """run.json's `ended` record (RunDir.record_end) as the fields of the history's row."""
    fields = ("status", "ended_at", "error", "hint", "exit_code", "summary", "progress")
    return {key: ended[key] for key in fields if key in ended}


# ---- SLURM ---------------------------------------------------------------------------------------


# What SLURM takes in each #SBATCH value gpuscale writes, as (pattern, what it takes in words). A value
# must match whole before anything is printed: no whitespace, control character or shell character can
# reach the script, where a newline would start a line of its own that the job's shell runs.
SLURM_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
SLURM_NAME_WORDS = "letters, digits and _ . -, a letter or digit first"
SBATCH_VALUES = {
    "time": (r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite)",
             "SLURM's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED"),
    "partition": (rf"{SLURM_NAME}(,{SLURM_NAME})*",
                  f"a partition name ({SLURM_NAME_WORDS}), or several joined by commas"),
    "account": (SLURM_NAME, f"an account name ({SLURM_NAME_WORDS})"),
    "qos": (SLURM_NAME, f"a QOS name ({SLURM_NAME_WORDS})"),
    "job-name": (SLURM_NAME, f"a job name ({SLURM_NAME_WORDS})"),
}
DEFAULT_TIME_LIMIT = "04:00:00"


def checked_sbatch_value(option: str, value: str) -> str:
    """`value` for `#SBATCH --OPTION=`, or SettingsError naming the option, the value and what SLURM takes."""
    pattern, takes = SBATCH_VALUES[option]
    if not re.fullmatch(pattern, value, re.ASCII):  # ASCII: \d is 0-9 alone, as SLURM reads it
        raise SettingsError(f"{option}: {value!r}: expected {takes}")
    return value


def sbatch_script(recipe_name: str, nodes: int, gpus_per_node: int, run_args: list[str],
                  slurm_options: dict[str, str | None] | None = None, port: int = 29500,
                  requeue_margin_s: int | None = None) -> str:
    """A batch script: one `gpuscale run` per node through srun, rendezvous on the first node.
    `slurm_options`: #SBATCH values by option name (time, partition, account, qos; None: not given),
    each checked against SLURM's syntax (`checked_sbatch_value`); `run_args` go into the command
    quoted, whatever they hold. `requeue_margin_s`: a job that checkpoints and requeues itself that
    many seconds before its time limit (`requeue_lines`)."""
    options = {"job-name": f"gpuscale-{recipe_name}", "time": DEFAULT_TIME_LIMIT, **(slurm_options or {})}
    given = {option: checked_sbatch_value(option, value) for option, value in options.items() if value is not None}
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={given.pop('job-name')}",
        f"#SBATCH --nodes={int(nodes)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={int(gpus_per_node)}",
        *(f"#SBATCH --{option}={value}" for option, value in given.items()),
        "#SBATCH --output=gpuscale-%j.out",
    ]
    if requeue_margin_s is not None:
        # USR1 to the batch shell (B:) alone: srun passes it to each node's `gpuscale run` (below).
        head += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{int(requeue_margin_s)}"]
        run_args = [*run_args, "--slurm-requeue"]
    run = shlex.join(
        ["gpuscale", "run", "--recipe", recipe_name, "--gpus", str(gpus_per_node), "--nnodes", str(nodes), *run_args]
    )
    body = [
        "set -euo pipefail",
        "# The first node of the allocation hosts the c10d rendezvous; every node runs one gpuscale run,",
        "# which starts torchrun there. Each task appends its own node rank (SLURM_NODEID) to the command.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "srun --kill-on-bad-exit=1 bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"' node \\",
        f'  {run} \\',
        f'  --rdzv-endpoint "$head_node:{int(port)}" --set rdzv_id="$SLURM_JOB_ID"',
    ]
    if requeue_margin_s is not None:
        body = requeue_lines(body)
    return "\n".join(head + [""] + body) + "\n"


def requeue_lines(body: list[str]) -> list[str]:
    """The batch script's body for `--requeue`: srun in the background, so that the shell can take
    SLURM's USR1 (bash runs a trap only between commands, and `wait` is one it interrupts). On USR1
    it passes the signal to srun, which passes it to each node's `gpuscale run` (its supervisor then to
    the ranks: they write a checkpoint and the run ends `preempted`), waits for them, and requeues the
    job: SLURM requeues on its own only for a node failure or a preemption, never at the time limit.
    The requeued job runs this script again (same SLURM_JOB_ID, SLURM_RESTART_COUNT > 0), and
    `gpuscale run --slurm-requeue` continues each node's run from its checkpoint."""
    *before, last = body
    return [
        *before,
        f"{last} &",
        "step=$!",
        "requeue() {",
        '  echo "USR1 from SLURM: the runs write a checkpoint and end; then the job is requeued"',
        '  kill -USR1 "$step" || true',
        '  wait "$step" || true',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "}",
        "trap requeue USR1",
        'wait "$step"',
    ]
