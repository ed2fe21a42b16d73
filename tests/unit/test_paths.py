"""A path the user types is kept absolute and normalised (the ranks start in the run folder): `..` and
`.` gone, the folders above resolved, the path's own name kept where it is a symbolic link."""

import json

from gpuscale.data.models import model_path
from gpuscale.data.paths import absolute_path
from gpuscale.recipes.rft import Settings as RftSettings
from gpuscale.recipes.sft import Settings
from gpuscale.runs.settings import resolve_settings


def test_dot_dot_and_tilde_are_taken_out(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path))
    real = tmp_path.resolve()
    assert absolute_path("../m") == real / "m"
    assert absolute_path("./a/../b/./c.jsonl") == real / "work" / "b" / "c.jsonl"
    assert absolute_path("~/x") == real / "x"
    assert absolute_path("..") == real and absolute_path("/") == absolute_path("/..")


def test_a_linked_name_is_kept_and_the_folders_above_it_resolved(tmp_path, monkeypatch):
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "sha256-1f2e").write_text("")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "test.jsonl").symlink_to(tmp_path / "blobs" / "sha256-1f2e")
    (tmp_path / "linked").symlink_to(tmp_path / "snapshot")
    monkeypatch.chdir(tmp_path / "blobs")
    # `linked/..` is the folder above snapshot, as the system reads it; the file keeps its own name.
    assert absolute_path("../linked/test.jsonl") == tmp_path.resolve() / "snapshot" / "test.jsonl"


def test_model_dataset_and_data_from_are_stored_normalised_and_a_hub_id_as_typed(tmp_path, monkeypatch):
    """`--model ../m` used to be stored as WORK/../m."""
    model = tmp_path / "m"
    model.symlink_to(model_path())  # a local model folder (linked: its name is kept)
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "one.jsonl").write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    monkeypatch.chdir(work)
    settings = resolve_settings(Settings, overrides={"model": "../m", "dataset": "./data/../data/one.jsonl"},
                                environ={})
    assert settings.model == str(tmp_path.resolve() / "m")
    assert settings.dataset == str(work.resolve() / "data" / "one.jsonl")
    hub = resolve_settings(Settings, overrides={"model": "Qwen/Qwen2.5-0.5B"}, environ={})
    assert hub.model == "Qwen/Qwen2.5-0.5B"
    assert resolve_settings(RftSettings, overrides={"data_from": "../m"}, environ={}).data_from == str(
        tmp_path.resolve() / "m")
    assert resolve_settings(RftSettings, overrides={"data_from": "12"}, environ={}).data_from == "12"  # a run id
