"""Fixtures of the orchestrator tests."""

import pytest

from tests.orchestrator.orchestrator_support import Trainer, model_folder


@pytest.fixture
def world(tmp_path):
    """(tmp_path, a tiny model folder, a `Trainer` that has published version 0: the initial weights)."""
    model_dir = model_folder(tmp_path)
    trainer = Trainer(model_dir, tmp_path / "weights")
    trainer.publish()
    return tmp_path, model_dir, trainer
