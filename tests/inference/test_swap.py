import pytest
import torch

from tests.inference.inference_fixtures import make_engine, tiny_model, wait_until
from whetstone.inference.metrics import render_prometheus
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence
from whetstone.inference.swap import WeightFollower, WeightUpdateError, full_update
from whetstone.model.layout import is_column_major
from whetstone.sync import Publisher, Subscriber, SyncConfig, TensorUpdate, WeightStore, WeightUpdate

PROMPT = [5, 17, 42, 8, 99]


def run_until(engine, condition):
    with torch.inference_mode():
        while not condition():
            engine.step()


def test_full_update_serves_the_new_weights_from_the_next_step(model):
    new = tiny_model(seed=9)
    engine = make_engine(model)
    engine.update_weights(full_update(new.state_dict(), version=1))
    [seq] = engine.generate([PROMPT], SamplingParams(max_tokens=6, seed=0))
    [expected] = make_engine(new).generate([PROMPT], SamplingParams(max_tokens=6, seed=0))
    assert seq.output_ids == expected.output_ids and seq.versions == [1] * 6
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), new.state_dict().values()))
    assert engine.stats.swaps_total == 1 and engine.stats.weight_version == 1
    assert "whetstone_swap_pause_seconds_count" in render_prometheus(engine.stats, "m")


def test_sparse_update_overwrites_exactly_the_given_values(model):
    engine = make_engine(model)
    name = "layers.0.mlp.experts.down_proj"
    before = model.state_dict()[name].clone()
    indices, values = torch.tensor([0, 7, 123]), torch.tensor([1.5, -2.0, 0.25])
    engine.update_weights(WeightUpdate(2, 1, {name: TensorUpdate(values, indices, tuple(before.shape))}))
    with torch.inference_mode():
        engine.step()
    assert is_column_major(model.state_dict()[name])  # indices are logical, the memory is not in that order
    after = model.state_dict()[name].reshape(-1)
    assert after[indices].tolist() == values.tolist()
    untouched = torch.ones(after.numel(), dtype=torch.bool)
    untouched[indices] = False
    assert torch.equal(after[untouched], before.reshape(-1)[untouched])


def test_continue_policy_tags_each_token_with_its_version(model):
    engine = make_engine(model, swap_policy="continue")
    seq = Sequence("s", PROMPT, SamplingParams(max_tokens=8, seed=0))
    engine.add(seq)
    run_until(engine, lambda: len(seq.output_ids) == 3)
    engine.update_weights(full_update(tiny_model(seed=9).state_dict(), version=1))
    run_until(engine, lambda: seq.finished)
    assert seq.versions == [0, 0, 0, 1, 1, 1, 1, 1]


def test_finish_policy_drains_in_flight_sequences_on_the_old_weights(model):
    engine = make_engine(model, swap_policy="finish")
    old = Sequence("old", PROMPT, SamplingParams(max_tokens=6, seed=0))
    engine.add(old)
    run_until(engine, lambda: len(old.output_ids) == 2)
    engine.update_weights(full_update(tiny_model(seed=9).state_dict(), version=1))
    new = Sequence("new", PROMPT, SamplingParams(max_tokens=3, seed=0))
    engine.add(new)
    run_until(engine, lambda: old.finished)
    assert old.versions == [0] * 6 and not new.output_ids  # the newcomer waited
    run_until(engine, lambda: new.finished)
    assert new.versions == [1] * 3


def test_an_update_that_does_not_fit_is_refused_and_nothing_is_written(model):
    engine = make_engine(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = tiny_model(seed=9).state_dict()
    state["norm.weight"] = torch.ones(7)
    with pytest.raises(WeightUpdateError, match=r"norm.weight has shape \(7,\)"):
        engine.update_weights(full_update(state, version=1))
    with pytest.raises(WeightUpdateError, match="no tensor 'nope'"):
        engine.update_weights(WeightUpdate(1, None, {"nope": TensorUpdate(torch.ones(1), None, (1,))}))
    name = "norm.weight"
    with pytest.raises(WeightUpdateError, match="index outside"):
        engine.update_weights(WeightUpdate(1, 0, {name: TensorUpdate(torch.ones(1), torch.tensor([10**6]), (64,))}))
    with torch.inference_mode():
        engine.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and engine.version == 0


def test_follows_a_weight_store_through_the_sync_subscriber(model, tmp_path):
    """Trainer side publishes a keyframe then a delta; the server applies both in place."""
    config = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", poll_interval=0.05)
    store = WeightStore.open(config)
    publisher = Publisher(store, config)
    trained = tiny_model(seed=9)
    publisher.publish(trained.state_dict())
    with torch.no_grad():
        trained.layers[0].mlp.experts.down_proj[0, :3] += 0.5
    publisher.publish(trained.state_dict())

    engine = make_engine(model)
    engine.start()
    follower = WeightFollower(Subscriber(store, config), engine, poll_seconds=0.05).start()
    try:
        wait_until(lambda: engine.version == 1)
    finally:
        follower.stop()
        engine.stop()
    assert engine.version == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))


def test_an_update_is_taken_when_update_weights_returns(model):
    """A caller may reuse its tensors once `update_weights` returns: on the CPU, values already in
    the served dtype and order must not be served from the caller's memory."""
    engine = make_engine(model)
    given = {name: t.clone() for name, t in tiny_model(seed=9).state_dict().items()}
    expected = {name: t.clone() for name, t in given.items()}
    engine.update_weights(full_update(given, version=1))
    indices, values = torch.tensor([0, 5]), torch.tensor([1.5, -2.0])
    engine.update_weights(WeightUpdate(2, 1, {"norm.weight": TensorUpdate(values, indices, (64,))}))
    expected["norm.weight"][indices] = values
    for t in (*given.values(), values):
        t.fill_(123.0)
    indices.fill_(1)
    with torch.inference_mode():
        engine.step()
    assert engine.version == 2
    assert all(torch.equal(t, expected[name]) for name, t in model.state_dict().items())
