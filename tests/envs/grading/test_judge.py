"""The LLM judge, against a real HTTP server that speaks the chat-completions shape."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from whetstone.envs.grading.grade import grade
from whetstone.envs.grading.judge import JudgeConfig, JudgeError, judge_score, parse_score
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.task import Task


class JudgeServer:
    """A tiny OpenAI-compatible endpoint: scores 9 when the diff fixes the sign, 2 otherwise."""

    def __init__(self, status: int = 200, answer: str | None = None):
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                diff = body["messages"][-1]["content"]
                content = answer or ("Looks right.\nSCORE: 9" if "+    return a + b" in diff else "Wrong.\nSCORE: 2")
                message = {"role": "assistant", "content": content}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                reply = {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [choice]}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


TASK = Task(
    id="custom/add",
    kind="bugfix",
    instruction="add() subtracts. Fix it.",
    repo_files={"calc.py": "def add(a, b):\n    return a - b\n"},
    hidden_tests={"test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"},
    solution_files={"calc.py": "def add(a, b):\n    return a + b\n"},
    fail_to_pass=["test_calc.py::test_add"],
    rubric="The fix is minimal and keeps the function's name and signature.",
)


def test_score_from_a_chat_completions_endpoint(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sekret")
    with JudgeServer() as server:
        config = JudgeConfig(base_url=server.url, model="grader", api_key_env="JUDGE_KEY")
        score, answer = judge_score("task", "rubric", "+    return a + b\n", "t: passed", config)
    assert score == 0.9 and answer.endswith("SCORE: 9")
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sekret"
    assert request["body"]["model"] == "grader" and request["body"]["temperature"] == 0.0
    assert "rubric" in request["body"]["messages"][1]["content"]


def test_judge_term_is_bounded_by_its_weight():
    with JudgeServer() as server:
        config = RewardConfig(judge=JudgeConfig(base_url=server.url))
        solved = grade(TASK, TASK.solution_files, config)
        failed = grade(TASK, {"calc.py": "def add(a, b):\n    return 0\n"}, config)
    assert solved.breakdown["judge"] == pytest.approx(0.2 * 0.9) and solved.reward == pytest.approx(1.18)
    assert failed.breakdown["judge"] == pytest.approx(0.2 * 0.2) and failed.reward == pytest.approx(0.04)
    assert "[judge] score 0.90" in solved.log


def test_flagged_rollouts_are_never_judged():
    with JudgeServer() as server:
        config = RewardConfig(judge=JudgeConfig(base_url=server.url))
        result = grade(TASK, {**TASK.solution_files, "conftest.py": "x = 1\n"}, config)
    assert result.reward == 0.0 and server.requests == []


def test_a_failing_judge_costs_its_term_not_the_grade():
    with JudgeServer(status=500) as server:
        result = grade(TASK, TASK.solution_files, RewardConfig(judge=JudgeConfig(base_url=server.url)))
    assert result.passed and result.reward == 1.0 and result.breakdown["judge"] == 0.0
    assert "[judge] not scored" in result.log and "500" in result.log


def test_answers_without_a_score_and_missing_keys_are_errors(monkeypatch):
    assert parse_score("first SCORE: 3, then on reflection SCORE: 7") == 0.7
    assert parse_score("SCORE: 14") == 1.0
    with JudgeServer(answer="I cannot decide.") as server, pytest.raises(JudgeError, match="no `SCORE: N`"):
        judge_score("t", "r", "d", "s", JudgeConfig(base_url=server.url))
    monkeypatch.delenv("MISSING_JUDGE_KEY", raising=False)
    with pytest.raises(JudgeError, match="MISSING_JUDGE_KEY"):
        judge_score("t", "r", "d", "s", JudgeConfig(base_url="http://127.0.0.1:9", api_key_env="MISSING_JUDGE_KEY"))


def test_an_answer_that_is_not_text_costs_its_term_not_the_grade():
    with JudgeServer(answer=[{"type": "text", "text": "SCORE: 9"}]) as server:
        result = grade(TASK, TASK.solution_files, RewardConfig(judge=JudgeConfig(base_url=server.url)))
    assert result.passed and result.reward == 1.0 and result.breakdown["judge"] == 0.0
    assert "[judge] not scored" in result.log and "is not text" in result.log


class EndlessServer:
    """An endpoint that answers 200 and then sends `chunk` every `pause_s` seconds until the
    client hangs up: a stuck proxy (a byte now and then) or a runaway one (a flood)."""

    def __init__(self, chunk: bytes, pause_s: float):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(1 << 40))
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        time.sleep(pause_s)
                except OSError:  # the client gave up
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize(
    "chunk,pause_s,problem",
    [(b" ", 0.02, "took longer than timeout_s=0.3 s"), (b" " * 65536, 0.0, "is over")],
    ids=["trickle", "flood"],
)
def test_an_answer_that_never_ends_is_given_up_on(chunk, pause_s, problem):
    outcome: list[BaseException] = []

    def ask():
        try:
            judge_score("t", "r", "d", "s", JudgeConfig(base_url=server.url, timeout_s=0.3))
        except BaseException as err:
            outcome.append(err)

    with EndlessServer(chunk, pause_s) as server:
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(30)  # each read of the trickle returns within the timeout: only a whole deadline ends it
        assert not asking.is_alive(), "the judge request is still waiting"
    [error] = outcome
    assert isinstance(error, JudgeError) and problem in str(error)
