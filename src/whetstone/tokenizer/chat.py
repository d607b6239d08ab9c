"""The chat format: Qwen3's ChatML with tool calls, shared by training, inference and the harness.

Messages are plain dicts in OpenAI's shape: `{"role": "system"|"user"|"assistant"|"tool",
"content": str | None}`, assistant messages may carry `tool_calls` (`[{"id", "type": "function",
"function": {"name", "arguments"}}]`, arguments a JSON string or a dict, never absent) and, as in OpenAI's
fine-tuning format, `"weight": 0` (rendered, but not trained on: a demonstrated mistake), tool
messages carry `tool_call_id`. Tools are OpenAI function schemas (`{"type": "function", "function": {...}}`).

`render_chat` is a Python transcription of Qwen3's chat template (tests check it against
transformers' `apply_chat_template` running the real template). Thinking:

- `thinking=None` (whetstone's format, the default): the template without its thinking parts.
  Every assistant turn renders as written and the generation prompt is `<|im_start|>assistant\\n`,
  so rendering a conversation up to a model call gives a prefix of rendering all of it: what
  multi-turn RL needs. Identical to Qwen3's template for every prompt that ends in a user or tool
  turn; `template.CHAT_TEMPLATE` is this format as Jinja, for HF tools and vLLM.
- `thinking=True` / `False`: Qwen3's template exactly, with `enable_thinking` set to that value
  (reasoning kept only after the last user query, an empty `<think>` block added to the final
  assistant turn, `False` pre-fills an empty block in the generation prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from whetstone.errors import WhetstoneError
from whetstone.tokenizer.bpe import CHAT_SPECIAL_TOKENS, MARKUP_TOKENS
from whetstone.tokenizer.template import TOOLS_FOOTER, TOOLS_HEADER

if TYPE_CHECKING:
    from whetstone.tokenizer.bpe import Tokenizer

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Segment:
    text: str
    assistant: bool
    """True for what the model writes itself and is trained on: an assistant turn's body through
    its `<|im_end|>`, unless the message has `"weight": 0`."""


def render_chat(
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    *,
    thinking: bool | None = None,
) -> str:
    """The conversation as the model sees it (see the module docstring for `thinking`)."""
    return "".join(s.text for s in chat_segments(messages, tools, add_generation_prompt, thinking=thinking))


def chat_segments(
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    *,
    thinking: bool | None = None,
) -> list[Segment]:
    """`render_chat`'s text cut into pieces, each marked by whether the assistant wrote it."""
    _check_messages(messages)
    out: list[Segment] = []

    def emit(text: str, assistant: bool = False) -> None:
        if text:
            out.append(Segment(text, assistant))

    first_is_system = messages[0]["role"] == "system"
    if tools:
        system = _content(messages[0]) + "\n\n" if first_is_system else ""
        listing = "".join("\n" + _tojson(tool) for tool in tools)
        emit("<|im_start|>system\n" + system + TOOLS_HEADER + listing + TOOLS_FOOTER)
    elif first_is_system:
        emit(f"<|im_start|>system\n{_content(messages[0])}<|im_end|>\n")

    last_query = _last_query_index(messages)
    for index, message in enumerate(messages):
        role, content = message["role"], _content(message)
        is_last = index == len(messages) - 1
        if role == "user" or (role == "system" and index > 0):
            emit(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            emit("<|im_start|>assistant\n")
            show_thinking = thinking is not None and index > last_query
            trained = message.get("weight", 1) == 1
            emit(_assistant_body(message, content, thinking is not None, show_thinking, is_last), trained)
            emit("\n")
        elif role == "tool":
            if index == 0 or messages[index - 1]["role"] != "tool":
                emit("<|im_start|>user")
            emit(f"\n<tool_response>\n{content}\n</tool_response>")
            if is_last or messages[index + 1]["role"] != "tool":
                emit("<|im_end|>\n")
    if add_generation_prompt:
        emit("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else ""))
    return out


def _assistant_body(message: Message, content: str, qwen3: bool, show_thinking: bool, is_last: bool) -> str:
    """Everything the assistant wrote in one turn: [think block] content, tool calls, `<|im_end|>`."""
    body = content
    if qwen3:  # Qwen3 moves reasoning out of the content, and shows it only after the last query
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        body = content
        if show_thinking and (is_last or reasoning):
            body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    for number, call in enumerate(message.get("tool_calls") or []):
        if number > 0 or content:
            body += "\n"
        call = call.get("function") or call
        arguments = call["arguments"]
        arguments = arguments if isinstance(arguments, str) else _tojson(arguments)
        name = str(call.get("name", ""))
        body += f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}'
    return body + "<|im_end|>"


def _last_query_index(messages: list[Message]) -> int:
    """Index of the last real user message (not a tool response passed as a user turn)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = _content(message)
        wrapped = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if message["role"] == "user" and not wrapped:
            return index
    return len(messages) - 1


@dataclass
class ChatTokens:
    ids: list[int]
    assistant_mask: list[bool]
    """Per token: True where the assistant wrote it (train on these), False for prompt and tool output."""


ZERO_WIDTH_SPACE = "\u200b"


def defuse_markup(text: str) -> str:
    """`text` with every control or markup token string (`<|im_end|>`, `<tool_call>`, ...) broken
    by a zero-width space after its first character, so that untrusted text (a tool's output, a
    file the agent reads) can never encode to the chat's control tokens and fake a turn or a call.
    The model still reads the text; only the token ids differ."""
    return _break_tokens(text, (*CHAT_SPECIAL_TOKENS, *MARKUP_TOKENS))


def defuse_controls(value: Any) -> Any:
    """`value` (a message, a tool schema: any JSON value) with the chat control strings
    (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) in every string it holds (keys too) broken as
    `defuse_markup` breaks them, so that a client's text can neither end its turn nor open
    another. Markup (`<tool_call>`, `<think>`, ...) stays: a replayed assistant message holds
    the calls and reasoning the model wrote, which must render as the tokens it wrote."""
    return _break_everywhere(value, CHAT_SPECIAL_TOKENS)


def defuse_all(value: Any) -> Any:
    """`value` (a message, a transcript: any JSON value) with `defuse_markup` applied to every
    string it holds, keys too: no control or markup string in it encodes as the token the chat
    format reserves for it. A value with no such string comes back equal; applying it twice
    changes nothing."""
    return _break_everywhere(value, (*CHAT_SPECIAL_TOKENS, *MARKUP_TOKENS))


def defuse_message(message: dict[str, Any]) -> dict[str, Any]:
    """A client's chat message as the server renders it: the control strings broken everywhere
    (`defuse_controls`), and in a user's or a tool's content every markup string too
    (`defuse_markup`): text that may come from anywhere (a web page, a file a tool read) can then
    fake neither a turn nor a call or a tool response, as the agent harness keeps a tool's output
    from doing. An assistant's message keeps its markup: it replays what the model wrote."""
    message = defuse_controls(message)
    if message.get("role") in ("user", "tool") and "content" in message:
        message["content"] = defuse_all(message["content"])
    return message


def _break_everywhere(value: Any, tokens: tuple[str, ...]) -> Any:
    """`value` with `tokens` broken (`_break_tokens`) in every string it holds, keys too."""
    if isinstance(value, str):
        return _break_tokens(value, tokens)
    if isinstance(value, dict):
        return {_break_everywhere(key, tokens): _break_everywhere(item, tokens) for key, item in value.items()}
    if isinstance(value, list):
        return [_break_everywhere(item, tokens) for item in value]
    return value


def _break_tokens(text: str, tokens: tuple[str, ...]) -> str:
    for token in tokens:
        if token in text:
            text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
    return text


def encode_chat(
    tokenizer: "Tokenizer",
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    *,
    thinking: bool | None = None,
) -> ChatTokens:
    """Token ids of `render_chat(messages, tools)` and which of them the assistant wrote.

    Prompt-side text and each assistant turn are encoded separately, the way inference sees
    them (the prompt encoded as one string, the completion as the model produced it), so a
    token never straddles a prompt/completion boundary. `decode(ids)` gives back the rendering.
    """
    pieces: list[Segment] = []
    for segment in chat_segments(messages, tools, thinking=thinking):
        if pieces and pieces[-1].assistant == segment.assistant:
            pieces[-1] = Segment(pieces[-1].text + segment.text, segment.assistant)
        else:
            pieces.append(segment)
    ids: list[int] = []
    mask: list[bool] = []
    for piece in pieces:
        piece_ids = tokenizer.encode(piece.text)
        ids += piece_ids
        mask += [piece.assistant] * len(piece_ids)
    return ChatTokens(ids, mask)


def parse_assistant(text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """Split what the model wrote into (content, tool_calls, errors); never raises.

    `text` is the completion after the generation prompt, with or without its closing
    `<|im_end|>`. Tool calls come back in OpenAI's shape (`id` is `call_<n>`, `arguments` a JSON
    string); each malformed call (bad JSON, JSON nested too deeply to parse, no name, no
    closing tag) becomes a message in `errors` instead. A `<think>` block is dropped from the
    content, as Qwen3's template does.
    """
    for stop in ("<|endoftext|>", "<|im_end|>"):
        text = text.removesuffix(stop)
    if "</think>" in text:
        text = text.split("</think>")[-1].lstrip("\n")
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, [], []
    content = text[:start].removesuffix("\n")  # the separator render_chat puts before a call
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    number = 0
    while start >= 0:
        end = text.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            errors.append(f"tool call {number}: no closing {TOOL_CALL_CLOSE}")
            break
        call, error = _parse_tool_call(text[start + len(TOOL_CALL_OPEN) : end], number)
        if error:
            errors.append(error)
        else:
            calls.append(call)
        number += 1
        start = text.find(TOOL_CALL_OPEN, end)
        between = text[end + len(TOOL_CALL_CLOSE) : start if start >= 0 else len(text)]
        if between.strip():
            errors.append(f"text outside tool calls ignored: {between.strip()[:80]!r}")
    return content, calls, errors


def _parse_tool_call(body: str, number: int) -> tuple[dict[str, Any], str | None]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return {}, f"tool call {number}: invalid JSON ({err.msg} at char {err.pos})"
    except (ValueError, RecursionError) as err:  # too deeply nested; an integer of too many digits
        return {}, f"tool call {number}: invalid JSON ({_json_problem(err)})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return {}, f'tool call {number}: expected an object with a string "name"'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the OpenAI wire form, a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return {}, f'tool call {number} ({value["name"]}): "arguments" must be an object'
    try:
        function = {"name": value["name"], "arguments": _tojson(arguments)}
    except (ValueError, RecursionError) as err:
        return {}, f"tool call {number} ({value['name']}): invalid arguments ({_json_problem(err)})"
    return {"id": f"call_{number}", "type": "function", "function": function}, None


def _json_problem(err: Exception) -> str:
    return "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]


def _check_messages(messages: list[Message]) -> None:
    if not messages:
        raise WhetstoneError("chat: the conversation has no messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise WhetstoneError(f"chat: message {index} has role {got!r}; expected one of {ROLES}")
        if message.get("content") is not None and not isinstance(message["content"], str):
            raise WhetstoneError(f"chat: message {index} content must be a string or None")
        if message.get("weight", 1) not in (0, 1) or isinstance(message.get("weight"), bool):
            raise WhetstoneError(f"chat: message {index} weight must be 0 or 1, got {message['weight']!r}")
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
            raise WhetstoneError(f"chat: message {index} tool_calls must be a list of objects")
        for number, call in enumerate(calls):
            function = call.get("function") or call
            if not isinstance(function, dict):
                raise WhetstoneError(f"chat: message {index} tool_calls[{number}].function must be an object")
            if "arguments" not in function:  # Qwen3's template fails on it too (tojson of undefined)
                raise WhetstoneError(
                    f"chat: message {index} tool_calls[{number}] has no arguments "
                    "(a JSON string or object; {} for a call without any)"
                )


def _content(message: Message) -> str:
    return message.get("content") or ""


def _tojson(value: Any) -> str:
    # transformers' `tojson` filter: json.dumps with non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False)
