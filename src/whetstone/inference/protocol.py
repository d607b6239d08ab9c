"""The HTTP contract: OpenAI request bodies plus whetstone's RL extension fields.

Extension fields (docs/inference.md, "RL extension fields"), accepted by both completion endpoints:
  `return_token_ids`       choices carry `prompt_token_ids`, `token_ids` and `weight_versions`
                           (the weight version that produced each token)
  `return_routed_experts`  choices carry `routed_experts`: the experts of every token fed through
                           the model (see `encode_routes`)
  `priority`               `interactive` (default: users) or `batch` (RL rollouts, preemptible)
  `top_k`, `stop_token_ids`, `ignore_eos`   sampling controls as in vLLM
Logprobs use OpenAI's own fields (`logprobs`, `top_logprobs`) and shapes.

Feedback (online RL): POST /v1/feedback with `FeedbackRequest` rates one choice of a response by
its `id`, when the server keeps responses (`feedback.store`).

OpenAI fields whetstone does not implement are accepted only at their neutral value, so a
request never silently means something else than what it says. Values are strict, as OpenAI's
are: a value of the wrong JSON type is refused, never converted (`"3"` or `true` for an integer,
`"no"` for a boolean, `2.0` for an integer); an integer is a number. `null` for an optional field,
of a body or of an object inside one, means "not given", as in OpenAI's API: the field has its
default (`_Body`).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)

from whetstone.inference.feedback import Rating
from whetstone.inference.sampling import MAX_TOP_LOGPROBS, InvalidRequest, SamplingParams
from whetstone.inference.sequence import Priority

MAX_CHOICES = 64
MAX_SEQUENCES = 1024
"""Most sequences one completion request may start (prompts x n): the server's work grows with
the sequences, not the body's bytes (a 120 KB body of one-token prompts with n = 64 asks for
millions), so this bounds it as `max_request_bytes` bounds the body."""
MAX_STOP_CHARS = 512
"""Longest stop string, in characters: the engine thread searches the text's tail, as long as
the longest stop string, for every stop string after each token."""
MAX_STOP_STRINGS = 8
"""Most stop strings: each is searched for after every token."""
MAX_TOKEN_IDS = 2**20
"""Most token ids one prompt may hold: more than any served context, so only an absurd list is
refused here, while the body is validated (its length is checked before its items are); the
engine refuses a prompt longer than its context."""
MAX_STOP_TOKEN_IDS = 64
"""Most `stop_token_ids`: the engine thread looks every sampled token up in them."""

TokenIds = Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_IDS, fail_fast=True)]
"""A list of token ids; validation stops at its first bad item."""


def _prompt_form(value: Any) -> str | None:
    """Which form a `prompt` has: a string, or a list of strings, of token ids or of token-id lists
    (by its first item). It is validated as that form only, so a bad prompt gets one error, not
    one per item for every form it is not."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "texts" if isinstance(first, str) else "token_id_lists" if isinstance(first, list) else "token_ids"


def _stop_form(value: Any) -> str | None:
    """Which form `stop` has: a string or a list (of strings), validated as that form only."""
    return "text" if isinstance(value, str) else "texts" if isinstance(value, list) else None


def _content_form(value: Any) -> str | None:
    """Which form a message's `content` has: a string or a list (of parts), validated as that form
    only, so a bad one gets one error naming `content`, not one per form it is not."""
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[list[StrictStr], Field(max_length=MAX_SEQUENCES, fail_fast=True), Tag("texts")]
    | Annotated[list[TokenIds], Field(max_length=MAX_SEQUENCES, fail_fast=True), Tag("token_id_lists")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_type",
        custom_error_message="must be a string, a list of token ids, or a list of strings or of token-id lists",
    ),
]
"""A completion's `prompt`: one text or token-id list, or a list of them (at most MAX_SEQUENCES)."""
Stop = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS, fail_fast=True), Tag("texts")],
    Discriminator(
        _stop_form, custom_error_type="stop_type", custom_error_message="must be a string or a list of strings"
    ),
]
"""`stop`: one stop string or a list of them (at most MAX_STOP_STRINGS)."""
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[Any], Tag("parts")],
    Discriminator(
        _content_form,
        custom_error_type="content_type",
        custom_error_message="must be a string, a list of text parts ({'type': 'text', 'text': ...}), or null",
    ),
]
"""A chat message's `content`: its text, or a list of content parts (`ChatMessage._text_parts`
checks each)."""


