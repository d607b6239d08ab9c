"""Where sandboxes make their cgroups (envs/sandbox/cgroups.py `find_cgroup_root`), on a cgroup
tree laid out in a temporary folder: what it takes, and what it leaves when it cannot use it."""

import pytest

from whetstone.envs.sandbox import cgroups


@pytest.fixture
def v2_tree(tmp_path, monkeypatch):
    """A cgroup v2 mount in tmp_path, this process in its group /run/roles (no v1 hierarchies)."""
    own = tmp_path / "run" / "roles"
    own.mkdir(parents=True)
    monkeypatch.setattr(cgroups, "MOUNTS", tmp_path)
    monkeypatch.setattr(cgroups, "own_cgroup_path", lambda controller: "/run/roles" if controller == "" else None)
    return own


def test_a_v2_group_that_passes_on_no_pids_or_memory_is_left_as_it_was(v2_tree):
    """The kernel fills a new group's cgroup.controllers from its parent's subtree_control; a
    group whose processes keep it from passing pids and memory on (a run's CPU group) gets none.
    The probe folder goes again: left there, it kept the run's CPU group from being removed."""
    assert cgroups.find_cgroup_root() is None
    assert list(v2_tree.iterdir()) == []


def test_a_v2_parent_that_was_there_before_is_not_removed(v2_tree):
    """Another process's sandboxes may use it."""
    (v2_tree / "whetstone").mkdir()
    (v2_tree / "whetstone" / "cgroup.controllers").write_text("cpu io\n")
    assert cgroups.find_cgroup_root() is None
    assert (v2_tree / "whetstone").is_dir()


def test_a_v2_parent_with_pids_and_memory_is_where_sandbox_groups_go(v2_tree):
    (v2_tree / "whetstone").mkdir()
    (v2_tree / "whetstone" / "cgroup.controllers").write_text("cpu io memory pids\n")
    root = cgroups.find_cgroup_root()
    assert root == cgroups.CgroupRoot(2, v2_tree / "whetstone", v2_tree / "whetstone")
    assert (v2_tree / "whetstone" / "cgroup.subtree_control").read_text() == "+pids +memory"
