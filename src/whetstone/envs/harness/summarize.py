"""Self-summarization: when the next turn would not fit the context, the model summarizes its
work, and a new segment starts from the system prompt, the task and that summary.

The budget keeps room for a summary at all times: a normal call is made only if its prompt,
its whole completion budget, the largest tool-result turn and then a summary request with the
whole summary budget would all still fit the window. So whatever the call and its tools
produce, the summary can always be asked for. The summary call is trained like any other
(the final reward credits every segment, summaries included).
"""

from __future__ import annotations

from whetstone.envs import prompts
from whetstone.envs.harness.config import HarnessConfig
from whetstone.envs.harness.context import Message, SegmentContext
from whetstone.envs.task import Task
from whetstone.tokenizer import Tokenizer, defuse_markup, parse_assistant

SUMMARY_REQUEST = (
    "Your context is full and will be reset. Write a summary of your work for yourself: what you "
    "changed, what you found, what is left to do. Be brief. Do not call tools."
)
SUMMARY_INTRO = "Your context was reset. Your summary of the work so far:\n"
SLACK_TOKENS = 8  # a cut-off call's closing `<|im_end|>`, and margin


def summary_request() -> Message:
    return {"role": "user", "content": SUMMARY_REQUEST}


def segment_messages(task: Task, summary: str | None) -> list[Message]:
    """The opening of a segment: system prompt and task, then the summary (after a restart)."""
    messages = [
        {"role": "system", "content": prompts.SYSTEM_PROMPT},
        {"role": "user", "content": prompts.first_user_message(task)},
    ]
    if summary is not None:
        messages.append({"role": "user", "content": SUMMARY_INTRO + summary})
    return messages


def summary_text(completion_text: str) -> str:
    """The summary in a completion: its text without tool calls or a thinking block, with control
    and markup strings broken (`defuse_markup`): it opens the next segment as user text, which
    must not end that turn or fake a call or a tool response."""
    content, _, _ = parse_assistant(completion_text)
    return defuse_markup((content or completion_text.removesuffix("<|im_end|>")).strip())


def fit_summary(tokenizer: Tokenizer, summary: str, limit: int) -> str:
    """`summary` cut at its end until it encodes to at most `limit` tokens. The next segment
    encodes the summary's text anew, which can take more tokens than the model sampled: each
    markup token it wrote (`<tool_response>`, one id) is broken by `defuse_markup` into several,
    and a byte that is no UTF-8 becomes a three-byte U+FFFD. Uncut, such a summary could take
    the restart past the room the first segment kept for it (`Budget.restart_growth`)."""
    whole, keep = tokenizer.encode(summary), limit
    while len(tokenizer.encode(summary)) > limit:
        summary = tokenizer.decode(whole[: max(keep, 0)]).rstrip("\ufffd").rstrip()  # no half character
        keep -= 1
    return summary


class Budget:
    """Token room in one segment's window."""

    def __init__(self, config: HarnessConfig, window: int, context: SegmentContext):
        self.config = config
        self.window = window
        request = len(context.turn_ids([summary_request()])) - len(context.turn_ids([]))
        self.summary_reserve = request + config.summary_tokens + SLACK_TOKENS
        """Tokens a summary request and its answer may add to any context."""
        intro = context.tokenizer.encode(f"<|im_start|>user\n{SUMMARY_INTRO}<|im_end|>\n")
        self.restart_growth = len(intro) + config.summary_tokens + SLACK_TOKENS if config.summarize else 0
        """How much longer a segment's opening gets when it carries a summary."""

    def fits_turn(self, prompt_length: int) -> bool:
        """A call on this prompt, then its tool results, then a summary, all fit the window."""
        turn = prompt_length + self.config.max_turn_tokens + self.config.max_tool_tokens
        return turn + self.summary_reserve <= self.window
