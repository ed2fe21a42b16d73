"""A rank frozen (SIGSTOP) or killed (SIGKILL) in a real run: how long until the run ends, and how.

    python bench/faults.py [--cases sft-stop,sft-kill,grpo-stop,grpo-kill] [--gpus 2] [--model M]
                           [--hang-timeout 30] [--at-step 10] [--set [RECIPE:]KEY=VALUE ...] [--parallel]

Each case is a real `gpuscale run --detach` (CLI, supervisor, torchrun or accelerate, the ranks) in a
GPUSCALE_HOME of its own, with `hang_timeout`, a large max_steps (the run must not end first) and
`checkpoint_every` = --at-step. Once the history (the Store's metrics) shows every rank past step
--at-step (and, for a `stop` case, past the checkpoint written there, so that the fault does not land
in a save, which has a longer allowance), the script signals one rank (--rank, 1 by default; its
process is the run's process carrying that RANK, gpuscale.runs.process):

- `stop`: SIGSTOP. Measured: the seconds from the SIGSTOP to the run's end in the history, and to the
  supervisor's RUN_DIR/errors/hung.json; whether a `late` warning was live before. Checked: the run
  ended `failed`, its error starts `hung: rank R made no progress`, every other rank's stacks file is in
  RUN_DIR/errors/, no process of the run is left; then `gpuscale resume ID --set max_steps=C+N` (C the
  newest checkpoint's step, N --resume-steps) must succeed from that checkpoint and reach its max_steps,
  its resume check not failed.
  Verdict: all of that, the end within hang_timeout + 30 s.
- `kill`: SIGKILL. Measured: the seconds until every other rank process is gone, until no process of
  the run is left, and until the run's end. Checked: the error starts `rank R:`. Verdict: the other
  ranks gone within 10 s.

With --parallel the cases run at once, each on its own GPUs (--gpus of them from --gpu-ids, a case
waiting until enough are free); on CPU they share the cores. The result (bench/record.py's schema)
goes to bench/results/faults/faults-<date>-<card>.json (the card: the GPUs of one case); one line a
case is printed, and the exit code is 1 unless every case passed. With --partial FILE each case's
figures are appended to FILE as it ends, so that a call cut by its time limit keeps the cases it
finished; --from-partial FILE... runs nothing and writes the result of the cases such files hold.

On CPU (2 gloo ranks of tiny-math; the test's sizes):

    python bench/faults.py --cases sft-stop,sft-kill --gpus 2 --model tiny-math --hang-timeout 20 --at-step 4 \\
        --set batch_size=2 --set max_examples=64 --set eval_examples=2 --set sft:max_length=64 \\
        --set sft:max_new_tokens=8 --json /tmp/faults-cpu.json

On the GPUs (random-qwen2.5-0.5b, 2 then 4 GPUs a case):

    python bench/faults.py --gpus 2 --parallel
    python bench/faults.py --gpus 4 --parallel
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import ROOT, card, write_result  # noqa: E402
from resume_kill import cli, describe  # noqa: E402

sys.path.insert(0, str(ROOT))  # gpuscale from this checkout when run as a script
import psutil  # noqa: E402

from gpuscale.control.launch import stop_run  # noqa: E402
from gpuscale.control.store import Store  # noqa: E402
from gpuscale.control.supervisor import RANK_MODULE  # noqa: E402
from gpuscale.runs.checkpoints import checkpoint_step, latest_checkpoint, list_checkpoints  # noqa: E402
from gpuscale.runs.devices import visible_gpu_indices  # noqa: E402
from gpuscale.runs.process import process_alive, run_processes, wait_for  # noqa: E402
from gpuscale.runs.resume_check import check_failed, check_line  # noqa: E402
from gpuscale.runs.run_dir import RunDir  # noqa: E402
from gpuscale.runs.statuses import LIVE_STATUSES  # noqa: E402

BASELINE = "No baseline: the issue's targets are absolute (hang_timeout + 30 s for a frozen rank, 10 s for a dead one)."


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str
    fault: str  # "stop" or "kill"


CASES = {case.name: case for case in (Case("sft-stop", "sft", "stop"), Case("sft-kill", "sft", "kill"),
                                      Case("grpo-stop", "grpo-mtl", "stop"), Case("grpo-kill", "grpo-mtl", "kill"))}
STOP_MARGIN_S = 30.0  # the target: a frozen rank's run ends within hang_timeout + 30 s
KILL_LIMIT_S = 10.0  # and a dead rank's peers within 10 s
GIVE_UP_AFTER_S = 90.0  # past its limit, a case stops waiting for the run to end and stops it itself


class CaseError(RuntimeError):
    """A case that could not reach its fault (the run ended first, no checkpoint...)."""


# ---- the run's processes and progress ----------------------------------------------------------------

def rank_processes(run_dir: Path) -> dict[int, psutil.Process]:
    """The run's rank processes by rank (the launcher and a rank's helpers carry no RANK of their own)."""
    found = {}
    for proc in run_processes(str(run_dir)):
        try:
            if RANK_MODULE in proc.cmdline() and "RANK" in (env := proc.environ()):
                found[int(env["RANK"])] = proc
        except (psutil.Error, ValueError):
            pass
    return found


class Progress:
    """Each rank's highest logged step, read from the history a little at a time."""

    def __init__(self, store: Store, run_id: int):
        self.store, self.run_id = store, run_id
        self.steps: dict[int, int] = {}
        self.since = float("-inf")

    def update(self) -> dict[int, int]:
        for metric in self.store.metrics(self.run_id, since=self.since):
            self.steps[metric["rank"]] = max(self.steps.get(metric["rank"], 0), metric["step"])
            self.since = max(self.since, metric["t"])
        return self.steps


