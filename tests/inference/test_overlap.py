"""Running one decode step ahead (`EngineConfig.overlap_steps`, on by default on CUDA) changes
when a step's tokens are read back, never what they are: the same tokens, logprobs, top
logprobs, routes and finish reasons as one step at a time, through stops, admissions, prefix
sharing, preemption, aborts and weight swaps. On the CPU the engine is asked to run ahead
(`overlap=True`), which there only reorders the work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.host_work import watch_host_work
from tests.inference.inference_fixtures import make_engine, tiny_model
from whetstone.inference import engine as engine_module
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.inference.swap import full_update
from whetstone.utils.transfer import to_device

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def prompts(*lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_on(device: str, overlap: bool, static_shapes: bool | None = None, **config):
    """The tiny MoE's engine on `device`; `static_shapes` True runs CUDA's static decode (inputs
    in fixed buffers, the tokens run ahead written into them) on the CPU too."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return make_engine(tiny_model(), overlap=overlap, static_shapes=static_shapes, device=device, **config)


def requests() -> list[Sequence]:
    """Sequences of every kind: lengths 2-12, greedy and sampled, top-k/top-p, top logprobs,
    two sharing a prompt prefix, more than the batch holds (admissions while others decode)."""
    base = prompts(20)[0]
    bodies = [base, base + [5, 6, 7], *prompts(3, 9, 14, 6, seed=1)]
    kinds = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=7, seed=1, top_logprobs=3),
        SamplingParams(max_tokens=2, seed=2, top_k=5),
        SamplingParams(max_tokens=9, seed=3, top_p=0.8, temperature=0.7),
        SamplingParams(max_tokens=5, seed=4),
        SamplingParams(max_tokens=11, seed=5, top_logprobs=1),
    ]
    return [Sequence(f"r{i}", body, kind, "batch") for i, (body, kind) in enumerate(zip(bodies, kinds))]


def drive(engine, seqs: list[Sequence], events=None) -> list[Sequence]:
    """Step `engine` until every sequence of `seqs` (added at once) finished; `events` maps a
    step number to a function of the engine called before that step."""
    for seq in seqs:
        engine.add(seq)
    step = 0
    with torch.inference_mode():
        while not all(seq.finished for seq in seqs):
            if events and step in events:
                events[step](engine)
            engine.step()
            step += 1
    if engine.device.type == "cuda":  # the decode graphs replayed (a failed capture decodes eagerly)
        assert engine.stats.graph_captures_total > 0 and engine.decoder.graphs
    return seqs


