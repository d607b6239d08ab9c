"""Fixtures: a tiny MoE model, a tokenizer trained here, and a served checkpoint folder whose
model has learned (by heart, in a few seconds) to answer two chat prompts: one with a plain
reply, one with a `<tool_call>`. Nothing is downloaded."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from tests.inference.inference_fixtures import (
    GREETING,
    GREETING_REPLY,
    WEATHER_CALL,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    learn_by_heart,
    tiny_model,
)
from whetstone.model import Transformer
from whetstone.model.hf import save_hf
from whetstone.tokenizer import Tokenizer, render_chat


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    chats = [
        render_chat(GREETING + [{"role": "assistant", "content": GREETING_REPLY}]),
        render_chat(WEATHER_QUESTION, [WEATHER_TOOL], add_generation_prompt=True) + WEATHER_CALL,
    ]
    texts = [inspect.getsource(textwrap), inspect.getsource(json.decoder)] + chats * 50
    return Tokenizer.train(texts, vocab_size=1024)


@pytest.fixture
def model() -> Transformer:
    return tiny_model()


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory, tokenizer):
    """An HF folder (weights + tokenizer) of a tiny model that knows GREETING and WEATHER."""
    model = tiny_model(
        seed=1,
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        head_dim=8,
        moe_intermediate_size=32,
    )
    end = [tokenizer.im_end_id]
    examples = [
        (tokenizer.encode(render_chat(GREETING, add_generation_prompt=True)), tokenizer.encode(GREETING_REPLY) + end),
        (
            tokenizer.encode(render_chat(WEATHER_QUESTION, [WEATHER_TOOL], add_generation_prompt=True)),
            tokenizer.encode(WEATHER_CALL) + end,
        ),
    ]
    learn_by_heart(model, examples)
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(tokenizer_dir)
    return save_hf(model, tmp_path_factory.mktemp("served") / "tiny-chat", tokenizer_dir=tokenizer_dir)
