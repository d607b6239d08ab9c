"""The disk budget's bookkeeping (envs/sandbox/disk.py) on plain folders: what counts as a write
cut short at the size cap, and what taking a command's growth back keeps."""

import os
from pathlib import Path

from tests.envs.sandbox.sandbox_support import as_non_root
from whetstone.envs.sandbox.disk import DiskWatch


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
