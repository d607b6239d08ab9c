"""Progress on stderr: plain lines at a steady pace where stderr is a file (a role's log)."""

import os
import subprocess
import sys

import pytest

WORK = """
from whetstone.utils.progress import progress_bar
with progress_bar(20, "work", "step") as bar:
    for step in range(20):
        bar.update(1, loss=1.0 / (step + 1))
"""


@pytest.mark.parametrize("env", [{}, {"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}])
def test_progress_into_a_file_is_plain_lines_even_where_colours_are_forced(tmp_path, env):
    """FORCE_COLOR asks for colours, not for a bar redrawn ten times a second into a log file."""
    log = tmp_path / "role.log"
    with log.open("w") as stderr:
        subprocess.run([sys.executable, "-c", WORK], stderr=stderr, check=True, timeout=60, env={**os.environ, **env})
    lines = log.read_text().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["work: 0/20 step (0%)", "work: 20/20 step (100%)"], lines
    assert lines[-1].endswith("loss=0.05") and "\x1b" not in log.read_text() and "\r" not in log.read_text()