def wait_for_fault_point(store: Store, run_id: int, run_dir: Path, ranks: int, at_step: int, after_checkpoint: bool,
                         timeout: float) -> tuple[dict[int, int], Path | None]:
    """Waits until every rank logged a step past `at_step` (with `after_checkpoint`, once the checkpoint
    of that step is complete too): the ranks' steps then, and that checkpoint. The history lags the ranks
    by a tick: a fast run is a few steps further, well before its next checkpoint (2 x at_step)."""
    progress, deadline = Progress(store, run_id), time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = store.get_run(run_id)
        if run["status"] not in LIVE_STATUSES:
            raise CaseError(f"run {run_id} {run['status']} before step {at_step}: {run['error']}")
        steps = progress.update()
        of_ranks = {rank: steps[rank] for rank in range(ranks) if rank in steps}  # rank -1: the run's own lines
        checkpoint = first_checkpoint(run_dir, at_step) if after_checkpoint else None
        if (checkpoint or not after_checkpoint) and len(of_ranks) == ranks and min(of_ranks.values()) > at_step:
            return of_ranks, checkpoint
        time.sleep(0.1)
    raise CaseError(f"run {run_id}: not every rank past step {at_step} (and a checkpoint) after {timeout:.0f} s")


def first_checkpoint(run_dir: Path, at_step: int) -> Path | None:
    """The run's first complete checkpoint of `at_step` or later."""
    return next((path for path in list_checkpoints(run_dir) if checkpoint_step(path) >= at_step), None)


def wait_for_end(store: Store, run_id: int, timeout: float) -> tuple[dict, float | None]:
    """The run once it ended (the seconds it took, from now), or as it is when `timeout` runs out (None);
    also the seconds until the history first held a `late` warning, in the run's `late_s`."""
    started, late_s = time.monotonic(), None
    while time.monotonic() - started < timeout:
        run = store.get_run(run_id)
        if late_s is None and (run.get("progress") or {}).get("late"):
            late_s = time.monotonic() - started
        if run["status"] not in LIVE_STATUSES:
            return {**run, "late_s": late_s}, time.monotonic() - started
        time.sleep(0.1)
    return {**store.get_run(run_id), "late_s": late_s}, None


def left_behind(run_dir: Path, grace: float = 5.0) -> list[str]:
    """The run's processes still alive `grace` seconds after its end (none expected)."""
    wait_for(lambda: not run_processes(str(run_dir)), grace)
    return describe(run_processes(str(run_dir)))


