"""Simulated users: real HTTP requests to real servers, replies rated by a hidden preference.

Each user opens a task's conversation on /v1/chat/completions (as a person would: no extension
fields), judges the reply by the preference the loop never sees (e.g. "the code passes the
task's tests"), and posts a thumbs up or down to /v1/feedback. `preference_rate` asks the same
way without giving feedback, to measure the model on held-out prompts without training on them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from whetstone.envs.task import Task
from whetstone.errors import WhetstoneError
from whetstone.online.preferences import Preference, task_messages


@dataclass
class Exchange:
    """One user request, and what the user made of it."""

    task_id: str
    response_id: str
    liked: bool
    latency_s: float
    """Wall time of the chat request, as the user saw it."""
    rated_at: float | None = None
    """When the feedback was accepted (time.time()), or None if none was given."""
    seed: int | None = None
    """The request's sampling seed (None: the server's own randomness)."""
    reply: str = ""
    """The reply's text, as the user judged it."""


class UserSimulator:
    def __init__(
        self,
        urls: list[str],
        model: str,
        api_key: str,
        preference: Preference,
        *,
        max_tokens: int = 160,
        temperature: float = 1.0,
        seed: int | None = None,
        timeout_s: float = 300.0,
    ):
        """`urls`: API roots (`http://host:port/v1`), used in turn. `seed`: request i samples with
        seed + i (reproducible runs); None = the server's own randomness, as real users."""
        if not urls:
            raise WhetstoneError("the user simulator needs at least one server URL")
        self.urls, self.model, self.preference = urls, model, preference
        self.max_tokens, self.temperature = max_tokens, temperature
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})
        self._next_url = itertools.cycle(urls)
        self._seeds = None if seed is None else itertools.count(seed)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    def _post(self, url: str, path: str, body: dict) -> dict:
        response = self.client.post(f"{url}{path}", json=body)
        if response.status_code != 200:
            raise WhetstoneError(f"POST {url}{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def ask(self, task: Task, give_feedback: bool = True, seed: int | None = None) -> Exchange:
        """One user: ask about `task`, judge the reply, and (if `give_feedback`) rate it.
        `seed`: this request's sampling seed (default: the simulator's next one, if seeded)."""
        with self._lock:
            url = next(self._next_url)
            if seed is None and self._seeds is not None:
                seed = next(self._seeds)
        request = {
            "model": self.model,
            "messages": task_messages(task),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": seed,
        }
        started = time.perf_counter()
        answer = self._post(url, "/chat/completions", request)
        latency = time.perf_counter() - started
        reply = answer["choices"][0]["message"]["content"] or ""
        liked = self.preference.likes(task, reply)
        exchange = Exchange(task.id, answer["id"], liked, latency, seed=seed, reply=reply)
        if give_feedback:
            self._post(url, "/feedback", {"id": answer["id"], "rating": "thumbs_up" if liked else "thumbs_down"})
            exchange.rated_at = time.time()
        return exchange

    def run(
        self,
        tasks: list[Task],
        *,
        users: int = 2,
        requests: int | None = None,
        until: Callable[[], bool] | None = None,
        give_feedback: bool = True,
    ) -> list[Exchange]:
        """`users` concurrent users asking about `tasks` in turn, for `requests` requests in all or
        until `until()` holds (checked before each request)."""
        if requests is None and until is None:
            raise WhetstoneError("give requests or until, or the users never stop")
        order = itertools.cycle(tasks)
        budget = itertools.count()
        exchanges: list[Exchange] = []

        def user() -> None:
            while True:
                with self._lock:
                    if (requests is not None and next(budget) >= requests) or (until is not None and until()):
                        return
                    task = next(order)
                    seed = None if self._seeds is None else next(self._seeds)  # the same pairs every run
                exchange = self.ask(task, give_feedback, seed)
                with self._lock:
                    exchanges.append(exchange)

        with ThreadPoolExecutor(users) as pool:
            for future in [pool.submit(user) for _ in range(users)]:
                future.result()
        return exchanges

    def preference_rate(self, tasks: list[Task], samples: int = 1, users: int = 2) -> float:
        """Fraction of replies the hidden preference likes, `samples` per task, no feedback given."""
        return liked_share(self.judge(tasks, samples, users))

    def judge(self, tasks: list[Task], samples: int = 1, users: int = 2) -> list[Exchange]:
        """`samples` replies per task, each judged by the hidden preference, no feedback given."""
        return self.run(tasks, users=users, requests=len(tasks) * samples, give_feedback=False)


def liked_share(exchanges: list[Exchange]) -> float:
    """Fraction of `exchanges` whose reply the user liked (0 for none)."""
    return sum(e.liked for e in exchanges) / max(1, len(exchanges))
