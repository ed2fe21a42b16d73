"""The pieces of resuming a run that need no rank: the store's parent_id migration, finding the last
complete checkpoint, the checkpoint settings and their TrainingArguments, the refusals."""

from __future__ import annotations

import sqlite3

import pytest
import sqlite_utils

from gpuscale.control import launch
from gpuscale.control.store import MIGRATIONS, SCHEMA_VERSION, Store
from gpuscale.engines.trl_checkpoints import checkpoint_args, resume_checkpoint
from gpuscale.runs.checkpoints import latest_checkpoint, prune_checkpoints, writing_checkpoint
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.settings import RunSettings, SettingsError, resolve_settings


def test_a_version_3_history_gains_parent_id_and_keeps_its_runs(tmp_path):
    (tmp_path / "runs").mkdir()
    db = sqlite_utils.Database(sqlite3.connect(tmp_path / "runs.db"))
    for migrate in MIGRATIONS[:3]:
        migrate(db)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (3)")
    db["runs"].insert({"id": 7, "recipe": "eggroll", "status": "failed", "settings": "{}", "label": "old"})
    db.conn.commit()
    db.conn.close()

    store = Store(tmp_path)
    assert SCHEMA_VERSION == 4
    assert store.db.execute("SELECT version FROM schema_version").fetchone()[0] == 4
    old = store.get_run(7)
    assert old["label"] == "old" and old["parent_id"] is None
    child = store.create_run("eggroll", {}, [], "host", parent_id=7)
    assert store.get_run(child)["parent_id"] == 7


def complete(run_dir, step, marker="checkpoint.json"):
    folder = RunDir(run_dir).checkpoint(step)
    folder.mkdir(parents=True)
    (folder / marker).write_text("{}")
    return folder


