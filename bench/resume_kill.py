"""One grpo-mtl run whose supervisor is killed with SIGKILL once it has saved a checkpoint, then
`gpuscale resume` to its end: the GPU demonstration of checkpoints and resume.

    python bench/resume_kill.py [--gpus all] [--checkpoint-every 50] [--set key=value ...] [--home DIR]

What it does, through the real CLI and nothing else:
1. `gpuscale run --recipe grpo-mtl --detach --json --set checkpoint_every=N ...`: the run's supervisor
   (`python -m gpuscale.control.supervisor`, in a session of its own) starts the launcher and the ranks;
   nothing follows the run, so no front end cleans up behind it.
2. Waits until the first complete checkpoint (RUN_DIR/checkpoints/checkpoint-<step>/ with TRL's
   trainer_state.json) is there, then sends SIGKILL to the supervisor, whose pid the store holds
   (`gpuscale show ID --json`: supervisor_pid). Not to the ranks.
3. Watches the run's processes (every process carrying the run's mark, gpuscale.runs.process): the
   launcher dies with the supervisor and the ranks with the launcher (PR_SET_PDEATHSIG; a run of one
   rank has no launcher, and its rank dies with the supervisor), so none may remain, before any front
   end has read the store.
4. `gpuscale show ID --json`: reading the store marks the run lost (launch.reconcile).
5. `gpuscale resume ID --json` to the end: a new run naming the parent, from its newest checkpoint.

The result (bench/record.py's schema, under bench/results/grpo_mtl/resume-kill-<date>-<card>.json):
parent and child ids and statuses, the step of the checkpoint the child started from, the step the
parent had logged when killed, the child's final step and max_steps, wall times (parent to the
checkpoint, to the kill, the processes' exit after it, the child), the rank processes left behind
(none expected), the child's accuracy figures (before and after, greedy and sampled) and whether its
model was saved (RUN_DIR/model/model.safetensors).

Quick check on CPU (2 CPU ranks, a handful of steps, about a minute on 2 cores):

    python bench/resume_kill.py --gpus 2 --checkpoint-every 2 --set max_steps=6 --set eval_examples=4 \\
        --set max_examples=16 --set prompts_per_step=4 --set num_generations=4 --set batch_size=4 \\
        --set max_completion_length=16 --home /tmp/resume-kill --out /tmp/resume-kill.json

On the GPUs, with the recipe's defaults (200 steps, a checkpoint every 50):

    python bench/resume_kill.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import ROOT, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))  # gpuscale from this checkout when run as a script
from gpuscale.control.store import Store  # noqa: E402
from gpuscale.runs.checkpoints import checkpoint_step, list_checkpoints  # noqa: E402
from gpuscale.runs.heartbeat import BEAT_KEY  # noqa: E402
from gpuscale.runs.process import process_alive, run_processes  # noqa: E402
from gpuscale.runs.statuses import LIVE_STATUSES  # noqa: E402

ACCURACIES = ("accuracy_greedy_before", "accuracy_greedy_after", "accuracy_sampled_before", "accuracy_sampled_after")


def cli(*arguments: str, timeout: float | None = None, env: dict | None = None) -> tuple[int, dict | None, str]:
    """`gpuscale ARGS --json`: (exit code, the printed JSON or None, stderr); `env`: this process's
    environment by default (bench/faults.py gives each case its own GPUSCALE_HOME)."""
    done = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", *arguments, "--json"], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)
    try:
        printed = json.loads(done.stdout)
    except json.JSONDecodeError:
        printed = None
    return done.returncode, printed, done.stderr.strip()


def show(run_id: int) -> dict:
    code, run, error = cli("show", str(run_id))
    if run is None:
        raise SystemExit(f"gpuscale show {run_id}: exit {code}: {error[-500:]}")
    return run


def stored(run_id: int) -> dict:
    """The run's row as the store holds it now (read only: nothing reconciled), supervisor_started too."""
    return Store.for_reading().get_run(run_id)


