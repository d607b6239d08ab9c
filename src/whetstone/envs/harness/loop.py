"""The agent loop: ask the model, run the tool calls it wrote, feed back the results, until it
submits or a budget runs out; summarize and restart the context when it fills up.

Each call's prompt is the segment's token ids so far (context.py), so the trajectory holds
exactly what was sampled. Tool calls are parsed from the decoded completion ids with the shared
`parse_assistant`. A reply that cannot be acted on (malformed call, unknown tool, wrong
arguments, no tool call at all) gets an error message back and counts as an invalid tool call;
only `max_invalid_replies` of them in a row end the loop. Running out of turns, tokens or time
ends the rollout normally (the workspace is still graded); a policy or sandbox failure ends it
as `failed`, keeping what was sampled before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pydantic import ValidationError

from whetstone.envs.harness.base import Harness
from whetstone.envs.harness.config import HarnessConfig
from whetstone.envs.harness.context import Message, SegmentContext
from whetstone.envs.harness.policy import Completion, Policy, PolicyError, Sampling
from whetstone.envs.harness.summarize import Budget, fit_summary, segment_messages, summary_request, summary_text
from whetstone.envs.harness.tools import ToolCallError, Tools, check_call
from whetstone.envs.prompts import tool_message
from whetstone.envs.sandbox import Sandbox
from whetstone.envs.task import Task
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.tokenizer import Tokenizer, defuse_markup, parse_assistant

log = logging.getLogger(__name__)
NO_TOOL_CALL = "No tool call found in your reply. Call one of the tools, or submit when you are done."
CHARS_PER_TOKEN = 8  # tool outputs are cut to this many characters per token of budget before tokenizing


class AgentHarness(Harness):
    """The built-in harness: the tools of `envs/prompts.py` over a sandbox, with self-summarization."""

    def __init__(self, config: HarnessConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    @property
    def context_tokens(self) -> int:
        return self.config.context_tokens

    @classmethod
    def from_config(cls, config: HarnessConfig) -> AgentHarness:
        """Load the tokenizer from `config.tokenizer_path` (the served model's folder)."""
        if not config.tokenizer_path:
            raise ConfigError(
                "harness.tokenizer_path is not set: point it at the served model's folder "
                "(the one holding tokenizer.json)"
            )
        return cls(config, Tokenizer.load(config.tokenizer_path))

    async def run(self, task: Task, policy: Policy, sandbox: Sandbox) -> Trajectory:
        return await _Episode(self.config, self.tokenizer, task, policy, sandbox).run()


class _Episode:
    """The state of one rollout of the loop."""

    def __init__(self, config: HarnessConfig, tokenizer: Tokenizer, task: Task, policy: Policy, sandbox: Sandbox):
        self.config = config
        self.tokenizer = tokenizer
        self.task = task
        self.policy = policy
        self.tools = Tools(sandbox, task, config.max_tool_tokens * CHARS_PER_TOKEN, config.run_timeout_s)
        self.deadline = time.monotonic() + task.time_limit_s
        self.trajectory = Trajectory(task_id=task.id)
        self.timings = {"generation": 0.0, "tools": 0.0}
        self.stop_reason = ""
        """Why the loop ended: submitted, max_turns, max_total_tokens, wall_clock, context_full,
        invalid_replies, failed."""
        self.invalid_in_a_row = 0
        """Replies in a row with no call that ran (for `max_invalid_replies`)."""

    async def run(self) -> Trajectory:
        try:
            self.stop_reason = await self._loop()
        except Exception as err:  # the policy or the sandbox failed: keep what was sampled
            if not isinstance(err, WhetstoneError):  # not a failure foreseen: a defect, with its traceback
                log.exception("%s: the rollout failed after %d turns", self.task.id, self.trajectory.turns)
            self.stop_reason = "failed"
            self.trajectory.status, self.trajectory.error = "failed", f"{type(err).__name__}: {err}"
        self.trajectory.timings.update(self.timings)
        self.trajectory.stop_reason = self.stop_reason
        log.debug("%s: %s after %d turns", self.task.id, self.stop_reason, self.trajectory.turns)
        return self.trajectory

    async def _loop(self) -> str:
        window = self.config.context_tokens or self.policy.context_limit
        if not window:
            raise ConfigError("harness.context_tokens is 0 and the policy does not report its context limit: set it")
        limit = self.policy.context_limit
        if limit and window > limit:  # the server would cut calls at its limit, then refuse the prompts
            raise ConfigError(
                f"harness.context_tokens={window} is more than the server's context limit of {limit} tokens: "
                f"set it to {limit} or less (0 = the server's limit)"
            )
        context = self._start_segment(None)
        budget = Budget(self.config, window, context)
        self._check_room(budget, context)
        pending: list[Message] = []
        while (reason := self._out_of_budget()) is None:
            prompt = context.prompt(pending)
            if not budget.fits_turn(len(prompt)):
                if not self.config.summarize:
                    return "context_full"
                if self.trajectory.turns + 1 >= self.config.max_turns:  # no turn would follow the summary
                    return "max_turns"
                if self.config.max_total_tokens - self.trajectory.completion_tokens <= self.config.summary_tokens:
                    return "max_total_tokens"  # a whole summary could leave no token for a turn after it
                context = await self._summarize(context, pending, budget)
                if context is None:
                    return "wall_clock"
                pending = []
                continue
            left = self.config.max_total_tokens - self.trajectory.completion_tokens
            completion = await self._call(prompt, min(self.config.max_turn_tokens, left), is_summary=False)
            if completion is None:
                return "wall_clock"
            context.add(prompt, completion.ids)
            pending, submitted, acted = await self._act(self.tokenizer.decode(completion.ids))
            if submitted:
                return "submitted"
            self.invalid_in_a_row = 0 if acted else self.invalid_in_a_row + 1
            if self.config.max_invalid_replies and self.invalid_in_a_row >= self.config.max_invalid_replies:
                return "invalid_replies"
            pending = context.fit_turn(pending, self.config.max_tool_tokens)
        return reason

    def _out_of_budget(self) -> str | None:
        if self.trajectory.turns >= self.config.max_turns:
            return "max_turns"
        if self.trajectory.completion_tokens >= self.config.max_total_tokens:
            return "max_total_tokens"
        if time.monotonic() >= self.deadline:
            return "wall_clock"
        return None

    def _start_segment(self, summary: str | None) -> SegmentContext:
        self.trajectory.segments.append(Segment())
        return SegmentContext(self.tokenizer, segment_messages(self.task, summary))

    def _check_room(self, budget: Budget, context: SegmentContext) -> None:
        """Refuse an opening that leaves no room for a turn; the first one must also leave room
        for the summary every later opening carries, so a restart can never be stuck."""
        first = len(self.trajectory.segments) == 1
        if not budget.fits_turn(len(context.ids) + (budget.restart_growth if first else 0)):
            opening = "system prompt and task" if first else "system prompt, task and summary"
            growth = f" + a later summary's {budget.restart_growth}" if first and budget.restart_growth else ""
            raise WhetstoneError(
                f"the {opening} take {len(context.ids)} tokens{growth}, leaving no room for a turn in a "
                f"{budget.window}-token context (a turn needs max_turn_tokens + max_tool_tokens + a summary's "
                f"{budget.summary_reserve})"
            )

    async def _summarize(
        self, context: SegmentContext, pending: list[Message], budget: Budget
    ) -> SegmentContext | None:
        prompt = context.prompt([*pending, summary_request()])
        completion = await self._call(prompt, self.config.summary_tokens, is_summary=True)
        if completion is None:
            return None
        summary = fit_summary(
            self.tokenizer, summary_text(self.tokenizer.decode(completion.ids)), self.config.summary_tokens
        )
        self.trajectory.segments[-1].summary = summary
        context = self._start_segment(summary)
        self._check_room(budget, context)
        return context

    async def _call(self, prompt: list[int], max_tokens: int, is_summary: bool) -> Completion | None:
        """One model call, recorded in the current segment; None when the time is up."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        started = time.monotonic()
        try:
            sampling = Sampling.of(self.config.sampling, max_tokens)
            completion = await asyncio.wait_for(self.policy.complete(prompt, sampling), left)
        except TimeoutError:
            return None
        finally:
            self.timings["generation"] += time.monotonic() - started
        if len(completion.ids) > max_tokens:
            raise PolicyError(f"the policy returned {len(completion.ids)} tokens for max_tokens={max_tokens}")
        trained = completion.finish_reason == "stop" or self.config.train_cut_off_calls
        try:
            call = ModelCall(
                prompt_ids=prompt,
                completion_ids=completion.ids,
                logprobs=completion.logprobs,
                versions=completion.versions,
                loss_mask=[int(trained)] * len(completion.ids),
                routes=completion.routes,
                routes_missing=completion.routes_missing,
                is_summary=is_summary,
                finish_reason=completion.finish_reason,
            )
        except ValidationError as err:
            raise PolicyError(f"the policy's completion is inconsistent: {err.errors()[0]['msg']}") from None
        self.trajectory.segments[-1].calls.append(call)
        self.trajectory.turns += 1
        return completion

    async def _act(self, text: str) -> tuple[list[Message], bool, bool]:
        """Run the reply's tool calls: (result messages, whether it submitted, whether any call ran)."""
        _, calls, errors = parse_assistant(text)
        if not calls and not errors:
            self.trajectory.invalid_tool_calls += 1
            return [{"role": "user", "content": NO_TOOL_CALL}], False, False
        limit = self.config.max_calls_per_turn
        results: list[Message] = []
        submitted = False
        for call in calls[:limit]:
            name = call["function"]["name"]
            try:
                arguments = check_call(name, json.loads(call["function"]["arguments"]))
            except (ToolCallError, ValueError, RecursionError) as err:
                errors.append(str(err) if isinstance(err, ToolCallError) else f"{name}: arguments do not parse")
                continue
            if name == "submit":
                submitted = True
                break
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            started = time.monotonic()
            result = await asyncio.to_thread(self.tools.call, name, arguments, left)
            self.timings["tools"] += time.monotonic() - started
            results.append(tool_message(call["id"], _untrusted(result)))
        extra = 0 if submitted else max(0, len(calls) - limit)
        self.trajectory.invalid_tool_calls += len(errors) + extra
        if extra:
            errors.append(f"{extra} more tool calls were not run: at most {limit} run per reply")
        if errors:  # one message for all of them, so that a flood of bad calls cannot flood the context
            results.append(tool_message("invalid", _untrusted("\n".join(f"error: {error}" for error in errors))))
        ran = len(results) - bool(errors)  # one result per call that ran, plus one message for all errors
        return results, submitted, ran > 0


def _untrusted(text: str) -> str:
    """A tool result or error as the model reads it: with no control token strings, so that no
    output can fake a turn, and with `?` for what UTF-8 cannot encode (a lone surrogate: a file
    name that is not UTF-8 lists as one, and a call's text echoed in an error can hold one)."""
    return defuse_markup(text.encode("utf-8", "replace").decode("utf-8"))
