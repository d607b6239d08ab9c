"""Shared pieces of the harness tests (no tests here): a small tokenizer trained on the spot, a
scripted policy that stands in for the model, tool-call text, and a synth task.

The scripted policy is stateless, like a model: each reply is a function of the prompt text it
is given, so whatever it "remembers" must be in its context."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

from whetstone.envs import prompts
from whetstone.envs.harness import Completion, Policy, Sampling
from whetstone.envs.task import Task
from whetstone.envs.tasks import load_source
from whetstone.tokenizer import Tokenizer, render_chat
from whetstone.utils.processes import free_port


@functools.cache
def tokenizer() -> Tokenizer:
    demo = [prompts.SYSTEM_PROMPT, render_chat([{"role": "user", "content": "x"}, prompts.tool_call("c", "run_tests")])]
    return Tokenizer.train([inspect.getsource(textwrap), inspect.getsource(json.decoder)] + demo * 20, vocab_size=1024)


def call(name: str, **arguments: str) -> str:
    """A tool call as the model writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@functools.cache
def _synth() -> Task:
    return load_source("synth", ["count=1", "seed=3"])[0]


def synth_task(**changes) -> Task:
    return _synth().model_copy(update=changes)


class ScriptedPolicy(Policy):
    """Replies `reply(prompt_text)`, tokenized with the tokenizer and ended by `<|im_end|>`, cut to
    `max_tokens` (finish_reason `length`) like a server would."""

    def __init__(self, reply: Callable[[str], str], context_limit: int | None = None, version: int = 7):
        self.reply = reply
        self.context_limit = context_limit
        self.version = version
        self.prompts: list[list[int]] = []

    async def complete(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        tok = tokenizer()
        self.prompts.append(list(prompt_ids))
        ids = tok.encode(self.reply(tok.decode(prompt_ids))) + [tok.im_end_id]
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        logprobs = [-0.1 - position / 1000 for position in range(len(ids))]
        return Completion(ids, logprobs, [self.version] * len(ids), None, finish, tok.decode(ids))


def assert_one_growing_sequence(calls) -> None:
    """Each call's prompt starts with the previous call's prompt + completion (the trainer's merge)."""
    for before, after in zip(calls, calls[1:]):
        sent = before.prompt_ids + before.completion_ids
        assert after.prompt_ids[: len(sent)] == sent


def turn_number(prompt: str) -> int:
    """How many tool results the current context holds (the scripted agent's notion of progress)."""
    return prompt.count("<tool_response>")


def solver(task: Task) -> Callable[[str], str]:
    """A scripted agent that writes the reference solution, runs the tests and submits."""
    path, content = next(iter(task.solution_files.items()))
    steps = [call("write_file", path=path, content=content), call("run_tests"), call("submit")]
    return lambda prompt: steps[min(turn_number(prompt), len(steps) - 1)]


def save_tiny_model(folder) -> str:
    """An HF folder (random weights + the tokenizer above) of a tiny MoE that `whetstone serve` can load.
    With random weights it writes noise: the tests check the pipeline, not the answers."""
    import torch

    from whetstone.model import ModelConfig, Transformer
    from whetstone.model.hf import save_hf

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tokenizer().vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        max_position_embeddings=1024,
    )
    tokenizer_dir = folder / "tokenizer"
    tokenizer().save(tokenizer_dir)
    return str(save_hf(Transformer(config).eval(), folder / "tiny-agent", tokenizer_dir=tokenizer_dir))


@contextlib.contextmanager
def serve_in_thread(model_dir: str) -> Iterator[str]:
    """The real inference server (engine + HTTP app) on a free port, run by uvicorn in a thread of
    this process (no second torch import); yields its API root."""
    import uvicorn

    from whetstone.inference.config import EngineConfig, ServeConfig
    from whetstone.inference.launch import build_app

    port = free_port()
    config = ServeConfig(model_path=model_dir, port=port, threads=1, engine=EngineConfig(max_batch=8))
    server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
