"""Tokenizer and chat format: byte-level BPE in Qwen3's layout, ChatML with Qwen3's tool calls."""

from whetstone.tokenizer.bpe import ENDOFTEXT, IM_END, IM_START, Tokenizer
from whetstone.tokenizer.chat import (
    ChatTokens,
    Message,
    Segment,
    chat_segments,
    defuse_all,
    defuse_controls,
    defuse_markup,
    defuse_message,
    encode_chat,
    parse_assistant,
    render_chat,
)
from whetstone.tokenizer.template import CHAT_TEMPLATE

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "ChatTokens",
    "Message",
    "Segment",
    "Tokenizer",
    "chat_segments",
    "defuse_all",
    "defuse_controls",
    "defuse_markup",
    "defuse_message",
    "encode_chat",
    "parse_assistant",
    "render_chat",
]
