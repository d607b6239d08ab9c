"""repofix's splits: a template none of whose functions is of the split asked for is refused at
once, not drawn until the tries run out."""

import random
from unittest import mock

import pytest

from whetstone.envs.tasks import repofix
from whetstone.envs.tasks.repofix import RepofixConfig, generate, template_splits
from whetstone.errors import WhetstoneError


def test_every_template_has_train_functions_and_textkit_no_heldout_ones():
    assert {name: template_splits(name) for name in ("shop", "textkit", "life")} == {
        "shop": {"train", "heldout"},
        "textkit": {"train"},
        "life": {"train", "heldout"},
    }


def test_heldout_tasks_of_textkit_alone_are_refused_before_any_sandbox_runs():
    with mock.patch.object(repofix, "find_bugs", side_effect=AssertionError("a sandbox ran")):
        with pytest.raises(WhetstoneError) as refused:
            generate(RepofixConfig(count=1, templates=["textkit"], split="heldout"))
        assert generate(RepofixConfig(count=0, templates=["textkit"], split="heldout")) == []
    message = str(refused.value)
    assert "no function of the templates ['textkit'] is in the 'heldout' split" in message
    assert "templates with such functions: ['life', 'shop']" in message


def test_a_draw_with_no_function_of_the_split_runs_no_tests():
    """A textkit draw among heldout templates has no candidate: it costs no sandboxed test run."""
    from whetstone.envs.tasks import bugs

    files = {"lib.py": "def double(x):\n    return 2 * x\n", "test_lib.py": "from lib import double\n"}
    with mock.patch.object(bugs, "split_of", return_value="train"):
        with mock.patch.object(bugs, "run_tests", side_effect=AssertionError("a sandbox ran")):
            found = bugs.find_bugs(
                files,
                ["lib.py"],
                ["test_lib.py"],
                rng=random.Random(0),
                want=1,
                max_tries=5,
                test_command="python -m pytest -q",
                split="heldout",
            )
    assert found == []
