import json
import os

import pytest

from whetstone.utils.atomic import atomic_directory, atomic_path, atomic_write_json


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "a" / "x.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_failed_write_leaves_old_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_atomic_directory(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError
    assert (target / "a").read_text() == "1"
    with atomic_directory(target) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_atomic_directory_syncs_its_files_and_folders_before_the_rename(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd)
    )
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or replace(a, b))
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("2")
    renamed = events.index(("replace", str(tmp)))
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert {str(tmp / "a"), str(tmp / "sub" / "b"), str(tmp / "sub"), str(tmp)} <= synced
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the parent, after the rename
    assert (target / "sub" / "b").read_text() == "2"
