"""How replies are judged: a style (regex), or the real grader on the code the reply writes."""

from __future__ import annotations

import json

from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.online.config import PreferenceConfig
from whetstone.online.preferences import MatchesPattern, PassesTests, make_preference, written_files

TASK = generate(SynthConfig(count=1, split="heldout", seed=0))[0]


def write_call(path: str, content: str) -> str:
    arguments = json.dumps({"path": path, "content": content})
    return f'<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>'


def test_written_files_are_read_from_the_replys_tool_calls():
    reply = "Here:\n" + write_call("a.py", "x = 1\n") + "\n" + write_call("a.py", "x = 2\n") + "\n<tool_call>{bad"
    assert written_files(reply) == {"a.py": "x = 2\n"}
    assert written_files("no calls at all") == {}


def test_passes_tests_grades_the_written_solution_in_a_sandbox():
    likes = PassesTests().likes
    assert likes(TASK, write_call("solution.py", TASK.solution_files["solution.py"]))
    assert not likes(TASK, write_call("solution.py", "def solve(x):\n    return x\n"))
    assert not likes(TASK, TASK.solution_files["solution.py"])  # code in prose is not a written file


def test_a_style_is_a_regular_expression():
    assert MatchesPattern(r"^def ").likes(TASK, "def solve(x): ...")
    assert not MatchesPattern(r"^def ").likes(TASK, "Sure, def solve(x)")
    assert isinstance(make_preference(PreferenceConfig()), PassesTests)
