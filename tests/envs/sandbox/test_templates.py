"""The workspace pool: templates written once, private copies prepared ahead of time."""

import shutil
import time

import pytest

from whetstone.envs.sandbox import templates
from whetstone.envs.sandbox.templates import WorkspacePool
from whetstone.errors import WhetstoneError

A = {"pkg/mod.py": "X = 1\n", "run.sh": "#!/bin/sh\necho hi\n"}
B = {"other.py": "Y = 2\n"}


def wait_for_spares(pool: WorkspacePool, count: int) -> list:
    for _ in range(500):
        spares = [spare for template in pool._templates.values() for spare in template.spares]
        if len(spares) >= count:
            return spares
        time.sleep(0.01)
    raise AssertionError("the pool never prepared its spares")


def test_checkouts_are_private_copies_and_spares_are_prepared(tmp_path):
    pool = WorkspacePool(tmp_path, spares=2, max_templates=4)
    first = pool.checkout(A)
    assert (first / "pkg/mod.py").read_text() == "X = 1\n"
    spares = wait_for_spares(pool, 2)
    second = pool.checkout(A)
    assert second in spares and second != first  # handed out ready-made, not copied on demand
    (second / "pkg/mod.py").write_text("X = 2\n")
    assert (pool.checkout(A) / "pkg/mod.py").read_text() == "X = 1\n"
    pool.close()


def test_evicted_and_closed_templates_are_deleted(tmp_path):
    pool = WorkspacePool(tmp_path, spares=1, max_templates=1)
    pool.checkout(A)
    wait_for_spares(pool, 1)
    pool.checkout(B)  # A is the least recently used: its template and spare go
    remaining = sorted(p.name for p in (tmp_path / "templates").iterdir())
    assert len(remaining) == 1 and (tmp_path / "templates" / remaining[0] / "other.py").exists()
    pool.close()
    assert list((tmp_path / "templates").iterdir()) == []


def test_snapshot_directories_are_used_in_place_and_never_deleted(tmp_path):
    snapshot = tmp_path / "repo"
    (snapshot / ".git").mkdir(parents=True)
    (snapshot / "main.py").write_text("print(1)\n")
    pool = WorkspacePool(tmp_path / "pool", spares=0, max_templates=1)
    workspace = pool.checkout(snapshot)
    assert sorted(p.name for p in workspace.iterdir()) == ["main.py"]
    pool.checkout(A)  # evicts the snapshot's entry
    pool.close()
    assert (snapshot / "main.py").exists()
    with pytest.raises(WhetstoneError, match="does not exist"):
        WorkspacePool(tmp_path / "pool2", spares=0, max_templates=1).checkout(tmp_path / "missing")


def test_a_template_evicted_halfway_through_a_copy_is_copied_again(tmp_path, monkeypatch):
    """Another thread's checkout of a new task can evict the template a checkout is copying (the
    copy runs outside the pool's lock): the copy then fails on files already deleted, and the
    checkout starts over with the template written again."""
    pool = WorkspacePool(tmp_path, spares=0, max_templates=1)
    copy, evicting = shutil.copy, []

    def copy_while_evicted(source, destination, **kwargs):
        if not evicting:
            evicting.append(True)
            pool.checkout(B)  # the other thread's checkout, at this point of the copy
        return copy(source, destination, **kwargs)

    monkeypatch.setattr(templates.shutil, "copy", copy_while_evicted)
    workspace = pool.checkout(A)
    assert evicting and (workspace / "pkg/mod.py").read_text() == "X = 1\n"
    assert (workspace / "run.sh").read_text() == "#!/bin/sh\necho hi\n"
    pool.close()