def wait_for_checkpoint(run_id: int, run_dir: str, timeout: float) -> Path:
    """The first complete checkpoint of the run, looked for every 0.1 s (a tiny CPU run takes about a
    second a step); exits if the run ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    next_status = 0.0
    while time.monotonic() < deadline:
        found = list_checkpoints(run_dir)
        if found:
            return found[0]
        if time.monotonic() >= next_status:
            run = stored(run_id)
            if run["status"] not in LIVE_STATUSES:
                raise SystemExit(f"run {run_id} {run['status']} before its first checkpoint: {run['error']}")
            next_status = time.monotonic() + 2.0
        time.sleep(0.1)
    raise SystemExit(f"run {run_id}: no checkpoint after {timeout:.0f} s (checkpoint_every too large?)")


def is_supervisor_of(pid: int, run_id: int) -> bool:
    """Whether `pid` is `python -m gpuscale.control.supervisor RUN_ID ...`."""
    import psutil

    try:
        command = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return "gpuscale.control.supervisor" in command and str(run_id) in command


def logged_steps(run_dir: str) -> list[int]:
    """The optimizer steps rank 0 logged (its metrics file), in order."""
    path = Path(run_dir) / "metrics" / "rank0.jsonl"
    steps = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the kill
            # Heartbeats (runs/heartbeat.py) say where a rank is, not a step it logged.
            if "summary" not in record and "total" not in record and BEAT_KEY not in record:
                steps.append(int(record.get("step", 0)))
    return steps


def describe(processes) -> list[str]:
    shown = []
    for proc in processes:
        try:
            shown.append(f"{proc.pid} {' '.join(proc.cmdline()[:6])}")
        except Exception:  # gone meanwhile
            shown.append(str(proc.pid))
    return shown


BASELINE = """No baseline: a demonstration that a killed run resumes from its checkpoint; nothing is compared."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="all", help="GPUs of the run (a count: CPU ranks where there is no GPU)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="optimizer steps between checkpoints")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the run (repeatable): tiny ones for a quick check on CPU")
    parser.add_argument("--checkpoint-timeout", type=float, default=3600,
                        help="seconds to wait for the first checkpoint")
    parser.add_argument("--exit-timeout", type=float, default=30,
                        help="seconds the run's processes get to die after the supervisor's SIGKILL")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/grpo_mtl/resume-kill-<date>-<card>.json")
    args = parser.parse_args()
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    os.environ["GPUSCALE_HOME"] = str(Path(args.home or tempfile.mkdtemp(prefix="gpuscale-resume-kill-")).resolve())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    arguments = ["--recipe", "grpo-mtl", "--gpus", args.gpus, "--set", f"checkpoint_every={args.checkpoint_every}"]
    for assignment in args.assignments:
        arguments += ["--set", assignment]
    print("$ gpuscale run", " ".join(arguments), "--detach", flush=True)
    started = time.monotonic()
    code, printed, error = cli("run", *arguments, "--detach")
    if code != 0 or not printed:
        raise SystemExit(f"gpuscale run: exit {code}: {error[-1000:]}")
    parent_id = int(printed["id"])
    parent = show(parent_id)
    run_dir = parent["run_dir"]

    # 1. Its first checkpoint.
    first = wait_for_checkpoint(parent_id, run_dir, args.checkpoint_timeout)
    to_checkpoint = time.monotonic() - started
    print(f"run {parent_id}: {first.name} after {to_checkpoint:.1f} s", flush=True)

    # 2. SIGKILL to its supervisor, the process the store names (checked to be it: pid and start time).
    row = stored(parent_id)
    pid = row["supervisor_pid"]
    if not (process_alive(pid, row["supervisor_started"]) and is_supervisor_of(pid, parent_id)):
        raise SystemExit(f"run {parent_id}: its supervisor (pid {pid}) is not running ({row['status']})")
    before_kill = run_processes(run_dir)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    steps_at_kill = max(logged_steps(run_dir), default=None)
    print(f"run {parent_id}: SIGKILL to supervisor pid {pid} at step {steps_at_kill}, "
          f"{len(before_kill)} run process(es) alive", flush=True)

    # 3. The launcher and the ranks must go by themselves (no front end has looked yet).
    deadline = killed_at + args.exit_timeout
    left = run_processes(run_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = run_processes(run_dir)
    processes_gone_s = time.monotonic() - killed_at if not left else None
    left_behind = describe(left)
    if left_behind:
        print(f"run {parent_id}: still alive {args.exit_timeout:.0f} s after the kill: {left_behind}", flush=True)

    # 4. The next read of the store marks it lost (and kills whatever was left).
    parent = show(parent_id)
    remaining = describe(run_processes(run_dir))
    checkpoints = [p.name for p in list_checkpoints(run_dir)]
    print(f"run {parent_id}: {parent['status']} ({parent['error']}); checkpoints {checkpoints}", flush=True)
    if parent["status"] not in ("lost", "failed"):
        raise SystemExit(f"run {parent_id} is {parent['status']} after its supervisor's SIGKILL, not lost")

    # 5. Resume to the end.
    print(f"$ gpuscale resume {parent_id}", flush=True)
    resumed_at = time.monotonic()
    code, child, error = cli("resume", str(parent_id))
    child_seconds = time.monotonic() - resumed_at
    if child is None:
        raise SystemExit(f"gpuscale resume {parent_id}: exit {code}: {error[-1000:]}")
    summary = child.get("summary") or {}
    child_steps = logged_steps(child["run_dir"]) if child.get("run_dir") else []
    resumed_from = (child.get("settings") or {}).get("resume_from")
    model_dir = summary.get("model_dir")
    settings = child.get("settings") or {}
    figures = {
        "parent_id": parent_id, "child_id": child["id"], "child_parent_id": child.get("parent_id"),
        "parent_status": parent["status"], "parent_error": parent["error"], "child_status": child["status"],
        "child_error": child.get("error"), "child_exit_code": code,
        "first_checkpoint_step": checkpoint_step(first),
        "checkpoints_at_resume": checkpoints,
        "resumed_from": resumed_from, "resumed_from_step": checkpoint_step(resumed_from) if resumed_from else None,
        "parent_step_at_kill": steps_at_kill, "child_final_step": summary.get("steps"),
        "max_steps": settings.get("max_steps"), "world_size": summary.get("world_size"),
        "supervisor_pid": pid, "run_processes_at_kill": len(before_kill),
        "processes_left_after_kill": left_behind, "processes_left_after_reconcile": remaining,
        "processes_gone_s": processes_gone_s,
        "parent_to_checkpoint_s": to_checkpoint, "parent_to_kill_s": killed_at - started,
        "child_wall_s": child_seconds, "total_wall_s": time.monotonic() - started,
        **{f"child_{name}": summary.get(name) for name in ACCURACIES},
        "parent_accuracy_greedy_before": (parent.get("summary") or {}).get("accuracy_greedy_before"),
        "child_model_dir": model_dir,
        "child_model_saved": bool(model_dir) and (Path(model_dir) / "model.safetensors").is_file(),
        "child_first_logged_step": min(child_steps, default=None),
        "child_last_logged_step": max(child_steps, default=None),
    }
    print_report(figures)
    write_result("grpo_mtl", "resume-kill", {**vars(args), "run_arguments": arguments,
                                             "run_settings": settings}, figures, out=args.out)
    ok = (child["status"] == "succeeded" and not left_behind and not remaining
          and figures["child_final_step"] == figures["max_steps"])
    sys.exit(0 if ok else 1)


def print_report(f: dict) -> None:
    def pct(value):
        return f"{100 * value:.1f}" if isinstance(value, (int, float)) else "-"

    gone = f"{f['processes_gone_s']:.1f} s" if f["processes_gone_s"] is not None else "NOT ALL"
    print(f"\nparent run {f['parent_id']}: {f['parent_status']}, killed at step {f['parent_step_at_kill']} "
          f"({f['parent_to_kill_s']:.0f} s in; first checkpoint at step {f['first_checkpoint_step']} after "
          f"{f['parent_to_checkpoint_s']:.0f} s)")
    print(f"  its {f['run_processes_at_kill']} process(es) gone {gone} after the supervisor's SIGKILL; "
          f"left behind: {f['processes_left_after_kill'] or 'none'}")
    print(f"child run {f['child_id']} (parent {f['child_parent_id']}): {f['child_status']}, from step "
          f"{f['resumed_from_step']} to step {f['child_final_step']} of {f['max_steps']} in {f['child_wall_s']:.0f} s"
          + (f"; error: {f['child_error']}" if f["child_error"] else ""))
    print(f"  accuracy greedy {pct(f['child_accuracy_greedy_before'])} -> {pct(f['child_accuracy_greedy_after'])}, "
          f"sampled {pct(f['child_accuracy_sampled_before'])} -> {pct(f['child_accuracy_sampled_after'])}; "
          f"model saved: {'yes' if f['child_model_saved'] else 'no'}")


if __name__ == "__main__":
    main()
