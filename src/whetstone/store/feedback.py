"""The feedback store: every response the servers gave users, and the feedback users gave on them.

A real database through SQLAlchemy: a SQLite file by default, PostgreSQL by URL when many servers
write. Two tables:

    whetstone_responses   (response_id, choice) -> model, sampling, weight versions, prompt and
                          completion token ids, behavior logprobs, routes: what the trainer needs
    whetstone_feedback    seq (increasing, in the order events commit) -> (response_id, choice),
                          rating, score, created; unique per (response_id, choice)

Uniqueness is the database's own constraint, so two servers accepting the same feedback at once
cannot both succeed. A write returns only once committed: accepted feedback survives restarts.
Old responses are deleted by the online loop once it has read their feedback (`prune`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from whetstone.errors import WhetstoneError

metadata = sa.MetaData()

responses = sa.Table(
    "whetstone_responses",
    metadata,
    sa.Column("response_id", sa.String(100), primary_key=True),
    sa.Column("choice", sa.Integer, primary_key=True),
    sa.Column("created", sa.Float, nullable=False, index=True),
    sa.Column("model", sa.String(200), nullable=False),
    sa.Column("priority", sa.String(16), nullable=False),
    sa.Column("temperature", sa.Float, nullable=False),
    sa.Column("top_p", sa.Float, nullable=False),
    sa.Column("top_k", sa.Integer, nullable=False),
    sa.Column("finish_reason", sa.String(16), nullable=False),
    sa.Column("prompt_ids", sa.JSON, nullable=False),
    sa.Column("completion_ids", sa.JSON, nullable=False),
    sa.Column("logprobs", sa.JSON, nullable=False),
    sa.Column("versions", sa.JSON, nullable=False),
    sa.Column("routes", sa.JSON, nullable=True),
)

feedback = sa.Table(
    "whetstone_feedback",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("response_id", sa.String(100), nullable=False),
    sa.Column("choice", sa.Integer, nullable=False),
    sa.Column("rating", sa.String(20), nullable=False),
    sa.Column("score", sa.Float, nullable=True),
    sa.Column("created", sa.Float, nullable=False),
    sa.ForeignKeyConstraint(
        ["response_id", "choice"], ["whetstone_responses.response_id", "whetstone_responses.choice"]
    ),
    sa.UniqueConstraint("response_id", "choice", name="one_feedback_per_choice"),
)


class UnknownResponse(WhetstoneError):
    """Feedback for a response (or choice) this store never recorded."""


class DuplicateFeedback(WhetstoneError):
    """Feedback for a response choice that already has feedback."""


@dataclass
class ResponseRecord:
    """One choice of one response, as the trainer will need it."""

    response_id: str
    choice: int
    model: str
    priority: str
    temperature: float
    top_p: float
    top_k: int
    finish_reason: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routes: dict[str, Any] | None
    """The server's compact routes (`encode_routes`), or None for a dense model."""
    created: float = 0.0


@dataclass
class RatedResponse:
    """A feedback event joined with the response it rates."""

    seq: int
    rating: str
    score: float | None
    rated_at: float
    response: ResponseRecord


def database_url(store: str) -> str:
    """A SQLAlchemy URL for `store`: a URL as given (psycopg 3 for plain `postgresql://`), or a
    SQLite file path (its folder is created)."""
    if "://" not in store:
        path = Path(store).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    if store.startswith("postgresql://") or store.startswith("postgres://"):
        return "postgresql+psycopg://" + store.split("://", 1)[1]
    return store


def _create_tables(engine: sa.Engine) -> None:
    """Create the tables and indexes that are missing. Servers sharing a store start together, so
    the check and the create must be one step (`IF NOT EXISTS`): `create_all` checks first and
    creates after, and another server creating a table in between made this one fail with "table
    already exists". PostgreSQL's `IF NOT EXISTS` can still collide in its catalog when two
    sessions create the same table at once; the loser tries again and finds it there."""
    for attempt in range(5):
        try:
            with engine.begin() as db:
                for table in metadata.sorted_tables:
                    db.execute(sa.schema.CreateTable(table, if_not_exists=True))
                    for index in sorted(table.indexes, key=lambda index: index.name):
                        db.execute(sa.schema.CreateIndex(index, if_not_exists=True))
            return
        except sa.exc.DatabaseError:
            if attempt == 4:
                raise


