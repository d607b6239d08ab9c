"""The curriculum: a task whose last group was all solved or all failed sits out the next
`rest_passes` passes, then comes back; tasks in the band always run."""

import asyncio
import itertools
import json

import pytest

from tests.orchestrator.orchestrator_support import coin_tasks, orchestrator_config, synth_tasks, thread_servers
from whetstone.orchestrator import Orchestrator
from whetstone.orchestrator.curriculum import Curriculum, CurriculumConfig
from whetstone.orchestrator.loop import STATE_KEY


@pytest.mark.parametrize(("solved", "rests"), [(0, True), (1, False), (7, False), (8, True)])
def test_a_task_rests_after_a_group_outside_the_band(solved, rests):
    curriculum = Curriculum(CurriculumConfig(min_solve_rate=0.1, max_solve_rate=0.9, rest_passes=2))
    curriculum.record("t", solved, 8, pass_number=3)
    assert [curriculum.rests("t", p) for p in (4, 5, 6)] == [rests, rests, False]
    assert curriculum.rested == (2 if rests else 0)


def test_a_task_never_seen_or_with_no_curriculum_always_runs():
    assert not Curriculum(CurriculumConfig()).rests("new", 1)
    curriculum = Curriculum(CurriculumConfig(rest_passes=0))
    curriculum.record("t", 0, 8, pass_number=0)
    assert not curriculum.rests("t", 1)


def test_the_newest_group_decides():
    curriculum = Curriculum(CurriculumConfig())
    curriculum.record("t", 8, 8, pass_number=0)
    curriculum.record("t", 4, 8, pass_number=1)
    assert not curriculum.rests("t", 2)


def test_the_band_must_not_be_empty():
    with pytest.raises(ValueError, match="min_solve_rate"):
        CurriculumConfig(min_solve_rate=0.8, max_solve_rate=0.2)


def test_the_orchestrator_rests_tasks_it_never_solves_and_a_restarted_one_goes_on(world):
    """Real servers with a random model: synth tasks are never solved, so once their first groups
    are scored they sit out passes, and the batches still fill from the coin task. An orchestrator
    restarted after batch 1 goes on with the task stream and the record its predecessor saved."""
    tmp_path, model_dir, _ = world
    tasks = coin_tasks(1) + synth_tasks(2)

    class Recording(Orchestrator):
        """Keeps the curriculum's record as it was at each batch put: groups still in flight then
        may be scored before the run's end cancels the rest."""

        def _state(self, index):
            self.records = [*getattr(self, "records", []), self.curriculum.state()]
            return super()._state(index)

    with thread_servers(model_dir, tmp_path / "weights") as servers:
        config = orchestrator_config(tmp_path, model_dir, [s.url for s in servers], max_batches=2)
        first = Recording(config, tasks)
        assert asyncio.run(asyncio.wait_for(first.run(), 180)) == [0, 1]
        saved = json.loads(first.batches.get(STATE_KEY))
        assert saved["batch_index"] == 1 and saved["curriculum"] == first.records[-1]
        second = Orchestrator(config.model_copy(update={"max_batches": 1}), tasks)
        assert asyncio.run(asyncio.wait_for(second.run(), 180)) == [2]
    assert second._stream_start == tuple(saved["stream"]) != (0, 0)
    assert saved["curriculum"]["last"].keys() <= second.curriculum.state()["last"].keys()
    assert second.curriculum.rested > 0 and json.loads(second.batches.get(STATE_KEY))["batch_index"] == 2


