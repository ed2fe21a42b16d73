"""End to end on CPU: real torchrun ranks on gloo, a real supervisor, a real runs.db."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    check_step_phases,
    finished,
    gpuscale,
    leftover_processes,
    run_json,
    run_together,
    spawn_gpuscale,
    wait_for_metrics,
    wait_until,
)
from gpuscale.app.views.text import format_number, format_rate
from gpuscale.control.store import Store
from gpuscale.recipes.probe import MEASURE_SIZES
from gpuscale.runs.statuses import LIVE_STATUSES

pytestmark = pytest.mark.e2e  # every test here starts real runs

FAST = ["--recipe", "probe", "--set", "steps=4", "--set", "prompt_tokens=8", "--batch-size", "2"]
LONG = ["--recipe", "probe", "--set", "steps=100000", "--set", "prompt_tokens=8", "--batch-size", "2",
        "--set", "telemetry_interval=0.2"]


def test_two_ranks_succeed_with_metrics_and_samples(home):
    run = run_json("run", *FAST, "--gpus", "2")
    assert run["status"] == "succeeded" and run["error"] is None
    assert run["summary"]["world_size"] == 2
    assert len(run["summary"]["tokens_per_s_per_rank"]) == 2 and run["summary"]["tokens_per_s"] > 0
    store = Store(home)
    assert {m["rank"] for m in store.metrics(run["id"], "tokens")} == {0, 1}
    kinds = {s["kind"] for s in store.samples(run["id"])}
    assert "host" in kinds or "gpu" in kinds
    if "gpu" in kinds:  # NVML's energy counter over the run (control/telemetry.py's EnergyMeter)
        assert run["summary"]["energy_j"] > 0 and len(run["summary"]["energy_j_by_gpu"]) == 2
    else:
        assert run["summary"]["energy_unavailable"] == "no NVML GPU (CPU run)" and "energy_j" not in run["summary"]
        assert "  energy_unavailable: no NVML GPU (CPU run)" in gpuscale("show", str(run["id"])).stdout.splitlines()
    assert_node_check(run)
    # A probe step is one decode step and its record written (data/step_phases.py): both named, covering 95%
    # of each rank's steady steps.
    check_step_phases(home, run, {"decode", "log"}, ranks=2)
    listed = run_json("runs")
    assert [r["id"] for r in listed] == [run["id"]]
    assert {"id", "recipe", "status", "settings", "summary", "started_at", "ended_at", "error"} <= set(listed[0])
    assert (home / "runs" / str(run["id"]) / "logs" / "rank1.log").read_text().startswith("rank 1/2")
    logs = gpuscale("logs", str(run["id"]), "--rank", "0")
    assert logs.returncode == 0 and "[rank0] rank 0/2" in logs.stdout
    csv = gpuscale("export", str(run["id"]), "--format", "csv")
    assert csv.stdout.splitlines()[0] == "run_id,rank,t,step,name,value" and ",tokens," in csv.stdout
    # probe keeps no per-item results: nothing to export, said in one line, nothing written.
    for fmt in ("csv", "json"):
        empty = gpuscale("export", str(run["id"]), "--format", fmt, "--what", "results", "-o", str(home / "r.out"))
        assert (empty.returncode, empty.stdout) == (2, "")
        assert empty.stderr == (f"gpuscale: error: run {run['id']}: nothing to export: it has no per-item results "
                                "(no results.jsonl in its folder: its recipe writes none, or it ended before any)\n")
        assert not (home / "r.out").exists()
    missing = gpuscale("export", str(run["id"]), "-o", "/nonexistent/dir/x.json")
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr == ("gpuscale: error: output: /nonexistent/dir/x.json: the folder /nonexistent/dir does "
                              "not exist\n")
    written = gpuscale("export", str(run["id"]), "--what", "summary", "-o", str(home / "summary.json"))
    assert written.returncode == 0 and json.loads((home / "summary.json").read_text()) == run["summary"]
    assert not leftover_processes(run["run_dir"])


def assert_node_check(run: dict) -> None:
    """The probe's node check on two ranks: every figure measured on each, the all-reduce's busbw
    nccl-tests' algbw x 2(n-1)/n, and `show` ends in one table with a row a rank, the per-rank figures
    not repeated in the plain list above it."""
    summary = run["summary"]
    assert len(summary["node_check_gpus"]) == 2
    for name in ("copy_gb_per_s", "matmul_tflops", "latency_tokens_per_s", "throughput_tokens_per_s",
                 "decode_batch1_floor_share"):
        assert summary[f"{name}_rank_0"] > 0 and summary[f"{name}_rank_1"] > 0, name
    # The engine's fastest path on a GPU, its plain one on CPU ranks; the check says which, and what it
    # timed (FAST: 4 new tokens; on a GPU at least its decode_new_tokens).
    on_cpu = summary["devices"] == ["cpu", "cpu"]
    assert summary["node_check_decode"].startswith("uncompiled step" if on_cpu else "compiled step, CUDA graphs")
    sizes = MEASURE_SIZES["cpu" if on_cpu else "cuda"]
    new = max(4, sizes.decode_new_tokens)
    assert (f"(a call of {new} new tokens - a call of 1) / {new - 1}, medians of {sizes.decode_calls} calls each"
            in summary["node_check_decode"])
    assert summary["decode_weight_bytes"] > 0
    assert summary["allreduce_busbw_gb_per_s"] == pytest.approx(summary["allreduce_algbw_gb_per_s"], abs=0.002)
    shown = gpuscale("show", str(run["id"])).stdout.splitlines()
    table = shown[shown.index("node check:"):]
    assert table[1].split()[:2] == ["GPU", "device"] and "decode b=2 tokens/s" in table[1]
    assert table[1].endswith("b=1 of floor")
    for rank, gpu in enumerate(summary["node_check_gpus"]):  # a row a rank, ending in its floor share
        assert table[2 + rank].split()[:2] == gpu.split()
        assert table[2 + rank].endswith(f"{100 * summary[f'decode_batch1_floor_share_rank_{rank}']:.1f}%")
    assert table[4] == f"  decode: {summary['node_check_decode']}; the summary's tokens_per_s, not these columns, " \
        "counts transformers' forward on every rank"
    assert table[5].startswith("  b=1 of floor: the time to read the weights a decode step reads (")
    assert table[6].startswith("  all-reduce bus bandwidth ") and "across 2 ranks" in table[6]
    gpus = summary["node_check_gpus"]
    assert table[7] == (f"  links (GB/s each way, a pair at a time): {gpus[0]} - {gpus[1]} "
                        f"{format_number(summary['link_gb_per_s_0_1'])}") and summary["link_gb_per_s_0_1"] > 0
    # CPU ranks share two cores: whether a gap is wider than its repeats' spread is chance; the table
    # gives the verdicts, then the gaps it cannot judge, one line each.
    verdicts = [line for line in table if line.startswith("  slow: ")]
    unjudged = [line for line in table if line.startswith("  not judged: ")]
    assert verdicts and table[-len(unjudged) - 1] == verdicts[-1], table
    assert len(unjudged) == len(summary["node_check_unjudged"])
    assert not any(line.startswith("  copy_gb_per_s") for line in shown)


@pytest.fixture(scope="module")
def one_rank_runs(module_home) -> dict[str, subprocess.CompletedProcess]:
    """Two 1-rank FAST runs started together (each keeps one core busy), one from `gpuscale run` as a user
    types it (what it writes is the terminal's, not --json's), one from the headless `gpuscale-tui --recipe
    ... --json`: {front end: what it gave}."""
    cli, tui = finished(spawn_gpuscale("run", *FAST, "--gpus", "1"),
                        spawn_gpuscale(*FAST, "--gpus", "1", "--json", entry="gpuscale.app.tui_main"))
    return {"cli": cli, "tui": tui}


@pytest.fixture(scope="module")
def cli_run(module_home, one_rank_runs) -> dict:
    """The run of one_rank_runs' `gpuscale run`, from the history: its first line names it (`run N: ...`)."""
    result = one_rank_runs["cli"]
    assert result.returncode == 0, result.stderr
    return Store(module_home).get_run(int(re.match(r"run (\d+): ", result.stderr)[1]))


