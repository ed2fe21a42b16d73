"""The run's error when a rank fails: the rank's own line, from its error file, its log, or how it
ended, never the launcher's wrapper (`ChildFailedError:`, `CalledProcessError`). The launcher logs
here are the shapes torchrun and accelerate write (seen in real failed runs)."""

from __future__ import annotations

import json

from gpuscale.control.run_errors import OOM_KILLER_HINT, first_error
from gpuscale.runs.run_dir import RunDir

TORCHRUN_TABLE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
gpuscale.recipes FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-27_05:58:19
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 8224)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8224
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_05:58:19
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 8223)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
ACCELERATE_ONE_PROCESS = """\
    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)
subprocess.CalledProcessError: Command '['python', '-m', 'gpuscale.recipes']' {how}.
"""


def run_folder(tmp_path, launcher: str, logs: dict[int, str] = (), errors: dict[int, dict] = ()):
    folder = RunDir(tmp_path / "run").make()
    folder.launcher_log.write_text(launcher)
    for rank, text in dict(logs).items():
        folder.log(rank).write_text(text)
    for rank, record in dict(errors).items():
        folder.error(rank).write_text(json.dumps({"rank": rank, **record}))
    return folder.root


def test_a_rank_dead_before_its_error_file_gives_its_logs_last_exception_line(tmp_path):
    log = ("rank 0/2 on cpu\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
           "ModuleNotFoundError: No module named 'trl'\n")
    folder = run_folder(tmp_path, TORCHRUN_TABLE.format(code=1), logs={0: log, 1: "rank 1/2 on cpu\n"})
    assert first_error(folder, 1) == ("rank 0: ModuleNotFoundError: No module named 'trl'", None)


def test_the_error_file_comes_before_any_log(tmp_path):
    folder = run_folder(tmp_path, TORCHRUN_TABLE.format(code=1), logs={0: "ValueError: later\n"},
                        errors={1: {"t": 2.0, "message": "RuntimeError: first"}, 0: {"t": 3.0, "message": "second"}})
    assert first_error(folder, 1) == ("rank 1: RuntimeError: first", None)


def test_a_rank_killed_by_sigkill_outranks_its_peers_errors(tmp_path):
    """Its peers' errors (a connection closed under a collective) only follow from it."""
    folder = run_folder(tmp_path, TORCHRUN_TABLE.format(code=-9),
                        errors={1: {"t": 2.0, "message": "RuntimeError: Connection closed by peer"}})
    error, hint = first_error(folder, 1)
    assert error == "rank 0: killed by SIGKILL with no error of its own" and "out-of-memory killer" in hint


def test_accelerates_single_process_is_rank_0(tmp_path):
    killed = run_folder(tmp_path / "a", ACCELERATE_ONE_PROCESS.format(how="died with <Signals.SIGKILL: 9>"))
    assert first_error(killed, 1)[0] == "rank 0: killed by SIGKILL with no error of its own"
    exited = run_folder(tmp_path / "b", ACCELERATE_ONE_PROCESS.format(how="returned non-zero exit status 3"),
                        logs={0: "rank 0/1 on cpu\n"})
    assert first_error(exited, 1)[0] == "rank 0: exited with code 3 and no error message (see gpuscale logs)"


def test_the_launchers_wrapper_is_never_the_error(tmp_path):
    launchers = (TORCHRUN_TABLE.format(code=1), ACCELERATE_ONE_PROCESS.format(how="returned non-zero exit status 1"))
    for number, launcher in enumerate(launchers):
        error = first_error(run_folder(tmp_path / str(number), launcher), 1)[0]
        assert "ChildFailedError" not in error and "CalledProcessError" not in error
        assert error.startswith("rank 0: exited with code 1")


def test_a_rank_started_without_a_launcher_is_named_by_how_it_ended(tmp_path):
    """A one-process run has no launcher (control/launch.py:launcher_argv): the exit code is rank 0's own,
    and launcher.log, the supervisor's file for its child's output, holds what the rank wrote before it
    opened its own log."""
    killed = run_folder(tmp_path / "a", "")
    assert first_error(killed, -9, direct_rank=True) == ("rank 0: killed by SIGKILL with no error of its own",
                                                         OOM_KILLER_HINT)
    terminated = run_folder(tmp_path / "b", "", logs={0: "rank 0/1 on cpu\n"})
    assert first_error(terminated, -15, direct_rank=True) == ("rank 0: killed by signal 15 (SIGTERM)", None)
    exited = run_folder(tmp_path / "c", "", logs={0: "rank 0/1 on cpu\n"})
    assert first_error(exited, 3, direct_rank=True)[0] == \
        "rank 0: exited with code 3 and no error message (see gpuscale logs)"
    early = run_folder(tmp_path / "d", "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                        "ModuleNotFoundError: No module named 'trl'\n")
    assert first_error(early, 1, direct_rank=True) == ("rank 0: ModuleNotFoundError: No module named 'trl'", None)
    # What the rank recorded comes first, as under a launcher; a launcher's exit code says nothing of rank 0.
    recorded = run_folder(tmp_path / "e", "", errors={0: {"t": 1.0, "message": "ValueError: bad"}})
    assert first_error(recorded, 1, direct_rank=True) == ("rank 0: ValueError: bad", None)
    assert first_error(killed, -9) == ("launcher killed by signal 9", None)
