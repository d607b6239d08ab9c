import threading

import pytest
import torch

from tests.inference.inference_fixtures import make_engine, tiny_model, wait_until
from whetstone.errors import WhetstoneError
from whetstone.inference.sampling import InvalidRequest, SamplingParams
from whetstone.inference.sequence import Sequence


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
def test_a_prefill_that_raises_is_retried_and_fails_its_sequences_if_it_raises_again(model, times):
    """The scheduler takes admitted sequences off its queues before their prefill; when it raises
    (a GPU out of memory) they go back to their queues, and fail only if the retry raises too."""
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
    assert calls[0] == [longer] and calls[1] == [longer]
    if times == 1:
        for seq, reference in zip((longer, shorter), references):
            same_generation(seq, reference)
        assert engine.stats.requests_total["error"] == 0
    else:
        for seq in (longer, shorter):
            assert seq.error == "RuntimeError: out of memory (the engine's step failed 2 times in a row)"
            assert seq.finish_reason == "abort" and seq.slot is None and not seq.output_ids
        assert engine.stats.requests_total["error"] == 2
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


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batched_forward_that_raises_once_costs_its_sequences_nothing_and_twice_fails_them(model, overlap):
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

    engine, seqs = run({4, 5})  # the retry's first decode raises too
    for seq, reference in zip(seqs, references):
        assert seq.error == "RuntimeError: CUDA out of memory (the engine's step failed 2 times in a row)"
        # the tokens read back before it: three steps' (one step at a time) or two (the third pending)
        assert seq.finish_reason == "abort" and seq.output_ids == reference.output_ids[: 2 if overlap else 3]
    assert engine.stats.requests_total["error"] == 3 and not engine.scheduler.has_work
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