def test_headless_tui_is_the_same_run(one_rank_runs):
    result = one_rank_runs["tui"]
    assert result.returncode == 0, result.stderr
    assert run_json("show", str(json.loads(result.stdout)["id"]))["status"] == "succeeded"


def test_the_final_line_of_a_probe_run_gives_the_summarys_tokens_per_s(one_rank_runs, cli_run):
    """One figure, one value: `gpuscale run` ends with a progress line whose tokens/s is its summary's (the
    decode loop's), not the supervisor's average over the whole run; then the node check's table, one rank's."""
    result, run = one_rank_runs["cli"], cli_run
    final = [line for line in result.stderr.splitlines() if line.startswith(f"run {run['id']} probe · succeeded")]
    assert final, result.stderr
    shown = re.search(r"tokens/s ([\d,.]+)", final[-1])
    assert shown and shown.group(1) == format_rate(run["summary"]["tokens_per_s"]), (final[-1], run["summary"])
    # The supervisor's own figure for the run is another number (it counts loading and warm-up).
    assert run["progress"]["tokens_per_s"] != run["summary"]["tokens_per_s"]
    # The output ends in the node check's one table: a row for the one rank, no all-reduce, no peers.
    output = result.stdout.splitlines()
    table = output[output.index("node check:"):]
    summary = run["summary"]
    assert table[1].split()[:2] == ["GPU", "device"] and "decode b=2 tokens/s" in table[1], table
    assert table[2].split()[:3] == [*summary["node_check_gpus"][0].split(), summary["devices"][0].split()[0]], table
    assert table[3].startswith(f"  decode: {summary['node_check_decode']}; the summary's tokens_per_s"), table
    assert table[4].startswith("  b=1 of floor: "), table
    assert table[5:] == ["  all-reduce: one rank, nothing to measure",
                         *(["  no data-sheet figures for cpu (not in gpuscale/data/cards.py)"]
                           if summary["devices"] == ["cpu"] else []),
                         "  slow: none (no GPU more than 15% below its peers)"], table
    # The decode loop passes its KV cache as `cache`: transformers' "`past_key_values` ... deprecated"
    # warning reaches neither the output nor the rank's log.
    rank_log = (Path(run["run_dir"]) / "logs" / "rank0.log").read_text()
    assert "deprecated" not in rank_log and "deprecated" not in result.stderr, rank_log


