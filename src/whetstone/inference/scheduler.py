"""Who runs next: two priority classes, with interactive requests preempting batch ones.

Interactive requests (users) are admitted before batch requests (RL rollouts). When the batch
is full and a user is waiting, the scheduler preempts a running batch sequence, which goes back
to the front of the batch queue with everything it generated and resumes when a slot frees up.
While users are served, the batch class is also held to a few sequences, because on a CPU a
decode step costs about linearly in the batch size, and no batch sequence starts (its prefill
would be a forward inside the user's decode). So rollouts soak up whatever capacity the users
leave, and users see a near-idle server.

Running sequences are kept in slot order (`running[i].slot == i`); the engine does the moving.
Waiting ones are in a `WaitQueue` per class, where an abort takes O(1), however long the queue.

Sequences a failed step requeued are suspects (`Scheduler.suspects`): while any waits, a plan
admits at most one of them, and nothing else new with it (`Scheduler.probe`), so that a step
failing again while admitting it is that sequence's failure, not its neighbours'
(`Engine._recover`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from whetstone.inference.sequence import Priority, Sequence


class WaitQueue:
    """One priority class's waiting sequences, the first to start first.

    Removing a sequence (an abort) takes O(1): it leaves the queue at once (its length, its
    iteration), and its entry is dropped when it reaches the front, or in one pass once dropped
    entries outnumber queued ones (O(1) amortised too). A walk of the queue per abort would make
    a client cancelling many sequences queued behind many others (1,024 behind 16,384: seconds)
    pause every running sequence's decoding, since aborts are taken in the engine's step."""

    def __init__(self) -> None:
        self._entries: deque[list[Sequence | None]] = deque()
        """One `[sequence]` per queued sequence, in order; `[None]` once it was removed."""
        self._entry: dict[Sequence, list[Sequence | None]] = {}
        """Each queued sequence's entry (sequences hash by identity)."""
        self._removed = 0
        """Entries in `_entries` whose sequence was removed."""

    def __len__(self) -> int:
        return len(self._entry)

    def __iter__(self) -> Iterator[Sequence]:
        return (entry[0] for entry in self._entries if entry[0] is not None)

    def append(self, seq: Sequence) -> None:
        self._entries.append(self._new_entry(seq))

    def appendleft(self, seq: Sequence) -> None:
        self._entries.appendleft(self._new_entry(seq))

    @property
    def head(self) -> Sequence | None:
        """The first sequence (None: the queue is empty)."""
        self._drop_removed_front()
        return self._entries[0][0] if self._entries else None

    def popleft(self) -> Sequence:
        self._drop_removed_front()
        seq = self._entries.popleft()[0]
        del self._entry[seq]
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Take `seq` out of the queue; False if it is not in it."""
        entry = self._entry.pop(seq, None)
        if entry is None:
            return False
        entry[0] = None
        self._removed += 1
        if self._removed > len(self._entry):
            self._entries = deque(entry for entry in self._entries if entry[0] is not None)
            self._removed = 0
        return True

    def clear(self) -> None:
        """Take every sequence out of the queue."""
        self._entries.clear()
        self._entry.clear()
        self._removed = 0

    def _new_entry(self, seq: Sequence) -> list[Sequence | None]:
        if seq in self._entry:
            raise ValueError(f"sequence {seq.request_id!r} is queued already")
        entry: list[Sequence | None] = [seq]
        self._entry[seq] = entry
        return entry

    def _drop_removed_front(self) -> None:
        while self._entries and self._entries[0][0] is None:
            self._entries.popleft()
            self._removed -= 1


@dataclass
class Plan:
    preempt: list[Sequence] = field(default_factory=list)
    admit: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        max_batch: int,
        prefill_tokens_per_step: int,
        batch_beside_interactive: int | None = None,
        interactive_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        prefill_cost: Callable[[Sequence, list[Sequence]], int] | None = None,
    ):
        self.max_batch = max_batch
        self._prefill_cost = prefill_cost or (lambda seq, admitted: seq.num_tokens - 1)
        """Tokens `seq` would prefill if admitted after `admitted` (the engine knows which
        prefixes it can copy); by default all but the last (which decode feeds)."""
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.batch_beside_interactive = max_batch if batch_beside_interactive is None else batch_beside_interactive
        self.interactive_grace_s = interactive_grace_s
        self._clock = clock
        self._last_user: float | None = None
        """When a user was last seen running or admitted (None: never)."""
        self.waiting: dict[str, WaitQueue] = {"interactive": WaitQueue(), "batch": WaitQueue()}
        self.running: list[Sequence] = []
        self.admit_fresh = True
        """False while draining before a swap that must not touch in-flight sequences: only
        sequences that already have tokens (preempted ones) may start."""
        self.suspects: set[Sequence] = set()
        """Waiting sequences a failed step requeued (`Engine._recover`), not admitted since."""
        self.probe: Sequence | None = None
        """The suspect being admitted, from the plan that takes it until the engine has run it
        through a decode step (`Engine._settle_probe`): no other sequence is admitted meanwhile."""

    def add(self, seq: Sequence) -> None:
        self.waiting[seq.priority].append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence goes first in its class: it has waited longest."""
        self.waiting[seq.priority].appendleft(seq)

    def remove_waiting(self, seq: Sequence) -> bool:
        """Take `seq` out of its queue (O(1)); False if it is not waiting."""
        if not self.waiting[seq.priority].remove(seq):
            return False
        self.suspects.discard(seq)
        return True

    def pop_waiting(self, priority: Priority) -> Sequence:
        """Take the first sequence of `priority`'s queue off it (no longer a suspect)."""
        seq = self.waiting[priority].popleft()
        self.suspects.discard(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting["interactive"] or self.waiting["batch"])

    def in_flight(self) -> bool:
        """Any sequence that has generated tokens and has not finished (running or preempted)."""
        return bool(self.running) or any(s.output_ids for q in self.waiting.values() for s in q)

    def plan(self, plan: Plan | None = None) -> Plan:
        """Sequences to preempt and to admit before this step's decode, filled into `plan` (a new
        one if None) and returned. A sequence taken off its queue is in `plan.admit` from then on:
        if this raises part-way, the caller's `plan` says which sequences are in no queue.

        Users first: a waiting interactive request takes a free slot or preempts the batch
        sequence cheapest to recompute. While any user is being served, and for
        `interactive_grace_s` seconds after, at most `batch_beside_interactive` batch
        sequences decode (a smaller batch is a faster step); the rest wait, keeping their
        tokens, and (unless the cap is `max_batch`) none starts. Seconds, not steps: with
        every batch sequence capped out a step decodes nothing and takes no time, so a count of
        steps would run out between one request of a user and the next. Prefill work per step is
        capped (`prefill_tokens_per_step`, at least one sequence) so a burst of long prompts
        cannot stall the sequences already decoding.

        A suspect (`suspects`) is admitted only as the plan's first admission, and becomes the
        `probe`: while there is one, nothing else is admitted.
        """
        plan = Plan() if plan is None else plan
        self._budget = self.prefill_tokens_per_step
        batch = [s for s in self.running if s.priority == "batch"]
        free = self.max_batch - len(self.running)
        queue = self.waiting["interactive"]
        while queue and (free > 0 or batch) and (seq := self._next(queue)) is not None and self._fits(seq, plan):
            if free == 0:
                plan.preempt.append(_pop_cheapest(batch))
                free += 1
            self._take(queue, seq, plan)
            free -= 1
        users = bool(plan.admit) or any(s.priority == "interactive" for s in self.running)
        now = self._clock()
        if users:
            self._last_user = now
        # users tend to come back (the next turn, the next request): stay small a little longer
        capped = users or (self._last_user is not None and now - self._last_user < self.interactive_grace_s)
        limit = min(self.batch_beside_interactive, self.max_batch) if capped else self.max_batch
        while len(batch) > limit:
            plan.preempt.append(_pop_cheapest(batch))
            free += 1
        queue = self.waiting["batch"]
        starts = not users or limit >= self.max_batch  # capped: no batch prefill inside a user's decode
        while (
            queue
            and free > 0
            and len(batch) < limit
            and starts
            and (seq := self._next(queue)) is not None
            and self._fits(seq, plan)
        ):
            batch.append(self._take(queue, seq, plan))
            free -= 1
        return plan

    def _next(self, queue: WaitQueue) -> Sequence | None:
        """The sequence of `queue` that may start first: its head, or while draining (`admit_fresh`
        False) its first sequence in flight (None: none is). A sequence with no token can be at the
        front of a queue that holds some in flight (one preempted before its first token was read
        back, one a failed step requeued); the drain waits for those, so starting them only from the
        head would never end it. A walk of the queue, as `in_flight` makes, only while draining."""
        if self.admit_fresh:
            return queue.head
        return next((seq for seq in queue if seq.output_ids), None)

    def _fits(self, seq: Sequence, plan: Plan) -> bool:
        """May `seq` start now? Charges its prefill to this step's budget if so."""
        if not self.admit_fresh and not seq.output_ids:
            return False
        if self.probe is not None or (plan.admit and seq in self.suspects):  # suspects start alone
            return False
        cost = self._prefill_cost(seq, plan.admit)
        if plan.admit and cost > self._budget:
            return False
        self._budget -= cost
        return True

    def _take(self, queue: WaitQueue, seq: Sequence, plan: Plan) -> Sequence:
        """Take `seq` (from `_next`) off `queue` into `plan.admit`; a suspect becomes the `probe`."""
        if seq is queue.head:
            queue.popleft()
        else:
            queue.remove(seq)
        plan.admit.append(seq)
        if self.suspects and seq in self.suspects:
            self.suspects.discard(seq)
            self.probe = seq
        return seq


def _pop_cheapest(batch: list[Sequence]) -> Sequence:
    """Remove and return the sequence cheapest to recompute (fewest tokens; the first of equals).
    Looked up when a preemption needs it, not sorted every step."""
    cheapest = min(range(len(batch)), key=lambda i: batch[i].num_tokens)
    return batch.pop(cheapest)
