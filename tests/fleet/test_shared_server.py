"""A server that also serves users, in the fleet: it lends only `fleet.rollout_slots` of its
slots to the orchestrators' rollouts, and within them the rollouts (`batch` requests) yield to
users. Real servers (engine + HTTP app in threads of this process), found through the registry."""

import asyncio
import re
from collections import Counter

import httpx

from tests.envs.harness.test_pool import ENDPOINT, registry_of, until, world  # noqa: F401 (fixture)
from tests.orchestrator.orchestrator_support import ThreadServer
from whetstone.envs.harness import Sampling, ServerPool

LONG = Sampling(max_tokens=900, seed=7)
"""A rollout call that decodes for hundreds of steps (sampled with `batch` priority, as the
orchestrator's harness asks by default)."""


def metric(server: ThreadServer, name: str) -> float:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=10).text
    return float(re.search(rf"^whetstone_{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_a_server_lends_only_its_rollout_slots(world):  # noqa: F811
    shared = ThreadServer(*world, cluster="shared", rollout_slots=1).start()
    own = ThreadServer(*world, cluster="own").start()

    async def scenario():
        pool = await ServerPool.connect([], ENDPOINT, health_interval_s=0.1, registry=registry_of(world[1]))
        try:
            assert {s.cluster: s.rollout_slots for s in pool.servers} == {"shared": 1, "own": 0}
            async with pool.lease() as a, pool.lease() as b, pool.lease() as c:
                leased = Counter(policy.server.cluster for policy in (a, b, c))
                assert leased == {"shared": 1, "own": 2}  # least-loaded, but never past the lent slots
            async with pool.lease() as a, pool.lease() as b:
                assert {a.server.cluster, b.server.cluster} == {"shared", "own"}  # the slot came back
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        shared.stop()
        own.stop()


def test_a_user_of_a_server_lending_to_rollouts_is_answered_ahead_of_them(world):  # noqa: F811
    """Both slots of the server hold rollouts; a user's request preempts one and is answered
    while both rollouts are still decoding (it did not wait for a slot to free up)."""
    shared = ThreadServer(*world, cluster="shared", max_batch=2, rollout_slots=2).start()

    async def scenario():
        pool = await ServerPool.connect([], ENDPOINT, health_interval_s=0.1, registry=registry_of(world[1]))
        try:
            async with pool.lease() as a, pool.lease() as b:
                rollouts = [asyncio.create_task(p.complete([1, 2, 3], LONG)) for p in (a, b)]
                await until(lambda: metric(shared, "running_sequences") == 2)
                async with httpx.AsyncClient(timeout=60) as client:  # a user: no priority given = interactive
                    answer = await client.post(
                        shared.url + "/completions",
                        json={"model": pool.model, "prompt": [4, 5, 6], "max_tokens": 4, "ignore_eos": True},
                    )
                assert answer.status_code == 200, answer.text
                assert not any(task.done() for task in rollouts)  # answered ahead of both rollouts
                assert metric(shared, "preemptions_total") >= 1
                completions = await asyncio.gather(*rollouts)
                assert [c.finish_reason for c in completions] == ["length", "length"]  # they ran long, then finished
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        shared.stop()
