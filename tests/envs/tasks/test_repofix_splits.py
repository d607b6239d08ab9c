"""repofix's splits: a template none of whose functions is of the split asked for is refused at
once, not drawn until the tries run out."""

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
