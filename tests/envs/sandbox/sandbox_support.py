"""What the sandbox tests share: running a check as a caller that is not root."""

import os
import traceback

NOBODY = 65534


def in_child(check) -> None:
    """Run `check` in a forked child; its exception fails the caller, with its traceback. The
    child has only the modules imported before the fork."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            check()
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report


def as_non_root(check) -> None:
    """Run `check` in a forked child (`in_child`) that, when this process is root, switches to
    uid and gid 65534 (nobody): the sandbox's caller where it is not root, whom file modes and
    RLIMIT_NPROC bind (this interpreter's own files may not be readable to nobody)."""

    def as_nobody():
        if os.getuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        check()

    in_child(as_nobody)
