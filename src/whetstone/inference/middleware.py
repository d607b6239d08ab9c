"""ASGI middleware of the server: the request-body limit, the 500 answer to an unhandled error,
and the one-line request log (499 for a client that left).

All are plain ASGI (no buffering of bodies or responses), so a streamed response streams
through them unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
request_log = logging.getLogger("whetstone.requests")
"""One INFO line per request: id, route, status, prompt/completion tokens, milliseconds."""
CLIENT_CLOSED = 499
"""The status logged for a request whose client left before its answer ended (nginx's code)."""
POLLS = frozenset({"/health", "/metrics"})
"""Routes that monitors poll every few seconds: a good answer there is logged at DEBUG only."""


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413 before reading it: at once when its
    Content-Length says so, else as soon as the bytes streamed in (chunked) pass the limit.

    The refusal is an `HTTPException` raised where the handler reads the body, so the app's own
    error handler writes it (OpenAI's error body); a route that never reads its body is not
    refused. It says `Connection: close`, and the server closes the connection after it: the rest
    of the body is never read, so the connection cannot carry another request."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise self.too_large(f"is {int(declared)} bytes (Content-Length)")
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large(f"reached {received} bytes before its end")
            return message

        await self.app(scope, limited, send)

    def too_large(self, size: str) -> HTTPException:
        return HTTPException(
            413,
            f"the request body {size}; this server takes at most {self.max_bytes} bytes (max_request_bytes)",
            headers={"Connection": "close"},
        )


class Crashes:
    """Answers a request whose handler raised an error no handler took with `answer(error)` (a
    500), and logs the error once, with its traceback and route.

    An app's handler for `Exception` cannot do this: Starlette raises the error again after
    calling it, so the ASGI server logs it a second time; here it goes no further. An error
    raised once the answer has started (a stream cut midway) goes on to the server, which closes
    the connection, so the client cannot take the cut answer for a whole one; the server logs
    it, so it is not logged here too."""

    def __init__(self, app: ASGIApp, answer: Callable[[Exception], Response]):
        self.app = app
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as err:
            if started:
                raise
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            await self.answer(err)(scope, receive, send)


class RequestLog:
    """Logs every HTTP request on `request_log` as its answer ends (a stream: its last chunk), so
    the line is written before the client has the whole answer. A request whose client was seen
    gone (the app received `http.disconnect`) before then is logged with status 499, whatever
    was sent: a stream cut short started as a 200.

    Handlers add what they know to the request's state: `response_id`, and `submission` (its
    prompt lengths and sequences give the token counts)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not request_log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start, status, logged = time.perf_counter(), 500, False  # 500: what an unhandled error becomes
        gone = False
        state = scope.setdefault("state", {})  # the dict `request.state` writes to

        def log() -> None:
            nonlocal logged
            logged = True
            submission = state.get("submission")
            tokens = "-/-"
            if submission is not None:
                tokens = f"{sum(submission.prompt_lengths)}/{sum(len(s.output_ids) for s in submission.seqs)}"
            shown = CLIENT_CLOSED if gone else status
            level = logging.DEBUG if scope["path"] in POLLS and shown == 200 else logging.INFO
            request_log.log(
                level,
                "%s %s %s %d tokens=%s %.0fms",
                state.get("response_id", "-"),
                scope["method"],
                scope["path"],
                shown,
                tokens,
                (time.perf_counter() - start) * 1000,
            )

        async def watched() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def recorded(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                log()
            await send(message)

        try:
            await self.app(scope, watched, recorded)
        finally:
            if not logged:
                log()