def test_a_restarted_orchestrators_task_stream_is_the_one_its_predecessor_would_have_gone_on_with(world, caplog):
    tmp_path, model_dir, _ = world
    tasks = coin_tasks(5)
    config = orchestrator_config(tmp_path / "restart", model_dir, ["http://127.0.0.1:9"])
    first = Orchestrator(config, tasks)
    first._know_tasks(tasks)  # as run() does with the tasks it loaded
    first._resume(0)
    stream = first._task_stream(tasks)
    taken = [next(stream) for _ in range(7)]  # into the second pass
    first._stream_next = (taken[-1][0], taken[-1][1] + 1)  # as the producer records a group started
    first.curriculum.record(taken[0][2].id, 0, 2, pass_number=0)  # never solved: rests in passes 1 and 2
    first.batches.put(STATE_KEY, json.dumps(first._state(3)).encode())
    second = Orchestrator(config, tasks)
    second._know_tasks(tasks)
    second._resume(4)
    going_on = [(number, position, task.id) for number, position, task in itertools.islice(stream, 8)]
    assert [(n, p, t.id) for n, p, t in itertools.islice(second._task_stream(tasks), 8)] == going_on
    assert taken[0][2].id not in [t for n, _, t in going_on if n in (1, 2)]  # the record came along
    # a state of other tasks (as many or not) is not gone on from
    renamed = [task.model_copy(update={"id": f"other-{task.id}"}) for task in tasks]
    for other_tasks in (coin_tasks(6), renamed):
        other = Orchestrator(config, other_tasks)
        other._know_tasks(other_tasks)
        with caplog.at_level("WARNING", logger="whetstone.orchestrator"):
            other._resume(4)
        assert other._stream_start == (0, 0) and "is of another task set or seed (tasks)" in caplog.text
        caplog.clear()
    # nor a position outside the task set
    first.batches.put(STATE_KEY, json.dumps({**first._state(3), "stream": [0, -3]}).encode())
    outside = Orchestrator(config, tasks)
    outside._know_tasks(tasks)
    with caplog.at_level("WARNING", logger="whetstone.orchestrator"):
        outside._resume(4)
    assert outside._stream_start == (0, 0) and "no pass 0, position -3 in 5 tasks" in caplog.text
    # nor a state that does not parse: the stream starts afresh, the record stays empty
    broken = {**first._state(3), "curriculum": {"last": {"t": "not a pair"}, "rested": 1}}
    first.batches.put(STATE_KEY, json.dumps(broken).encode())
    third = Orchestrator(config, tasks)
    third._know_tasks(tasks)
    with caplog.at_level("WARNING", logger="whetstone.orchestrator"):
        third._resume(4)
    assert third._stream_start == (0, 0) and third.curriculum.state() == {"last": {}, "rested": 0}
    assert f"{STATE_KEY} is unreadable (ValueError" in caplog.text


def test_the_record_survives_its_state():
    curriculum = Curriculum(CurriculumConfig())
    curriculum.record("a", 0, 8, pass_number=2)
    curriculum.record("b", 3, 8, pass_number=1)
    assert curriculum.rests("a", 3)
    again = Curriculum(CurriculumConfig())
    again.load(json.loads(json.dumps(curriculum.state())))
    assert again.state() == curriculum.state() and again.rested == 1
    assert again.rests("a", 4) and not again.rests("b", 2)


def test_a_group_with_no_rollout_that_ran_leaves_no_record():
    curriculum = Curriculum(CurriculumConfig())
    curriculum.record("t", 0, 0, pass_number=0)
    assert not curriculum.rests("t", 1)


def test_a_restarted_orchestrator_counts_the_rests_before_its_next_task_once(tmp_path):
    """The producer takes its next task from the stream (counting the resting tasks it skips on
    the way), then waits for room; a batch put meanwhile saves the state, and an orchestrator
    restarted from it takes the same task next without counting those skips again."""
    tasks = coin_tasks(6)
    config = orchestrator_config(tmp_path, str(tmp_path), ["http://127.0.0.1:9/v1"])
    fresh = Orchestrator(config, tasks)
    second_pass = [task for number, _, task in itertools.islice(fresh._task_stream(tasks), 12) if number == 1]
    for task in second_pass[:3]:  # never solved in pass 0: they rest in pass 1
        fresh.curriculum.record(task.id, 0, 2, pass_number=0)
    fresh._know_tasks(tasks)
    fresh._stream_next = (1, 0)
    fresh.batches.put(STATE_KEY, json.dumps(fresh._state(9)).encode())

    def restarted() -> Orchestrator:
        """As `run` starts with batches 0-9 in the store: the trainer has published no version
        yet, so there is no room for a group."""
        orchestrator = Orchestrator(config, tasks)
        orchestrator._know_tasks(tasks)
        orchestrator._resume(10)
        orchestrator._last_put = 9
        return orchestrator

    async def take_next_task(orchestrator: Orchestrator) -> None:
        producer = asyncio.create_task(orchestrator._produce(tasks, None, None))
        for _ in range(20):  # the producer runs until it waits for room
            await asyncio.sleep(0)
        assert not producer.done()
        producer.cancel()

    first = restarted()
    asyncio.run(take_next_task(first))
    assert first.curriculum.rested == 3
    first.batches.put(STATE_KEY, json.dumps(first._state(9)).encode())  # as a batch put meanwhile does
    second = restarted()
    asyncio.run(take_next_task(second))
    assert (second.curriculum.rested, second._stream_next) == (3, first._stream_next) == (3, (1, 3))
