"""Shared test helpers: a private GPUSCALE_HOME per test, and the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpuscale.control.store import Store
from gpuscale.runs.process import run_processes


def machine_slowness() -> float:
    """How much slower than a quiet machine this one is likely to run the tests: the load average of
    the last minute per core, from 1 (quiet, or only this suite) up to 4.

    Taken once, when a test process starts and before its tests add load: what it sees is other
    work. On a 2-core machine shared with other jobs the end-to-end tests' runs take several times
    their quiet time (a resume test: 123 s alone, over 300 s at a load of 10), so the per-test limit
    and the waits below scale with it; on a quiet machine they are what they say.
    GPUSCALE_TEST_SLOWNESS sets it where the load average does not tell (a throttled container)."""
    if os.environ.get("GPUSCALE_TEST_SLOWNESS"):
        return float(os.environ["GPUSCALE_TEST_SLOWNESS"])
    return min(max(os.getloadavg()[0] / (os.cpu_count() or 1), 1.0), 4.0)


SLOWNESS = machine_slowness()


def share_the_cores_among_workers() -> None:
    """Each of xdist's workers gets its share of the cores as OpenMP threads (at least 1), unless
    OMP_NUM_THREADS is set already.

    torch otherwise gives each worker every core. Two workers on 2 cores then run 4 OpenMP threads,
    and a thread waiting at a barrier for one that is descheduled spins: with both workers in torch
    at once, a 1.2 s test of the embedded model took 48 s, 2.7 s with one thread a worker. Set here,
    in conftest's import, because OpenMP reads it once, when torch loads (no test module has been
    imported yet); the processes the tests start inherit it, as the ranks of `private_home` do."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


share_the_cores_among_workers()


def slow(seconds: float) -> float:
    """`seconds` on a quiet machine, allowed for this one."""
    return seconds * SLOWNESS


def pytest_configure(config):
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not hasattr(config, "workerinput"):  # once, not per worker
        compile_gpuscale()


def compile_gpuscale() -> None:
    """gpuscale's modules compiled into its __pycache__ folders, where Python keeps them when it may.
    PYTHONDONTWRITEBYTECODE (which some machines set for every process) stops it from doing so, and each of
    the hundreds of processes the tests start (CLI calls, supervisors, launchers, ranks) compiled them
    again: 0.1 s of CPU a `gpuscale show`, more a rank, minutes over the suite. A process still reads
    compiled modules it finds with the variable set."""
    import compileall

    import gpuscale

    compileall.compile_dir(Path(gpuscale.__file__).parent, quiet=1)


def pytest_report_header(config):
    return f"machine slowness {SLOWNESS:.1f} (load per core at start); per-test timeouts and waits scale with it"