# ---- the two faults -----------------------------------------------------------------------------------

def stop_case(store: Store, run_id: int, run_dir: Path, victim: psutil.Process, opts, env: dict) -> dict:
    limit = opts.hang_timeout + STOP_MARGIN_S
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_wall = time.time()
    run, took = wait_for_end(store, run_id, limit + GIVE_UP_AFTER_S)
    if took is None:  # not ended by the supervisor: stop it ourselves so nothing stays behind
        run = stop_run(Store(store.home), run_id)
    folder = RunDir(run_dir)
    hung_s = folder.hung.stat().st_mtime - stopped_wall if folder.hung.is_file() else None
    answering = [rank for rank in range(opts.gpus) if rank != opts.rank]
    figures = {
        "stop_to_end_s": took, "stop_to_hung_record_s": hung_s, "late_warning_after_s": run["late_s"],
        "limit_s": limit, "status": run["status"], "error": run["error"], "hint": run.get("hint"),
        "stacks_files": [path.name for path in folder.stacks_files()],
        "stacks_of_other_ranks": all(folder.stacks(rank).is_file() for rank in answering),
        "hung_record": json.loads(folder.hung.read_text()) if folder.hung.is_file() else None,
        "processes_left": left_behind(run_dir),
    }
    figures["resume"] = resume(run_id, run_dir, opts, env)
    figures["passed"] = bool(
        took is not None and took <= limit and run["status"] == "failed"
        and (run["error"] or "").startswith(f"hung: rank {opts.rank} made no progress")
        and figures["stacks_files"] and figures["stacks_of_other_ranks"] and not figures["processes_left"]
        and figures["resume"]["passed"])
    return figures


