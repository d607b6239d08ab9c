import sys

import pytest

from whetstone.inference.sampling import SamplingParams
from whetstone.inference.scheduler import Scheduler
from whetstone.inference.sequence import Sequence


def seq(name, priority, length=4, generated=0):
    s = Sequence(name, list(range(length)), SamplingParams(), priority)
    s.output_ids = [0] * generated
    return s


def run(scheduler, plan):
    """Apply a plan the way the engine does (slots are positions in `running`)."""
    for victim in plan.preempt:
        scheduler.running.remove(victim)
        victim.preempt()
        scheduler.requeue(victim)
    scheduler.running += plan.admit
    return [s.request_id for s in plan.admit], [s.request_id for s in plan.preempt]


def test_interactive_requests_are_admitted_first():
    scheduler = Scheduler(max_batch=2, prefill_tokens_per_step=100)
    for s in (seq("b1", "batch"), seq("i1", "interactive"), seq("b2", "batch")):
        scheduler.add(s)
    assert run(scheduler, scheduler.plan()) == (["i1", "b1"], [])


def test_a_waiting_user_preempts_the_cheapest_batch_sequence_which_resumes_first():
    scheduler = Scheduler(max_batch=2, prefill_tokens_per_step=100)
    scheduler.add(seq("long", "batch", generated=50))
    scheduler.add(seq("short", "batch", generated=5))
    run(scheduler, scheduler.plan())
    scheduler.add(seq("user", "interactive"))
    scheduler.add(seq("later", "batch"))
    assert run(scheduler, scheduler.plan()) == (["user"], ["short"])
    short = scheduler.waiting["batch"].head
    assert short.request_id == "short" and len(short.output_ids) == 5 and short.preemptions == 1
    scheduler.running.remove(scheduler.running[0])  # "long" finishes
    assert run(scheduler, scheduler.plan()) == (["short"], [])


def test_users_never_preempt_users():
    scheduler = Scheduler(max_batch=1, prefill_tokens_per_step=100)
    scheduler.add(seq("u1", "interactive"))
    run(scheduler, scheduler.plan())
    scheduler.add(seq("u2", "interactive"))
    assert run(scheduler, scheduler.plan()) == ([], [])


def test_prefill_budget_caps_admissions_but_always_admits_one():
    scheduler = Scheduler(max_batch=8, prefill_tokens_per_step=10)
    for name in ("a", "b", "c"):
        scheduler.add(seq(name, "batch", length=7))  # 6 tokens to prefill each
    assert run(scheduler, scheduler.plan())[0] == ["a"]
    scheduler.add(seq("huge", "interactive", length=50))
    assert run(scheduler, scheduler.plan())[0] == ["huge"]


def test_draining_admits_only_sequences_already_in_flight():
    scheduler = Scheduler(max_batch=4, prefill_tokens_per_step=100)
    scheduler.add(seq("fresh", "interactive"))
    scheduler.add(seq("resumed", "batch", generated=3))
    scheduler.admit_fresh = False
    assert scheduler.in_flight()
    assert run(scheduler, scheduler.plan()) == (["resumed"], [])


def test_while_users_are_served_the_batch_class_shrinks_then_grows_back():
    scheduler = Scheduler(max_batch=8, prefill_tokens_per_step=1000, batch_beside_interactive=2)
    for i in range(6):
        scheduler.add(seq(f"b{i}", "batch", generated=i + 1))
    run(scheduler, scheduler.plan())
    assert len(scheduler.running) == 6
    user = seq("user", "interactive")
    scheduler.add(user)
    admitted, preempted = run(scheduler, scheduler.plan())
    assert admitted == ["user"] and preempted == ["b0", "b1", "b2", "b3"]  # cheapest to recompute first
    assert run(scheduler, scheduler.plan()) == ([], [])  # no batch admissions beyond the cap
    scheduler.running.remove(user)  # the user is done
    assert sorted(run(scheduler, scheduler.plan())[0]) == ["b0", "b1", "b2", "b3"]


