"""The feedback contract shared by the servers and the online loop: which ratings exist, and the
servers' `[feedback]` config section (kept free of heavy imports: `whetstone serve` loads it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from whetstone.config import Config

Rating = Literal["thumbs_up", "thumbs_down", "edit_kept", "edit_reverted", "score"]
"""Feedback events: thumbs, whether the user kept or reverted the suggested edit, or a score in [0, 1]."""


class FeedbackConfig(Config):
    """Capture for online RL: what `whetstone serve` keeps of each response, and where."""

    store: str = ""
    """Feedback database: a SQLite file path, or a PostgreSQL URL (`postgresql://user@host/db`,
    when many servers write); empty = no capture, and POST /v1/feedback answers 404. Needs
    `auth_token`: only authenticated clients may give feedback."""
    record: Literal["interactive", "all"] = "interactive"
    """Which responses are kept for feedback: user traffic (`interactive` priority) only, or also
    `batch` requests (RL rollouts, which have their own rewards)."""
    keep_timeout_s: float = Field(2.0, gt=0)
    """Seconds a reply's answer waits at most for the reply to be stored (a locked or slow
    database); past it the answer goes out unstored, logged and counted in
    `whetstone_feedback_keep_failures_total` (a write still running may store it later)."""