def resume(run_id: int, run_dir: Path, opts, env: dict) -> dict:
    """`gpuscale resume ID` from the newest checkpoint, --resume-steps past it: it must get there, its
    resume check (runs/resume_check.py) not failed."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return {"passed": False, "error": "no checkpoint to resume from"}
    max_steps = checkpoint_step(newest) + opts.resume_steps
    started = time.monotonic()
    code, child, error = cli("resume", str(run_id), "--set", f"max_steps={max_steps}", env=env,
                             timeout=opts.start_timeout)
    if child is None:
        return {"passed": False, "error": f"exit {code}: {error[-500:]}"}
    summary = child.get("summary") or {}
    resumed_from = (child.get("settings") or {}).get("resume_from")
    return {
        "run": child["id"], "status": child["status"], "error": child.get("error"),
        "wall_s": time.monotonic() - started,
        "from_checkpoint": newest.name, "resumed_from": resumed_from, "max_steps": max_steps,
        "final_step": summary.get("steps"), "resume_check": summary.get("resume_check"),
        "passed": (child["status"] == "succeeded" and resumed_from == str(newest)
                   and summary.get("steps") == max_steps and not check_failed(summary.get("resume_check"))),
    }


def kill_case(store: Store, run_id: int, run_dir: Path, victim: psutil.Process, opts, env: dict) -> dict:
    others = [proc for rank, proc in rank_processes(run_dir).items() if rank != opts.rank]
    started = {proc.pid: proc.create_time() for proc in others}
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()

    def since_kill(condition, timeout: float) -> float | None:
        return time.monotonic() - killed if wait_for(condition, timeout - (time.monotonic() - killed), 0.05) else None

    others_gone = since_kill(lambda: not any(process_alive(pid, t) for pid, t in started.items()), GIVE_UP_AFTER_S)
    all_gone = since_kill(lambda: not run_processes(str(run_dir)), GIVE_UP_AFTER_S)
    run, _ = wait_for_end(store, run_id, GIVE_UP_AFTER_S)
    ended = time.monotonic() - killed if run["status"] not in LIVE_STATUSES else None
    if ended is None:
        run = stop_run(Store(store.home), run_id)
    figures = {
        "others_gone_s": others_gone, "all_processes_gone_s": all_gone, "kill_to_end_s": ended,
        "limit_s": KILL_LIMIT_S, "other_ranks": len(others), "status": run["status"], "error": run["error"],
        "processes_left": left_behind(run_dir),
    }
    figures["passed"] = bool(
        others_gone is not None and others_gone <= KILL_LIMIT_S and run["status"] == "failed"
        and (run["error"] or "").startswith(f"rank {opts.rank}:") and not figures["processes_left"])
    return figures


FAULTS = {"stop": stop_case, "kill": kill_case}


# ---- one case, start to end ---------------------------------------------------------------------------

def run_arguments(case: Case, opts, gpus: str) -> list[str]:
    arguments = ["--recipe", case.recipe, "--gpus", gpus, "--model", opts.model,
                 "--set", f"hang_timeout={opts.hang_timeout:g}", "--set", f"checkpoint_every={opts.at_step}",
                 "--set", f"max_steps={opts.run_steps}"]
    for recipe, assignment in opts.assignments:
        if recipe in (None, case.recipe):
            arguments += ["--set", assignment]
    return arguments


def run_case(case: Case, opts, gpus: str, home: Path) -> dict:
    env = {**os.environ, "GPUSCALE_HOME": str(home)}
    arguments = run_arguments(case, opts, gpus)
    say(case, "$ gpuscale run " + " ".join(arguments) + " --detach")
    figures = {"case": case.name, "recipe": case.recipe, "fault": case.fault, "gpus": gpus, "rank": opts.rank,
               "home": str(home),
               "run_arguments": arguments}
    code, printed, error = cli("run", *arguments, "--detach", env=env, timeout=opts.start_timeout)
    if code != 0 or not printed:
        return {**figures, "passed": False, "error": f"gpuscale run: exit {code}: {error[-1000:]}"}
    store = Store(home, read_only=True)  # reading only: nothing here marks a run lost behind the supervisor
    run_id = int(printed["id"])
    run_dir = Path(store.get_run(run_id)["run_dir"])
    figures.update(run=run_id, run_dir=str(run_dir))
    try:
        steps, checkpoint = wait_for_fault_point(store, run_id, run_dir, opts.gpus, opts.at_step,
                                                 case.fault == "stop", opts.start_timeout)
        victim = rank_processes(run_dir).get(opts.rank)
        if victim is None:
            raise CaseError(f"run {run_id}: no process of rank {opts.rank}")
        figures.update(steps_at_fault=steps, fault_step=steps[opts.rank],
                       checkpoint_at_fault=checkpoint.name if checkpoint else None)
        say(case, f"run {run_id}: SIG{case.fault.upper()} to rank {opts.rank} (pid {victim.pid}) at steps {steps}")
        figures.update(FAULTS[case.fault](store, run_id, run_dir, victim, opts, env))
    except CaseError as error:
        stop_run(Store(home), run_id)
        figures.update(passed=False, error=str(error))
    say(case, verdict_line(figures))
    return figures


def verdict_line(f: dict) -> str:
    def secs(value) -> str:
        return f"{value:.1f} s" if isinstance(value, (int, float)) else "not within the wait"

    verdict = "PASS" if f["passed"] else "FAIL"
    if "limit_s" not in f:  # never got to its fault
        return f"{f['case']}: {verdict}: {f.get('error')}"
    left = f"{len(f['processes_left'])} process(es) left"
    head = f"{f['case']} ({f['gpus']}): {verdict}: rank {f['rank']} SIG{f['fault'].upper()} at step {f['fault_step']}"
    if f["fault"] == "kill":
        return (f"{head}; "
                f"other ranks gone in {secs(f['others_gone_s'])} (limit {f['limit_s']:.0f} s), every process in "
                f"{secs(f['all_processes_gone_s'])}, run {f['status']} in {secs(f['kill_to_end_s'])}; {left}; "
                f"error: {f['error']}")
    resumed = f["resume"]
    return (f"{head}; "
            f"run {f['status']} in {secs(f['stop_to_end_s'])} (limit {f['limit_s']:.0f} s; hung.json after "
            f"{secs(f['stop_to_hung_record_s'])}, late warning after {secs(f['late_warning_after_s'])}); "
            f"stacks {', '.join(f['stacks_files']) or 'none'}; {left}; resume run {resumed.get('run')} "
            f"{resumed.get('status')} from {resumed.get('from_checkpoint')} to step {resumed.get('final_step')} "
            f"of {resumed.get('max_steps')}"
            f"{'; ' + check_line(resumed['resume_check']) if resumed.get('resume_check') else ''}; error: {f['error']}")


_print_lock = threading.Lock()


def say(case: Case, line: str) -> None:
    with _print_lock:
        print(f"[{case.name}] {line}", flush=True)


# ---- the GPUs the cases share ------------------------------------------------------------------------

class GpuPool:
    """The GPUs the cases may use; a case takes `count` different ones and gives them back when done. A
    GPU named twice in --gpu-ids (0,1,0,1) is shared by two cases at once, to fit the cases into one
    call's time. Without GPUs (CPU ranks) a case takes nothing and `--gpus` is the number of ranks.
    Cases take their turn in the order they asked: otherwise one-GPU cases, each finding a GPU free, kept
    a two-GPU case waiting until a call's limit cut it (bench/gpu_counts.py on 2 x H200)."""

    def __init__(self, indices: list[int]):
        self.free, self.cpu = list(indices), not indices
        self.changed = threading.Condition()
        self.asked = 0  # the cases that asked so far: each one's ticket is its place in that order
        self.serving = 0  # the ticket whose turn it is

    def take(self, count: int) -> list[int]:
        if self.cpu:
            return []
        with self.changed:
            ticket, self.asked = self.asked, self.asked + 1
            self.changed.wait_for(lambda: self.serving == ticket and len(set(self.free)) >= count)
            taken = sorted(set(self.free))[:count]
            for index in taken:
                self.free.remove(index)
            self.serving += 1
            self.changed.notify_all()  # the next in line may find enough free already
            return taken

    def give_back(self, indices: list[int]) -> None:
        with self.changed:
            self.free = sorted(self.free + indices)
            self.changed.notify_all()


