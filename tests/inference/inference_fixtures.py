"""Helpers and data shared by the inference tests (a plain module: `conftest` names clash
across test folders, so tests import from here)."""

from __future__ import annotations

import time

import torch

from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.model import ModelConfig, Transformer

torch.set_num_threads(1)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
GREETING = [{"role": "user", "content": "Say hello."}]
GREETING_REPLY = "Hello! How can I help you today?"
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tiny_config(**changes) -> ModelConfig:
    fields = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=512,
    )
    return ModelConfig(**(fields | changes))


def tiny_model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**changes)).eval()


def make_engine(
    model, tokenizer=None, static_shapes: bool | None = None, overlap: bool | None = None, **config
) -> Engine:
    eos = () if tokenizer is None else (tokenizer.im_end_id, tokenizer.endoftext_id)
    # the CPU unless a test asks for a device: tests compare with forwards of the model on the CPU;
    # one step at a time unless a test asks to run ahead (tests count the tokens each step gives)
    config = {"max_batch": 4, "context_limit": 256, "device": "cpu", "overlap_steps": False} | config
    decode = None if tokenizer is None else tokenizer.decode
    return Engine(
        model, EngineConfig(**config), eos_token_ids=eos, decode=decode, static_shapes=static_shapes, overlap=overlap
    )


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll `condition` (something another thread makes true) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def learn_by_heart(model: Transformer, examples: list[tuple[list[int], list[int]]], steps: int = 80) -> None:
    """Train until greedy decoding of each prompt reproduces its completion (checked)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = 0.0
        for prompt, completion in examples:
            ids = torch.tensor([prompt + completion])
            logits = model(ids[:, :-1]).logits[0, len(prompt) - 1 :]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(completion))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        for prompt, completion in examples:
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == completion, "the fixture model did not learn its answers"
