"""A sequence whose prompt starts like a running one's copies that prefix's cache and routes
(`EngineConfig.share_prefixes`): the G rollouts of a task are prefilled once."""

import torch

from tests.inference.inference_fixtures import make_engine, tiny_model
from whetstone.inference.engine import common_prefix_length
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.inference.swap import full_update


def prompt(length, seed=0):
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def group_and_neighbour():
    """Four copies of one prompt (a rollout group) and a prompt sharing its first 20 tokens."""
    base = prompt(40)
    return [base] * 4 + [base[:20] + prompt(15, seed=1)]


def generate(model, prompts, **config):
    engine = make_engine(model, max_batch=8, **config)
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=10, seed=i) for i in range(len(prompts))])
    return engine, seqs


def test_shared_prefixes_change_no_token_logprob_or_route():
    # Invariant numerics: a prefix computed once and copied is bit for bit the prefix computed again.
    model = tiny_model()
    shared_engine, shared = generate(model, group_and_neighbour(), numerics="invariant")
    alone_engine, alone = generate(model, group_and_neighbour(), numerics="invariant", share_prefixes=False)
    for a, b in zip(shared, alone):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
        assert torch.equal(a.routes, b.routes)  # the prompt's routes came along with its cache
    assert shared_engine.stats.prompt_tokens_shared_total == 3 * 39 + 20
    assert alone_engine.stats.prompt_tokens_shared_total == 0
    assert len({tuple(s.output_ids) for s in shared[:4]}) > 1  # same prompt, own seeds: own samples


def test_fast_numerics_share_to_float_noise():
    model = tiny_model()
    _, shared = generate(model, group_and_neighbour())
    _, alone = generate(model, group_and_neighbour(), share_prefixes=False)
    for a, b in zip(shared, alone):
        assert a.output_ids == b.output_ids and torch.equal(a.routes, b.routes)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_copies_fit_the_prefill_budget_and_a_later_arrival_copies_from_a_running_sequence():
    model = tiny_model()
    engine = make_engine(model, max_batch=8, prefill_tokens_per_step=50)
    first = [Sequence(f"r{i}", prompt(40), SamplingParams(max_tokens=12, seed=i)) for i in range(4)]
    for seq in first:
        engine.add(seq)
    with torch.inference_mode():
        engine.step()  # one 39-token prefill: the other three copy it, so all four start at once
        assert len(engine.scheduler.running) == 4
        late = Sequence("late", prompt(40), SamplingParams(max_tokens=4, seed=9))
        engine.add(late)
        engine.step()
        assert late.slot is not None and engine.stats.prompt_tokens_shared_total == 4 * 39
        while not late.finished:
            engine.step()
    [reference] = make_engine(model, share_prefixes=False).generate([prompt(40)], SamplingParams(max_tokens=4, seed=9))
    assert late.output_ids == reference.output_ids