PARTIAL_LOCK = threading.Lock()


def run_on_pool(case: Case, opts, pool: GpuPool, home_root: Path) -> dict:
    taken = pool.take(opts.gpus)
    try:
        gpus = ",".join(map(str, taken)) if taken else str(opts.gpus)
        figures = run_case(case, opts, gpus, home_root / case.name)
    finally:
        pool.give_back(taken)
    if opts.partial:  # kept as it ends, with its card: a call cut by its time limit keeps the cases it finished
        with PARTIAL_LOCK, open(opts.partial, "a") as partial:
            partial.write(json.dumps({**figures, "card": case_card(opts.gpus)}) + "\n")
    return figures


def cases_from_partial(paths: list[str]) -> tuple[list[dict], dict | str | None]:
    """The cases --partial files hold, in their order (several calls' cases make one result), and the
    card the first of them ran on."""
    cases = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    cards = [case.pop("card", None) for case in cases]
    return cases, next(iter(cards), None)


def run_cases(opts) -> list[dict]:
    """Each of --cases on the pool's GPUs (at once with --parallel), in its own GPUSCALE_HOME."""
    pool = GpuPool(opts.pool)
    home_root = Path(opts.home or tempfile.mkdtemp(prefix="gpuscale-faults-")).resolve()
    cases = [CASES[name] for name in opts.cases.split(",")]
    with ThreadPoolExecutor(max_workers=len(cases) if opts.parallel else 1) as workers:
        return list(workers.map(lambda case: run_on_pool(case, opts, pool, home_root), cases))


# ---- options -----------------------------------------------------------------------------------------

