"""The feedback contract shared by the servers and the online loop: which ratings exist, the
servers' `[feedback]` config section, and what both say when the store's tables are gone (kept
free of heavy imports: `whetstone serve` loads it)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from whetstone.config import Config

if TYPE_CHECKING:
    from whetstone.store.feedback import FeedbackStore, FeedbackStoreError

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


_NO_TABLE = re.compile(r'no such table: whetstone_|relation "whetstone_\w+" does not exist')
"""How SQLite and PostgreSQL say that a table of the store is not there."""
_NO_FILE = "unable to open database file"
"""How SQLite says it cannot open a file: the store's connections open it without creating it."""


def lost_tables(err: FeedbackStoreError, store: FeedbackStore) -> str | None:
    """What happened and what to do, when `err` says the store's tables are gone (its SQLite file
    deleted or replaced while in use, its tables dropped); None for any other failure. Nothing
    creates the tables (or the SQLite file) again behind the servers' backs: a new, empty store
    would hide the loss of the responses and feedback, and would have a new id, which the online
    loop refuses anyway."""
    file_gone = store.path is not None and err.reason == _NO_FILE and not store.path.exists()
    if not (file_gone or _NO_TABLE.search(err.reason)):
        return None
    if file_gone:
        where, how, back = f"at {store.path}", "no file is at that path: it was deleted", "the file"
    elif store.path is not None:
        where, how, back = f"at {store.path}", "its file was deleted, or replaced by one without them", "the file"
    else:
        where, how, back = store.name, "they were dropped, or the database replaced by one without them", "them"
    return (
        f"the feedback store's database {where} has lost its tables ({how}, while in use): the responses and "
        f"feedback it held are not there, and nothing is stored until it has them. Put {back} back from a copy; "
        "or, to start an empty store, restart the servers (they create it) and move the online loop's "
        "state.json away"
    )
