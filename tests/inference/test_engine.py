import threading
import time

import pytest
import torch

from tests.inference.inference_fixtures import make_engine, tiny_model, wait_until
from whetstone.errors import WhetstoneError
from whetstone.inference.engine import FAIL_AFTER_STEPS
from whetstone.inference.sampling import InvalidRequest, SamplingParams
from whetstone.inference.sequence import Sequence

ADMITTED_ALONE = "the engine's step failed again when it admitted this sequence alone"
"""What a sequence that failed alone, retried after a failed step, reports after its error."""


def prompts(*lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_logprobs_routes_and_versions_are_those_of_the_model(model):
    """Each token's logprob is log-softmax(logits / T) of a plain full forward over the same
    tokens, and the routes are that forward's experts for every token fed."""
    engine = make_engine(model)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    for seq in engine.generate(prompts(7, 20, 3), params):
        tokens = seq.prompt_ids + seq.output_ids
        with torch.no_grad():
            full = model(torch.tensor([tokens[:-1]]), return_routes=True)
        logprobs = torch.log_softmax(full.logits[0, len(seq.prompt_ids) - 1 :] / 0.8, -1)
        expected = logprobs.gather(1, torch.tensor(seq.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)
        assert torch.equal(seq.routes.long(), full.routes[0])  # [tokens fed, moe_layers, top_k]
        assert seq.routes.shape == (len(tokens) - 1, model.cfg.num_moe_layers, model.cfg.num_experts_per_tok)
        assert seq.versions == [0] * 12 and seq.finish_reason == "length"


def test_same_seed_same_tokens_alone_or_joined_by_others_midway(model):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    [alone] = make_engine(model).generate(prompts(9), params)

    engine = make_engine(model)
    target = Sequence("target", prompts(9)[0], params)
    engine.add(target)
    others = [
        Sequence(f"o{i}", p, SamplingParams(max_tokens=5 + i, seed=i)) for i, p in enumerate(prompts(4, 30, 12, seed=1))
    ]
    with torch.inference_mode():
        for other in others:
            engine.add(other)  # joins between decode steps; leaves after 5 + i tokens
            engine.step()
        while not target.finished:
            engine.step()
    assert target.output_ids == alone.output_ids
    assert target.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_sequences_join_and_leave_between_steps(model):
    engine = make_engine(model, max_batch=2)
    lengths = [3, 9, 1, 6, 4]
    seqs = engine.generate(prompts(5, 8, 2, 11, 1), [SamplingParams(max_tokens=n, seed=0) for n in lengths])
    assert [len(s.output_ids) for s in seqs] == lengths
    assert all(s.finish_reason == "length" and s.slot is None for s in seqs)
    assert engine.stats.generation_tokens_total == sum(lengths)
    assert not engine.scheduler.running


def test_preempted_sequence_resumes_exactly_where_it_stopped(model):
    params = SamplingParams(max_tokens=20, seed=5)
    [reference] = make_engine(model).generate(prompts(10), params)

    engine = make_engine(model, max_batch=1)
    rollout = Sequence("rollout", prompts(10)[0], params, priority="batch")
    user = Sequence("user", prompts(6, seed=2)[0], SamplingParams(max_tokens=4, seed=0), priority="interactive")
    engine.add(rollout)
    with torch.inference_mode():
        for _ in range(7):
            engine.step()
        engine.add(user)
        engine.step()  # the user takes the only slot
        assert rollout.slot is None and len(rollout.output_ids) == 7 and user.output_ids
        while not rollout.finished:
            engine.step()
    assert user.finished and engine.stats.preemptions_total == 1
    assert rollout.output_ids == reference.output_ids  # nothing lost, nothing sampled twice
    assert torch.equal(rollout.routes, reference.routes)  # the recompute replayed the same experts
    assert rollout.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_stop_tokens_stop_strings_and_eos(model, tokenizer):
    engine = make_engine(tiny_model(vocab_size=tokenizer.vocab_size), tokenizer)
    prompt = tokenizer.encode("def main():\n")
    [free] = engine.generate([prompt], SamplingParams(max_tokens=30, seed=1, ignore_eos=True))
    stop_token = free.output_ids[5]
    first = free.output_ids.index(stop_token)
    [by_token] = engine.generate([prompt], SamplingParams(max_tokens=30, seed=1, stop_token_ids=(stop_token,)))
    assert by_token.output_ids == free.output_ids[: first + 1] and by_token.finish_reason == "stop"
    assert by_token.text.text == tokenizer.decode(free.output_ids[:first])  # the stop token is not text

    stop = free.text.text[10:13]
    [by_string] = engine.generate([prompt], SamplingParams(max_tokens=30, seed=1, stop=(stop,)))
    assert by_string.finish_reason == "stop" and by_string.text.text == free.text.text.split(stop)[0]

    eos_engine = make_engine(engine.model, tokenizer)
    eos_engine.eos_token_ids = frozenset({stop_token})
    [by_eos] = eos_engine.generate([prompt], SamplingParams(max_tokens=30, seed=1))
    assert by_eos.output_ids == by_token.output_ids


def test_prompts_that_do_not_fit_are_rejected_not_truncated(model):
    engine = make_engine(model, context_limit=32)
    with pytest.raises(InvalidRequest, match="prompt has 32 tokens; the context limit is 32"):
        engine.add(Sequence("long", list(range(32)), SamplingParams(max_tokens=1)))
    with pytest.raises(InvalidRequest, match=r"\+ max_tokens \(10\) = 40 exceeds the context limit of 32"):
        engine.add(Sequence("greedy", list(range(30)), SamplingParams(max_tokens=10)))
    with pytest.raises(InvalidRequest, match="token ids must be in 0..511"):
        engine.add(Sequence("bad", [600], SamplingParams()))
    assert not engine.step()  # nothing was queued


def test_generate_with_a_prompt_that_does_not_fit_queues_none_of_its_prompts(model):
    engine = make_engine(model, context_limit=32)
    with pytest.raises(InvalidRequest, match="prompt 1: the prompt has 40 tokens"):
        engine.generate([[1, 2, 3], list(range(40))], SamplingParams(max_tokens=4))
    assert not engine.step()  # the prompt that fits was not left to generate for no one
    [seq] = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
    assert len(seq.output_ids) == 2 and engine.stats.decode_steps_total == 2


def test_a_kv_cache_that_cannot_be_allocated_is_named_with_its_size_and_settings(model):
    # 2^35 positions in each of 4 + 16 slots: 320 TiB, which no allocator gives (the CPU's refuses at once)
    with pytest.raises(
        WhetstoneError, match=r"KV cache does not fit on cpu: 327680.0 GiB .*\(20 slots of 34359738368 "
    ):
        make_engine(model, context_limit=2**35)


def test_abort_frees_the_slot_and_keeps_what_was_generated(model):
    engine = make_engine(model)
    seq = Sequence("s", prompts(5)[0], SamplingParams(max_tokens=50, seed=0))
    engine.add(seq)
    with torch.inference_mode():
        engine.step()
        engine.step()
        engine.abort(seq)
        engine.step()
    assert seq.finish_reason == "abort" and len(seq.output_ids) == 2 and not engine.scheduler.running


def test_a_dense_model_serves_without_routes():
    engine = make_engine(tiny_model(num_experts=0))
    [seq] = engine.generate(prompts(4), SamplingParams(max_tokens=3, seed=0))
    assert len(seq.output_ids) == 3 and seq.routes is None


def test_engine_thread_serves_sequences_added_from_other_threads(model):
    engine = make_engine(model)
    finished, all_done = [], threading.Event()

    def on_event(progress):  # called in the engine thread
        finished.append(progress)
        if len(finished) == 3:
            all_done.set()

    engine.start()
    try:
        seqs = [
            Sequence(f"s{i}", p, SamplingParams(max_tokens=4, seed=i), on_event=on_event)
            for i, p in enumerate(prompts(3, 5, 7))
        ]
        for seq in seqs:
            engine.add(seq)
        assert all_done.wait(timeout=30)
    finally:
        engine.stop()
    assert all(s.finished and len(s.output_ids) == 4 for s in seqs)
    assert [event.num_output for event in finished] == [4, 4, 4]


def test_a_fast_engine_serves_column_major_weights_and_an_invariant_one_the_trainers_layout():
    # Invariant numerics rest on the engine's matmuls seeing the trainer's operands, strides included.
    import copy

    from whetstone.model.layout import is_column_major

    fast = make_engine(copy.deepcopy(tiny_model()))
    invariant = make_engine(copy.deepcopy(tiny_model()), numerics="invariant")
    assert is_column_major(fast.model.layers[0].self_attn.o_proj.weight)
    assert all(p.is_contiguous() for p in invariant.model.parameters())


def run_until_finished(engine, seqs):
    with torch.inference_mode():
        while not all(seq.finished for seq in seqs):
            engine.step()


def same_generation(seq, reference):
    """`seq` generated exactly what `reference` did (tokens, routes; logprobs to float noise)."""
    assert seq.error is None and seq.finish_reason == reference.finish_reason
    assert seq.output_ids == reference.output_ids
    assert torch.equal(seq.routes, reference.routes)
    assert seq.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


@pytest.mark.parametrize("times", [1, 2])
def test_a_prefill_that_raises_is_retried_one_sequence_at_a_time_and_fails_the_one_it_raises_again_for(model, times):
    """The scheduler takes admitted sequences off its queues before their prefill; when it raises
    (a GPU out of memory) they go back to their queues, to be admitted again one per step; the
    one whose retry raises too fails alone."""
    base = prompts(30)[0]
    # the longer one is prefilled first; the other copies its prefix from it after
    longer = Sequence("longer", base + [40, 41], SamplingParams(max_tokens=4, seed=0))
    shorter = Sequence("shorter", base, SamplingParams(max_tokens=4, seed=1))
    later = Sequence("later", prompts(6)[0], SamplingParams(max_tokens=4, seed=2))
    references = make_engine(model).generate([longer.prompt_ids, shorter.prompt_ids], [longer.params, shorter.params])
    engine = make_engine(model)
    prefill, calls = engine._prefill, []

    def out_of_memory(group):
        calls.append(group)
        if len(calls) <= times:
            raise RuntimeError("out of memory")
        prefill(group)

    engine._prefill = out_of_memory
    engine.add(longer)
    engine.add(shorter)
    engine.start()
    try:
        wait_until(lambda: longer.finished and shorter.finished, timeout=10)
        engine.add(later)  # and the engine serves on
        wait_until(lambda: later.finished, timeout=10)
    finally:
        engine.stop()
    assert calls[:3] == [[longer], [longer], [shorter]]  # then one at a time
    requeued_not_preempted(engine, 2)  # by the first failure (both were being admitted)
    if times == 1:
        for seq, reference in zip((longer, shorter), references):
            same_generation(seq, reference)
        assert engine.stats.requests_total["error"] == 0
    else:
        assert longer.error == f"RuntimeError: out of memory ({ADMITTED_ALONE})"
        assert longer.finish_reason == "abort" and longer.slot is None and not longer.output_ids
        same_generation(shorter, references[1])
        assert engine.stats.requests_total["error"] == 1
    assert engine.stats.isolated_failures_total == times - 1
    assert later.error is None and len(later.output_ids) == 4
    assert not engine.scheduler.has_work


class FaultyDecode:
    """The engine's decoder, raising `error` on the calls numbered in `fail_at` (1 = the first)."""

    def __init__(self, decoder, fail_at: set[int], error: Exception):
        self.decoder, self.fail_at, self.error, self.calls = decoder, fail_at, error, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls in self.fail_at:
            raise self.error
        return self.decoder(*args)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def requeued_not_preempted(engine, count: int) -> None:
    """Failed steps requeued `count` sequences: counted apart from preemptions, in the metrics too."""
    from whetstone.inference.metrics import render_prometheus

    assert engine.stats.failure_requeues_total == count and engine.stats.preemptions_total == 0
    text = render_prometheus(engine.stats, "tiny")
    assert f'\nwhetstone_failure_requeues_total{{model="tiny"}} {count}\n' in text
    assert '\nwhetstone_preemptions_total{model="tiny"} 0\n' in text


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batched_forward_that_raises_once_costs_its_sequences_nothing_and_again_fails_the_one_retried(model, overlap):
    """A decode that raises requeues the three; raising again in the step that admits the first of
    them back (alone), it fails that one only."""
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i) for i in range(3)]
    references = make_engine(model, overlap=overlap).generate(prompts(5, 9, 7), params)

    def run(fail_at):
        engine = make_engine(model, overlap=overlap)
        engine.decoder = FaultyDecode(engine.decoder, fail_at, RuntimeError("CUDA out of memory"))
        seqs = [Sequence(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(5, 9, 7), params))]
        for seq in seqs:
            engine.add(seq)
        run_until_finished(engine, seqs)
        return engine, seqs

    for fail_at in (1, 4):  # the step that admitted them (their prefill's routes on their way), a later one
        engine, seqs = run({fail_at})
        for seq, reference in zip(seqs, references):
            same_generation(seq, reference)  # requeued, recomputed, resumed: nothing lost or drawn twice
            assert seq.preemptions == 1
        assert engine.stats.requests_total["error"] == 0 and not engine.scheduler.has_work
        requeued_not_preempted(engine, 3)

    engine, seqs = run({4, 5})  # the retry's first decode raises too
    s0, s1, s2 = seqs  # s1 was admitted first (requeued in slot order: the longest prompt first)
    assert s1.error == f"RuntimeError: CUDA out of memory ({ADMITTED_ALONE})"
    # the tokens read back before it: three steps' (one step at a time) or two (the third pending)
    assert s1.finish_reason == "abort" and s1.output_ids == references[1].output_ids[: 2 if overlap else 3]
    for seq, reference in ((s0, references[0]), (s2, references[2])):
        same_generation(seq, reference)
    assert engine.stats.requests_total["error"] == 1 and not engine.scheduler.has_work
    assert engine.stats.isolated_failures_total == 1
    requeued_not_preempted(engine, 3)  # by the first failure; the second failed s1 (nothing else ran)
    [later] = engine.generate(prompts(5), params[0])  # the engine serves on
    same_generation(later, references[0])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fault", ["stop check", "stream callback", "sampling parameters"])