def test_nothing_is_copied_from_a_cache_filled_under_older_weights():
    model, new_weights = tiny_model(), tiny_model(seed=9).state_dict()
    engine = make_engine(model, max_batch=8)
    old = Sequence("old", prompt(40), SamplingParams(max_tokens=20, seed=0))
    engine.add(old)
    with torch.inference_mode():
        engine.step()
        engine.update_weights(full_update(new_weights, version=1))
        engine.step()  # the swap lands; `old` keeps decoding (continue policy)
        new = Sequence("new", prompt(40), SamplingParams(max_tokens=5, seed=3))
        engine.add(new)
        while not new.finished:
            engine.step()
    assert engine.stats.prompt_tokens_shared_total == 0 and new.versions == [1] * 5
    [reference] = make_engine(tiny_model(seed=9)).generate([prompt(40)], SamplingParams(max_tokens=5, seed=3))
    assert new.output_ids == reference.output_ids


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 4], 10) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix_length([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix_length([5], [1], 3) == 0 and common_prefix_length([], [1], 3) == 0
    long = list(range(1000))
    assert common_prefix_length(long, long[:777] + [-1] + long[778:], 1000) == 777


def continue_turn(engine, first_prompt, seed=0):
    """A first turn, then a second whose prompt is the first's tokens and a tool result."""
    [first] = engine.generate([first_prompt], SamplingParams(max_tokens=10, seed=seed))
    second_prompt = first.prompt_ids + first.output_ids + prompt(6, seed=seed + 50)
    [second] = engine.generate([second_prompt], SamplingParams(max_tokens=8, seed=seed + 1))
    return first, second


def test_a_next_turn_copies_the_finished_turns_cache():
    model = tiny_model()
    kept_engine = make_engine(model, numerics="invariant")
    first, second = continue_turn(kept_engine, prompt(30))
    # everything the first turn fed: its prompt and all its tokens but the last sampled one
    assert kept_engine.stats.prompt_tokens_shared_total == 30 + 10 - 1
    _, alone = continue_turn(make_engine(model, numerics="invariant", share_prefixes=False), prompt(30))
    assert second.output_ids == alone.output_ids and second.logprobs == alone.logprobs
    assert torch.equal(second.routes, alone.routes)


def test_kept_caches_are_evicted_least_recently_used_and_dropped_at_a_swap():
    model, params = tiny_model(), SamplingParams(max_tokens=2, seed=0)
    engine = make_engine(model, keep_finished=2)
    [a] = engine.generate([prompt(30, seed=2)], SamplingParams(max_tokens=4, seed=0))
    [b] = engine.generate([prompt(30, seed=3)], SamplingParams(max_tokens=4, seed=0))
    engine.generate([a.prompt_ids + a.output_ids], params)  # uses a's; when it ends, b's is evicted
    assert engine.stats.prompt_tokens_shared_total == 30 + 4 - 1
    engine.generate([b.prompt_ids + b.output_ids], params)
    assert engine.stats.prompt_tokens_shared_total == 30 + 4 - 1

    engine = make_engine(model)
    [c] = engine.generate([prompt(30, seed=4)], SamplingParams(max_tokens=4, seed=0))
    engine.update_weights(full_update(tiny_model(seed=9).state_dict(), version=1))
    engine.generate([c.prompt_ids + c.output_ids], params)  # the swap lands first: c's cache is stale
    assert engine.stats.prompt_tokens_shared_total == 0

    engine = make_engine(model, keep_finished=0)
    continue_turn(engine, prompt(30))
    assert engine.stats.prompt_tokens_shared_total == 0


def agents_next_turns(engine) -> list[Sequence]:
    """Four conversations' first turns (kept when they end), then their next turns at once, each
    with its own tool output after its own history: followers copying prefixes of different
    lengths, prefilled from different positions."""
    histories = [prompt(20 + 9 * i, seed=30 + i) for i in range(4)]
    firsts = engine.generate(histories, [SamplingParams(max_tokens=3 + i, seed=i) for i in range(4)])
    nexts = [h + s.output_ids + prompt(5 + 4 * i, seed=60 + i) for i, (h, s) in enumerate(zip(histories, firsts))]
    return engine.generate(nexts, [SamplingParams(max_tokens=6, seed=i) for i in range(4)])


def test_followers_admitted_together_are_prefilled_in_one_forward_each_from_its_own_position():
    model = tiny_model()
    engine = make_engine(model, numerics="invariant", max_batch=4)
    forwards = []
    real_forward = engine._forward
    engine._forward = lambda ids, positions, cache, **kw: (
        forwards.append(positions.tolist()) or real_forward(ids, positions, cache, **kw)
    )
    ragged = agents_next_turns(engine)
    # the second turns: one prefill forward (their rows start where each history's cache ends)
    prefills = [p for p in forwards if len(p[0]) > 1]
    assert len(prefills) == 2  # the first turns' (one group), then the second turns' (one wave)
    starts = sorted(row[0] for row in prefills[1])
    assert len(set(starts)) == 4  # four different first positions in one forward
    assert engine.stats.prompt_tokens_shared_total == sum(20 + 9 * i + 3 + i - 1 for i in range(4))
    # invariant numerics: the same bits as each prompt prefilled alone from position 0
    alone = agents_next_turns(make_engine(model, numerics="invariant", max_batch=4, share_prefixes=False))
    for a, b in zip(ragged, alone):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs
        assert torch.equal(a.routes, b.routes)


def test_a_follower_whose_longest_prefix_is_another_followers_waits_for_it():
    # b's prompt continues a's, and both continue a kept turn. Admitted together, a's longest
    # prefix is b's prompt: a waits for the wave after b's and copies all of it but its last
    # token, as one at a time it would have; in one wave it would copy only the kept turn.
    model = tiny_model()
    engine = make_engine(model, max_batch=4)
    [root] = engine.generate([prompt(24, seed=1)], SamplingParams(max_tokens=2, seed=0))
    a_prompt = root.prompt_ids + root.output_ids + prompt(10, seed=2)
    b_prompt = a_prompt + prompt(7, seed=3)
    shared_before = engine.stats.prompt_tokens_shared_total
    a, b = engine.generate([a_prompt, b_prompt], SamplingParams(max_tokens=3, seed=4))
    # a copies root's 25 cached positions; b copies a's whole prompt but its last token
    assert engine.stats.prompt_tokens_shared_total - shared_before == 25 + len(a_prompt) - 1
    alone = make_engine(model, max_batch=4, share_prefixes=False)
    for ours, theirs in zip([a, b], alone.generate([a_prompt, b_prompt], SamplingParams(max_tokens=3, seed=4))):
        assert ours.output_ids == theirs.output_ids and torch.equal(ours.routes, theirs.routes)


def test_a_follower_whose_padding_would_run_past_the_cache_is_prefilled_alone():
    # context 96: a long kept history (80 positions) beside a follower with 60 tokens to feed
    model = tiny_model()
    engine = make_engine(model, max_batch=4, context_limit=96, numerics="invariant")
    [long_turn] = engine.generate([prompt(78, seed=5)], SamplingParams(max_tokens=3, seed=0))
    [short_turn] = engine.generate([prompt(12, seed=6)], SamplingParams(max_tokens=3, seed=0))
    nexts = [
        long_turn.prompt_ids + long_turn.output_ids + prompt(4, seed=7),
        short_turn.prompt_ids + short_turn.output_ids + prompt(60, seed=8),
    ]
    ours = engine.generate(nexts, SamplingParams(max_tokens=4, seed=1))
    alone = make_engine(model, max_batch=4, context_limit=96, numerics="invariant", share_prefixes=False)
    theirs = alone.generate(nexts, SamplingParams(max_tokens=4, seed=1))
    for a, b in zip(ours, theirs):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
