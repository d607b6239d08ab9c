from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the cores are shared with other engineers' tests
