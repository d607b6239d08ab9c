"""The curriculum: a task whose last group was all solved or all failed sits out the next
`rest_passes` passes, then comes back; tasks in the band always run."""

import asyncio

import pytest

from tests.orchestrator.orchestrator_support import coin_tasks, orchestrator_config, synth_tasks, thread_servers
from whetstone.orchestrator import Orchestrator
from whetstone.orchestrator.curriculum import Curriculum, CurriculumConfig


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


def test_the_orchestrator_rests_tasks_it_never_solves(world):
    """Real servers with a random model: synth tasks are never solved, so once their first groups
    are scored they sit out passes, and the batches still fill from the coin task."""
    tmp_path, model_dir, _ = world
    with thread_servers(model_dir, tmp_path / "weights") as servers:
        config = orchestrator_config(tmp_path, model_dir, [s.url for s in servers], max_batches=3)
        orchestrator = Orchestrator(config, coin_tasks(1) + synth_tasks(2))
        assert asyncio.run(asyncio.wait_for(orchestrator.run(), 180)) == [0, 1, 2]
    assert orchestrator.curriculum.rested > 0


def test_a_group_with_no_rollout_that_ran_leaves_no_record():
    curriculum = Curriculum(CurriculumConfig())
    curriculum.record("t", 0, 0, pass_number=0)
    assert not curriculum.rests("t", 1)
