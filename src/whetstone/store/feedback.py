"""The feedback store: every response the servers gave users, and the feedback users gave on them.

A real database through SQLAlchemy: a SQLite file by default, PostgreSQL by URL when many servers
write. Three tables:

    whetstone_responses   (response_id, choice) -> model, sampling, weight versions, prompt and
                          completion token ids, behavior logprobs, routes: what the trainer needs
    whetstone_feedback    seq (increasing, in the order events commit) -> (response_id, choice),
                          rating, score, created; unique per (response_id, choice)
    whetstone_store       one row: the store's random id (given when its tables are created) and
                          the newest event an online loop has read (`consume`)

Uniqueness is the database's own constraint, so two servers accepting the same feedback at once
cannot both succeed. A write returns only once committed: accepted feedback survives restarts.
Old responses are deleted by the online loop once it has read their feedback (`prune`). Event
numbers mean something only in the database that gave them: a database recreated (or restored
from an older copy) numbers its events anew, and its id (or newest number) tells the loop so.
A SQLite file deleted or replaced under open connections is followed: every use of a connection
checks that it still holds the file at the path, so servers write into the store the loop reads.
Only `FeedbackStore.open` creates the file: a connection made later to a deleted one fails
("unable to open database file") instead of leaving a new, empty database at the path.
Times (`created`) are the database's clock (`now`), so servers and the loop on machines whose
clocks disagree still agree on a response's age. Database failures raise `FeedbackStoreError`.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from whetstone.config import expand_path, hide_password
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

identity = sa.Table(
    "whetstone_store",
    metadata,
    sa.Column("key", sa.Integer, primary_key=True, autoincrement=False),  # always 1: one row
    sa.Column("store_id", sa.String(32), nullable=False),
    sa.Column("consumed", sa.Integer, nullable=False),
)


class FeedbackStoreError(WhetstoneError):
    """The database failed (unreachable, locked past its timeout, corrupt...): names the store and
    what was being done; `reason` is the database's own word, without SQL."""

    def __init__(self, message: str, reason: str, transient: bool = True):
        super().__init__(message)
        self.reason = reason
        self.transient = transient
        """Whether the same call may succeed later by itself (a lock, a restart); False when
        someone must act first (the store's tables are gone)."""


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