def assert_same(ours: list[Sequence], theirs: list[Sequence], exact: bool) -> None:
    """Tokens, routes, finish reasons, versions and top-logprob ids equal; logprobs equal bit for
    bit where `exact` (invariant numerics), else to 1e-5: a step run ahead may hold a sequence
    that one step at a time would have retired, and fast numerics round by the batch's shape."""
    for a, b in zip(ours, theirs, strict=True):
        assert (a.output_ids, a.finish_reason, a.versions) == (b.output_ids, b.finish_reason, b.versions)
        assert torch.equal(a.routes, b.routes)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
        if exact:
            assert (a.logprobs, a.top_logprobs) == (b.logprobs, b.top_logprobs)
        else:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize(
    ("device", "static_shapes"), [("cpu", False), ("cpu", True), pytest.param("cuda", None, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("numerics", ["fast", "invariant"])
def test_running_ahead_gives_what_one_step_at_a_time_gives(device, static_shapes, numerics):
    exact = numerics == "invariant"
    one_at_a_time = drive(engine_on(device, overlap=False, numerics=numerics), requests())
    ahead_engine = engine_on(device, overlap=True, static_shapes=static_shapes, numerics=numerics)
    ahead = drive(ahead_engine, requests())
    assert_same(ahead, one_at_a_time, exact)
    assert ahead_engine.stats.prompt_tokens_shared_total > 0  # the shared prefix was copied

    # stop tokens where each sequence's third token falls: they stop early, mid-flight
    def stopping() -> list[Sequence]:
        seqs = requests()
        for seq, reference in zip(seqs, one_at_a_time):
            if len(reference.output_ids) > 3:
                seq.params = dataclasses.replace(seq.params, stop_token_ids=(reference.output_ids[2],))
        return seqs

    stops_reference = drive(engine_on(device, overlap=False, numerics=numerics), stopping())
    stops_ahead = drive(engine_on(device, overlap=True, static_shapes=static_shapes, numerics=numerics), stopping())
    assert_same(stops_ahead, stops_reference, exact)
    assert sum(s.finish_reason == "stop" for s in stops_ahead) >= 3
    # the slots are free again and nothing is left in flight after the last token is taken
    with torch.inference_mode():
        ahead_engine.step()
    assert not ahead_engine.scheduler.running and ahead_engine._launched is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_preempted_sequence_drops_its_step_in_flight_and_resumes_exactly(device):
    # max_batch 1: the user preempts the rollout (which has a step in flight) and runs alone
    [reference] = drive(engine_on(device, overlap=False, max_batch=1), [requests()[5]])
    engine = engine_on(device, overlap=True, max_batch=1)
    rollout, user = requests()[5], Sequence("user", prompts(6, seed=7)[0], SamplingParams(max_tokens=4, seed=8))
    drive(engine, [rollout], events={6: lambda e: e.add(user)})
    assert rollout.preemptions == 1 and user.finished and len(user.output_ids) == 4
    assert_same([rollout], [reference], exact=False)  # its resumption prefilled what it had decoded


@pytest.mark.parametrize("device", DEVICES)
def test_an_aborted_sequence_keeps_what_was_read_back_and_frees_its_slot(device):
    engine = engine_on(device, overlap=True)
    seq, other = requests()[0], requests()[4]
    drive(engine, [seq, other], events={4: lambda e: e.abort(seq)})
    [reference] = drive(engine_on(device, overlap=False), [requests()[0]])
    assert seq.finish_reason == "abort" and 0 < len(seq.output_ids) < 12
    assert seq.output_ids == reference.output_ids[: len(seq.output_ids)]
    assert len(seq.routes) == len(seq.prompt_ids) + len(seq.output_ids) - 1  # no route of a dropped step
    assert other.finish_reason == "length" and not engine.scheduler.running


@pytest.mark.parametrize("device", DEVICES)
def test_each_token_carries_the_version_its_step_ran_with(device):
    """A step launched before a swap runs on the old weights and says so: the run equals one
    that takes the new weights one step at a time from that token on."""
    new_weights = full_update(tiny_model(seed=9).state_dict(), version=1)
    ahead = requests()[0]
    drive(engine_on(device, overlap=True), [ahead], events={4: lambda e: e.update_weights(new_weights)})
    switch = ahead.versions.index(1)
    assert ahead.versions == [0] * switch + [1] * (12 - switch)
    reference = requests()[0]
    engine = engine_on(device, overlap=False)
    engine.add(reference)
    with torch.inference_mode():
        while len(reference.output_ids) < switch:
            engine.step()
        engine.update_weights(new_weights)
        while not reference.finished:
            engine.step()
    assert_same([ahead], [reference], exact=False)


def test_a_step_ahead_builds_nothing_on_the_host_and_reads_back_once():
    engine = make_engine(tiny_model(), overlap=True, max_batch=4)
    seqs = requests()[:4]
    for seq in seqs:
        engine.add(seq)
    with torch.inference_mode():
        engine.step()  # admits, launches step 1
        engine.step()  # launches step 2, takes step 1
        with watch_host_work() as work:
            engine.step()  # launches step 3, takes step 2
    engine_work = [where for where in work.host_tensors + work.syncs if not where.startswith("model/")]
    assert len(engine_work) == 1 and engine_work[0].endswith(" result")  # Readback.result
    assert all(len(seq.output_ids) == 2 for seq in seqs if seq.params.max_tokens >= 3)


def test_a_step_over_the_same_rows_feeds_the_draws_ahead_as_they_are(monkeypatch):
    # the usual step: nobody joined, left or ends by length, so the step is fed the draws of the
    # one ahead of it without a gather or any copy to the device; the tokens stay the same
    def same_rows() -> list[Sequence]:
        params = [SamplingParams(max_tokens=8, seed=seed) for seed in range(4)]
        return [Sequence(f"r{i}", body, p, "batch") for i, (body, p) in enumerate(zip(prompts(5, 7, 9, 11), params))]

    reference = drive(make_engine(tiny_model(), overlap=False, max_batch=4), same_rows())
    copies = []
    monkeypatch.setattr(engine_module, "to_device", lambda *args: copies.append(args) or to_device(*args))
    # from step 2 on (launch 3, take 2), until step 7 (launch 8 would end by length)
    ahead = drive(make_engine(tiny_model(), overlap=True, max_batch=4), same_rows(), {2: lambda _: copies.clear()})
    assert len(copies) == 0
    assert_same(ahead, reference, exact=False)


def test_a_drain_ends_when_a_sequence_preempted_before_its_first_token_waits_ahead_of_one_in_flight():
    """Running ahead, a sequence admitted in the step before a user preempts it has no token yet
    (its step in flight is dropped). Preempted after a shorter one, it goes back to the queue
    ahead of it; a weight update under `swap_policy = "finish"` then drains, waiting for the
    shorter one, which must still start: it finishes on the old weights, then the update is
    written and the other one generates on the new."""
    engine = engine_on("cpu", overlap=True, max_batch=2, swap_policy="finish", interactive_grace_s=0.0)
    short, long, mine = prompts(3, 30, 4)
    early = Sequence("early", short, SamplingParams(max_tokens=10, seed=1), "batch")
    late = Sequence("late", long, SamplingParams(max_tokens=4, seed=2), "batch")
    user = Sequence("user", mine, SamplingParams(max_tokens=2, seed=3))
    new_weights = full_update(tiny_model(seed=9).state_dict(), version=1)
    engine.add(early)
    with torch.inference_mode():
        for step in range(6):
            if step == 3:
                engine.add(late)
            if step == 4:
                engine.add(user)  # it preempts both: `early` (the fewest tokens) first, then `late`
            engine.step()
        assert [s.request_id for s in engine.scheduler.waiting["batch"]] == ["late", "early"]
        assert not late.output_ids and early.output_ids
        engine.update_weights(new_weights)
        for _ in range(60):
            if early.finished and late.finished:
                break
            engine.step()
    assert early.finished and late.finished, f"the drain never ended: {early.output_ids=}, {late.output_ids=}"
    assert early.versions == [0] * 10 and late.versions == [1] * 4 and user.versions == [0, 0]


def test_a_drain_waiting_on_a_user_s_grace_sleeps_between_steps():
    """A weight update waits for a batch sequence in flight, which waits for a user's grace to
    end: the engine's thread looks again every few milliseconds instead of spinning a core."""
    import time

    from whetstone.inference.swap import full_update

    engine = engine_on(
        "cpu", overlap=False, max_batch=2, swap_policy="finish", interactive_grace_s=3.0, batch_beside_interactive=0
    )
    first, second = prompts(3, 4)
    batch = Sequence("batch", first, SamplingParams(max_tokens=50, seed=1), "batch")
    user = Sequence("user", second, SamplingParams(max_tokens=2, seed=3))
    engine.add(batch)
    with torch.inference_mode():
        for _ in range(3):
            engine.step()
        engine.add(user)
        for _ in range(4):
            engine.step()
    assert user.finished and batch.output_ids and not batch.finished  # preempted, in flight, held by the grace
    engine.update_weights(full_update(tiny_model(seed=9).state_dict(), version=1))
    steps = []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    engine.start()
    try:
        time.sleep(0.1)
        counted = len(steps)
        time.sleep(0.5)
        looked = len(steps) - counted
    finally:
        engine.stop()
    assert looked < 500  # polled at WAITING_POLL_S (~100 in 0.5 s), not spun (tens of thousands)
