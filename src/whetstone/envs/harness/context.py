"""One segment's context as token ids, grown turn by turn in the shared chat format.

The context starts as the rendered system and task messages plus the generation prompt. After
each model call it grows by the completion's ids exactly as sampled, then by the tokens of the
text between that assistant turn and the next (the tool results or a user turn, and the next
generation prompt), cut from `chat_segments` so that the text is what `render_chat` renders.
Every prompt therefore extends the previous prompt + completion, and when the model's tokens are
the tokenizer's own, the context equals `encode_chat` of the conversation token for token.
"""

from __future__ import annotations

from typing import Any

from whetstone.envs.harness.workspace import head_tail
from whetstone.tokenizer import Tokenizer, chat_segments, render_chat

Message = dict[str, Any]
MAX_FIT_ROUNDS = 32
CUT_MARKER_TOKENS = 24  # room for head_tail's `[... N characters cut ...]`


class SegmentContext:
    def __init__(self, tokenizer: Tokenizer, messages: list[Message]):
        self.tokenizer = tokenizer
        self.ids: list[int] = tokenizer.encode(render_chat(messages, add_generation_prompt=True))
        """Everything the next call's prompt starts with."""
        self.open = True
        """The ids end with a generation prompt (only at the segment's start)."""

    def prompt(self, messages: list[Message]) -> list[int]:
        """The next prompt: the context, then `messages` (tool results, user turns) as the chat renders them."""
        if self.open:
            assert not messages, "the first turn of a segment is the task itself"
            return list(self.ids)
        return self.ids + self.turn_ids(messages)

    def add(self, prompt: list[int], completion: list[int]) -> None:
        """The call's prompt and completion become the context. A completion cut off before its
        `<|im_end|>` gets one (as prompt-side text), so the turn is closed like any other."""
        end = self.tokenizer.im_end_id
        self.ids = prompt + completion + ([] if completion and completion[-1] == end else [end])
        self.open = False

    def turn_ids(self, messages: list[Message]) -> list[int]:
        """Tokens from the end of an assistant turn through the next generation prompt."""
        return self.tokenizer.encode(between_turns(messages))

    def fit_turn(self, messages: list[Message], limit: int) -> list[Message]:
        """`messages` with their longest contents cut (head and tail kept) until their turn takes
        at most `limit` tokens."""
        messages = [dict(m) for m in messages]
        for _ in range(MAX_FIT_ROUNDS):
            excess = len(self.turn_ids(messages)) - limit
            if excess <= 0:
                return messages
            longest = max(messages, key=lambda m: len(m["content"]))
            content = longest["content"]
            tokens = len(self.tokenizer.encode(content))
            keep = len(content) * (tokens - excess - CUT_MARKER_TOKENS) // max(tokens, 1)  # at its own chars per token
            keep = min(keep, len(content) * 3 // 4)  # always some progress
            longest["content"] = head_tail(content, keep) if keep > 120 else "[output cut: too long]"
        raise AssertionError(f"could not fit a turn of {len(messages)} messages into {limit} tokens")


def between_turns(messages: list[Message]) -> str:
    """What `render_chat` puts after an assistant turn's `<|im_end|>` when `messages` follow it,
    generation prompt included."""
    segments = chat_segments([{"role": "assistant", "content": ""}, *messages], add_generation_prompt=True)
    last_assistant = max(i for i, segment in enumerate(segments) if segment.assistant)
    return "".join(segment.text for segment in segments[last_assistant + 1 :])