class _Body(BaseModel):
    """A request body, or an object inside one: an optional field given as null has its default,
    as OpenAI takes null for "not given" (some clients send every field, null where unset, as the
    `openai` client's `model_dump` of a reply's message does); so has an unknown key's null where
    the model takes unknown keys (a chat message's `name`, `function_call`). A required field's
    null is still refused, and so are a forbidden unknown key's and any other value of the wrong
    type."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields, extra = cls.model_fields, cls.model_config.get("extra") == "allow"
        return {
            key: value
            for key, value in data.items()
            if value is not None or (fields[key].is_required() if key in fields else not extra)
        }


class StreamOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """Send a last chunk with the request's token usage."""
    include_obfuscation: bool = False
    """OpenAI pads its chunks with an `obfuscation` field; whetstone does not (false only)."""

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value):
        if value:
            raise ValueError("is not supported (whetstone's chunks carry no obfuscation field; leave it false)")
        return value


class _Request(_Body):
    # NaN passes no range check; strict: a value of the wrong JSON type is refused, not converted
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    """0 or -1: off."""
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Stop | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # RL extensions
    return_token_ids: bool = False
    return_routed_experts: bool = False
    priority: Priority = "interactive"

    @model_validator(mode="after")
    def _unsupported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (leave them at 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters long")
        return value

    def sampling(
        self, max_tokens: int, top_logprobs: int, choice: int, vocab_size: int | None = None
    ) -> SamplingParams:
        """Sampling parameters of choice `choice` (each choice gets seed + its index). A `top_k`
        above `vocab_size` keeps every token, as `vocab_size` does: it is clamped to it, so no
        request's value reaches the engine's step as an integer too big for it."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = max(self.top_k, 0)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k if vocab_size is None else min(top_k, vocab_size),
            stop=tuple(stop),
            stop_token_ids=frozenset(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=None if self.seed is None else self.seed + choice,
            top_logprobs=top_logprobs,
        )


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Return the logprob of each token, and this many most likely alternatives."""
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported (use return_token_ids to get the prompt's token ids)")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.prompt_count * self.n > MAX_SEQUENCES:
            raise ValueError(
                f"{self.prompt_count} prompts x n={self.n} = {self.prompt_count * self.n} sequences; a request "
                f"may ask for at most {MAX_SEQUENCES} (prompts x n): split it into several requests"
            )
        return self

    @property
    def prompt_count(self) -> int:
        """How many prompts `prompt` holds (one text or token-id list, or a list of them)."""
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one text or token-id list each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt is empty")
        return list(prompt)


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)  # e.g. `name`, `reasoning_content`: passed on as is

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Content | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        """Content parts must be text parts (`{"type": "text", "text": "..."}`), joined as the text."""
        for number, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                raise ValueError(
                    f"part {number}: a content part must be an object {{'type': 'text', 'text': ...}}, "
                    f"got {'null' if part is None else type(part).__name__}"
                )
            if part.get("type") != "text":
                raise ValueError(f"part {number}: only text content parts are supported, got {_got(part, 'type')}")
            if not isinstance(part.get("text"), str):
                raise ValueError(
                    f"part {number}: a text part's `text` must be a string, got {_got(part, 'text', True)}"
                )
        return content

    @field_validator("tool_calls")
    @classmethod
    def _tool_call_nulls(cls, calls):
        # `type` may be left out (it is "function"); `id` is not rendered
        return None if calls is None else [_without_nulls(call, ("function",), ("name", "arguments")) for call in calls]

    def as_chat_dict(self) -> dict[str, Any]:
        """The message in the shape `render_chat` takes (text parts joined, developer = system)."""
        message = self.model_dump(exclude_none=True)
        message["role"] = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):  # text parts only (`_text_parts`)
            message["content"] = "".join(part["text"] for part in self.content)
        return message


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    """False: a reply carries at most one tool call, the model's first (`responses.assistant_message`)."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tool_nulls(cls, tools):
        return None if tools is None else [_without_nulls(tool, ("type", "function"), ("name",)) for tool in tools]

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError("response_format other than {'type': 'text'} is not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        for index, message in enumerate(self.messages):
            for number, call in enumerate(message.tool_calls or []):
                problem = _tool_call_problem(call)
                if problem:
                    raise ValueError(f"messages[{index}].tool_calls[{number}]{problem}")
        for index, tool in enumerate(self.tools or []):
            problem = _tool_problem(tool)
            if problem:
                raise ValueError(f"tools[{index}]{problem}")
        return self

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _without_nulls(entry: dict[str, Any], required: tuple[str, ...], function_required: tuple[str, ...]) -> dict:
    """`entry` (a `tools` or `tool_calls` entry, checked by hand rather than by a model) without
    the keys whose value is null, in it and in its `function`, but for the `required` and
    `function_required` ones, as `_Body` takes null for "not given": clients send optional keys as
    null (a `model_dump` of the `openai` client's `FunctionDefinition` has `"description": null`
    and `"strict": null`), and the prompt renders the entry as if they were not sent. A required
    key's null stays, for the check that names it. What the keys hold (a JSON Schema, a call's
    arguments) is data and stays as sent."""
    entry = {key: value for key, value in entry.items() if value is not None or key in required}
    function = entry.get("function")
    if isinstance(function, dict):
        entry["function"] = {
            key: value for key, value in function.items() if value is not None or key in function_required
        }
    return entry


def _got(entry: dict[str, Any], key: str, as_type: bool = False) -> str:
    """What an entry's `key` holds, as an error message says it: `nothing` when it is missing,
    `null` for JSON's null, else the value (its type with `as_type`)."""
    if key not in entry:
        return "nothing"
    value = entry[key]
    return "null" if value is None else type(value).__name__ if as_type else repr(value)


