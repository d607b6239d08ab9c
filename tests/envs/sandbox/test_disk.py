"""The disk budget's bookkeeping (envs/sandbox/disk.py) on plain folders: what counts as a write
cut short at the size cap, and what taking a command's growth back keeps."""

import ctypes
import os
import shutil
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from tests.envs.sandbox.sandbox_support import as_non_root, in_child
from whetstone.envs.sandbox import disk
from whetstone.envs.sandbox.disk import BLOCK, MAX_PATH_CHARS, DiskWatch, _tree, remove_tree, scan
from whetstone.errors import WhetstoneError


def listing(directory: Path) -> list[str]:
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*"))


def replace(path: Path, text: str) -> None:
    """Write `text` as a new file renamed over `path`, as `sed -i` and atomic writes do."""
    staged = path.with_name(path.name + ".new")
    staged.write_text(text)
    os.replace(staged, path)


def watch_with_a_cap(directory: Path, limit: int) -> tuple[DiskWatch, int]:
    """A command's watch whose budget left is under the file-size limit, and that cap."""
    watch = DiskWatch([directory], {}, limit)
    cap = watch.file_limit(64 << 20)
    assert cap < 64 << 20
    return watch, cap


def test_only_a_file_grown_to_the_cap_is_a_write_cut_short(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 1_900_000)  # far past what is left of a 2 MiB budget
    watch, cap = watch_with_a_cap(tmp_path, 2 << 20)
    os.truncate(big, 1_000_000)  # used less disk than before: reached nothing
    (tmp_path / "notes.txt").write_text("hi\n")
    assert not watch.ran_into()

    watch, cap = watch_with_a_cap(tmp_path, 2 << 20)
    os.rename(big, tmp_path / "moved.txt")  # a large file moved, not grown
    replace(tmp_path / "moved.txt", "y" * 900_000)  # and rewritten, smaller
    assert not watch.ran_into()

    watch, cap = watch_with_a_cap(tmp_path, 2 << 20)
    (tmp_path / "out.bin").write_bytes(b"z" * cap)  # what RLIMIT_FSIZE lets a new file reach
    assert watch.ran_into()


