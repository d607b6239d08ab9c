"""Helpers shared by the online tests (a plain module: `conftest` names clash across folders):
a tiny MoE with a tokenizer trained on the synth tasks' text, and a real server on a real port."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import uvicorn

from tests.inference.inference_fixtures import tiny_config
from whetstone.envs.prompts import SYSTEM_PROMPT, first_user_message
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.model import Transformer
from whetstone.model.hf import load_hf, save_hf
from whetstone.online.config import OnlineConfig
from whetstone.online.loop import OnlineLoop
from whetstone.online.preferences import task_messages
from whetstone.online.simulator import UserSimulator
from whetstone.tokenizer import Tokenizer, render_chat
from whetstone.utils.processes import free_port

torch.set_num_threads(1)

API_KEY = "test-key"
USER_TASKS = SynthConfig(count=24, split="train", seed=3)
HELDOUT_TASKS = SynthConfig(count=12, split="heldout", seed=4)


def tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """An HF folder: a tiny MoE with random weights, and a BPE trained on the tasks' prompts."""
    tasks = generate(USER_TASKS) + generate(HELDOUT_TASKS)
    texts = [
        SYSTEM_PROMPT,
        *(first_user_message(t) for t in tasks),
        *(s for t in tasks for s in t.solution_files.values()),
    ]
    tokenizer = Tokenizer.train(texts * 4, vocab_size=600)
    tokenizer.save(folder / "tokenizer")
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=tokenizer.vocab_size)
    return Path(save_hf(Transformer(config).eval(), folder / "model", tokenizer_dir=folder / "tokenizer"))


@contextmanager
def running_server(app):
    """`app` under uvicorn on a free port in a thread (real sockets, real HTTP); yields the API root."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


CODE_REPLY = "def solve(x):\n    return x\n"
PROSE_REPLY = "I would rather explain it first."
PREFERS_CODE = r"^def "
"""The simulated users' hidden taste in the tests: replies that start with code."""


def two_style_model(folder: Path, code_share: float = 0.5, prompts: int = 4, steps: int = 40) -> Path:
    """`tiny_chat_model`, taught to answer a task with CODE_REPLY (share `code_share` of its
    first-token probability) or PROSE_REPLY (the rest): a style the loop can move, measurably.
    A few prompts suffice: the style does not depend on the task, so held-out prompts get it too."""
    model_dir = tiny_chat_model(folder)
    tokenizer = Tokenizer.load(model_dir)
    model = load_hf(model_dir).train()
    rows, weights = [], []
    for task in generate(USER_TASKS)[:prompts]:
        prompt = tokenizer.encode(render_chat(task_messages(task), add_generation_prompt=True))
        for reply, weight in ((CODE_REPLY, code_share), (PROSE_REPLY, 1 - code_share)):
            rows.append((prompt, tokenizer.encode(reply) + [tokenizer.im_end_id]))
            weights.append(weight)
    length = max(len(p) + len(c) for p, c in rows) - 1
    inputs = torch.zeros(len(rows), length, dtype=torch.long)
    targets = torch.full((len(rows), length), -100)  # right padding, never a target
    for row, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        targets[row, len(prompt) - 1 : len(ids) - 1] = torch.tensor(completion)
    row_weights = torch.tensor(weights).unsqueeze(1).expand(-1, length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        logits = model(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        loss = (loss * row_weights.flatten()).sum() / (targets != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return Path(save_hf(model.eval(), folder / "two-style", tokenizer_dir=folder / "tokenizer"))


def merged(base: dict, changes: dict) -> dict:
    """`base` with `changes` applied, nested sections merged key by key."""
    return base | {
        key: merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        for key, value in changes.items()
    }


def online_config(work: Path, model_dir: Path, **changes) -> OnlineConfig:
    """The loop's config for the tests: stores under `work`, the two-style gate, quick polling;
    `changes` merged in (a nested section key by key)."""
    fields = {
        "model_path": str(model_dir),
        "feedback_store": str(work / "feedback.db"),
        "output_dir": str(work / "online"),
        "sync": {"store": str(work / "weights"), "poll_interval": 0.05, "publish_dtype": "float32"},
        "trigger": {"every_events": 16, "min_events": 4, "max_events": 64},
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0},
        "gate": {
            "tasks": {"synth": HELDOUT_TASKS.model_dump()},
            "max_tokens": 12,
            "metric": {"kind": "regex", "pattern": PREFERS_CODE},
        },
        "poll_interval": 0.05,
    }
    return OnlineConfig.model_validate(merged(fields, changes))


NO_GATE = {"gate": {"max_regression": 1.0, "max_total_regression": 1.0}}
"""Changes that let every candidate through the gate."""


@dataclass
class World:
    """One server following the weight store and keeping feedback, the loop, and its users."""

    config: OnlineConfig
    url: str
    loop: OnlineLoop
    users: UserSimulator

    def feedback(self, requests: int = 16, **ask) -> None:
        self.users.run(generate(USER_TASKS), users=2, requests=requests, **ask)

    def greedy(self) -> dict:
        body = {
            "model": "two-style",
            "messages": task_messages(generate(USER_TASKS)[0]),
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = self.users.client.post(f"{self.url}/chat/completions", json=body).json()
        return answer["choices"][0]


def wait_for_version(url: str, version: int, timeout: float = 30.0) -> None:
    """Until the server at API root `url` reports `version` on /health."""
    deadline = time.monotonic() + timeout
    while httpx.get(url.removesuffix("/v1") + "/health").json()["weight_version"] != version:
        assert time.monotonic() < deadline, f"the server did not reach version {version}"
        time.sleep(0.05)
