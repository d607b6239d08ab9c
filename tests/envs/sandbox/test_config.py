"""SandboxConfig: settings that would break every sandbox are refused when the config is read."""

import pytest
from pydantic import ValidationError

from whetstone.envs.sandbox import SandboxConfig, open_sandbox


@pytest.mark.parametrize(
    ("workdir", "problem"),
    [
        ("workspace", "write an absolute, normalized path"),
        ("/workspace/", "write an absolute, normalized path"),
        ("/", "would hide /usr"),  # and /bin/bash with it: no command could start
        ("/tmp", "would hide /tmp"),  # the tmpfs the disk budget measures
        ("/opt", "would hide /opt/venv"),
        ("/dev/shm", "lies in the sandbox's own /dev"),
    ],
)
def test_a_workdir_over_what_the_sandbox_needs_is_refused(workdir, problem):
    with pytest.raises(ValidationError, match=f"workdir '{workdir}'.*{problem}"):
        SandboxConfig(workdir=workdir)


def test_a_workdir_of_its_own_is_where_commands_start():
    with open_sandbox({"a.txt": "hi\n"}, SandboxConfig(workdir="/tmp/repo")) as sandbox:
        result = sandbox.run("pwd && cat a.txt")
    assert (result.exit_code, result.stdout) == (0, "/tmp/repo\nhi\n")
