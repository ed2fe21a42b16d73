"""The suite's own time limits allow for a shared machine: they scale with its slowness."""

import os
import subprocess
import sys

import conftest


def test_this_tests_limit_is_the_quiet_limit_times_the_slowness(request):
    mark = request.node.get_closest_marker("timeout")
    limit = mark.args[0] if mark else float(request.config.getini("timeout"))
    assert limit == 300 * conftest.SLOWNESS
    assert conftest.slow(60) == 60 * conftest.SLOWNESS


def test_a_set_slowness_is_reported_and_applied():
    test = "tests/unit/test_suite_timeouts.py::test_this_tests_limit_is_the_quiet_limit_times_the_slowness"
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", test],
                            env={**os.environ, "GPUSCALE_TEST_SLOWNESS": "3"}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "machine slowness 3.0" in result.stdout and "1 passed" in result.stdout
