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


def test_a_failed_prefill_fails_every_sequence_admitted_with_it(model):
    """The scheduler takes admitted sequences off its queues before their prefill; when it raises
    (a GPU out of memory), those not started yet must fail too, not wait for ever."""
    engine = make_engine(model)
    prefill, calls = engine._prefill, []

    def out_of_memory_once(group):
        calls.append(group)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        prefill(group)

    engine._prefill = out_of_memory_once
    base = prompts(30)[0]
    # the longer one is prefilled first; the other copies its prefix from it after
    longer = Sequence("longer", base + [40, 41], SamplingParams(max_tokens=4, seed=0))
    shorter = Sequence("shorter", base, SamplingParams(max_tokens=4, seed=1))
    later = Sequence("later", prompts(6)[0], SamplingParams(max_tokens=4, seed=2))
    engine.add(longer)
    engine.add(shorter)
    engine.start()
    try:
        wait_until(lambda: longer.finished and shorter.finished, timeout=10)
        engine.add(later)  # and the engine serves on
        wait_until(lambda: later.finished, timeout=10)
    finally:
        engine.stop()
    assert calls[0] == [longer]
    for seq in (longer, shorter):
        assert seq.error == "RuntimeError: out of memory" and seq.finish_reason == "abort" and seq.slot is None
    assert later.error is None and len(later.output_ids) == 4
    assert engine.stats.requests_total["error"] == 2 and not engine.scheduler.has_work


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(model):
    """Even one too big for an int64 (the step would raise, failing every running sequence)."""
    engine = make_engine(model)
    huge, whole = (SamplingParams(max_tokens=5, seed=3, top_k=k) for k in (10**20, model.cfg.vocab_size))
    [a], [b] = engine.generate(prompts(5), huge), engine.generate(prompts(5), whole)
    assert a.error is None and a.output_ids == b.output_ids and a.logprobs == b.logprobs
