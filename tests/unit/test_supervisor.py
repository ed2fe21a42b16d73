"""The supervisor's own process hygiene: what it opens for the launcher, it closes."""

from __future__ import annotations

import gc
import json
import sys
import warnings

from gpuscale.engines.store import Store
from gpuscale.engines.supervisor import Supervisor


def test_launch_leaves_no_file_open_in_the_supervisor(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [sys.executable, "-c", "print('launcher started')"], "host")
    run_dir = tmp_path / "runs" / str(run_id)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"gpu_indices": [], "nproc": 1}))
    supervisor = Supervisor(store, run_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launcher = supervisor.launch()
        gc.collect()  # a file object nobody closed warns when it is collected
    assert launcher.wait(30) == 0
    assert (run_dir / "logs" / "launcher.log").read_text() == "launcher started\n"  # the child's copy wrote it
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
