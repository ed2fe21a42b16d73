"""The CLI as a Unix tool: output piped into a reader that stops early, help texts, bad ranks."""

from __future__ import annotations

import subprocess
import sys

from conftest import gpuscale
from gpuscale.control.store import Store


def test_a_reader_that_closes_early_ends_the_output_quietly(home):
    """`gpuscale runs | head -1`: far more rows than a pipe holds, and the reader leaves after one line."""
    # 10,000 rows print about 430 kB: several times a pipe's 64 kB plus the reader's buffer, so the
    # writer cannot finish before the reader leaves (1,500 rows, 64.5 kB, sometimes could, and exited 0)
    store = Store(home)
    for number in range(10_000):
        store.create_run("probe", {"seed": number}, ["true"], "host")
    store.close()
    writer = subprocess.Popen([sys.executable, "-m", "gpuscale.app.cli", "runs", "--limit", "10000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = writer.stdout.readline()
    writer.stdout.close()  # as `head -1` does
    stderr = writer.stderr.read().decode()
    code = writer.wait(timeout=60)
    assert first.startswith(b"ID")
    assert stderr == "", stderr  # no BrokenPipeError traceback, no "Exception ignored" line
    assert code == 141  # 128 + SIGPIPE, as a Unix tool ended by the closed pipe


def test_every_argument_has_help_text():
    import argparse

    from gpuscale.app.cli import build_parser

    def commands(parser, prefix=""):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield f"{prefix}{name}", sub
                    yield from commands(sub, f"{prefix}{name} ")

    missing = [f"{name} {action.dest}" for name, sub in commands(build_parser()) for action in sub._actions
               if action.help is None and not isinstance(action, argparse._SubParsersAction)]
    assert missing == []


def test_logs_of_a_rank_that_does_not_exist_is_an_error(home):
    store = Store(home)
    run_id = store.create_run("probe", {"gpus": 2}, ["true"], "host")
    run_dir = home / "runs" / str(run_id)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.log").write_text("rank 0/2\n")
    (run_dir / "logs" / "rank1.log").write_text("rank 1/2\n")
    store.update_run(run_id, run_dir=str(run_dir), status="succeeded")
    store.close()
    result = gpuscale("logs", str(run_id), "--rank", "5")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"gpuscale: error: rank: 5: run {run_id} has ranks 0-1"]
    assert gpuscale("logs", str(run_id), "--rank", "1").stdout == "[rank1] rank 1/2\n"
