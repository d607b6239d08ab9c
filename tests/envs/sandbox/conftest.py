import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shared_tmp():
    """A folder nobody may write in, under the system temp dir (pytest's tmp_path is its user's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="whetstone-test-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