def test_taking_back_keeps_the_files_the_task_had_even_when_replaced(tmp_path):
    (tmp_path / "keep.py").write_text("x = 1\n")
    (tmp_path / "log.txt").write_text("start\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("a = 1\n")
    watch = DiskWatch([tmp_path], {}, 32 << 20)
    # the command: two edits that wrote new files (one of them grown), a folder made anew with
    # its old file moved back in, and new files
    replace(tmp_path / "keep.py", "x = 2\n")
    replace(tmp_path / "log.txt", "start\n" + "y" * 100_000)
    os.rename(tmp_path / "pkg", tmp_path / "old-pkg")
    (tmp_path / "pkg").mkdir()
    os.rename(tmp_path / "old-pkg" / "mod.py", tmp_path / "pkg" / "mod.py")
    (tmp_path / "old-pkg").rmdir()
    (tmp_path / "pkg" / "new.py").write_text("b = 2\n")
    (tmp_path / "fill.bin").write_bytes(b"0" * (40 << 20))
    undone = watch.undo()
    assert listing(tmp_path) == ["keep.py", "log.txt", "pkg", "pkg/mod.py"]
    assert (tmp_path / "keep.py").read_text() == "x = 2\n"  # edited, stays edited
    assert (tmp_path / "log.txt").read_text() == "start\n"  # grown, cut back to its earlier size
    assert (undone.removed, undone.cut_back) == (2, 1)


def test_a_grown_file_made_read_only_is_cut_back_not_deleted(shared_tmp):
    def check():
        data = shared_tmp / "data.txt"
        data.write_text("start\n")
        watch = DiskWatch([shared_tmp], {}, 32 << 20)
        with data.open("a") as grown:
            grown.write("y" * 100_000)
        data.chmod(0o444)
        assert watch.undo().cut_back == 1
        assert data.read_text() == "start\n" and data.stat().st_mode & 0o777 == 0o444

    as_non_root(check)


def nest(directory: Path, depth: int) -> None:
    """`depth` folders named `d`, each inside the one before, under `directory`, and a file in the
    last: made through folder descriptors, as a command that `cd`s down as it goes makes them
    (their paths grow past what one system call takes)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(os.open("f.txt", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)


def test_folders_nested_past_the_recursion_limit_are_measured_taken_back_and_removed(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "keep.py").write_text("x = 1\n")
    watch = DiskWatch([workspace], {}, 64 << 20)
    nest(workspace, 1500)  # paths up to 3,000 characters: within what the budget records
    after = scan([workspace], 64 << 20)
    assert after.complete and not after.too_deep and len(after.entries) == 1 + 1500 + 1
    assert not watch.ran_into()
    assert watch.undo().removed == 1501
    assert listing(workspace) == ["keep.py"]
    nest(workspace, 1500)
    remove_tree(workspace)
    assert not workspace.exists()


def test_folders_nested_past_the_longest_path_count_as_over_the_budget(tmp_path):
    watch = DiskWatch([tmp_path], {}, 64 << 20)
    nest(tmp_path, MAX_PATH_CHARS)  # paths up to twice the longest the budget records
    assert watch.ran_into() and watch.too_deep
    assert scan([tmp_path], 64 << 20).used > 64 << 20
    assert watch.undo().removed == MAX_PATH_CHARS + 1
    assert listing(tmp_path) == []


def test_folders_their_owner_cannot_search_or_read_are_measured_and_taken_back(shared_tmp):
    """A caller that is not root cannot look into a folder without its search bit (`chmod 400`,
    `600`) or list one without its read bit, the workspace itself included: each is opened up
    for its owner, so that a walk neither fails nor misses what such a folder holds."""

    def check():
        workspace = shared_tmp / "ws"
        workspace.mkdir()
        (workspace / "kept.txt").write_text("x\n")
        watch = DiskWatch([workspace], {}, 32 << 20)
        for name, mode in (("listed", 0o400), ("private", 0o600), ("locked", 0o000)):
            (workspace / name).mkdir()
            (workspace / name / "f.bin").write_bytes(b"0" * 100_000)
            (workspace / name).chmod(mode)
        workspace.chmod(0o000)
        measured = scan([workspace], 32 << 20)
        assert {"listed/f.bin", "private/f.bin", "locked/f.bin"} <= {path for _, path in measured.entries}
        assert measured.used >= 3 * 100_000
        workspace.chmod(0o000)  # locked again before the command's growth is taken back
        assert watch.undo().removed == 6
        assert listing(workspace) == ["kept.txt"]

    as_non_root(check)


def test_a_walk_passes_over_folders_replaced_while_it_runs(tmp_path):
    """A command still running may replace a folder the walk has listed but not yet opened: with
    a file (it is not opened), or with a symlink (never followed out of the tree)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not in the tree\n")
    tree_dir = tmp_path / "tree"
    for name in ("a", "b"):
        (tree_dir / name).mkdir(parents=True)
        (tree_dir / name / "x.txt").write_text("1\n")
    fd = os.open(tree_dir, os.O_RDONLY | os.O_DIRECTORY)
    seen = []
    try:
        with closing(_tree(fd)) as tree:
            for _, path, _, st in tree:
                seen.append(path)
                if st is not None and path == "a":
                    shutil.rmtree(tree_dir / "a")
                    (tree_dir / "a").write_text("a file now\n")
                elif st is not None and path == "b":
                    shutil.rmtree(tree_dir / "b")
                    (tree_dir / "b").symlink_to(outside)
    finally:
        os.close(fd)
    assert sorted(seen) == ["a", "b"]


def swap_after_first_open(target: str, swap):
    """`os.open` that runs `swap` once right after the first open of `target` (failed or not):
    a command still running that replaces that name at this point of a walk."""
    real_open, swapped = os.open, []

    def open_then_swap(path, *args, **kwargs):
        try:
            return real_open(path, *args, **kwargs)
        finally:
            if str(path) == target and not swapped:
                swapped.append(True)
                swap()

    return open_then_swap


@pytest.mark.parametrize("locked", ["folder", "workspace", "read-only file"])
def test_a_name_swapped_for_a_symlink_while_opened_up_changes_nothing_outside(shared_tmp, locked):
    """A caller that is not root opens up what its owner locked; a running command that swaps
    the name for a symlink to a host folder right then must not get that folder's mode changed."""

    def check():
        outside = shared_tmp / "outside"
        outside.mkdir(mode=0o500)
        workspace = shared_tmp / "ws"
        workspace.mkdir()
        swapped = {"folder": workspace / "d", "workspace": workspace, "read-only file": workspace / "data.txt"}[locked]

        def swap():
            swapped.rename(
                swapped.with_name("moved")
            )  # in its folder: a locked folder moved elsewhere needs write access
            swapped.symlink_to(outside)

        if locked == "read-only file":
            swapped.write_text("start\n")
            watch = DiskWatch([workspace], {}, 32 << 20)
            with swapped.open("a") as grown:
                grown.write("y" * 100_000)
            swapped.chmod(0o444)
            os.open = swap_after_first_open(swapped.name, swap)
            watch.undo()
        else:
            if locked == "folder":
                swapped.mkdir()
            swapped.chmod(0o000)
            os.open = swap_after_first_open(str(swapped) if locked == "workspace" else swapped.name, swap)
            scan([workspace], 32 << 20)
        assert swapped.is_symlink() and outside.stat().st_mode & 0o777 == 0o500

    as_non_root(check)


def test_a_walk_that_loses_its_way_back_up_counts_as_over_the_budget(tmp_path, monkeypatch):
    """Folders deep in a walk are closed and opened again through `..`: one moved while the walk
    is below it leaves what was left above it uncounted, which is charged as over the bound."""
    nest(tmp_path, 30)  # deep enough that the folders 17 to 29 levels down are closed at the bottom
    lstat = disk._lstat

    def move_at_the_bottom(fd, name):
        if name == "f.txt":
            os.rename(tmp_path / "/".join(["d"] * 25), tmp_path / "elsewhere")
        return lstat(fd, name)

    monkeypatch.setattr(disk, "_lstat", move_at_the_bottom)
    walked = scan([tmp_path], 32 << 20)
    assert not walked.complete and walked.used > 32 << 20


def moving_at_the_bottom(tmp_path: Path, moves: list[int], every_walk: bool):
    """`_lstat` that, as a walk reaches the bottom of `nest(tmp_path, 30)`, moves a folder the walk
    closed on its way down to another parent and back, as a command still running would (its
    walk loses its way back up): on the first walk only, or on `every_walk`."""
    lstat = disk._lstat
    deep = tmp_path / "/".join(["d"] * 25)

    def move_at_the_bottom(fd, name):
        if name == "f.txt" and (every_walk or not moves):
            moves.append(1)
            if deep.exists():
                os.rename(deep, tmp_path / "elsewhere")
            else:
                os.rename(tmp_path / "elsewhere", deep)
        return lstat(fd, name)

    return move_at_the_bottom


def every_check_walks(monkeypatch) -> None:
    monkeypatch.setattr(disk, "WALK_EVERY_S", 0.0)
    monkeypatch.setattr(disk, "POLL_COST_SHARE", 1.0)


def test_a_walk_that_loses_its_way_while_a_command_runs_is_walked_again(tmp_path, monkeypatch):
    """A command that moves folders about (package managers, builds) and uses a sliver of its
    budget is not over it because one walk lost its way: the walk is made again."""
    nest(tmp_path, 30)
    every_check_walks(monkeypatch)
    watch = DiskWatch([tmp_path], {}, 32 << 20)
    moves: list[int] = []
    monkeypatch.setattr(disk, "_lstat", moving_at_the_bottom(tmp_path, moves, every_walk=False))
    assert watch.check(os.getpid()) is None and moves == [1]
    assert not watch.ran_into()


def test_walks_that_keep_losing_their_way_leave_the_budget_to_the_filesystems_growth(tmp_path, monkeypatch):
    """While every walk loses its way, how much the filesystems grew since the last whole walk
    judges the budget: a command moving folders about cannot hide what it writes meanwhile."""
    nest(tmp_path, 30)
    every_check_walks(monkeypatch)
    grown = [0]
    used = disk.filesystems_used
    monkeypatch.setattr(disk, "filesystems_used", lambda directories: used(directories) + grown[0])
    watch = DiskWatch([tmp_path], {}, 32 << 20)
    moves: list[int] = []
    monkeypatch.setattr(disk, "_lstat", moving_at_the_bottom(tmp_path, moves, every_walk=True))
    walks, real_scan = [], disk.scan
    monkeypatch.setattr(disk, "scan", lambda *args: walks.append(real_scan(*args)) or walks[-1])
    assert watch.check(os.getpid()) is None
    assert len(walks) == disk.WALK_TRIES and all(walked.lost for walked in walks)
    grown[0] = 40 << 20  # the filesystem grew past the budget meanwhile
    assert watch.check(os.getpid()) == "disk"


def test_a_closed_folder_locked_while_a_walk_is_below_it_is_opened_up_on_the_way_back(shared_tmp):
    def check():
        nest(shared_tmp, 30)
        fd = os.open(shared_tmp, os.O_RDONLY | os.O_DIRECTORY)
        done = []
        try:
            with closing(_tree(fd)) as tree:
                for _, path, name, st in tree:
                    if name == "f.txt":  # the command locks a folder the walk closed on its way down
                        (shared_tmp / "/".join(["d"] * 24)).chmod(0o000)
                    elif st is None:
                        done.append(path)
        finally:
            os.close(fd)
        assert len(done) == 30  # every folder's contents walked to its end

    as_non_root(check)


def test_a_walk_past_its_bound_reads_no_more_of_a_huge_folder(tmp_path, monkeypatch):
    """A folder's listing is read as the walk goes: one that passes its bound after a few entries
    does not first read all of a folder of thousands."""
    for i in range(3000):
        (tmp_path / f"f{i}").touch()
    read = []
    scandir, listdir = os.scandir, os.listdir

    @contextmanager
    def counting_scandir(fd):
        with scandir(fd) as entries:
            yield (read.append(entry.name) or entry for entry in entries)

    def counting_listdir(fd):
        names = listdir(fd)
        read.extend(names)
        return names

    monkeypatch.setattr(disk.os, "scandir", counting_scandir)
    monkeypatch.setattr(disk.os, "listdir", counting_listdir)
    walked = scan([tmp_path], 10 * BLOCK)
    assert not walked.complete and len(read) < 100


def test_a_closed_folders_listing_is_read_into_a_list_once(tmp_path):
    """A folder deeper than KEEP_OPEN is closed again at each of its subfolders: copying the rest
    of its listing each time would make a walk of a big deep folder quadratic."""
    for name in "abc":
        (tmp_path / name).mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    level = disk._Level(fd, disk._key(fd), "", "", disk._listing(fd, changes=False))
    first = next(level.names)
    level.close()
    rest = level.names
    level.fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    level.close()  # as at the next subfolder: the rest is not copied again
    assert level.names is rest
    assert sorted([first, *rest]) == ["a", "b", "c"]


def test_an_entry_removed_by_a_running_process_before_undo_removes_it_is_left_gone(tmp_path):
    (tmp_path / "gone.txt").write_text("x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.unlink(tmp_path / "gone.txt")
        disk._remove(fd, "gone.txt", os.unlink)  # no FileNotFoundError out of undo
    finally:
        os.close(fd)


@pytest.mark.parametrize("locked", ["folder", "unsearchable folder", "workspace"])
def test_a_folder_locked_again_as_it_is_opened_up_counts_as_over_the_budget(shared_tmp, locked):
    """A command still running can lock a folder again (`chmod 000` in a loop) right after the
    walk opened it up: that walk counts as over the budget instead of failing, and the walk after
    the command ended, which nothing races, opens it up and counts what it holds."""

    def check():
        workspace = shared_tmp / "ws"
        (workspace / "d").mkdir(parents=True)
        (workspace / "d" / "f.bin").write_bytes(b"0" * 100_000)
        target = workspace if locked == "workspace" else workspace / "d"
        mode = 0o600 if locked == "unsearchable folder" else 0o000  # 600: opened, but nothing in it looked at
        target.chmod(mode)
        real_chmod, real_fchmod = os.chmod, os.fchmod

        def then_locked_again(change):
            def change_then_lock(*args, **kwargs):
                change(*args, **kwargs)
                real_chmod(target, mode)  # the command, right then

            return change_then_lock

        os.chmod, os.fchmod = then_locked_again(real_chmod), then_locked_again(real_fchmod)
        try:
            walked = scan([workspace], 32 << 20)
        finally:
            os.chmod, os.fchmod = real_chmod, real_fchmod
        assert not walked.complete and walked.used > 32 << 20
        after = scan([workspace], 32 << 20)
        assert after.complete and (0, "d/f.bin") in after.entries and after.used < 32 << 20

    as_non_root(check)


def without_proc(check) -> None:
    """Run `check` in a forked child whose own mount namespace has no /proc (it needs root), as a
    caller that is not root (`as_non_root`)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def unmounted():
        if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
            raise OSError(ctypes.get_errno(), "unshare")
        if libc.mount(b"none", b"/", None, (1 << 14) | (1 << 18), None) != 0:  # MS_REC | MS_PRIVATE
            raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
        if libc.umount2(b"/proc", 2) != 0:  # MNT_DETACH
            raise OSError(ctypes.get_errno(), "umount /proc")
        as_non_root(check)

    in_child(unmounted)


@pytest.mark.skipif(os.getuid() != 0, reason="unmounting /proc in a mount namespace of its own needs root")
def test_without_proc_a_locked_folder_is_a_clear_error_not_passed_over(shared_tmp):
    """Folders are opened up through /proc/self/fd: without /proc that path is missing, which must
    not be taken for a folder removed meanwhile (what it holds would escape the budget)."""

    def check():
        assert not os.path.exists("/proc/self")
        workspace = shared_tmp / "ws"
        (workspace / "d").mkdir(parents=True)
        (workspace / "d" / "f.bin").write_bytes(b"0" * 100_000)
        (workspace / "d").chmod(0o000)
        with pytest.raises(WhetstoneError, match="/proc is not mounted"):
            scan([workspace], 32 << 20)

    without_proc(check)
