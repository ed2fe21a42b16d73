import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuscale.control import launch
from gpuscale.recipes.probe import Settings
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.devices import usable_cores
from gpuscale.runs.settings import SettingsError


def test_plan_on_a_gpu_machine():
    available = [0, 1, 2, 3]
    assert launch.plan_devices("all", available) == launch.DevicePlan(4, (0, 1, 2, 3))
    assert launch.plan_devices(2, available).gpu_indices == (0, 1)
    assert launch.plan_devices([0, 3], available).gpu_indices == (0, 3)
    with pytest.raises(SettingsError, match=r"gpus: 8: only 4 GPU\(s\) here"):
        launch.plan_devices(8, available)
    with pytest.raises(SettingsError, match="gpus: 1,5: no GPU 5 here"):
        launch.plan_devices([1, 5], available)


def test_the_cores_counted_are_those_the_process_may_run_on():
    """A process pinned to one core (taskset, a container's cpuset, SLURM's --cpus-per-task) counts one, not
    the machine's: its ranks' threads and the CPU ranks it allows follow."""
    pinned = subprocess.run([sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
                             "from gpuscale.runs.devices import usable_cores; print(usable_cores())"],
                            capture_output=True, text=True, check=True)
    assert pinned.stdout.split() == ["1"]
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_plan_on_a_cpu_machine():
    assert launch.plan_devices("all", []) == launch.DevicePlan(1, ())
    assert launch.plan_devices(1, []).on_gpu is False
    cores = usable_cores()
    # More ranks than cores run (the launch warns: control/host_load.py), up to four a core.
    assert launch.plan_devices(4 * cores, []).nproc == 4 * cores
    with pytest.raises(SettingsError, match=rf"gpus: {4 * cores + 1}: no GPU here, and {cores} CPU cores take at "
                                            rf"most {4 * cores} CPU ranks$"):
        launch.plan_devices(4 * cores + 1, [])
    with pytest.raises(SettingsError, match="no NVIDIA GPU"):
        launch.plan_devices([0, 1], [])


def test_torchrun_argv_single_and_multi_node(tmp_path):
    recipe = get_recipe("probe")
    path = tmp_path / "settings.json"
    argv = launch.launcher_argv(recipe, Settings(), launch.DevicePlan(2, (0, 1)), path)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in argv
    assert argv[-6:] == ["-m", "gpuscale.recipes", "--recipe", "probe", "--settings", str(path)]
    multi = Settings(nnodes=2, node_rank=1, rdzv_endpoint="node1:29400", rdzv_id="job7")
    argv = launch.torchrun_argv(multi, launch.DevicePlan(8, tuple(range(8))), recipe.rank_entry, path)
    joined = " ".join(argv)
    assert "--standalone" not in argv
    assert "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint node1:29400 --rdzv-id job7" in joined
    assert launch.display_command(argv).startswith("torchrun --nproc-per-node 8")


def test_accelerate_argv(tmp_path):
    plan = launch.DevicePlan(4, (0, 1, 2, 3))
    argv = launch.accelerate_argv(Settings(precision="bf16"), plan, ["-m", "m"], tmp_path / "s")
    assert argv[1:3] == ["-m", "accelerate.commands.launch"]
    assert argv[argv.index("--num_processes") + 1] == "4" and "--multi_gpu" in argv
    # The rank alone decides the autocast (its trainer's bf16/fp16): accelerate's flag is always `no`.
    for precision in ("auto", "bf16", "fp16", "fp32"):
        flagged = launch.accelerate_argv(Settings(precision=precision), plan, ["-m", "m"], tmp_path / "s")
        assert flagged[flagged.index("--mixed_precision") + 1] == "no"
    assert argv[argv.index("--main_process_port") + 1] == "0"  # a free port: concurrent runs never collide
    # Several CPU ranks go through accelerate's multi-process launcher too (its --cpu wants mpirun).
    cpu_ranks = launch.accelerate_argv(Settings(), launch.DevicePlan(2, ()), ["-m", "m"], tmp_path / "s")
    assert cpu_ranks[1:3] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in cpu_ranks
    assert "--cpu" not in cpu_ranks and cpu_ranks[-4:] == ["-m", "m", "--settings", str(tmp_path / "s")]
    one_cpu = launch.accelerate_argv(Settings(), launch.DevicePlan(1, ()), ["-m", "m"], tmp_path / "s")
    assert "--cpu" in one_cpu and "--multi_gpu" not in one_cpu
    multi = Settings(nnodes=2, node_rank=1, rdzv_endpoint="node1:29400")
    argv = launch.accelerate_argv(multi, launch.DevicePlan(8, tuple(range(8))), ["-m", "m"], tmp_path / "s")
    joined = " ".join(argv)
    assert "--num_processes 16 --num_machines 2 --machine_rank 1" in joined
    assert "--main_process_ip node1 --main_process_port 29400" in joined and argv.count("--main_process_port") == 1