class FeedbackStore:
    def __init__(self, engine: sa.Engine):
        self.engine = engine

    @classmethod
    def open(cls, store: str) -> "FeedbackStore":
        """Connect (creating the tables if missing); raises a WhetstoneError naming the store."""
        url = database_url(store)
        if not url.startswith(("sqlite:", "postgresql")):
            raise WhetstoneError(
                f"the feedback store {_redacted(store)}: only SQLite (a path) and PostgreSQL URLs are "
                "supported (the online loop needs events to commit in the order of their numbers)"
            )
        options: dict[str, Any] = {"pool_pre_ping": True}
        if url.startswith("sqlite"):
            options["connect_args"] = {"timeout": 30.0}  # other servers may hold the write lock
        try:
            engine = sa.create_engine(url, **options)
            if url.startswith("sqlite"):
                sa.event.listen(engine, "connect", _sqlite_pragmas)
            _create_tables(engine)
        except (sa.exc.SQLAlchemyError, ImportError) as err:
            raise WhetstoneError(f"cannot open the feedback store {_redacted(store)}: {err}") from None
        return cls(engine)

    def __repr__(self) -> str:
        return f"FeedbackStore({self.engine.url.render_as_string(hide_password=True)})"

    def close(self) -> None:
        self.engine.dispose()

    def record(self, records: list[ResponseRecord]) -> None:
        """Keep the choices of a response (committed when this returns)."""
        if not records:
            return
        now = time.time()
        rows = [{**vars(r), "created": r.created or now} for r in records]
        with self.engine.begin() as db:
            db.execute(responses.insert(), rows)

    def add_feedback(self, response_id: str, choice: int, rating: str, score: float | None = None) -> int:
        """Record one rating; returns its sequence number. Raises UnknownResponse or DuplicateFeedback."""
        try:
            with self.engine.begin() as db:
                if db.dialect.name == "postgresql":
                    # One writer at a time, so events commit in `seq` order: the loop reads past the
                    # newest committed event, and an event given a lower number that committed after
                    # it would never be read. (SQLite's writers take turns by themselves.)
                    db.execute(sa.text(f"LOCK TABLE {feedback.name} IN SHARE ROW EXCLUSIVE MODE"))
                choices = (
                    db.execute(sa.select(responses.c.choice).where(responses.c.response_id == response_id))
                    .scalars()
                    .all()
                )
                if not choices:
                    raise UnknownResponse(
                        f"no response {response_id!r} was recorded for feedback (unknown id, a "
                        "request that is not kept: see feedback.record, or pruned as too old)"
                    )
                if choice not in choices:
                    raise UnknownResponse(f"response {response_id!r} has choices {sorted(choices)}, not {choice}")
                result = db.execute(
                    feedback.insert().values(
                        response_id=response_id, choice=choice, rating=rating, score=score, created=time.time()
                    )
                )
        except IntegrityError:
            if self.response(response_id, choice) is None:  # the foreign key: pruned meanwhile
                raise UnknownResponse(f"response {response_id!r} was pruned as too old") from None
            raise DuplicateFeedback(f"choice {choice} of response {response_id!r} already has feedback") from None
        return int(result.inserted_primary_key[0])

    def count_after(self, seq: int) -> int:
        """Feedback events newer than `seq`."""
        with self.engine.connect() as db:
            return int(
                db.execute(sa.select(sa.func.count()).select_from(feedback).where(feedback.c.seq > seq)).scalar()
            )

    def rated_after(self, seq: int, limit: int) -> list[RatedResponse]:
        """The oldest `limit` feedback events newer than `seq`, each with its response."""
        joined = feedback.join(
            responses,
            sa.and_(feedback.c.response_id == responses.c.response_id, feedback.c.choice == responses.c.choice),
        )
        query = (
            sa.select(
                feedback.c.seq, feedback.c.rating, feedback.c.score, feedback.c.created.label("rated_at"), *responses.c
            )
            .select_from(joined)
            .where(feedback.c.seq > seq)
            .order_by(feedback.c.seq)
            .limit(limit)
        )
        with self.engine.connect() as db:
            rows = db.execute(query).mappings().all()
        fields = [c.name for c in responses.c]
        return [
            RatedResponse(
                row["seq"],
                row["rating"],
                row["score"],
                row["rated_at"],
                ResponseRecord(**{name: row[name] for name in fields}),
            )
            for row in rows
        ]

    def prune(self, before: float, consumed: int) -> tuple[int, int]:
        """Delete the responses created before `before` (a time.time()) whose feedback, if any,
        is at or before seq `consumed` (read by the online loop), with that feedback, in one
        transaction. Returns (responses, feedback events) deleted.

        The newest feedback event stays, however old: SQLite numbers a new row max(seq) + 1, so
        deleting the newest would hand its seq out again, below the loop's cursor, and the loop
        would never read that event."""
        same_choice = sa.and_(
            feedback.c.response_id == responses.c.response_id, feedback.c.choice == responses.c.choice
        )
        try:
            with self.engine.begin() as db:
                newest = db.execute(sa.select(sa.func.max(feedback.c.seq))).scalar() or 0
                read = feedback.c.seq <= min(consumed, newest - 1)
                events = db.execute(
                    feedback.delete().where(read, sa.exists().where(same_choice, responses.c.created < before))
                )
                rows = db.execute(
                    responses.delete().where(responses.c.created < before, ~sa.exists().where(same_choice))
                )
        except sa.exc.SQLAlchemyError as err:
            raise WhetstoneError(f"pruning {self!r} failed: {err}") from None
        return rows.rowcount, events.rowcount

    def response(self, response_id: str, choice: int = 0) -> ResponseRecord | None:
        with self.engine.connect() as db:
            row = (
                db.execute(
                    sa.select(responses).where(responses.c.response_id == response_id, responses.c.choice == choice)
                )
                .mappings()
                .first()
            )
        return None if row is None else ResponseRecord(**row)


def _sqlite_pragmas(connection, _record) -> None:
    # WAL: readers (the online loop) never block the servers' writes; FULL: a commit is on disk.
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _redacted(store: str) -> str:
    if "://" not in store or "@" not in store:
        return store
    scheme, rest = store.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}" if ":" in credentials else store
