"""Bad input the loop meets: feedback events it cannot train on are dropped with the reason, not
the update (and its other events) with them; a damaged state.json is refused, saying what to do."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.online.online_fixtures import NO_GATE, online_config
from whetstone.errors import WhetstoneError
from whetstone.online.loop import OnlineLoop
from whetstone.store.feedback import FeedbackStore


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_feedback_the_loop_cannot_train_on_is_dropped_not_the_update(world, caplog):
    world.feedback(16)
    other = FeedbackStore.open(world.config.feedback_store)  # another writer of the store
    kept = other.rated_after(0, 1)[0].response
    outside = [world.loop.model.cfg.vocab_size + 5] * len(kept.completion_ids)  # a response of another model
    foreign = replace(kept, response_id="chatcmpl-other-model", completion_ids=outside, created=0.0)
    unknown = replace(kept, response_id="chatcmpl-other-rating", created=0.0)
    other.record([foreign, unknown])
    other.add_feedback(foreign.response_id, 0, "thumbs_up")
    other.add_feedback(unknown.response_id, 0, "regenerate")

    record = world.loop.update()
    assert record["events"] == 18 and record["dropped_malformed"] == 2 and record["kept"] == 16
    assert record["decision"] == "published"
    assert "feedback event 17 dropped: token ids in" in caplog.text
    assert "feedback event 18 dropped: rating 'regenerate' is not one of" in caplog.text
    state = json.loads((Path(world.config.output_dir) / "state.json").read_text())
    assert state["cursor"] == 18 and "consuming" not in state


@pytest.mark.parametrize("world", [NO_GATE], indirect=True)
def test_a_damaged_state_json_is_refused_saying_what_to_do(world):
    world.feedback(16)
    world.loop.update()
    path = Path(world.config.output_dir) / "state.json"
    good = json.loads(path.read_text())
    damaged = {
        '{"cursor": 16, "upd': "Invalid JSON",
        "[]": "Input should be an object",
        json.dumps(good | {"cursor": -1}): "cursor: Input should be greater than or equal to 0 (got -1)",
        json.dumps(good | {"lineage": None}): "lineage: Input should be an object",
        json.dumps(good | {"lineage": {"weights": {"one": 0}}}): "lineage.weights.one.[key]: Input should be",
        json.dumps({k: v for k, v in good.items() if k != "updates"}): "updates: Field required",
    }
    for text, problem in damaged.items():
        path.write_text(text)
        with pytest.raises(WhetstoneError) as refused:
            OnlineLoop(world.config)
        message = str(refused.value)
        assert message.startswith(f"{path} is not an online loop's state ({problem}")
        assert "move it away, and the loop starts after the newest feedback event" in message
    path.unlink()  # what the message says to do
    assert OnlineLoop(world.config).state["cursor"] == 16


def test_a_batch_of_token_ids_outside_the_vocabulary_is_refused_before_the_step(tmp_path, two_style_dir):
    # The loop's own check on what it trains, as the RL trainer's on every batch: a clear error
    # naming the update, not an index error in the embedding (a device-side assert on a GPU),
    # and the policy left as it was.
    from whetstone.rl.batch import collate
    from whetstone.rl.samples import Sample

    loop = OnlineLoop(online_config(tmp_path, two_style_dir))
    vocab = loop.model.cfg.vocab_size
    samples = [
        Sample([1, 2, token, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], None, reward=reward, advantage=reward)
        for token, reward in ((4, 1.0), (vocab + 7, -1.0))
    ]
    batch = collate(samples, meta={"index": 3})
    before = {name: tensor.clone() for name, tensor in loop.model.state_dict().items()}
    with pytest.raises(WhetstoneError, match=rf"update 3's feedback batch holds token ids in \[1, {vocab + 7}\]"):
        loop.train_and_gate(batch)
    assert all(torch.equal(tensor, before[name]) for name, tensor in loop.model.state_dict().items())