def test_the_cap_outlasts_the_last_user_by_the_grace_seconds():
    now = [0.0]
    scheduler = Scheduler(
        max_batch=4,
        prefill_tokens_per_step=1000,
        batch_beside_interactive=1,
        interactive_grace_s=0.5,
        clock=lambda: now[0],
    )
    user = seq("user", "interactive")
    scheduler.add(user)
    run(scheduler, scheduler.plan())
    scheduler.running.remove(user)
    for name in ("b0", "b1", "b2"):
        scheduler.add(seq(name, "batch"))
    # Steps that decode nothing take no time: the cap holds however many of them run.
    assert [len(run(scheduler, scheduler.plan())[0]) for _ in range(5)] == [1, 0, 0, 0, 0]
    now[0] = 0.6  # the grace is over
    assert len(run(scheduler, scheduler.plan())[0]) == 2


def test_no_batch_sequence_starts_while_a_user_is_served():
    scheduler = Scheduler(max_batch=8, prefill_tokens_per_step=1000, batch_beside_interactive=2)
    scheduler.add(seq("user", "interactive"))
    scheduler.add(seq("b0", "batch"))
    assert run(scheduler, scheduler.plan()) == (["user"], [])  # b0's prefill would delay the user's steps
    assert run(scheduler, scheduler.plan()) == ([], [])
    scheduler.running.clear()  # the user is done
    assert run(scheduler, scheduler.plan()) == (["b0"], [])


def test_among_equally_cheap_batch_sequences_the_earliest_running_is_preempted():
    scheduler = Scheduler(max_batch=3, prefill_tokens_per_step=100)
    for name in ("first", "second", "third"):
        scheduler.add(seq(name, "batch", generated=3))
    run(scheduler, scheduler.plan())
    scheduler.add(seq("user", "interactive"))
    assert run(scheduler, scheduler.plan()) == (["user"], ["first"])