def _tool_problem(tool: dict[str, Any]) -> str | None:
    """What is wrong with a `tools` entry, if anything: it must be OpenAI's function schema, as
    `render_chat` writes it into the prompt."""
    if tool.get("type") != "function":
        return f".type must be 'function', got {_got(tool, 'type')}"
    function = tool.get("function")
    if not isinstance(function, dict):
        return f".function must be an object {{'name': ..., 'parameters': ...}}, got {_got(tool, 'function', True)}"
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return f".function.name must be a non-empty string, got {_got(function, 'name')}"
    if not isinstance(function.get("description", ""), str):
        return f".function.description must be a string, got {_got(function, 'description', True)}"
    if not isinstance(function.get("parameters", {}), dict):
        return f".function.parameters must be a JSON Schema object, got {_got(function, 'parameters', True)}"
    return None


def _tool_call_problem(call: dict[str, Any]) -> str | None:
    """What is wrong with an assistant message's `tool_calls` entry, if anything: it must be in
    OpenAI's shape, as `render_chat` writes it into the prompt: a function with a non-empty string
    name and its arguments as a JSON string or an object (required: Qwen3's chat template cannot
    render a call without)."""
    if call.get("type", "function") != "function":
        return f".type must be 'function', got {_got(call, 'type')}"
    function = call.get("function")
    if not isinstance(function, dict):
        return f".function must be an object {{'name': ..., 'arguments': ...}}, got {_got(call, 'function', True)}"
    name = function.get("name")
    if not isinstance(name, str) or not name:
        return f".function.name must be a non-empty string, got {_got(function, 'name')}"
    if "arguments" not in function:
        return ".function has no 'arguments' (a JSON string or object; '{}' for a call without any)"
    if not isinstance(function["arguments"], str | dict):
        return f".function.arguments must be a JSON string or object, got {_got(function, 'arguments', True)}"
    return None


class FeedbackRequest(_Body):
    """POST /v1/feedback: a user's rating of one choice of a response this server family gave."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    id: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")
    """The response's `id` (`chatcmpl-...` or `cmpl-...`; no control characters)."""
    choice: int = Field(0, ge=0, strict=True)
    """Which choice of the response is rated (its `index`)."""
    rating: Rating
    score: float | None = Field(None, ge=0.0, le=1.0, strict=True)
    """Only with rating `score`: how good, from 0 to 1."""

    @model_validator(mode="after")
    def _score_with_score_rating(self):
        if (self.rating == "score") != (self.score is not None):
            raise ValueError("give `score` (0 to 1) with rating 'score', and only then")
        return self


def encode_routes(routes: torch.Tensor) -> dict[str, Any]:
    """Routes [tokens, moe_layers, top_k] as JSON: shape, dtype, and the C-order little-endian
    bytes in base64. uint8 when every expert id fits (< 256), else int16."""
    dtype = np.uint8 if routes.numel() == 0 or int(routes.max()) < 256 else np.dtype("<i2")
    array = np.ascontiguousarray(routes.numpy().astype(dtype))
    return {
        "shape": list(array.shape),
        "dtype": np.dtype(dtype).name,
        "data": base64.b64encode(array.tobytes()).decode(),
    }


def decode_routes(encoded: dict[str, Any]) -> torch.Tensor:
    """The int64 tensor [tokens, moe_layers, top_k] of `encode_routes`' output."""
    dtype = {"uint8": np.uint8, "int16": np.dtype("<i2")}[encoded["dtype"]]
    array = np.frombuffer(base64.b64decode(encoded["data"]), dtype=dtype).reshape(encoded["shape"])
    return torch.from_numpy(array.astype(np.int64))