def test_a_sequence_whose_own_host_code_raises_fails_alone(model, monkeypatch, fault, overlap):
    """Its stop check, its stream callback or its sampling parameters raise: it fails, and the
    sequences beside it in the batch generate what they would have alone."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    [alone] = make_engine(model, overlap=overlap).generate(prompts(9), params)
    engine = make_engine(model, overlap=overlap)
    innocent = Sequence("innocent", prompts(9)[0], params, stream=True, on_event=lambda progress: None)
    bad_params = SamplingParams(max_tokens=12, seed=3)
    error = ValueError("injected")

    def on_event(progress):
        if fault == "stream callback" and progress.num_output == 3:
            raise error

    culprit = Sequence("culprit", prompts(6, seed=1)[0], bad_params, stream=True, on_event=on_event)
    if fault == "stop check":
        stop_reason = engine._stop_reason

        def raising(seq, token):
            if seq is culprit and len(seq.output_ids) == 3:
                raise error
            return stop_reason(seq, token)

        engine._stop_reason = raising
    elif fault == "sampling parameters":
        import whetstone.inference.engine as engine_module

        sample = engine_module.sample

        def raising(logits, params, seeds, counters):
            if any(p is bad_params for p in params) and counters[params.index(bad_params)] == 3:
                raise error
            return sample(logits, params, seeds, counters)

        monkeypatch.setattr(engine_module, "sample", raising)
    engine.add(innocent)
    engine.add(culprit)
    run_until_finished(engine, [innocent, culprit])
    assert culprit.error == "ValueError: injected" and culprit.finish_reason == "abort" and culprit.slot is None
    # the tokens read back before it (drawing token 3 raised: running ahead, token 2 was pending)
    assert len(culprit.output_ids) == (2 if fault == "sampling parameters" and overlap else 3)
    same_generation(innocent, alone)
    assert innocent.preemptions == 0  # kept its slot
    assert engine.stats.requests_total["error"] == 1 and engine.stats.requests_total["length"] == 1
    assert not engine.scheduler.has_work


def test_aborted_queued_sequences_leave_the_queue_gauges_at_once(model):
    engine = make_engine(model, max_batch=2)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=3, seed=i)) for i, p in enumerate(prompts(*range(3, 9)))]
    for seq in seqs:
        engine.add(seq)
    with torch.inference_mode():
        engine.step()
        assert (engine.stats.running, engine.stats.waiting_interactive) == (2, 4)
        for seq in (seqs[2], seqs[5], seqs[0]):  # the queue's first and last, and a running one
            engine.abort(seq)
        engine.step()
        assert (engine.stats.running, engine.stats.waiting_interactive) == (2, 1)  # s1 and s3 run, s4 waits
        assert [seq.finish_reason for seq in (seqs[0], seqs[2], seqs[5])] == ["abort"] * 3
        assert [seq.slot for seq in seqs[1:5]] == [0, None, 1, None]
    run_until_finished(engine, seqs)
    assert [len(seq.output_ids) for seq in seqs] == [1, 3, 0, 3, 3, 0]
    assert engine.stats.requests_total["abort"] == 3 and engine.stats.requests_total["length"] == 3
    assert (engine.stats.running, engine.stats.waiting_interactive) == (0, 0)


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(model):
    """Even one too big for an int64 (the step would raise, failing every running sequence)."""
    engine = make_engine(model)
    huge, whole = (SamplingParams(max_tokens=5, seed=3, top_k=k) for k in (10**20, model.cfg.vocab_size))
    [a], [b] = engine.generate(prompts(5), huge), engine.generate(prompts(5), whole)
    assert a.error is None and a.output_ids == b.output_ids and a.logprobs == b.logprobs


CUDA_ERROR = "CUDA error: an illegal memory access was encountered"


class Ends:
    """Makes sequences that count the finished events they get (each must get exactly one)."""

    def __init__(self):
        self.finished: dict[str, int] = {}

    def sequence(self, name: str, prompt: list[int], params: SamplingParams) -> Sequence:
        self.finished[name] = 0

        def on_event(progress):
            if progress.finished:
                self.finished[name] += 1

        return Sequence(name, prompt, params, on_event=on_event)

    def each_once(self, seqs) -> bool:
        return all(seq.finished for seq in seqs) and all(self.finished[seq.request_id] == 1 for seq in seqs)


def step_until_finished(engine, seqs, limit: int = 200) -> None:
    """`run_until_finished`, for at most `limit` steps (a lost sequence would never finish)."""
    with torch.inference_mode():
        for _ in range(limit):
            if all(seq.finished for seq in seqs):
                return
            engine.step()
    raise AssertionError(f"unfinished after {limit} steps: {[seq.request_id for seq in seqs if not seq.finished]}")


def all_slots_free(engine) -> None:
    """Nothing holds a slot, and `max_batch` new sequences run at once, in slots 0..max_batch-1."""
    assert not engine.scheduler.running and not engine.scheduler.has_work and not engine._unfinished
    batch = engine.config.max_batch
    seqs = [Sequence(f"fresh{i}", p, SamplingParams(max_tokens=3, seed=i)) for i, p in enumerate(prompts(*[4] * batch))]
    for seq in seqs:
        engine.add(seq)
    with torch.inference_mode():
        engine.step()
    assert sorted(seq.slot for seq in seqs) == list(range(batch))
    step_until_finished(engine, seqs)
    assert all(seq.error is None and len(seq.output_ids) == 3 for seq in seqs)


def test_a_slot_move_that_raises_loses_no_sequence(model):
    """A sequence stops in the middle of the batch; moving the last one into its slot raises (a
    broken device): the stopped one fails (it had its last token), the others keep their slots'
    tokens and are recomputed, and no sequence is left out of every queue."""
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=i) for i, n in enumerate((10, 3, 10))]
    lengths = (9, 7, 5)  # slots by prompt length, the longest first: s1 in the middle
    references = make_engine(model, share_prefixes=False).generate(prompts(*lengths), params)
    engine = make_engine(model, share_prefixes=False)  # no kept caches: the only moves are the slots'
    move, broken = engine.cache.move, []

    def move_broken_once(src, dst, length):
        if not broken:
            broken.append((src, dst))
            raise RuntimeError(CUDA_ERROR)
        move(src, dst, length)

    engine.cache.move = move_broken_once
    ends = Ends()
    seqs = [ends.sequence(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(*lengths), params))]
    for seq in seqs:
        engine.add(seq)
    step_until_finished(engine, seqs)
    assert broken == [(2, 1)]  # s2 was moving into s1's slot
    assert ends.each_once(seqs)
    s0, s1, s2 = seqs
    assert s1.error == f"RuntimeError: {CUDA_ERROR} (the engine failed while ending the sequence)"
    assert s1.output_ids == references[1].output_ids  # not resumed past its last token
    for seq, reference in ((s0, references[0]), (s2, references[2])):
        same_generation(seq, reference)
        assert seq.preemptions == 1
    all_slots_free(engine)


def test_a_sequence_that_stopped_when_a_failure_hit_its_end_fails_and_does_not_generate_past_its_stop(model):
    [free] = make_engine(model).generate(prompts(9), SamplingParams(max_tokens=12, temperature=1.0, seed=3))
    stop = free.output_ids[4]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop_token_ids=(stop,)),
        SamplingParams(max_tokens=12, temperature=1.0, seed=4),
    ]
    references = make_engine(model).generate(prompts(9, 7), params)
    assert references[0].output_ids == free.output_ids[: free.output_ids.index(stop) + 1]
    engine = make_engine(model)
    ends = Ends()
    stopping, other = [ends.sequence(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(9, 7), params))]
    keep, failed = engine._keep, []

    def keep_failing_once(seq):  # keeping its cache raises once its stop token is in
        if seq is stopping and not failed:
            failed.append(list(seq.output_ids))
            raise RuntimeError(CUDA_ERROR)
        keep(seq)

    engine._keep = keep_failing_once
    engine.add(stopping)
    engine.add(other)
    step_until_finished(engine, [stopping, other])
    assert failed == [references[0].output_ids]
    assert stopping.error == f"RuntimeError: {CUDA_ERROR} (the engine failed while ending the sequence)"
    assert stopping.output_ids == references[0].output_ids  # nothing drawn past the stop token
    same_generation(other, references[1])
    assert other.preemptions == 1 and ends.each_once([stopping, other])
    all_slots_free(engine)


def fails_every_sequence_once_and_serves_on(engine, message: str) -> None:
    """Serve three sequences (two run, one waits) on `engine`'s thread, where a failure injected
    past its step's recovery fails every one of them with `message`, once; then one more, which
    the engine, still serving, generates in full. `engine` runs two at a time (`max_batch=2`)."""
    ends = Ends()
    seqs = [ends.sequence(f"s{i}", p, SamplingParams(max_tokens=10, seed=i)) for i, p in enumerate(prompts(5, 6, 7))]
    later = ends.sequence("later", prompts(4)[0], SamplingParams(max_tokens=4, seed=0))
    for seq in seqs:
        engine.add(seq)
    engine.start()
    try:
        wait_until(lambda: all(seq.finished for seq in seqs), timeout=30)
        engine.add(later)
        wait_until(lambda: later.finished, timeout=30)
        assert engine.running
    finally:
        engine.stop()
    assert [seq.error for seq in seqs] == [message] * 3 and ends.each_once(seqs + [later])
    assert later.error is None and len(later.output_ids) == 4
    assert engine.stats.requests_total["error"] == 3
    all_slots_free(engine)


def test_a_recovery_that_raises_fails_every_sequence_once_and_the_engine_serves_on(model):
    """The step fails, and so does putting the engine back in order: every sequence it holds
    (running or waiting) fails with both errors, once, and the engine thread serves on."""
    engine = make_engine(model, max_batch=2)
    engine.decoder = FaultyDecode(engine.decoder, {2}, RuntimeError("CUDA out of memory"))
    requeue, broke = engine.scheduler.requeue, []

    def requeue_failing_once(seq):
        if not broke:
            broke.append(seq)
            raise RuntimeError("requeue broke")
        requeue(seq)

    engine.scheduler.requeue = requeue_failing_once
    message = (
        "RuntimeError: CUDA out of memory (and putting the engine back in order failed: RuntimeError: requeue broke)"
    )
    fails_every_sequence_once_and_serves_on(engine, message)


def test_a_step_that_raises_past_its_recovery_fails_every_sequence_once_and_the_engine_serves_on(model):
    engine = make_engine(model, max_batch=2)
    step, calls = engine.step, []

    def step_failing_second():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("step broke")
        return step()

    engine.step = step_failing_second  # what the engine thread's loop calls (only its second call raises)
    fails_every_sequence_once_and_serves_on(engine, "the engine failed: RuntimeError: step broke")


def three_served_to_the_end(engine, params: list[SamplingParams]):
    """Sequences s0, s1, s2 (prompts of 5, 6 and 7 tokens, `params`) added and stepped until each
    finished; the `Ends` that counts their finished events, and the sequences."""
    ends = Ends()
    seqs = [ends.sequence(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(5, 6, 7), params))]
    for seq in seqs:
        engine.add(seq)
    step_until_finished(engine, seqs)
    return ends, seqs


@pytest.mark.parametrize("times", [1, 2])
def test_sequences_a_failed_plan_took_off_their_queue_are_requeued_not_lost(model, times):
    """The scheduler's plan raises after taking a sequence off its queue (the engine's prefill
    cost of the next one raises): the taken one goes back to the front of its queue as one being
    admitted would. Retried alone (a suspect), nothing else is considered beside it, so the next
    plan to raise is the one that takes s1. None is lost: each ends once."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(3)]
    references = make_engine(model).generate(prompts(5, 6, 7), params)
    engine = make_engine(model)
    cost, raised = engine.scheduler._prefill_cost, []

    def cost_raising_once_one_is_taken(seq, admitted):
        if admitted and len(raised) < times:
            raised.append([other.request_id for other in admitted])
            raise RuntimeError("injected")
        return cost(seq, admitted)

    engine.scheduler._prefill_cost = cost_raising_once_one_is_taken
    ends, seqs = three_served_to_the_end(engine, params)
    assert raised == [["s0"], ["s1"]][:times] and ends.each_once(seqs)
    for seq, reference in zip(seqs, references):
        same_generation(seq, reference)  # admitted again a step later
    assert engine.stats.requests_total["error"] == 0
    requeued_not_preempted(engine, [1, 3][times - 1])  # s0 by the first failure; s1 and s0 (running) by the second
    all_slots_free(engine)


