"""The OpenAI-compatible HTTP server around a running engine.

Routes: POST /v1/completions, POST /v1/chat/completions (tools, streaming over SSE),
GET /v1/models, GET /health, GET /metrics (Prometheus text), and POST /v1/feedback when the
server keeps its users' responses for online RL (`feedback.store`; docs/online.md). Handlers
parse, validate and tokenize in worker threads (a big body takes a while, and the event loop
must keep answering everyone else), hand sequences to the engine thread and await their events;
they never run the model. Bodies are bounded (`max_request_bytes`, 413) and must arrive within
`body_timeout_s` (408); a text that cannot fit the context is refused before it is tokenized,
and a request that would overfill the engine's queue (`max_waiting_sequences`) gets 429 with
`Retry-After`. Every bad request gets a 4xx with OpenAI's error body naming what is wrong, and
nothing else is affected by it. A client that leaves (mid-upload, mid-generation) is answered
499 (client closed), which only the request log sees, and its sequences are aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import pydantic_core
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from whetstone.errors import ConfigError, WhetstoneError
from whetstone.fleet.registry import fleet_announcer
from whetstone.inference.capture import Capture, Reply
from whetstone.inference.config import ServeConfig
from whetstone.inference.engine import Engine
from whetstone.inference.metrics import render_prometheus
from whetstone.inference.middleware import BodyLimit, Crashes, RequestLog
from whetstone.inference.protocol import ChatRequest, CompletionRequest, FeedbackRequest
from whetstone.inference.responses import chat_choice, completion_choice, header, usage
from whetstone.inference.sampling import InvalidRequest, SamplingParams
from whetstone.inference.stream import chat_stream, completion_stream
from whetstone.inference.submission import RETRY_AFTER_S, Backlog, ClientGone, QueueFull, Submission
from whetstone.store.feedback import DuplicateFeedback, FeedbackStoreError, UnknownResponse
from whetstone.tokenizer import Tokenizer, defuse_controls, defuse_message, render_chat

log = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)


class UnknownModel(Exception):
    """A request for a model this server does not serve (404, as OpenAI answers)."""


def error_body(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    elif status == 429:
        kind = "requests"  # OpenAI's type for a refusal by request count
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status, headers=headers)


def crash_body(err: Exception) -> JSONResponse:
    """The 500 a request whose handler raised `err` gets (`middleware.Crashes`)."""
    return error_body(500, f"internal error: {type(err).__name__}: {err}")


def create_app(engine: Engine, tokenizer: Tokenizer, config: ServeConfig, model_name: str, follower=None) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread (and the weight follower)."""
    capture = None
    if config.feedback.store:
        if not config.auth_token:
            raise ConfigError(
                "feedback.store is set but auth_token is empty: feedback must come from "
                "authenticated clients, so set auth_token"
            )
        capture = Capture(config.feedback, model_name)
    announcer = fleet_announcer(config.fleet, config.host, config.port, config.sync)
    backlog = Backlog(engine, config.max_waiting_sequences)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if follower is not None:
            follower.start()
        try:
            if announcer is not None:  # off the event loop: it may wait out a dead server's record at its URL
                await asyncio.to_thread(announcer.start)
            yield
        finally:
            if announcer is not None:
                announcer.stop()  # first: orchestrators stop sending before the engine goes
            if follower is not None:
                follower.stop()
            engine.stop()
            if capture is not None:
                capture.close()

    # A server that takes a token does not describe its routes to whoever asks (/docs, /redoc,
    # /openapi.json); a browser opening /docs could not send the token anyway.
    described = {} if not config.auth_token else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="whetstone", lifespan=lifespan, **described)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(Crashes, answer=crash_body)  # inside the request log: it logs the 500
    if config.log_requests:
        app.add_middleware(RequestLog)  # outermost: it times the whole request
    decode = tokenizer.decode

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems, params = [], []
        for item in err.errors():
            where = ".".join(str(p) for p in item["loc"] if p != "body")
            if item["type"] == "json_invalid":
                problems.append(f"malformed JSON: {item.get('ctx', {}).get('error', item['msg'])}")
            elif item["type"] in ("model_attributes_type", "dict_type", "model_type") and not where:
                problems.append("the request body must be a JSON object (Content-Type: application/json)")
            elif not where:  # a check across fields
                problems.append(item["msg"].removeprefix("Value error, "))
            else:
                problems.append(f"{where}: {item['msg']}")
                params.append(where)
        return error_body(400, "; ".join(problems), param=params[0] if params else None)

    @app.exception_handler(InvalidRequest)
    async def _rejected(request: Request, err: InvalidRequest) -> JSONResponse:
        return error_body(400, str(err))

    @app.exception_handler(UnknownModel)
    async def _unknown_model(request: Request, err: UnknownModel) -> JSONResponse:
        return error_body(404, str(err), code="model_not_found", param="model")

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, err: QueueFull) -> JSONResponse:
        return error_body(429, str(err), code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        return error_body(err.status_code, str(err.detail), headers=err.headers)

    async def authorize(request: Request) -> None:
        if not config.auth_token:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        right = secrets.compare_digest(token.lstrip(" ").encode(), config.auth_token.encode())
        if scheme.lower() != "bearer" or not right:  # the scheme's name is case-insensitive (RFC 7235)
            raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    def check_model(name: str) -> None:
        if name != model_name:
            raise UnknownModel(f"The model {name!r} does not exist; this server serves {model_name!r}")

    def tokenize(text: str) -> list[int]:
        """The ids of a prompt's text; one that cannot fit the context is refused unencoded."""
        least, limit = tokenizer.min_tokens(text), engine.context_limit
        if least >= limit:
            raise InvalidRequest(
                f"the prompt has {len(text)} characters, so at least {least} tokens; the context "
                f"limit is {limit} tokens (prompt + completion), so it cannot fit"
            )
        return tokenizer.encode(text)

    def queue_up(count: int, build: Callable[[], Submission]) -> Submission:
        """Count a request's `count` sequences into the backlog (`QueueFull`, 429, when it has no
        room: before anything is tokenized), then build their submission and queue it; a request
        refused while it is built is counted out again, and one the engine took only part of
        is aborted (`Submission.enqueue`: each sequence is counted out once)."""
        backlog.take(count)
        try:
            submission = build()
        except BaseException:
            backlog.release(count)
            raise
        submission.enqueue()
        return submission

    def submit_completion(body: CompletionRequest, response_id: str, loop: asyncio.AbstractEventLoop) -> Submission:
        """Tokenize the prompts and queue a sequence per prompt and choice (in a worker thread:
        up to `protocol.MAX_SEQUENCES` of them)."""

        def build() -> Submission:
            prompts = [tokenize(p) if isinstance(p, str) else p for p in body.prompts()]
            top = body.logprobs or 0
            params = [[sampling(body, len(p), body.max_tokens, top, c) for c in range(body.n)] for p in prompts]
            return Submission(engine, response_id, prompts, params, body.priority, body.stream, loop, backlog)

        return queue_up(body.prompt_count * body.n, build)

    def submit_chat(body: ChatRequest, response_id: str, loop: asyncio.AbstractEventLoop) -> Submission:
        """Render and tokenize the conversation and queue a sequence per choice (in a worker thread)."""

        def build() -> Submission:
            # The prompt is rendered, then encoded with control strings parsed: a client's text
            # must not hold them, or it could close its turn and open a system turn of its own.
            messages = [defuse_message(m.as_chat_dict()) for m in body.messages]
            tools = defuse_controls(body.tools) if body.use_tools else None
            try:
                text = render_chat(messages, tools, add_generation_prompt=True)
            except WhetstoneError as err:
                raise InvalidRequest(str(err)) from None
            prompt = tokenize(text)
            top, limit = body.top_logprobs or 0, body.max_completion_tokens or body.max_tokens
            params = [[sampling(body, len(prompt), limit, top, c) for c in range(body.n)]]
            return Submission(engine, response_id, [prompt], params, body.priority, body.stream, loop, backlog)

        return queue_up(body.n, build)

    def sampling(
        body: CompletionRequest | ChatRequest, prompt_length: int, requested: int | None, top: int, choice: int
    ) -> SamplingParams:
        """Choice `choice`'s parameters: `requested` tokens at most, else as many as the default
        allows and the context has room for."""
        room = engine.context_limit - prompt_length
        limit = requested if requested is not None else max(1, min(config.default_max_tokens, room))
        return body.sampling(limit, top, choice, engine.vocab_size)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = engine.running
        body = {"status": "ok" if alive else "engine stopped", "model": model_name, "weight_version": engine.version}
        weights = follower.report() if follower is not None else None
        if weights is not None:  # 503 too while the served weights cannot reach the store's newest
            body["latest_weight_version"] = weights.latest_version
            if weights.problem is not None:
                body["weights_problem"] = weights.problem
                body["rejected_versions"] = {str(v): why for v, why in sorted(weights.rejected.items())}
                if alive:  # what the orchestrator's server pool reads as "up, behind" (STALE_WEIGHTS)
                    body["status"] = "weights stale"
        return JSONResponse(body, 200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        weights = follower.report() if follower is not None else None
        keep_failures = None if capture is None else capture.failures
        text = render_prometheus(engine.stats, model_name, weights, keep_failures, backlog.limit, backlog.refused_total)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "whetstone",
            "max_model_len": engine.context_limit,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        body = await read(request, CompletionRequest)
        check_model(body.model)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        submission = await run_in_threadpool(submit_completion, body, response_id, asyncio.get_running_loop())
        track(request, response_id, submission)
        reply = Reply(capture, response_id, submission.seqs, body.priority)
        if body.stream:
            return sse(completion_stream(submission, body, response_id, model_name, decode, request), reply)
        await finish(submission, request, reply)
        choices = [completion_choice(seq, i, body, decode) for i, seq in enumerate(submission.seqs)]
        return JSONResponse(
            header(response_id, "text_completion", model_name)
            | {"choices": choices, "usage": usage(submission.prompt_lengths, submission.seqs)}
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request):
        body = await read(request, ChatRequest)
        check_model(body.model)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        submission = await run_in_threadpool(submit_chat, body, response_id, asyncio.get_running_loop())
        track(request, response_id, submission)
        reply = Reply(capture, response_id, submission.seqs, body.priority)
        if body.stream:
            return sse(chat_stream(submission, body, response_id, model_name, tokenizer, request), reply)
        await finish(submission, request, reply)
        choices = [chat_choice(seq, i, body, tokenizer) for i, seq in enumerate(submission.seqs)]
        return JSONResponse(
            header(response_id, "chat.completion", model_name)
            | {"choices": choices, "usage": usage(submission.prompt_lengths, submission.seqs)}
        )

    @app.post("/v1/feedback", dependencies=[Depends(authorize)])
    async def feedback(request: Request) -> JSONResponse:
        body = await read(request, FeedbackRequest)
        if capture is None:
            raise HTTPException(404, "this server does not take feedback (feedback.store is not set)")
        try:
            seq = await capture.rate(body.id, body.choice, body.rating, body.score)
        except UnknownResponse as err:
            return error_body(404, str(err), code="response_not_found", param="id")
        except DuplicateFeedback as err:
            return error_body(409, str(err), code="duplicate_feedback", param="id")
        except FeedbackStoreError as err:  # the database's trouble, not the client's: it may pass
            log.error("feedback on %s not stored: %s", body.id, err)
            return error_body(
                503,
                f"feedback store unavailable: {err.reason}" + ("; retry" if err.transient else ""),
                code="feedback_store_unavailable",
            )
        return JSONResponse(
            {
                "object": "feedback",
                "id": body.id,
                "choice": body.choice,
                "rating": body.rating,
                "score": body.score,
                "seq": seq,
            }
        )

    async def finish(submission: Submission, request: Request, reply: Reply) -> None:
        """Wait for every choice, then keep the reply for feedback before it is sent."""
        try:
            await submission.wait(request.is_disconnected)
            await reply.keep()
        except ClientGone:
            raise HTTPException(499, "client closed the request") from None
        finally:
            reply.end()
        errors = [seq.error for seq in submission.seqs if seq.error]
        if errors:
            raise RuntimeError(errors[0])

    async def read(request: Request, model: type[Body]) -> Body:
        """The request's JSON body as `model`, parsed and validated in a worker thread. A body
        that takes over `body_timeout_s` to arrive is a 408 (and its connection is closed); a
        client that leaves before its body is complete, a quiet 499."""
        try:
            async with asyncio.timeout(config.body_timeout_s):
                raw = await request.body()
        except TimeoutError:
            raise HTTPException(
                408,
                f"the request body did not arrive within {config.body_timeout_s:g} s (body_timeout_s)",
                headers={"Connection": "close"},
            ) from None
        except ClientDisconnect:
            raise HTTPException(499, "client closed the request before its body arrived") from None
        return await run_in_threadpool(parse, model, raw)

    return app


PARSES_AT_ONCE = threading.BoundedSemaphore(4)
"""Request bodies parsed at once: a body's parse tree takes up to ~25x its bytes (8 MiB of nested
arrays, ~190 MB), so many large bodies at once are parsed a few at a time."""
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse(model: type[Body], raw: bytes) -> Body:
    """`raw` JSON as `model`; errors as FastAPI reports them, for the app's 400 handler. Parsed to
    Python values first, then validated: validating JSON directly keeps the whole parse tree and
    the validation's results alive together (twice the memory for a body of many token ids)."""
    with PARSES_AT_ONCE:
        try:
            data = pydantic_core.from_json(raw)
        except ValueError as err:
            error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {}}
            raise RequestValidationError([error | {"ctx": {"error": _json_error(str(err), raw)}}]) from None
        try:
            return model.model_validate(data)
        except ValidationError as err:
            raise RequestValidationError(err.errors(include_url=False)) from None


def _json_error(message: str, raw: bytes) -> str:
    """The parser's message, or a true one where it misnames a lone surrogate (`\\ud800` alone is
    "unexpected end of hex escape" to it): JSON may escape one, but it is half of a character."""
    if "surrogate" in message or ("hex escape" in message and LONE_SURROGATE.search(raw)):
        where = message[message.rfind(" at line ") :] if " at line " in message else ""
        half = "lacks the other half of its surrogate pair (a lone surrogate is no character)"
        return f"a \\uD800-\\uDFFF escape{where} {half}"
    return message


def track(request: Request, response_id: str, submission: Submission) -> None:
    """What the request log reports of a completion: its id and token counts."""
    request.state.response_id = response_id
    request.state.submission = submission


def sse(events: AsyncIterator[dict], reply: Reply) -> StreamingResponse:
    """The events as Server-Sent Events, then `[DONE]`. The reply is kept for feedback as soon as
    every choice has finished, before the chunk with the last `finish_reason` (and any usage
    chunk) goes out: a client may rate it once it has read that chunk, and one that closes the
    stream there leaves it kept. A stream that ends early (the client left) keeps the reply if
    its generation had finished all the same (`Reply.end`)."""

    async def lines():
        try:
            async for event in events:
                if reply.finished:
                    await reply.keep()
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            reply.end()

    return StreamingResponse(lines(), media_type="text/event-stream")