@dataclass(frozen=True)
class StoreMarks:
    """Where a store stands: what the online loop checks its saved position against."""

    store_id: str
    """Random id given to the store when its tables were created: another id, another database."""
    newest: int
    """The newest event's number (0 if none)."""
    consumed: int
    """The newest event an online loop recorded reading (`consume`; 0 if none)."""


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
    SQLite file path (`~` and `$NAME` expanded; its folder is created; `?`, `#`, `%`... quoted, so
    the URL's database is the path as given)."""
    if "://" not in store:
        path = expand_path(store).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return sa.engine.URL.create("sqlite", database=str(path)).render_as_string()
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
        database = _sqlite_file(engine)
        self.path = None if database is None else Path(database)
        """The SQLite file, or None."""

    @classmethod
    def open(cls, store: str) -> "FeedbackStore":
        """Connect (creating the tables if missing); raises a WhetstoneError naming the store."""
        try:
            url = database_url(store)
        except OSError as err:  # a file where its folder goes, a folder it may not write in
            reason = f"cannot create the folder {err.filename}: {err.strerror}"
            raise FeedbackStoreError(
                f"cannot open the feedback store {store}: {reason}", reason, transient=False
            ) from None
        if not url.startswith(("sqlite:", "postgresql")):
            raise WhetstoneError(
                f"the feedback store {hide_password(store)}: only SQLite (a path) and PostgreSQL URLs are "
                "supported (the online loop needs events to commit in the order of their numbers)"
            )
        options: dict[str, Any] = {"pool_pre_ping": True}
        if url.startswith("sqlite"):
            options["connect_args"] = {"timeout": 30.0}  # other servers may hold the write lock
        # A URL that does not parse (a port that is not a number, an unclosed `[`) is named without
        # the parser's words, which may quote the password.
        try:
            sa.engine.make_url(url)
        except (ValueError, sa.exc.ArgumentError):
            raise WhetstoneError(
                f"the feedback store {hide_password(store)} is not a valid database URL "
                "(postgresql://USER:PASSWORD@HOST:PORT/DATABASE, PORT a number; or a SQLite file's path)"
            ) from None
        try:
            engine = sa.create_engine(url, **options)
            if url.startswith("sqlite"):
                sa.event.listen(engine, "connect", _sqlite_pragmas)
                _follow_file(engine)
                _open_without_creating(engine)
                if (path := _sqlite_file(engine)) is not None:
                    sqlite3.connect(path).close()  # the file, empty, if none is there: the only place it is created
            _create_tables(engine)
            with engine.begin() as db:
                _identity_row(db)
        except (sa.exc.SQLAlchemyError, sqlite3.Error, ImportError) as err:
            reason = _reason(err)
            raise FeedbackStoreError(
                f"cannot open the feedback store {hide_password(store)}: {reason}", reason
            ) from None
        return cls(engine)

    def __repr__(self) -> str:
        return f"FeedbackStore({self.name})"

    @property
    def name(self) -> str:
        """The database's URL, without its password; a SQLite file's path as it is (unquoted)."""
        if self.path is not None:
            return f"sqlite:///{self.path}"
        return hide_password(self.engine.url.render_as_string(hide_password=False))

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def failing_as(self, operation: str) -> Iterator[None]:
        """Raise a database failure during `operation` as a FeedbackStoreError naming the store
        and the operation (the database's reason, without the SQL and its parameters)."""
        try:
            yield
        except sa.exc.SQLAlchemyError as err:
            reason = _reason(err)
            raise FeedbackStoreError(f"the feedback store {self.name}: {operation} failed: {reason}", reason) from None

    def now(self) -> float:
        """The database's clock, in seconds since the epoch (what `created` is stamped with)."""
        with self.failing_as("reading the clock"), self.engine.connect() as db:
            return float(db.execute(sa.select(_clock(db))).scalar())

    def record(self, records: list[ResponseRecord]) -> None:
        """Keep the choices of a response (committed when this returns), stamped with the
        database's clock unless a record has its own `created`."""
        if not records:
            return
        stamped = [vars(r) for r in records if r.created]
        unstamped = [{k: v for k, v in vars(r).items() if k != "created"} for r in records if not r.created]
        with self.failing_as("keeping a response"), self.engine.begin() as db:
            if stamped:
                db.execute(responses.insert(), stamped)
            if unstamped:
                db.execute(responses.insert().values(created=_clock(db)), unstamped)

    def add_feedback(self, response_id: str, choice: int, rating: str, score: float | None = None) -> int:
        """Record one rating; returns its sequence number. Raises UnknownResponse or DuplicateFeedback."""
        refused = False
        with self.failing_as("adding feedback"):
            try:
                with self.engine.begin() as db:
                    if db.dialect.name == "postgresql":
                        # One writer at a time, so events commit in `seq` order: the loop reads past
                        # the newest committed event, and an event given a lower number that
                        # committed after it would never be read. (SQLite's writers take turns.)
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
                            response_id=response_id, choice=choice, rating=rating, score=score, created=_clock(db)
                        )
                    )
            except IntegrityError:
                refused = True
        if refused:
            if self.response(response_id, choice) is None:  # the foreign key: pruned meanwhile
                raise UnknownResponse(f"response {response_id!r} was pruned as too old")
            raise DuplicateFeedback(f"choice {choice} of response {response_id!r} already has feedback")
        return int(result.inserted_primary_key[0])

    def count_after(self, seq: int) -> int:
        """Feedback events newer than `seq`."""
        with self.failing_as("counting new feedback"), self.engine.connect() as db:
            return int(
                db.execute(sa.select(sa.func.count()).select_from(feedback).where(feedback.c.seq > seq)).scalar()
            )

    def marks(self) -> StoreMarks:
        """The store's id, its newest event number and the newest one a loop has read."""
        with self.failing_as("reading its id and newest event"), self.engine.begin() as db:
            store_id, consumed = _identity_row(db)
            newest = db.execute(sa.select(sa.func.max(feedback.c.seq))).scalar() or 0
        return StoreMarks(store_id, int(newest), int(consumed))

    def consume(self, store_id: str, seq: int) -> None:
        """Record that an online loop has read every event up to `seq` (only ever moves forward;
        nothing if the store's id is not `store_id`): where a loop without a saved position starts."""
        with self.failing_as("recording the events read"), self.engine.begin() as db:
            db.execute(
                identity.update()
                .where(identity.c.key == 1, identity.c.store_id == store_id, identity.c.consumed < seq)
                .values(consumed=seq)
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
        with self.failing_as("reading new feedback"), self.engine.connect() as db:
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
        """Delete the responses created before `before` (the database's clock: `now`) whose
        feedback, if any, is at or before seq `consumed` (read by the online loop), with that
        feedback, in one transaction. Returns (responses, feedback events) deleted.

        The newest feedback event stays, however old: SQLite numbers a new row max(seq) + 1, so
        deleting the newest would hand its seq out again, below the loop's cursor, and the loop
        would never read that event."""
        same_choice = sa.and_(
            feedback.c.response_id == responses.c.response_id, feedback.c.choice == responses.c.choice
        )
        with self.failing_as("pruning"), self.engine.begin() as db:
            newest = db.execute(sa.select(sa.func.max(feedback.c.seq))).scalar() or 0
            read = feedback.c.seq <= min(consumed, newest - 1)
            events = db.execute(
                feedback.delete().where(read, sa.exists().where(same_choice, responses.c.created < before))
            )
            rows = db.execute(responses.delete().where(responses.c.created < before, ~sa.exists().where(same_choice)))
        return rows.rowcount, events.rowcount

    def response(self, response_id: str, choice: int = 0) -> ResponseRecord | None:
        with self.failing_as("reading a response"), self.engine.connect() as db:
            row = (
                db.execute(
                    sa.select(responses).where(responses.c.response_id == response_id, responses.c.choice == choice)
                )
                .mappings()
                .first()
            )
        return None if row is None else ResponseRecord(**row)


def _clock(db: sa.Connection) -> sa.ColumnElement:
    """The database's clock in seconds since the epoch, as SQL (one clock for every machine that
    writes: PostgreSQL's server; SQLite's, whose writers share the file and so the machine)."""
    if db.dialect.name == "postgresql":
        return sa.cast(sa.extract("epoch", sa.func.clock_timestamp()), sa.Float)
    return (sa.func.julianday("now") - 2440587.5) * 86400.0


def _identity_row(db: sa.Connection) -> tuple[str, int]:
    """The store's (id, consumed), giving it a new random id first if it has none. Servers open a
    new store together: the row has a fixed key and the insert does nothing if it is there, so
    all of them read the first one's id."""
    select = sa.select(identity.c.store_id, identity.c.consumed).where(identity.c.key == 1)
    row = db.execute(select).first()
    if row is None:
        insert = (postgresql.insert if db.dialect.name == "postgresql" else sqlite.insert)(identity)
        row = {"key": 1, "store_id": secrets.token_hex(8), "consumed": 0}
        db.execute(insert.values(row).on_conflict_do_nothing(index_elements=["key"]))
        row = db.execute(select).one()
    return row.store_id, row.consumed


def _reason(err: BaseException) -> str:
    """What the database said, without SQLAlchemy's SQL text and parameters."""
    cause = getattr(err, "orig", None) or err
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__


def _file_at(path: str) -> tuple[int, int] | None:
    """Which file is at `path` (device, inode), None if none is."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _sqlite_file(engine: sa.Engine) -> str | None:
    """The path of the engine's SQLite file (as its URL gives it); None for another database, an
    in-memory one, or a SQLite URI (a URL with `uri=true`: its database is a URI, not a path)."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or database in (None, "", ":memory:") or engine.url.query.get("uri"):
        return None
    return database


def _follow_file(engine: sa.Engine) -> None:
    """Make every use of a pooled connection to a SQLite file check that the file it opened is
    still the one at the store's path: one deleted or replaced since (the store recreated, a
    backup restored) is dropped for a new connection to the file there (the pool retries), so
    reads see and writes go into the store at the path, never into a deleted file."""
    path = _sqlite_file(engine)
    if path is None:
        return

    def connected(_connection, record) -> None:  # the file this connection opened (`mode=rw`: one was there)
        record.info["file"] = _file_at(path)

    def checkout(_connection, record, _proxy) -> None:
        if record.info.get("file") != _file_at(path):
            raise sa.exc.DisconnectionError(f"{path} was deleted or replaced")

    sa.event.listen(engine, "connect", connected)
    sa.event.listen(engine, "checkout", checkout)


def _open_without_creating(engine: sa.Engine) -> None:
    """Make every connection to a SQLite file open it read-write without creating it (a SQLite
    URI with `mode=rw`; `FeedbackStore.open` creates the file first). A connection made after the
    file was deleted (`_follow_file` drops the stale one and the pool connects again) then fails
    with "unable to open database file" (`lost_tables` says what happened) rather than creating
    an empty database at the path: that would hide the loss from the operator, and the next
    `open` would give it fresh tables and a new id."""
    if _sqlite_file(engine) is None:
        return

    def connecting(_dialect, _record, cargs: list, cparams: dict) -> None:
        # cargs[0]: the dialect's absolute path; quoted, as a URI's path must be (`?`, `#`, `%`)
        cargs[0] = f"file:{quote(cargs[0])}?mode=rw"
        cparams["uri"] = True

    sa.event.listen(engine, "do_connect", connecting)


def _sqlite_pragmas(connection, _record) -> None:
    # WAL: readers (the online loop) never block the servers' writes; FULL: a commit is on disk.
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