# `accelerate_argv` for 2 CPU ranks, run for real (every rank runs, joins one group, reports): the 2-rank
# runs of the accelerate recipes, e.g. tests/integration/test_sft_run.py's
# test_two_cpu_ranks_fine_tune_under_accelerate_launch (its command `accelerate launch --multi_gpu
# --num_processes 2`, world_size 2, both ranks' rows). One process goes without a launcher
# (`test_a_run_of_one_process_starts_its_rank_without_a_launcher`).


LAUNCHER_MODULES = {"torchrun": "torch.distributed.run", "accelerate": "accelerate.commands.launch"}


@pytest.mark.parametrize("name", ["probe", "sft"])  # under torchrun, under accelerate
def test_a_run_of_one_process_starts_its_rank_without_a_launcher(tmp_path, name):
    recipe, path = get_recipe(name), tmp_path / "settings.json"
    settings = recipe.settings_cls()
    for plan in (launch.DevicePlan(1, ()), launch.DevicePlan(1, (3,))):
        argv = launch.launcher_argv(recipe, settings, plan, path)
        assert argv == [sys.executable, "-m", "gpuscale.recipes", "--recipe", name, "--settings", str(path)]
        assert launch.direct_rank_environment(recipe, settings, plan)
        assert launch.display_command(argv) == f"python -m gpuscale.recipes --recipe {name} --settings {path}"
    # Two ranks, or one rank on each of two nodes: the launcher, and no variables of the supervisor's.
    nodes = recipe.settings_cls(nnodes=2, node_rank=1, rdzv_endpoint="node1:29400", rdzv_id="job7")
    for launched, plan in ((settings, launch.DevicePlan(2, ())), (nodes, launch.DevicePlan(1, (0,)))):
        argv = launch.launcher_argv(recipe, launched, plan, path)
        assert argv[1:3] == ["-m", LAUNCHER_MODULES[recipe.launcher]]
        assert launch.direct_rank_environment(recipe, launched, plan) is None


@pytest.mark.e2e
@pytest.mark.parametrize("name, plan", [("probe", launch.DevicePlan(1, ())), ("sft", launch.DevicePlan(1, ())),
                                        ("sft", launch.DevicePlan(1, (0,)))])
def test_a_rank_without_its_launcher_gets_what_the_launcher_gives_its_one_process(tmp_path, name, plan):
    """The real launcher with its own argv for one process (`torchrun_argv`, `accelerate_argv`: --cpu for
    a CPU plan), around a script that writes its environment: what the launcher adds is what
    `direct_rank_environment` gives a rank started without it, but for torchrun's TORCHELASTIC_*
    (its agent's, left out) and the free port it picked."""
    recipe = get_recipe(name)
    settings = recipe.settings_cls()
    script, written = tmp_path / "environment.py", tmp_path / "environment.json"
    script.write_text("import json, os, sys\nopen(sys.argv[2], 'w').write(json.dumps(dict(os.environ)))\n")
    argv = launch.LAUNCHERS[recipe.launcher](settings, plan, [str(script)], written)
    # No `accelerate config` file of the user's: HF_HOME is where accelerate looks for one.
    given = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path)}
    subprocess.run(argv, check=True, env=given, capture_output=True, timeout=120)
    added = {key: value for key, value in json.loads(written.read_text()).items()
             if given.get(key) != value and not key.startswith("TORCHELASTIC_")}
    expected = launch.direct_rank_environment(recipe, settings, plan)
    if "MASTER_PORT" in expected:
        assert int(added.pop("MASTER_PORT")) > 0 and int(expected.pop("MASTER_PORT")) > 0
    assert added == expected


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_script_is_valid_bash(tmp_path):
    script = launch.sbatch_script("probe", 2, 8, ["--set", "steps=5", "--set", "model=it's/odd"])
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--nnodes 2" in script and '--node-rank "$SLURM_NODEID"' in script


