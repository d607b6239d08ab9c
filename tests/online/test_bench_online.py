"""`whetstone bench online` end to end at tiny scale: two server processes, the loop process,
simulated users, on the two-style model (a process of its own: the bench renices itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.online.online_fixtures import PREFERS_CODE


@pytest.mark.slow  # about a minute: three processes start and the loop updates twice
def test_the_benchmark_reports_its_figures(two_style_dir, tmp_path):
    command = [sys.executable, "-m", "whetstone.cli", "bench", "online", "--json", "--model", str(two_style_dir),
               "--preference", PREFERS_CODE, "--max-tokens", "12", "--updates", "2", "--every-events", "8",
               "--heldout", "8", "--samples", "1", "--gate-tasks", "8", "--lr", "3e-3", "--output-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["updates"] == 2 == result["published"] + result["discarded"] + result["skipped"]
    assert len(result["feedback_to_deployed_s_each"]) == result["published"]
    assert all(0 < seconds < 120 for seconds in result["feedback_to_deployed_s_each"])
    assert 0 <= result["preference_rate_before"] <= 1 and 0 <= result["preference_rate_after"] <= 1
    assert result["interactive_p99_ms"] > 0 and result["interactive_p99_idle_ms"] > 0