def test_a_plan_that_keeps_failing_before_taking_any_sequence_fails_the_next_in_line_not_for_ever(model):
    """The scheduler raises before it takes anything whenever s1 would be next (a fault tied to
    one sequence that no step gets as far as running): s1 fails after `FAIL_AFTER_STEPS` failed
    steps, and the others are served as if nothing happened."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(3)]
    references = make_engine(model).generate(prompts(5, 6, 7), params)
    engine = make_engine(model, max_batch=1)
    plan, raised = engine.scheduler.plan, []

    def plan_refusing_s1(taken):
        head = engine.scheduler.waiting["interactive"].head
        if not engine.scheduler.running and head is not None and head.request_id == "s1":
            raised.append(1)
            raise RuntimeError("injected")
        return plan(taken)

    engine.scheduler.plan = plan_refusing_s1
    ends, seqs = three_served_to_the_end(engine, params)
    s0, s1, s2 = seqs
    assert len(raised) == FAIL_AFTER_STEPS and ends.each_once(seqs)
    assert s1.error == f"RuntimeError: injected (the engine's step failed {FAIL_AFTER_STEPS} times in a row)"
    for seq, reference in ((s0, references[0]), (s2, references[2])):
        same_generation(seq, reference)
    all_slots_free(engine)


def test_a_failed_step_while_idle_does_not_count_against_the_next_sequences(model):
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i) for i in range(2)]
    references = make_engine(model).generate(prompts(5, 9), params)
    engine = make_engine(model)
    plan, failed = engine.scheduler.plan, []

    def plan_failing_once(taken):
        if not failed:
            failed.append(1)
            raise RuntimeError("injected")
        return plan(taken)

    engine.scheduler.plan = plan_failing_once
    with torch.inference_mode():
        assert not engine.step()  # nothing to requeue or fail
    assert failed and engine._failed_steps == 0
    engine.decoder = FaultyDecode(engine.decoder, {1}, RuntimeError("CUDA out of memory"))  # a one-off
    seqs = [Sequence(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(5, 9), params))]
    for seq in seqs:
        engine.add(seq)
    step_until_finished(engine, seqs)
    for seq, reference in zip(seqs, references):
        same_generation(seq, reference)  # requeued once, not failed
        assert seq.preemptions == 1


def test_sequences_failed_by_a_repeated_failure_leave_the_next_ones_their_retry(model):
    engine = make_engine(model, max_batch=1)
    engine.decoder = FaultyDecode(engine.decoder, {1, 2, 3}, RuntimeError("CUDA out of memory"))
    first, second = (Sequence(f"s{i}", p, SamplingParams(max_tokens=4, seed=i)) for i, p in enumerate(prompts(5, 6)))
    engine.add(first)
    engine.add(second)
    step_until_finished(engine, [first, second])
    # retried alone, it failed again: its own failure, which leaves the count at 0
    assert first.error == f"RuntimeError: CUDA out of memory ({ADMITTED_ALONE})"
    assert second.error is None and second.preemptions == 1 and len(second.output_ids) == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_whose_prefill_always_fails_fails_alone_and_the_others_generate_what_they_would_without_it(
    model, overlap
):
    """A prompt whose prefill always raises (too long for memory, say) is admitted with an
    innocent one while two others run: that step fails and requeues all four, which are admitted
    again one per step; the step admitting the faulty one fails it alone. The innocents generate
    exactly what they do without it, and each sequence ends once."""
    from whetstone.inference.metrics import render_prometheus

    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    references = make_engine(model, overlap=overlap).generate(prompts(5, 9, 7), greedy)
    engine = make_engine(model, overlap=overlap)
    ends = Ends()
    a, b, c = (ends.sequence(name, p, greedy) for name, p in zip("abc", prompts(5, 9, 7)))
    faulty = ends.sequence("faulty", prompts(40, seed=1)[0], greedy)
    prefill, groups = engine._prefill, []

    def out_of_memory_with_faulty(group):
        groups.append([seq.request_id for seq in group])
        if faulty in group:
            raise RuntimeError("out of memory")
        prefill(group)

    engine._prefill = out_of_memory_with_faulty
    engine.add(a)
    engine.add(b)
    with torch.inference_mode():
        engine.step()
        engine.step()
        assert [seq.slot for seq in (a, b)] == [1, 0] and a.output_ids and b.output_ids  # running
        engine.add(faulty)
        engine.add(c)
        engine.step()  # admits both together: their prefill fails
    assert groups[-1] == ["faulty", "c"] and engine.stats.failure_requeues_total == 4
    step_until_finished(engine, [a, b, c, faulty])
    for seq, reference in zip((a, b, c), references):
        same_generation(seq, reference)
    assert faulty.error == f"RuntimeError: out of memory ({ADMITTED_ALONE})" and not faulty.output_ids
    assert groups.count(["faulty"]) == 1  # retried once, alone
    assert ends.each_once([a, b, c, faulty])
    assert engine.stats.requests_total["error"] == 1 and engine.stats.requests_total["length"] == 3
    # a and b, running when the faulty one was retried, were requeued once more
    assert engine.stats.failure_requeues_total == 6 and engine.stats.isolated_failures_total == 1
    assert '\nwhetstone_isolated_failures_total{model="tiny"} 1\n' in render_prometheus(engine.stats, "tiny")
    all_slots_free(engine)


def test_running_ahead_a_fault_that_surfaces_when_its_sequences_step_is_read_back_fails_it_alone(model):
    """Running one step ahead, a fault of one sequence's decode (an illegal memory access, say)
    surfaces when its step is read back, in the step after the one that launched it: the
    admission of a sequence retried after a failure lasts until then, so the fault is still
    that sequence's (not one admitted beside it, nor a step's that requeues everyone again)."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    references = make_engine(model, overlap=True).generate(prompts(5, 9), greedy)
    engine = make_engine(model, overlap=True)
    ends = Ends()
    a, b = (ends.sequence(name, p, greedy) for name, p in zip("ab", prompts(5, 9)))
    faulty = ends.sequence("faulty", prompts(7, seed=1)[0], greedy)
    take = engine._take

    def read_back_failing_with_faulty(launched):
        if faulty in launched.seqs:
            raise RuntimeError(CUDA_ERROR)
        take(launched)

    engine._take = read_back_failing_with_faulty
    for seq in (a, b, faulty):
        engine.add(seq)
    step_until_finished(engine, [a, b, faulty], limit=60)
    for seq, reference in zip((a, b), references):
        same_generation(seq, reference)
    assert faulty.error == f"RuntimeError: {CUDA_ERROR} ({ADMITTED_ALONE})" and not faulty.output_ids
    assert ends.each_once([a, b, faulty]) and engine.stats.isolated_failures_total == 1
    all_slots_free(engine)