def parse_assignment(text: str) -> tuple[str | None, str]:
    """`[RECIPE:]KEY=VALUE` as (RECIPE or None for every recipe, KEY=VALUE)."""
    key = text.split("=", 1)[0]
    if "=" not in text or not key.strip(":"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected [RECIPE:]KEY=VALUE")
    if ":" in key:
        recipe, rest = text.split(":", 1)
        return recipe, rest
    return None, text


def parse_options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of each case's run (CPU ranks without GPUs)")
    parser.add_argument("--gpu-ids", default=None, help="the GPUs the cases may use, e.g. 0,1,2,3 (default: all)")
    parser.add_argument("--model", default="random-qwen2.5-0.5b")
    parser.add_argument("--rank", type=int, default=1, help="the rank stopped or killed")
    parser.add_argument("--hang-timeout", type=float, default=30.0, help="the runs' hang_timeout, seconds")
    parser.add_argument("--at-step", type=int, default=10,
                        help="the fault comes once every rank is past this step (and its checkpoint: checkpoint_every)")
    parser.add_argument("--run-steps", type=int, default=1000,
                        help="the runs' max_steps: they must not end before the fault")
    parser.add_argument("--resume-steps", type=int, default=2, help="a resumed run's max_steps past its checkpoint")
    parser.add_argument("--set", dest="assignments", action="append", default=[], type=parse_assignment,
                        metavar="[RECIPE:]KEY=VALUE", help="a setting of every run, or of RECIPE's (repeatable)")
    parser.add_argument("--start-timeout", type=float, default=1800,
                        help="seconds a run may take to reach its fault point, and a resume to end")
    parser.add_argument("--parallel", action="store_true",
                        help="run the cases at once, each on its own GPUs (each in its own GPUSCALE_HOME)")
    parser.add_argument("--home", default=None,
                        help="a folder for the cases' GPUSCALE_HOMEs (default: a new temporary one)")
    parser.add_argument("--json", default=None, help="default: bench/results/faults/faults-<date>-<card>.json")
    parser.add_argument("--partial", default=None,
                        help="a JSON-lines file each case's figures are appended to as the case ends")
    parser.add_argument("--from-partial", nargs="+", default=None, metavar="FILE",
                        help="run nothing: the result of the cases these --partial files hold (several calls')")
    opts = parser.parse_args(argv)
    unknown = [name for name in opts.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"--cases: {unknown[0]}: not a case (choose from {', '.join(CASES)})")
    if not 0 <= opts.rank < opts.gpus or opts.gpus < 2:
        parser.error(f"--rank {opts.rank} --gpus {opts.gpus}: needs at least 2 ranks, the faulted one among them")
    if opts.at_step < 1 or opts.run_steps <= 2 * opts.at_step or opts.resume_steps < 1:
        parser.error(f"--at-step {opts.at_step} --run-steps {opts.run_steps} --resume-steps {opts.resume_steps}: "
                     "need 1 <= at-step, 2 x at-step < run-steps, 1 <= resume-steps")
    opts.pool = gpu_ids(parser, opts)
    return opts


def gpu_ids(parser, opts) -> list[int]:
    """The GPUs the cases share: --gpu-ids, all visible by default; none on a machine without GPUs."""
    visible = visible_gpu_indices()
    if not visible:
        return []
    given = (opts.gpu_ids or ",".join(map(str, visible))).split(",")
    if not all(index.strip().isdigit() and int(index) in visible for index in given):
        parser.error(f"--gpu-ids {opts.gpu_ids}: not all of them among the visible GPUs {visible}")
    if len(set(given)) < opts.gpus:
        parser.error(f"--gpus {opts.gpus}: only {len(given)} GPU(s) to use ({','.join(given)})")
    return [int(index) for index in given]


def case_card(gpus: int) -> dict | str:
    """The GPUs of one case: `gpus` of the visible ones (one kind on a host), or "cpu"."""
    found = card()
    return found if found == "cpu" else {"names": found["names"][:gpus], "count": gpus}


def main() -> None:
    opts = parse_options()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if opts.from_partial:
        results, where = cases_from_partial(opts.from_partial)
    else:
        results, where = run_cases(opts), case_card(opts.gpus)
    print()
    for figures in results:
        print(verdict_line(figures))
    settings = {**vars(opts), "assignments": [f"{r}:{a}" if r else a for r, a in opts.assignments]}
    write_result("faults", "faults", settings, {"cases": results}, out=opts.json, card=where or case_card(opts.gpus))
    sys.exit(0 if all(figures["passed"] for figures in results) else 1)


if __name__ == "__main__":
    main()