@pytest.fixture(scope="module")
def stopped_run(module_home) -> dict:
    """One detached LONG run on 2 ranks, stopped after a few steps, for the tests of what a stop does:
    what was seen on the way (processes before and after, the stop's output and time) and the run as
    `show` gives it after. Before the stop, two summary parts go into rank 0's metric file as its
    Reporter appends them."""
    run_id = int(gpuscale("run", *LONG, "--gpus", "2", "--detach").stdout)
    wait_for_metrics(module_home, run_id)
    run_dir = Path(Store(module_home).get_run(run_id)["run_dir"])
    seen = {"id": run_id, "processes_running": len(leftover_processes(str(run_dir)))}
    supervisor = psutil.Process(Store(module_home).get_run(run_id)["supervisor_pid"])
    seen["supervisors_children"] = [child.cmdline() for child in supervisor.children()]
    with open(run_dir / "metrics" / "rank0.jsonl", "a") as metrics:
        for part in ({"accuracy_before": 0.25, "eval_examples": 8}, {"accuracy_before": 0.5, "world_size": 1}):
            metrics.write(json.dumps({"t": time.time(), "rank": 0, "summary": part}) + "\n")
    wait_until(lambda: len(Store(module_home).metrics(run_id, "tokens")) >= 3, 60, message="a few steps")
    started = time.monotonic()
    seen["stop"] = gpuscale("stop", str(run_id))
    seen["stop_seconds"] = time.monotonic() - started
    seen["processes_left"] = leftover_processes(str(run_dir))
    seen["run"] = run_json("show", str(run_id))
    return seen