def test_running_ahead_a_fault_read_back_from_a_step_before_the_probe_is_not_the_probes(model):
    """Running one step ahead, the step that admits a retried sequence reads back the step
    launched before, which that sequence was not in: a fault surfacing there is not its own. It
    costs nobody: everyone is requeued once more, and every sequence generates what it would."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    references = make_engine(model, overlap=True).generate(prompts(5, 9), greedy)
    engine = make_engine(model, overlap=True)
    ends = Ends()
    a, b = (ends.sequence(name, p, greedy) for name, p in zip("ab", prompts(5, 9)))
    take, faults = engine._take, []

    def read_back_failing(launched):
        first = not faults and a.output_ids and b.output_ids  # a fault while both run: both suspects
        probe = engine.scheduler.probe
        later = len(faults) == 1 and probe is not None and probe not in launched.seqs
        if first or later:
            faults.append([seq.request_id for seq in launched.seqs])
            raise RuntimeError(CUDA_ERROR)
        take(launched)

    engine._take = read_back_failing
    engine.add(a)
    engine.add(b)
    step_until_finished(engine, [a, b], limit=60)
    # the second: the step of the one retried first, read back as the other one is admitted
    assert sorted(faults[0]) == ["a", "b"] and len(faults) == 2 and len(faults[1]) == 1
    for seq, reference in zip((a, b), references):
        same_generation(seq, reference)
    assert ends.each_once([a, b]) and engine.stats.isolated_failures_total == 0
    all_slots_free(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_device_whose_every_forward_fails_still_ends_every_sequence_one_by_one(model, overlap):
    """A failure tied to no sequence: every forward raises. The step that fails first requeues
    the two running sequences; each is retried alone and fails alone; then the two waiting ones,
    admitted together, fail that step, and are retried alone in turn. No step fails for ever, and
    once the device works again the engine serves on."""
    engine = make_engine(model, max_batch=2, overlap=overlap)
    ends = Ends()
    seqs = [ends.sequence(f"s{i}", p, SamplingParams(max_tokens=8, seed=i)) for i, p in enumerate(prompts(5, 6, 7, 8))]
    for seq in seqs:
        engine.add(seq)

    def broken(*args, **kwargs):
        raise RuntimeError(CUDA_ERROR)

    ended = []
    with torch.inference_mode():
        engine.step()
        engine.step()
        engine.model.forward = broken
        for _ in range(10):
            if all(seq.finished for seq in seqs):
                break
            before = sum(seq.finished for seq in seqs)
            engine.step()
            ended.append(sum(seq.finished for seq in seqs) - before)
    del engine.model.forward
    assert ended == [0, 1, 1, 0, 1, 1] and ends.each_once(seqs)
    assert all(seq.error == f"RuntimeError: {CUDA_ERROR} ({ADMITTED_ALONE})" for seq in seqs)
    assert engine.stats.isolated_failures_total == 4 and engine._failed_steps == 0
    all_slots_free(engine)


def test_a_weight_write_that_fails_leaves_the_weights_whole_and_costs_the_sequences_nothing(model, monkeypatch):
    """A write that raises part-way: what it wrote is put back, the version is not served, no
    sequence is requeued and no step counts as failed; the update says why it was not written.
    A delta on that version is not written either (it would leave the weights of no version),
    and the version sent again is."""
    import whetstone.inference.engine as engine_module
    from whetstone.inference.swap import full_update
    from whetstone.sync import TensorUpdate, WeightUpdate

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    [reference] = make_engine(model).generate(prompts(6), params)
    engine = make_engine(model)
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    real_prepare, broken = engine_module.prepare, []

    def second_write_fails_once(update, tensors):
        prepared = real_prepare(update, tensors)
        if not broken:  # the second tensor's values are one short: its copy raises
            broken.append(update.version)
            target, indices, values = prepared.writes[1]
            prepared.writes[1] = (target, indices, values[:-1])
        return prepared

    monkeypatch.setattr(engine_module, "prepare", second_write_fails_once)
    seq = Sequence("s", prompts(6)[0], params)
    engine.add(seq)
    with torch.inference_mode():
        while len(seq.output_ids) < 3:
            engine.step()
        new = tiny_model(seed=9).state_dict()
        sent = engine.update_weights(full_update(new, version=1))
        engine.step()
        served = engine.model.state_dict()
        assert all(torch.equal(served[name], value) for name, value in before.items())  # the first tensor put back
        assert engine.version == 0 and engine._failed_steps == 0 and seq.preemptions == 0
        assert sent.done.is_set() and sent.error.startswith("writing it failed (RuntimeError: ")
        assert sent.error.endswith("serving version 0 until it is written")
        name = "layers.0.mlp.experts.down_proj"
        values, indices = torch.tensor([1.5, -2.0]), torch.tensor([0, 7])
        delta = engine.update_weights(WeightUpdate(2, 1, {name: TensorUpdate(values, indices, tuple(new[name].shape))}))
        step_until_finished(engine, [seq])
    same_generation(seq, reference)
    assert seq.versions == [0] * 8 and engine.stats.requests_total["error"] == 0
    assert delta.done.is_set() and delta.error == "not written: it builds on weight version 1, whose write failed"
    assert all(torch.equal(served[name], value) for name, value in before.items())
    again = engine.update_weights(full_update(new, version=1))  # sent again (the follower merges those after)
    with torch.inference_mode():
        engine.step()
    assert again.done.is_set() and again.error is None and engine.version == 1 and broken == [1]
    assert all(torch.equal(served[name], value) for name, value in new.items())
    all_slots_free(engine)


def test_a_weight_write_that_cannot_be_put_back_stops_the_engine_and_fails_every_sequence(model, monkeypatch):
    """Writing fails and so does putting the old values back: the weights hold parts of two
    versions, so the engine stops (its thread ends: /health says so) and fails every sequence it
    holds, and any sent to it later, once each."""
    import whetstone.inference.swap as swap
    from whetstone.inference.swap import WeightUpdateError, full_update

    engine = make_engine(model, max_batch=1)
    put, calls = swap._put, []

    def put_failing_from_the_second(target, indices, values):
        calls.append(1)
        if len(calls) >= 2:
            raise RuntimeError(CUDA_ERROR)
        put(target, indices, values)

    ends = Ends()
    running, waiting = (
        ends.sequence(f"s{i}", p, SamplingParams(max_tokens=100, seed=i)) for i, p in enumerate(prompts(5, 6))
    )
    engine.add(running)
    engine.add(waiting)
    engine.start()
    try:
        wait_until(lambda: len(running.output_ids) >= 2, timeout=30)
        monkeypatch.setattr(swap, "_put", put_failing_from_the_second)
        sent = engine.update_weights(full_update(tiny_model(seed=9).state_dict(), version=1))
        wait_until(lambda: not engine.running, timeout=30)
    finally:
        engine.stop()
    message = (
        f"writing weight version 1 failed (RuntimeError: {CUDA_ERROR}), and putting the overwritten values back "
        f"failed too (RuntimeError: {CUDA_ERROR}): the served weights hold parts of two versions"
    )
    assert sent.done.is_set() and sent.error == message
    assert running.error == waiting.error == message and ends.each_once([running, waiting])
    late = ends.sequence("late", prompts(4)[0], SamplingParams(max_tokens=4, seed=0))
    engine.add(late)  # ends at once
    assert late.error == message and ends.each_once([late])
    with pytest.raises(WeightUpdateError, match="the engine has stopped: writing weight version 1 failed"):
        engine.update_weights(full_update(tiny_model(seed=9).state_dict(), version=2))
    assert engine.stats.requests_total["error"] == 3 and engine.version == 0


@pytest.mark.timeout(120)
def test_a_server_whose_engine_fails_answers_every_request_and_keeps_its_queue_bound(served_model_dir, tokenizer):
    """The queue bound counts a sequence out on its last event: a sequence the engine lost would
    keep it counted (and its request waiting) for ever, until every request got 429."""
    from fastapi.testclient import TestClient

    from whetstone.inference.config import EngineConfig, ServeConfig
    from whetstone.inference.engine import Engine
    from whetstone.inference.server import create_app
    from whetstone.model.hf import load_hf

    engine_config = EngineConfig(max_batch=4, context_limit=512, share_prefixes=False)
    engine = Engine(
        load_hf(served_model_dir),
        engine_config,
        eos_token_ids=(tokenizer.im_end_id, tokenizer.endoftext_id),
        decode=tokenizer.decode,
    )
    engine.decoder = FaultyDecode(engine.decoder, {3}, RuntimeError(CUDA_ERROR))
    move, device_broken = engine.cache.move, [True]

    def move_on_a_broken_device(src, dst, length):  # broken from the failed step on, until "repaired"
        if device_broken[0] and engine.decoder.calls >= 3:
            raise RuntimeError(CUDA_ERROR)
        move(src, dst, length)

    engine.cache.move = move_on_a_broken_device
    config = ServeConfig(model_path=str(served_model_dir), threads=1, max_waiting_sequences=3, engine=engine_config)
    body = {"model": "tiny-chat", "prompt": "def main():", "max_tokens": 8, "n": 3, "ignore_eos": True, "seed": 0}
    with TestClient(create_app(engine, tokenizer, config, "tiny-chat"), raise_server_exceptions=False) as http:
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 500 and CUDA_ERROR in failed.json()["error"]["message"]
        device_broken[0] = False
        for _ in range(2):  # the queue has room for them: nothing was left counted
            served = http.post("/v1/completions", json=body)
            assert served.status_code == 200 and len(served.json()["choices"]) == 3
        assert http.get("/health").json()["status"] == "ok"


def test_an_engine_that_can_start_nothing_while_sequences_wait_sleeps_between_steps(model, monkeypatch):
    """Sequences waiting that no step may start (a user's grace keeping batch work out, a drain):
    the engine's thread looks again every few milliseconds instead of spinning a core."""
    engine = make_engine(model)
    monkeypatch.setattr(engine.scheduler, "plan", lambda plan: None)  # nothing may start
    steps = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    engine.start()
    try:
        engine.add(Sequence("waits", prompts(3)[0], SamplingParams(max_tokens=2)))
        wait_until(lambda: len(steps) > 2)
        counted = len(steps)
        time.sleep(0.5)
        looked = len(steps) - counted
    finally:
        engine.stop()
    assert 5 < looked < 500  # polled at WAITING_POLL_S (~100 in 0.5 s), not spun (tens of thousands)