def test_latest_checkpoint_skips_incomplete_and_partial_folders(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    complete(tmp_path, 5)
    complete(tmp_path, 40, marker="trainer_state.json")  # TRL's
    RunDir(tmp_path).checkpoint(100).mkdir()  # TRL killed while writing: no trainer_state.json yet
    (RunDir(tmp_path).checkpoints / ".checkpoint-120.99.partial").mkdir()
    assert latest_checkpoint(tmp_path).name == "checkpoint-40"  # by step, not by name

    with pytest.raises(RuntimeError), writing_checkpoint(tmp_path, 60) as folder:
        (folder / "checkpoint.json").write_text("{}")
        raise RuntimeError("killed while writing")
    assert latest_checkpoint(tmp_path).name == "checkpoint-40"
    with writing_checkpoint(tmp_path, 60) as folder:
        (folder / "checkpoint.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "checkpoint-60"
    prune_checkpoints(tmp_path, keep=2)
    left = sorted(p.name for p in RunDir(tmp_path).checkpoints.iterdir())
    assert left == ["checkpoint-100", "checkpoint-40", "checkpoint-60"]  # the incomplete one is not counted


def test_checkpoint_settings_and_their_training_arguments(tmp_path):
    settings = resolve_settings(RunSettings, environ={})
    assert (settings.checkpoint_every, settings.keep_checkpoints, settings.resume_from) == (50, 2, None)
    assert checkpoint_args(settings, tmp_path) == {"save_strategy": "steps", "save_steps": 50, "save_total_limit": 2,
                                                   "output_dir": str(tmp_path / "checkpoints")}
    off = resolve_settings(RunSettings, overrides={"checkpoint_every": "off"}, environ={})
    # None on a schedule, but SLURM's signal may still ask for one (engines/preemption.py): it goes there too.
    assert off.checkpoint_every == 0 and checkpoint_args(off, tmp_path) == {
        "save_strategy": "no", "save_total_limit": 2, "output_dir": str(tmp_path / "checkpoints")}
    assert resume_checkpoint(settings) is None
    there = resolve_settings(RunSettings, overrides={"resume_from": str(tmp_path)}, environ={})
    assert resume_checkpoint(there) == str(tmp_path)
    for key, value, reason in (("checkpoint_every", "-1", "greater than or equal to 0"),
                               ("keep_checkpoints", "0", "greater than or equal to 1"),
                               ("resume_from", str(tmp_path / "nope"), "no such checkpoint folder")):
        with pytest.raises(SettingsError, match=f"^{key}: .*{reason}"):
            resolve_settings(RunSettings, overrides={key: value}, environ={})


@pytest.mark.parametrize("status, every, says", [
    ("running", 50, "run 3 is running: only a stopped, failed or lost run can be resumed"),
    ("succeeded", 50, "run 3 succeeded: there is nothing left to resume"),
    ("stopped", 0, "run 3 has no checkpoint to resume from (it saved none: checkpoint_every was 0)"),
    ("lost", 50, "run 3 has no checkpoint to resume from (it saved none: it stopped before step 50, "
                 "or its recipe writes no checkpoints)"),
])
def test_what_cannot_be_resumed_says_why(tmp_path, status, every, says):
    run = {"id": 3, "status": status, "run_dir": str(tmp_path), "settings": {"checkpoint_every": every}}
    with pytest.raises(launch.ResumeRefused) as refused:
        launch.resume_point(run)
    assert str(refused.value) == says


def test_a_resumed_run_without_its_own_checkpoint_goes_back_to_its_parents(tmp_path):
    parents = complete(tmp_path / "parent", 50)
    run = {"id": 4, "status": "failed", "run_dir": str(tmp_path / "child"),
           "settings": {"checkpoint_every": 50, "resume_from": str(parents)}}
    assert launch.resume_point(run) == parents
    mine = complete(tmp_path / "child", 100)
    assert launch.resume_point(run) == mine


def test_a_run_resumed_before_is_refused_naming_the_runs_that_continued_it(tmp_path):
    """Checked before anything starts: the refusal names each child and both ways on (--force)."""
    store = Store(tmp_path)
    parent = store.create_run("eggroll", {}, [], "h")
    first, second = (store.create_run("eggroll", {}, [], "h", parent_id=parent) for _ in range(2))
    store.finish_run(parent, "failed")
    store.finish_run(first, "stopped")
    folder = RunDir(store.get_run(parent)["run_dir"]).make()
    folder.settings.write_text(RunSettings(checkpoint_every=2).model_dump_json())
    complete(folder.root, 2)
    with pytest.raises(launch.AlreadyResumed) as refused:
        launch.resume_run(store, EggrollLike(), store.get_run(parent))
    assert [child["id"] for child in refused.value.children] == [first, second]
    assert str(refused.value) == (f"run {parent} was already resumed by run {first} (stopped), run {second} "
                                  f"(queued); `gpuscale resume {parent} --force` resumes run {parent} again")
    store.finish_run(second, "failed")  # the newest can itself be resumed: said first
    with pytest.raises(launch.AlreadyResumed, match=rf"\(failed\); `gpuscale resume {second}` goes on from where "
                                                    rf"that got, `gpuscale resume {parent} --force`"):
        launch.resume_run(store, EggrollLike(), store.get_run(parent))
    assert [run["id"] for run in store.list_runs()] == [second, first, parent]  # nothing was started


class EggrollLike:
    """A recipe as resume_settings sees it: its settings class and what it resumes besides checkpoints."""

    settings_cls = RunSettings

    def resume_overrides(self, run: dict) -> dict:
        return {}


def test_rft_resumes_a_run_stopped_in_generation_from_the_answers_it_kept(tmp_path):
    """No checkpoint (it never trained), but kept answers: the new run trains on them (data_from
    the folder); a run without kept answers is refused as having nothing to resume from."""
    from gpuscale.recipes.shared.registry import get_recipe

    rft = get_recipe("rft")
    folder = RunDir(tmp_path / "runs" / "43").make()
    folder.settings.write_text(rft.settings_cls(max_examples=4000).model_dump_json())
    run = {"id": 43, "status": "stopped", "run_dir": str(folder.root), "settings": {"checkpoint_every": 0}}
    with pytest.raises(launch.ResumeRefused, match="run 43 has no checkpoint to resume from"):
        launch.resume_settings(rft, run)
    folder.results.write_text('{"question": "1+1", "completion": "2", "domain": "add", "source": "sample"}\n')
    settings = launch.resume_settings(rft, run, {"max_steps": 1})
    assert settings.data_from == str(folder.root) and settings.resume_from is None
    assert settings.max_examples == 4000 and settings.max_steps == 1
    # Its child trains on a set already: nothing more of that kind to continue from.
    assert rft.resume_overrides({**run, "settings": {"data_from": str(folder.root)}}) == {}