def lines_run(action) -> int:
    """How many lines of Python `action()` runs (its cost, counted, not timed)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(None)
    return count


def test_aborting_queued_sequences_costs_the_same_however_long_the_queue(monkeypatch):
    """An abort is O(1): no comparison of sequences, and the same work behind 256 or 8,192 others
    (a walk of the queue per abort stalled every running sequence for seconds)."""
    compared = []
    monkeypatch.setattr(Sequence, "__eq__", lambda a, b: compared.append(1) or a is b, raising=False)
    lines = {}
    for queued in (256, 8192):
        scheduler = Scheduler(max_batch=2, prefill_tokens_per_step=100)
        seqs = [seq(f"s{i}", "batch") for i in range(queued + 256)]
        for s in seqs:
            scheduler.add(s)
        leaving = seqs[-256:]  # the newest request leaves: its sequences are at the back
        lines[queued] = lines_run(
            lambda scheduler=scheduler, leaving=leaving: [scheduler.remove_waiting(s) for s in leaving]
        )
        assert len(scheduler.waiting["batch"]) == queued
    assert not compared
    assert lines[8192] == lines[256]


def test_removed_sequences_leave_counts_order_and_admissions_at_once():
    scheduler = Scheduler(max_batch=2, prefill_tokens_per_step=100)
    seqs = {name: seq(name, "batch") for name in ("a", "b", "c", "d", "e")}
    for s in seqs.values():
        scheduler.add(s)
    user = seq("user", "interactive")
    scheduler.add(user)
    for name in ("a", "c", "e"):
        assert scheduler.remove_waiting(seqs[name])
    assert scheduler.remove_waiting(user) and not scheduler.remove_waiting(user)
    assert not scheduler.remove_waiting(seq("never", "batch"))
    assert (len(scheduler.waiting["batch"]), len(scheduler.waiting["interactive"])) == (2, 0)
    assert [s.request_id for s in scheduler.waiting["batch"]] == ["b", "d"]
    assert run(scheduler, scheduler.plan()) == (["b", "d"], [])
    assert not any(scheduler.waiting.values()) and scheduler.waiting["batch"].head is None


def test_a_wait_queue_drops_removed_entries_before_they_outnumber_queued_ones():
    queue = Scheduler(max_batch=1, prefill_tokens_per_step=1).waiting["batch"]
    seqs = [seq(f"s{i}", "batch") for i in range(1000)]
    for s in seqs:
        queue.append(s)
    for s in seqs[:-10:-1] + seqs[1:-9]:  # all but the first, from the back and then from the front
        queue.remove(s)
        assert len(queue._entries) <= 2 * len(queue) + 1
    assert list(queue) == [seqs[0]] and queue.popleft() is seqs[0] and not queue
    with pytest.raises(ValueError, match="sequence 's1' is queued already"):
        queue.append(seqs[1])
        queue.appendleft(seqs[1])


def requeue_suspects(scheduler, *seqs):
    """Requeue `seqs` in front of their queues, in that order, as a failed step does."""
    for s in reversed(seqs):
        scheduler.requeue(s)
        scheduler.suspects.add(s)


def test_suspects_are_admitted_one_per_plan_with_nothing_else_new():
    """Sequences a failed step requeued start one at a time, each alone among the admitted: while
    one is being admitted (the probe, until the engine clears it), nobody else starts."""
    scheduler = Scheduler(max_batch=8, prefill_tokens_per_step=100)
    scheduler.add(seq("new", "interactive"))
    scheduler.add(seq("rollout", "batch"))
    requeue_suspects(scheduler, seq("s1", "interactive", generated=2), seq("s2", "interactive"))
    assert run(scheduler, scheduler.plan()) == (["s1"], [])
    assert scheduler.probe.request_id == "s1" and [s.request_id for s in scheduler.suspects] == ["s2"]
    assert run(scheduler, scheduler.plan()) == ([], [])  # s1 is still being admitted
    scheduler.probe = None
    assert run(scheduler, scheduler.plan()) == (["s2"], [])
    scheduler.probe = None
    assert run(scheduler, scheduler.plan()) == (["new", "rollout"], [])
    assert scheduler.probe is None and not scheduler.suspects


def test_a_suspect_waits_for_a_plan_that_admits_nothing_before_it_and_leaves_the_suspects_if_removed():
    scheduler = Scheduler(max_batch=8, prefill_tokens_per_step=100)
    suspect, removed = seq("suspect", "batch"), seq("removed", "batch")
    requeue_suspects(scheduler, suspect, removed)
    scheduler.requeue(seq("preempted", "batch", generated=3))  # in front of them, not a suspect
    assert run(scheduler, scheduler.plan()) == (["preempted"], [])
    assert scheduler.remove_waiting(removed) and scheduler.suspects == {suspect}
    assert run(scheduler, scheduler.plan()) == (["suspect"], [])
    assert scheduler.probe is suspect and not scheduler.suspects


def test_draining_starts_sequences_in_flight_queued_behind_fresh_ones():
    """While draining, a sequence with no token at the front of its queue (one preempted before
    its first token was read back, one a failed step requeued) holds back none of the sequences
    in flight behind it: the drain waits for those, so held back, it would never end."""
    scheduler = Scheduler(max_batch=4, prefill_tokens_per_step=100)
    scheduler.add(seq("resumed", "batch", generated=3))
    scheduler.requeue(seq("no-token-yet", "batch"))
    scheduler.add(seq("user-resumed", "interactive", generated=2))
    scheduler.requeue(seq("user-no-token-yet", "interactive"))
    scheduler.admit_fresh = False
    assert run(scheduler, scheduler.plan()) == (["user-resumed", "resumed"], [])
    assert [s.request_id for s in scheduler.waiting["batch"]] == ["no-token-yet"]
    assert [s.request_id for s in scheduler.waiting["interactive"]] == ["user-no-token-yet"]
    scheduler.running.clear()  # they finish: nothing in flight is left, the drain can end
    assert not scheduler.in_flight() and run(scheduler, scheduler.plan()) == ([], [])