def test_stop_a_detached_run_leaves_no_process(stopped_run):
    run_id, result = stopped_run["id"], stopped_run["stop"]
    assert stopped_run["processes_running"] >= 3  # supervisor, torchrun, two ranks
    # Two ranks keep their launcher (one process alone goes without: test_direct_rank.py).
    assert [argv[1:3] for argv in stopped_run["supervisors_children"]] == [["-m", "torch.distributed.run"]]
    assert result.returncode == 0 and f"run {run_id}: stopped" in result.stdout
    assert stopped_run["stop_seconds"] < 12
    assert stopped_run["processes_left"] == []
    run = stopped_run["run"]
    assert run["status"] == "stopped" and run["ended_at"] and len(run["latest_samples"]) >= 1


def test_run_survives_its_front_end_being_killed(home):
    # One rank: what is killed is the front end, which no rank depends on.
    front = spawn_gpuscale("run", *FAST, "--gpus", "1", "--set", "steps=150")
    store = Store(home)
    run_id = wait_until(lambda: [r["id"] for r in store.list_runs()], message="the run row")[0]
    wait_for_metrics(home, run_id)
    front.send_signal(signal.SIGKILL)
    front.wait()
    # Still running once its front end is gone (else the test would show nothing), then ends on its own.
    assert store.get_run(run_id)["status"] in LIVE_STATUSES
    run = wait_until(lambda: (r := store.get_run(run_id))["status"] not in LIVE_STATUSES and r, 120)
    assert run["status"] == "succeeded", run["error"]


def test_killed_supervisor_means_lost_and_no_rank_left(home):
    run_id = int(gpuscale("run", *LONG, "--gpus", "2", "--detach").stdout)
    wait_for_metrics(home, run_id)
    store = Store(home)
    run = store.get_run(run_id)
    os.kill(run["supervisor_pid"], signal.SIGKILL)
    # The launcher and the ranks die with it (parent-death signals) ...
    wait_until(lambda: not leftover_processes(run["run_dir"]), 20, message="the run's processes to go")
    # ... and the next front end marks the run lost.
    listed = run_json("runs")
    assert listed[0]["status"] == "lost" and "supervisor" in listed[0]["error"]


FAULTS = ("1:error:2", "0:oom:1")
FAULT_RANKS = {FAULTS[0]: 2, FAULTS[1]: 1}  # rank 1 fails beside a rank that does not; rank 0's OOM needs no other