def pytest_collection_modifyitems(config, items):
    """pytest-timeout's limit (pyproject's `timeout`, or a test's own mark) times the slowness."""
    if SLOWNESS == 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = float(mark.args[0]) if mark and mark.args else default
        if limit:
            item.add_marker(pytest.mark.timeout(slow(limit)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` hands out whole test files (xdist's loadfile) instead of runs of consecutive tests cut
    anywhere (its default, `load`): a module fixture that starts runs for several tests (`module_home`'s),
    or sets up anything costly, then runs on one worker only, where a module cut between the two workers
    made both start its runs. A worker gets its next file when it is down to its last two tests, the files
    with the most tests first: the one-test files come last, and the workers end close together."""
    if config.getvalue("dist") == "load":  # -n's default; an explicit other --dist is left as asked
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)
    return None


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    return private_home(tmp_path / "gpuscale-home", monkeypatch)


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    """One home for a module's tests that assert on the same runs: a module-scoped fixture starts a
    run once, and each test checks its own aspect of it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield private_home(tmp_path_factory.mktemp("module") / "gpuscale-home", monkeypatch)


def private_home(path: Path, monkeypatch) -> Path:
    """GPUSCALE_HOME at `path`, the hub offline, one OpenMP thread a rank, no other gpuscale settings."""
    monkeypatch.setenv("GPUSCALE_HOME", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # CI's two cores are shared by pytest, the app, supervisors and ranks. A CPU rank with two OpenMP
    # threads there waits at OpenMP barriers for a descheduled thread: about 500 ms per tiny decode
    # step under load instead of 2 (bench/RESULTS.md), enough to time a test out.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in list(os.environ):
        if key.startswith(("GPUSCALE_", "POWERSAMPLE_")) and key != "GPUSCALE_HOME":
            monkeypatch.delenv(key)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: one thread is fastest, and several threads spinning on a busy machine made a
    4x64 matmul take 15 ms instead of 10 us."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gpuscale(*args: str, env: dict | None = None, timeout: float = 240, entry: str = "gpuscale.app.cli"):
    """Run the real CLI; returns the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", entry, *args], capture_output=True, text=True, timeout=slow(timeout),
        env={**os.environ, **(env or {})},
    )


def python_offline(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the hub unreachable and an empty Hugging Face cache."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(hf_home))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=slow(120))


def spawn_gpuscale(*args: str, env: dict | None = None, entry: str = "gpuscale.app.cli") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", entry, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **(env or {})},
    )


def run_json(*args: str, env: dict | None = None) -> dict:
    result = gpuscale(*args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def run_together(*arguments: list[str], env: dict | None = None,
                 envs: list[dict] | None = None) -> list[subprocess.CompletedProcess]:
    """`gpuscale run ARGUMENTS --json` for each list, all started together, their outcomes in the order
    given: a 1-rank run keeps one of the two cores busy, so two at once take little more than one.
    `envs`: one run's own variables each, over `env`."""
    envs = envs or [{} for _ in arguments]
    return finished(*(spawn_gpuscale("run", *args, "--json", env={**(env or {}), **own})
                      for args, own in zip(arguments, envs)))


def finished(*fronts: subprocess.Popen) -> list[subprocess.CompletedProcess]:
    """What each of the front ends `spawn_gpuscale` started gave, in the order given, once all ended."""
    ended = [(front, *front.communicate(timeout=slow(240))) for front in fronts]
    return [subprocess.CompletedProcess(front.args, front.returncode, out, err) for front, out, err in ended]


def runs_at_once(*arguments: list[str], env: dict | None = None) -> list[dict]:
    """`run_together`, each run succeeded: the runs as `--json` prints them."""
    ended = run_together(*arguments, env=env)
    for result in ended:
        assert result.returncode == 0, result.stderr
    return [json.loads(result.stdout) for result in ended]


def wait_until(condition, timeout: float = 60, interval: float = 0.2, message: str = "condition"):
    """`condition()` once it is true; `timeout` is a quiet machine's seconds (`slow`)."""
    timeout = slow(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def wait_for_metrics(home: Path, run_id: int, timeout: float = 90) -> None:
    store = Store(home)
    wait_until(lambda: store.metrics(run_id, "tokens"), timeout, message=f"metrics of run {run_id}")


def leftover_processes(run_dir: str) -> list[psutil.Process]:
    return run_processes(run_dir)


def rank_processes(run_dir: str | Path) -> dict[int, psutil.Process]:
    """The run's rank processes by rank (the launcher carries no RANK)."""
    found = {}
    for proc in leftover_processes(str(run_dir)):
        try:
            if "gpuscale.recipes" in proc.cmdline() and "RANK" in (env := proc.environ()):
                found[int(env["RANK"])] = proc
        except psutil.Error:
            pass
    return found


def check_step_phases(home: Path, run: dict, named: set[str], ranks: int) -> None:
    """The run's step phases (data/step_phases.py), as every recipe must log them: each rank logged
    them, every phase in `named` among them, and the named phases cover at least 95% of every rank's
    steady steps (`other` at most 5% of their time), in the summary and in each rank's own steps."""
    from gpuscale.data.step_phases import FIGURE_PREFIX, OTHER, WARM_UP_STEPS, mean_step, shares

    summary = run["summary"]
    assert named <= set(summary["step_phases"]), summary["step_phases"]
    assert summary["step_phases"].get(OTHER, 0.0) <= 0.05, summary["step_phases"]
    rows = [m for m in Store(home).metrics(run["id"]) if m["rank"] >= 0 and m["name"].startswith(FIGURE_PREFIX)]
    assert {m["rank"] for m in rows} == set(range(ranks))
    for rank in range(ranks):
        steps: dict[int, dict[str, float]] = {}
        for m in rows:
            if m["rank"] == rank:
                steps.setdefault(m["step"], {})[m["name"].removeprefix(FIGURE_PREFIX)] = m["value"]
        steady = [steps[step] for step in sorted(steps)][WARM_UP_STEPS:]
        assert steady, (rank, steps)
        assert shares(mean_step(steady)).get(OTHER, 0.0) <= 0.05, (rank, steady)