@pytest.mark.parametrize("gpu_indices, nproc", [([], 2), ([0, 3], 2), ([5], 1)])
def test_ranks_share_the_free_cores_unless_the_user_set_threads(monkeypatch, gpu_indices, nproc):
    from gpuscale.control import supervisor
    from gpuscale.control.supervisor import rank_environment

    monkeypatch.setattr(supervisor, "usable_cores", lambda: 16)
    monkeypatch.setattr(supervisor, "busy_cores", lambda cores: 0.3)  # an idle machine
    plan = {"gpu_indices": gpu_indices, "nproc": nproc}
    env = rank_environment({"PATH": "/bin"}, Path("/runs/7"), plan)
    assert env["OMP_NUM_THREADS"] == str(16 // nproc)
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == str(16 // nproc)  # Inductor's compile workers: the same share
    assert env["GPUSCALE_RUN_DIR"] == "/runs/7" and env["PATH"] == "/bin"
    assert env["TENSORBOARD_LOGGING_DIR"] == "/runs/7/tensorboard"  # report_to=tensorboard writes in the run folder
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpu_indices))
    assert (env.get("GPUSCALE_DEVICE") == "cpu") == (not gpu_indices)
    assert rank_environment({"OMP_NUM_THREADS": "3"}, Path("/runs/7"), plan)["OMP_NUM_THREADS"] == "3"
    users = rank_environment({"TORCHINDUCTOR_COMPILE_THREADS": "5"}, Path("/runs/7"), plan)
    assert users["TORCHINDUCTOR_COMPILE_THREADS"] == "5" and users["OMP_NUM_THREADS"] == str(16 // nproc)


@pytest.mark.parametrize("cores, busy, nproc, threads", [
    (2, 2.0, 1, "1"),   # CI's two cores, both taken by other work: one thread, not two at barriers
    (2, 1.0, 2, "1"),
    (16, 12.0, 2, "2"),  # four free cores for two ranks
    (16, 15.8, 1, "1"),
    (2, 0.2, 1, "2"),   # an idle laptop keeps its parallel speed-up
])
def test_a_busy_machine_gets_no_more_threads_than_free_cores(monkeypatch, cores, busy, nproc, threads):
    """Ranks on a busy machine ran 40-250x slower with cores / ranks threads."""
    from gpuscale.control import supervisor

    monkeypatch.setattr(supervisor, "usable_cores", lambda: cores)
    monkeypatch.setattr(supervisor, "busy_cores", lambda cores: busy)
    env = supervisor.rank_environment({}, Path("/runs/7"), {"gpu_indices": [], "nproc": nproc})
    assert env["OMP_NUM_THREADS"] == threads
    value, why = supervisor.omp_threads({}, nproc)
    assert value == threads and f"{cores} cores" in why and f"{busy:.1f} busy" in why
    assert supervisor.omp_threads({"OMP_NUM_THREADS": "4"}, nproc) == ("4", "set by the user")


@pytest.mark.parametrize("ranks_here, gpus_here, threads", [
    (1, 0, "64"),    # a lone CPU run keeps every core
    (4, 4, "16"),    # four 1-GPU runs started together on a 4-GPU host: a GPU's share each, not 64
    (48, 4, "1"),    # twelve 4-GPU runs on one host: the cores over all their ranks
    (1, 8, "8"),     # a lone 1-GPU run on an 8-GPU host: its GPU's share
])
def test_runs_started_together_share_the_host_by_their_ranks_and_gpus(ranks_here, gpus_here, threads):
    from gpuscale.control.supervisor import omp_threads

    value, why = omp_threads({}, 1, cores=64, busy=0.0, ranks_here=ranks_here, gpus_here=gpus_here)
    assert value == threads and f"of {ranks_here} on this host" in why
    assert ("GPUs" in why) == bool(gpus_here)


def test_the_history_counts_the_ranks_of_the_live_runs_on_a_host(tmp_path):
    import json

    from gpuscale.control.store import Store
    from gpuscale.runs.run_dir import RunDir

    store = Store(tmp_path)
    ids = [store.create_run("probe", {}, [], host) for host in ("node1", "node1", "node1", "node2")]
    for run_id, nproc in zip(ids, (4, 2, 8, 4), strict=True):
        folder = RunDir(store.get_run(run_id)["run_dir"])
        folder.plan.parent.mkdir(parents=True, exist_ok=True)
        folder.plan.write_text(json.dumps({"nproc": nproc, "gpu_indices": list(range(nproc))}))
    store.update_run(ids[1], status="running")
    store.finish_run(ids[2], "succeeded")  # ended: its 8 ranks no longer count
    assert store.live_ranks_on("node1") == 4 + 2 and store.live_ranks_on("node2") == 4
    RunDir(store.get_run(ids[0])["run_dir"]).plan.unlink()  # an unreadable plan counts one rank
    assert store.live_ranks_on("node1") == 1 + 2 and store.live_ranks_on("elsewhere") == 0
    store.close()


def test_busy_cores_sees_work_that_just_started():
    """A loop started now shows in the CPU use at once, before the load average catches up."""
    from gpuscale.control.supervisor import busy_cores

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert busy_cores(os.cpu_count() or 1) >= 0.5
    finally:
        spinner.kill()
        spinner.wait()



def test_sbatch_requeue_script_signals_ahead_of_the_limit_and_requeues_itself(tmp_path):
    """`gpuscale sbatch --requeue`'s script, run by bash with a stand-in srun and scontrol: SLURM's
    USR1 (300 s before the limit, to the batch shell) reaches srun at once (srun in the background,
    so that the trap runs), the shell waits for the nodes' runs to end and requeues the job."""
    printed = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "sbatch", "--recipe", "probe", "--nodes", "2",
                              "--gpus-per-node", "4", "--requeue", "--set", "steps=5"], capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert {"#SBATCH --requeue", "#SBATCH --signal=B:USR1@300"} <= set(lines)
    assert "--slurm-requeue" in next(line for line in lines if line.lstrip().startswith("gpuscale run"))
    script = tmp_path / "job.sh"
    script.write_text(printed.stdout)
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"""#!/bin/bash
trap 'echo "srun: USR1" >> {log}; exit 0' USR1
echo "srun: $*" >> {log}
while true; do sleep 0.05; done
""")
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
if [ "$1" = show ]; then echo node7; else echo "scontrol: $*" >> {log}; fi
""")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node7"}
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not (log.exists() and "srun:" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=10)
    assert job.returncode == 0
    assert "USR1 from SLURM" in out
    srun_line, *rest = log.read_text().splitlines()
    assert "--slurm-requeue" in srun_line and '--rdzv-endpoint node7:29500' in srun_line
    assert rest == ["srun: USR1", "scontrol: requeue 77"]


def test_sbatch_refuses_a_signal_margin_slurm_does_not_take():
    refused = subprocess.run([sys.executable, "-m", "gpuscale.app.cli", "sbatch", "--recipe", "probe", "--nodes", "1",
                              "--gpus-per-node", "1", "--requeue", "--signal-margin", "0"],
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr == "gpuscale: error: signal-margin: 0: SLURM takes 1 to 65535 seconds\n"


def test_the_front_end_waits_for_its_own_supervisor_s_exit_not_a_whole_poll(monkeypatch):
    """`gpuscale run` polls its run every 0.5 s; where it started the supervisor, the wait ends as
    that process exits (the run's end is recorded by then). Another front end's run: a plain sleep."""
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    monkeypatch.setattr(launch, "_children", [supervisor])
    started = time.monotonic()
    launch.wait_for_own_supervisor({"supervisor_pid": supervisor.pid}, 30)
    assert supervisor.returncode == 0 and time.monotonic() - started < 10
    started = time.monotonic()
    launch.wait_for_own_supervisor({"supervisor_pid": supervisor.pid}, 0.2)  # ended: nothing to wait on
    launch.wait_for_own_supervisor({"supervisor_pid": None}, 0.2)  # not started here
    assert time.monotonic() - started >= 0.4