@pytest.fixture(scope="module")
def failed_runs(module_home) -> dict:
    """A run for each of FAULTS on FAULT_RANKS ranks, both at once: {fault: what `gpuscale run --json` gave}.
    Started without OMP_NUM_THREADS, so that the supervisor gives the ranks threads by its own rule (what
    its log says of them is checked below)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("OMP_NUM_THREADS")
        ended = run_together(*([*FAST, "--gpus", str(FAULT_RANKS[fault])] for fault in FAULTS),
                             envs=[{"GPUSCALE_INJECT_FAULT": fault} for fault in FAULTS])
    return dict(zip(FAULTS, ended))


@pytest.mark.parametrize("fault, error, hint", [
    (FAULTS[0], "rank 1: RuntimeError: injected fault on rank 1 at step 2", None),
    (FAULTS[1], "rank 0: torch.OutOfMemoryError: CUDA out of memory", "lower batch_size (now 2; try 1)"),
])
def test_failing_rank_gives_failed_with_its_error_line(failed_runs, fault, error, hint):
    result = failed_runs[fault]
    assert result.returncode == 1
    run = run_json("show", str(json.loads(result.stdout)["id"]))
    assert run["status"] == "failed" and run["error"].startswith(error)
    assert (hint is None and run["hint"] is None) or hint in run["hint"]
    assert not leftover_processes(run["run_dir"])


def supervisor_log(run: dict) -> str:
    return (Path(run["run_dir"]) / "logs" / "supervisor.log").read_text()


def test_the_supervisor_log_names_the_threads_per_rank(failed_runs, cli_run):
    """The run's log says how many OpenMP threads its ranks got, and why: by the supervisor's rule where
    OMP_NUM_THREADS is not set (the failed runs), as set where the user set it (these tests' 1); and Inductor's
    compile workers, the same share."""
    log = supervisor_log(json.loads(failed_runs[FAULTS[0]].stdout))
    line = re.search(r"OMP_NUM_THREADS=(\d+) per rank \((\d+) cores, ([\d.]+) busy, (\d+) free, 2 rank\(s\)", log)
    assert line, log
    threads, free = int(line[1]), int(line[4])
    assert threads == max(1, free // 2)
    assert f"TORCHINDUCTOR_COMPILE_THREADS={threads}, the same share" in log
    assert "OMP_NUM_THREADS=1 per rank (set by the user)" in supervisor_log(cli_run)


def test_two_runs_at_once(one_rank_runs, cli_run):
    for result in one_rank_runs.values():
        assert result.returncode == 0, result.stderr
    ids = [cli_run["id"], json.loads(one_rank_runs["tui"].stdout)["id"]]
    runs = [run_json("show", str(run_id)) for run_id in ids]
    assert [r["status"] for r in runs] == ["succeeded", "succeeded"]
    assert all(r["summary"]["world_size"] == 1 for r in runs)


def node_failure(node, home: Path) -> str:
    """What a failed node printed, and the tail of every log of both nodes' runs: the cause is often
    on the other node (a rank that died takes the rendezvous with it)."""
    logs = [f"--- {log.relative_to(home)}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            for log in sorted((home / "runs").glob("*/logs/*"))]
    return "\n".join([node.stdout.read(), node.stderr.read(), *logs])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_form_one_four_rank_job(home):
    endpoint = f"127.0.0.1:{free_port()}"
    common = [*FAST, "--gpus", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--set", "rdzv_id=pair"]
    nodes = [spawn_gpuscale("run", *common, "--node-rank", str(r), "--json") for r in (0, 1)]
    for node in nodes:
        assert node.wait(240) == 0, node_failure(node, home)
    runs = run_json("runs")
    assert [r["status"] for r in runs] == ["succeeded", "succeeded"]
    store = Store(home)
    ranks = {m["rank"] for r in runs for m in store.metrics(r["id"], "tokens")}
    assert ranks == {0, 1, 2, 3}
    summaries = [r["summary"] for r in runs if "world_size" in r["summary"]]
    assert [s["world_size"] for s in summaries] == [4]


# ---- a run that ends early keeps what it did ---------------------------------------------

# Power sampling, one problem a batch, far more problems than the test waits for.
PROBLEMS = 400
SLOW_POWER_SAMPLING = ["--recipe", "power-sampling", "--gpus", "1", "--batch-size", "1",
                       "--set", f"max_examples={PROBLEMS}", "--set", "max_new_tokens=24", "--set", "blocks=2",
                       "--set", "mcmc_steps=1", "--set", "telemetry_interval=0.2"]


def start_and_wait_for_batches(home, batches: int) -> int:
    run_id = int(gpuscale("run", *SLOW_POWER_SAMPLING, "--detach").stdout)
    store = Store(home)
    wait_until(lambda: len(store.metrics(run_id, "samples")) >= batches, 180, message=f"{batches} batches")
    return run_id


def assert_kept_what_it_did(home, run: dict) -> None:
    """results.jsonl holds the problems finished (in order), the summary the figures so far, marked
    partial; its accuracy is that of the rows its metrics had counted."""
    summary = run["summary"]
    assert summary["partial"] is True and summary["steps_total"] == PROBLEMS
    assert 3 <= summary["steps_done"] < PROBLEMS and summary["samples"] >= 3 and summary["tokens"] > 0
    rows = Store(home).results(run["id"])
    assert (Path(run["run_dir"]) / "results.jsonl").exists()
    assert [row["index"] for row in rows] == list(range(len(rows)))
    # A rank writes a batch's rows, then its metrics line: a run cut in between has one batch more.
    counted = int(summary["samples"])
    assert counted <= len(rows) <= counted + 1
    assert summary["accuracy"] == pytest.approx(sum(row["correct"] for row in rows[:counted]) / counted)


def test_stopped_run_keeps_its_results_and_a_partial_summary(home):
    run_id = start_and_wait_for_batches(home, 3)
    result = gpuscale("stop", str(run_id))
    assert result.returncode == 0 and f"run {run_id}: stopped" in result.stdout
    run = run_json("show", str(run_id))
    # One process: its rank started without a launcher (test_direct_rank.py), stopped as any run's, by a
    # SIGTERM to its process group, with nothing of it left.
    assert run["status"] == "stopped" and run["command"][1:3] == ["-m", "gpuscale.recipes"]
    assert not leftover_processes(run["run_dir"])
    assert_kept_what_it_did(home, run)
    assert run["summary"]["duration_s"] > 0  # the supervisor's own figures are still there


def test_lost_run_keeps_its_results_and_a_partial_summary(home):
    run_id = start_and_wait_for_batches(home, 3)
    run = Store(home).get_run(run_id)
    os.kill(run["supervisor_pid"], signal.SIGKILL)
    wait_until(lambda: not leftover_processes(run["run_dir"]), 20, message="the run's processes to go")
    listed = run_json("runs")  # the front end finds the supervisor dead: lost, and keeps what the ranks did
    assert listed[0]["status"] == "lost"
    assert_kept_what_it_did(home, listed[0])


def test_stopped_run_keeps_the_summary_parts_rank0_wrote_and_its_progress(stopped_run):
    """Rank 0 may write its summary in parts (figures measured before training, then more): a run
    stopped after them keeps every part, later values winning, on top of the progress figures."""
    assert stopped_run["stop"].returncode == 0
    summary = stopped_run["run"]["summary"]
    assert summary["accuracy_before"] == 0.5 and summary["eval_examples"] == 8 and summary["world_size"] == 1
    assert summary["partial"] is True and summary["steps_done"] >= 1 and summary["tokens"] > 0
    assert summary["duration_s"] > 0


def test_doctor_repair_rebuilds_the_history_from_the_run_folders(home):
    """runs.db truncated to 100 bytes (its header only) while a run goes on; `doctor --repair` gives
    the new history every run back under its own id, with recipe, settings, label, summary, metrics
    and the status each one ended with: succeeded, failed, stopped (its figures kept), lost, and the
    live run running, its supervisor writing on to the new runs.db until it is stopped."""
    # The two short runs at once (each keeps one core busy), run 1 recorded before run 2 starts.
    good_front = spawn_gpuscale("run", *FAST, "--gpus", "1", "--label", "first", "--json")
    wait_until(lambda: (home / "runs.db").exists() and Store(home).list_runs(), 60, message="run 1 recorded")
    failing_front = spawn_gpuscale("run", *FAST, "--gpus", "1", "--json", env={"GPUSCALE_INJECT_FAULT": "0:error:2"})
    good_out, good_err = good_front.communicate(timeout=240)
    failing_front.communicate(timeout=240)
    assert good_front.returncode == 0 and failing_front.returncode == 1, good_err
    good = json.loads(good_out)
    assert good["id"] == 1 and good["status"] == "succeeded"
    # Each at a step a second once it has logged one (GPUSCALE_INJECT_FAULT's `slow`): running on, writing
    # to the history, but leaving the cores to the rest of the test.
    stopped, lost, live = (int(gpuscale("run", *LONG, "--gpus", "1", "--detach",
                                        env={"GPUSCALE_INJECT_FAULT": "0:slow:1"}).stdout) for _ in range(3))
    for run_id in (stopped, lost, live):
        wait_for_metrics(home, run_id)
    assert gpuscale("stop", str(stopped)).returncode == 0
    os.kill(Store(home).get_run(lost)["supervisor_pid"], signal.SIGKILL)
    wait_until(lambda: run_json("runs")[1]["status"] == "lost", 20, message="run 4 marked lost")
    before = {run["id"]: run for run in run_json("runs")}
    assert [before[i]["status"] for i in sorted(before)] == ["succeeded", "failed", "stopped", "lost", "running"]
    rank_rows = {run_id: [m for m in Store(home).metrics(run_id) if m["rank"] >= 0] for run_id in before}
    # Every page into runs.db itself first: in WAL mode the recent pages live in runs.db-wal until a
    # checkpoint, and a truncated runs.db whose pages all sat in the WAL still read as healthy (the test
    # then depended on whether SQLite had checkpointed by itself before this line).
    checkpoint_the_wal(home / "runs.db")
    os.truncate(home / "runs.db", 100)

    repaired = gpuscale("doctor", "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert ("5 run(s) rebuilt from their folders: 1 (succeeded), 2 (failed), 3 (stopped), 4 (lost), 5 (running)"
            in repaired.stdout)
    after = {run["id"]: run for run in run_json("runs")}
    assert sorted(after) == sorted(before) == [1, 2, 3, 4, 5]
    for run_id, run in after.items():
        assert run["recipe"] == "probe" and run["status"] == before[run_id]["status"]
        assert run["run_dir"] == before[run_id]["run_dir"] and run["settings"] == before[run_id]["settings"]
        ranks = [(m["rank"], m["step"], m["name"], m["value"]) for m in Store(home).metrics(run_id) if m["rank"] >= 0]
        assert ranks[:len(rank_rows[run_id])] == [(m["rank"], m["step"], m["name"], m["value"])
                                                  for m in rank_rows[run_id]]
    for run_id in (1, 2, 3, 4):  # ended: the same record, figures and all
        assert after[run_id]["ended_at"] == pytest.approx(before[run_id]["ended_at"], abs=0.5)
        assert {k: v for k, v in after[run_id]["summary"].items() if k != "duration_s"} == \
            {k: v for k, v in before[run_id]["summary"].items() if k != "duration_s"}
    assert after[1]["label"] == "first" and after[1]["command"] == before[1]["command"]
    assert after[2]["error"] == "rank 0: RuntimeError: injected fault on rank 0 at step 2"
    assert after[3]["summary"]["partial"] is True and 1 <= after[3]["summary"]["steps_done"] < 100000
    assert after[4]["error"] == before[4]["error"] and "supervisor" in after[4]["error"]

    # The live run's supervisor writes to the new runs.db: its steps go on there, and its end is recorded.
    step = after[5]["progress"]["step"]
    wait_until(lambda: run_json("show", "5")["progress"]["step"] > step, 30, message="run 5's steps in the new history")
    assert gpuscale("stop", "5").returncode == 0
    ended = run_json("show", "5")
    assert ended["status"] == "stopped" and ended["summary"]["steps_done"] > step
    steps = [(m["step"], m["t"]) for m in Store(home).metrics(5, "tokens") if m["rank"] == 0]
    assert len(steps) == len(set(steps))  # the rows the repair restored are not written twice
    assert gpuscale("doctor").returncode == 0


def checkpoint_the_wal(database: Path) -> None:
    """Copy the WAL's pages into the database file and empty the WAL, retried while the live run's
    supervisor holds a write."""
    connection = sqlite3.connect(database, timeout=10)
    try:
        for _ in range(50):
            busy, _, _ = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            time.sleep(0.1)
        raise AssertionError("the WAL could not be checkpointed")
    finally:
        connection.close()
