"""The deploy gate's engine scores the weights it is given, or says it could not take them."""

import pytest
import torch

import whetstone.inference.engine as engine_module
from tests.online.online_fixtures import HELDOUT_TASKS, PREFERS_CODE, tiny_chat_model
from whetstone.errors import WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.online.config import GateConfig
from whetstone.online.gate import Gate
from whetstone.tokenizer import Tokenizer


def test_a_candidate_the_gates_engine_cannot_write_is_not_scored_as_the_weights_it_already_has(tmp_path, monkeypatch):
    model_dir = tiny_chat_model(tmp_path)
    config = GateConfig.model_validate(
        {
            "tasks": {"synth": HELDOUT_TASKS.model_dump()},
            "max_tokens": 4,
            "metric": {"kind": "regex", "pattern": PREFERS_CODE},
        }
    )
    gate = Gate(config, load_hf(model_dir), Tokenizer.load(model_dir), device="cpu")
    weights = {name: t.clone() for name, t in load_hf(model_dir).state_dict().items()}
    assert 0.0 <= gate.score(weights, 1) <= 1.0  # written and scored
    real_prepare = engine_module.prepare

    def one_write_short(update, tensors):  # the second tensor's values are one short: its copy raises
        prepared = real_prepare(update, tensors)
        target, indices, values = prepared.writes[1]
        prepared.writes[1] = (target, indices, values[:-1])
        return prepared

    monkeypatch.setattr(engine_module, "prepare", one_write_short)
    candidate = {name: t + 0.5 for name, t in weights.items()}
    with pytest.raises(WhetstoneError, match=r"the gate's engine could not take weight version 2 to score it: writing"):
        gate.score(candidate, 2)
    served = gate.engine.model.state_dict()
    assert all(torch.equal(served[name], t) for name, t in weights.items())  # put back whole
