"""One rank of a 2-rank gloo `whetstone midtrain` job whose ranks see SIGTERM in different steps
(test_signals.py): each sends it to itself, rank 1 in step 2, rank 0 in step 4. Arguments: the
config file."""

import signal
import sys

from whetstone.cli import main
from whetstone.midtrain import loop

SIGNALLED_IN = {0: 4, 1: 2}
"""The step in which each rank gets SIGTERM."""

step = loop._step


def step_with_sigterm(session):
    if session.state.step + 1 == SIGNALLED_IN[session.rank]:
        signal.raise_signal(signal.SIGTERM)
    return step(session)


if __name__ == "__main__":
    loop._step = step_with_sigterm
    main(["midtrain", sys.argv[1]])
