"""Every `whetstone` command ends a Ctrl-C the same way: one line on stderr, "stopped by SIGINT",
and exit code 130, wherever the signal finds it: in the command's own code or in typer's parsing of
its arguments. A command that takes SIGTERM (`sigterm_raises`) ends it likewise, with 143."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

COMMANDS = """
import sys, threading, typer
import whetstone.cli as cli
from whetstone.utils.processes import sigterm_raises

def hold():
    print("holding", flush=True)
    threading.Event().wait()

def parse(value: str) -> str:
    hold()

@cli.app.command("own-code")
def own_code():
    hold()

@cli.app.command("parsing")
def parsing(value: str = typer.Option("x", callback=parse)):
    pass

@cli.app.command("takes-sigterm")
def takes_sigterm():
    with sigterm_raises():
        hold()

cli.main(sys.argv[1:])
"""
"""Commands of the real `whetstone` app that wait for a signal where each case needs it."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "command, number",
    [("own-code", signal.SIGINT), ("parsing", signal.SIGINT), ("takes-sigterm", signal.SIGTERM)],
    ids=["Ctrl-C in the command", "Ctrl-C in typer's parsing of its options", "SIGTERM where taken"],
)
def test_a_signal_ends_a_command_with_one_line_and_128_plus_its_number(command, number):
    with subprocess.Popen(
        [sys.executable, "-c", COMMANDS, command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout.readline() == "holding\n", process.stderr.read()
        process.send_signal(number)
        _, err = process.communicate(timeout=30)
    assert (process.returncode, err) == (128 + number, f"stopped by {number.name}\n")


INTERRUPTED_IMPORT = """
import signal, sys

class CtrlCAtTorch:  # a Ctrl-C while the command's modules load (torch takes a second or more)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            signal.raise_signal(signal.SIGINT)

sys.meta_path.insert(0, CtrlCAtTorch())
sys.argv = ["whetstone", "--help"]
import whetstone
whetstone.main()
"""


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_the_command_loads_ends_with_one_line_and_130():
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (130, "stopped by SIGINT\n")


FAILED_ELSEWHERE = """
import sys
import whetstone.cli as cli
from whetstone.errors import WhetstoneError
from whetstone.utils.processes import FailedElsewhere

@cli.app.command("interrupted")
def interrupted():
    raise FailedElsewhere(WhetstoneError("sampling the servers failed: the disk is full"))

cli.main(sys.argv[1:])
"""


@pytest.mark.timeout(60)
def test_a_failure_of_another_thread_that_interrupts_the_command_ends_it_as_an_error():
    # past the block that would have turned it into its error (a race at the block's end)
    done = subprocess.run(
        [sys.executable, "-c", FAILED_ELSEWHERE, "interrupted"], capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stderr) == (2, "error: sampling the servers failed: the disk is full\n")
